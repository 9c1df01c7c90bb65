"""A user's models, as a team would write them in a package of their own: the tests put this
folder on PYTHONPATH and name a factory in model.module ("my_models:build")."""

from __future__ import annotations

import torch
from torch import nn
from torchrec import KeyedJaggedTensor, KeyedTensor
from torchrec.modules.mlp import MLP

from streamtrain.models.base import ModelSpec


class WideConcat(nn.Module):
    """The pooled embeddings beside the dense features, an MLP, and a logit per task."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.tables = spec.embedding_bag_collection()
        self.names = [t.name for t in spec.features.tables]
        width = spec.dense_in_features + sum(t.embedding_dim for t in spec.features.tables)
        hidden = int(spec.model.options.get("hidden", 32))
        self.mlp = MLP(width, [hidden], device=spec.dense_device)
        self.logits = nn.Linear(hidden, len(spec.tasks), device=spec.dense_device)

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        # By key, in the config's order: a sharded collection orders its output by shard.
        (pooled,) = KeyedTensor.regroup([self.tables(sparse)], [self.names])
        return self.logits(self.mlp(torch.cat([dense, pooled], dim=1)))


def build(spec: ModelSpec) -> nn.Module:
    return WideConcat(spec)


class _NoTables(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.linear = nn.Linear(spec.dense_in_features, len(spec.tasks))

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        return self.linear(dense)


def no_tables(spec: ModelSpec) -> nn.Module:
    return _NoTables(spec)


class _OneLogit(WideConcat):
    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        return super().forward(dense, sparse)[:, 0]


def wrong_shape(spec: ModelSpec) -> nn.Module:
    return _OneLogit(spec)


class _DataDependent(WideConcat):
    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        logits = super().forward(dense, sparse)
        # Python control flow on a tensor's value: torch.export cannot trace it.
        if bool((logits > 0).any()):
            return logits
        return -logits


def not_exportable(spec: ModelSpec) -> nn.Module:
    return _DataDependent(spec)
