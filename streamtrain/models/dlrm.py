"""DLRM (Naumov et al., 2019), the default architecture: TorchRec's ``DLRM`` (tables -> pooled
embeddings, an MLP over the dense features, their pairwise dot products, then an over arch), with
its interaction picked where a sharded collection puts the embeddings, and with the heads of
``model.multitask`` (streamtrain/heads.py) in the over arch's place when it predicts several tasks.
One shared_bottom task keeps DLRM's own over arch, and the parameter names its snapshots use."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torchrec import KeyedJaggedTensor, KeyedTensor
from torchrec.models.dlrm import DLRM, InteractionArch, SparseArch

from streamtrain.heads import HEADS, architecture, interaction_size
from streamtrain.models.base import ModelSpec
from streamtrain.target_match import TargetMatchDLRM


def _upper_products(combined: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
    """[B, pairs]: the dot products of each event's rows of ``combined`` ([B, n, dim]) at the
    flat positions ``pairs`` of its n x n products."""
    return torch.bmm(combined, combined.transpose(1, 2)).flatten(1).index_select(1, pairs)


class _UpperProducts(torch.autograd.Function):
    """``_upper_products`` with the backward written for it. Autograd's would zero the n x n
    products' gradient and scatter-add into it, then add the two products' gradients, one of them
    transposed: a strided add, several times as slow as a contiguous one. Here the picked positions
    are copied into the zeros, and the gradient is that matrix times ``combined`` plus its
    transpose times ``combined``, both contiguous."""

    @staticmethod
    def forward(ctx: Any, combined: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(combined, pairs)
        return _upper_products(combined, pairs)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        combined, pairs = ctx.saved_tensors
        batch, n, _dim = combined.shape
        picked = grad.new_zeros(batch, n * n).index_copy_(1, pairs, grad).view(batch, n, n)
        return torch.baddbmm(torch.bmm(picked, combined), picked.transpose(1, 2), combined), None


def _interaction(dense: torch.Tensor, sparse: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
    """The dense features, then the products of the pairs of [dense, sparse features] at ``pairs``."""
    combined = torch.cat((dense.unsqueeze(1), sparse), dim=1)
    upper = _UpperProducts.apply if torch.is_grad_enabled() else _upper_products  # export traces the plain ops
    return torch.cat((dense, upper(combined, pairs)), dim=1)


class FlatInteractionArch(InteractionArch):
    """TorchRec's InteractionArch, the same forward bit for bit, at less cost: the upper triangle
    of the pairwise products is picked with ``index_select`` from the products flattened per event,
    where TorchRec indexes rows and columns with two index tensors, whose backward is an
    accumulating ``index_put``; and the backward is ``_UpperProducts``'. The buffers are not
    persistent: snapshots and served bases are unchanged."""

    def __init__(self, num_sparse_features: int) -> None:
        super().__init__(num_sparse_features)
        rows, columns = self.triu_indices
        self.register_buffer("triu_flat_indices", rows * (self.F + 1) + columns, persistent=False)

    def forward(self, dense_features: torch.Tensor, sparse_features: torch.Tensor) -> torch.Tensor:
        if self.F <= 0:
            return dense_features
        return _interaction(dense_features, sparse_features, self.triu_flat_indices)


_PAIRS: dict[tuple, torch.Tensor] = {}


def interaction_by_name(
    dense: torch.Tensor, embeddings: KeyedTensor, names: list[str], triu_flat_indices: torch.Tensor
) -> torch.Tensor:
    """``FlatInteractionArch`` over pooled embeddings in any order: the pairs of the features in the
    order of ``names`` are picked where ``embeddings``' order puts them (the products are symmetric,
    so either of a pair's two positions will do)."""
    keys, values = embeddings.keys(), embeddings.values()
    sparse = values.view(values.shape[0], len(keys), dense.shape[1])
    if keys == names:
        return _interaction(dense, sparse, triu_flat_indices)
    cached = (tuple(keys), tuple(names), values.device)
    if cached not in _PAIRS:
        n = len(keys) + 1
        row = [0] + [1 + keys.index(name) for name in names]  # combined's row of each table-order row
        _PAIRS[cached] = torch.tensor(
            [row[int(flat) // n] * n + row[int(flat) % n] for flat in triu_flat_indices], device=values.device
        )
    return _interaction(dense, sparse, _PAIRS[cached])


# TrainPipelineSparseDist traces the model with torch.fx; the order is read from the sharded
# collection's output, which a trace cannot look into: one node.
torch.fx.wrap("interaction_by_name")


class KeyedSparseArch(SparseArch):
    """TorchRec's SparseArch, less its reorder: the pooled embeddings stay a KeyedTensor in the
    collection's order, which a sharded collection groups by sharding type and rank. SparseArch
    puts them back in the tables' order with a slice per feature and a cat, and autograd undoes
    that with another cat; ``KeyedInteractionArch`` picks its pairs where they are instead."""

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        return self.embedding_bag_collection(features)


class KeyedInteractionArch(FlatInteractionArch):
    """``FlatInteractionArch`` over ``KeyedSparseArch``'s output: TorchRec's numbers in the
    forward, bit for bit, and in the backward to rounding (a sharded order sums each feature's
    gradient over the others in another order)."""

    def __init__(self, sparse_feature_names: list[str]) -> None:
        super().__init__(len(sparse_feature_names))
        self.sparse_feature_names = list(sparse_feature_names)

    def forward(self, dense_features: torch.Tensor, sparse_features: KeyedTensor) -> torch.Tensor:
        return interaction_by_name(dense_features, sparse_features, self.sparse_feature_names, self.triu_flat_indices)


def build(spec: ModelSpec) -> nn.Module:
    arguments = {
        "embedding_bag_collection": spec.embedding_bag_collection(),
        "dense_in_features": len(spec.features.dense),
        "dense_arch_layer_sizes": list(spec.model.dense_arch_layer_sizes),
        "over_arch_layer_sizes": list(spec.model.over_arch_layer_sizes),
        "dense_device": spec.dense_device,
    }
    # Without target matches, DLRM itself: its forward, and every snapshot made before them.
    matches = spec.model.target_matches
    dlrm = TargetMatchDLRM(matches, **arguments) if matches else DLRM(**arguments)
    dlrm.sparse_arch = KeyedSparseArch(dlrm.sparse_arch.embedding_bag_collection)
    dlrm.inter_arch = KeyedInteractionArch(dlrm.sparse_arch.sparse_feature_names)
    if architecture(spec.tasks, spec.model) != "dlrm":
        # DLRM's forward ends in over_arch(interaction): the heads take its place, and the sparse
        # arch, dense arch and interaction stay DLRM's, shared by every task.
        width = interaction_size(len(spec.features.tables), spec.features.tables[0].embedding_dim)
        dlrm.over_arch = HEADS[spec.model.multitask](width, spec.tasks, spec.model, spec.dense_device)
    return dlrm
