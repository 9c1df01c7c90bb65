"""DIN (Zhou et al., KDD 2018): target attention of the candidate over a history feature.

The history's table (``model.din.history``'s, with every feature that shares it) is kept unpooled
in a TorchRec ``EmbeddingCollection``: an embedding per id, sharded and updated by fbgemm's fused
optimizer like the pooled tables. Each history id gets a weight from a small MLP over [query, key,
query - key, query * key] (the query is the candidate's embedding, ``model.din.candidate``), and
the history reads as the weighted sum of its embeddings. As in the paper the weights are not
normalised: how many of the history's ids resemble the candidate is kept, which is what a "recently
clicked this category" effect needs. The attended history, the other sequence features summed, the
pooled tables and the dense vector (DLRM's dense arch) go side by side to the heads of
``model.multitask``.

The attention runs on the jagged ids themselves (each id's event from the lengths, a scatter-add
back per event), not on a padded [batch, longest history] block: no history length to configure,
no padding to mask, and the served program's shapes stay the batch's and the ids'.
"""

from __future__ import annotations

import torch
from torch import nn
from torchrec import JaggedTensor, KeyedJaggedTensor
from torchrec.models.dlrm import DenseArch
from torchrec.modules.mlp import MLP

from streamtrain.heads import HEADS
from streamtrain.models.base import ModelSpec


def _event_of_each_id(ids: JaggedTensor, batch: int) -> torch.Tensor:
    """[ids]: the event each id belongs to."""
    lengths = ids.lengths()
    events = torch.arange(batch, device=lengths.device)
    return torch.repeat_interleave(events, lengths, output_size=ids.values().shape[0])


def _sum_per_event(values: torch.Tensor, event_of_id: torch.Tensor, batch: int) -> torch.Tensor:
    """[batch, dim]: ``values`` ([ids, dim]) summed per event; 0 for an event with none."""
    return values.new_zeros(batch, values.shape[1]).index_add(0, event_of_id, values)


class TargetAttention(nn.Module):
    """The history's embeddings, each weighted by the MLP over it and the candidate's, summed per event."""

    def __init__(self, dim: int, layer_sizes: list[int], device: torch.device):
        super().__init__()
        self.mlp = MLP(4 * dim, layer_sizes, device=device)
        self.weight = nn.Linear(layer_sizes[-1], 1, device=device)

    def forward(self, query: torch.Tensor, history: JaggedTensor) -> torch.Tensor:
        batch = query.shape[0]
        event_of_id = _event_of_each_id(history, batch)
        keys = history.values()
        queries = query.index_select(0, event_of_id)
        weights = self.weight(self.mlp(torch.cat([queries, keys, queries - keys, queries * keys], dim=1)))
        return _sum_per_event(weights * keys, event_of_id, batch)


class DIN(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        din, tables = spec.model.din, {t.name: t for t in spec.features.tables}
        owner = tables[din.history].shares_table_with or din.history
        dim = tables[din.history].embedding_dim
        self.history, self.candidate = din.history, din.candidate
        # Plain lists fixed here: the train pipeline's fx trace cannot branch on the collections' output.
        self.sequence_features = [t.name for t in spec.features.tables if (t.shares_table_with or t.name) == owner]
        self.pooled_features = [t.name for t in spec.features.tables if t.name not in self.sequence_features]
        self.candidate_is_pooled = din.candidate in self.pooled_features
        self.pooled = spec.embedding_bag_collection(exclude=[owner])
        self.sequences = spec.embedding_collection([owner])
        self.dense_arch = DenseArch(spec.dense_in_features, list(spec.model.dense_arch_layer_sizes), spec.dense_device)
        self.attention = TargetAttention(dim, list(din.attention_layer_sizes), spec.dense_device)
        width = dim * (1 + len(spec.features.tables))
        self.over_arch = HEADS[spec.model.multitask](width, spec.tasks, spec.model, spec.dense_device)

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        batch = dense.shape[0]
        # By name: a sharded collection orders its output by shard.
        pooled = self.pooled(sparse).to_dict()
        sequences = self.sequences(sparse)
        summed = {
            name: _sum_per_event(sequences[name].values(), _event_of_each_id(sequences[name], batch), batch)
            for name in self.sequence_features
            if name != self.history
        }
        query = pooled[self.candidate] if self.candidate_is_pooled else summed[self.candidate]
        attended = self.attention(query, sequences[self.history])
        parts = [self.dense_arch(dense), *(pooled[name] for name in self.pooled_features)]
        parts += [attended if name == self.history else summed[name] for name in self.sequence_features]
        return self.over_arch(torch.cat(parts, dim=1))


def build(spec: ModelSpec) -> nn.Module:
    return DIN(spec)
