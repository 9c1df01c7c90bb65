"""DCN-v2 (Wang et al., WWW 2021), stacked: TorchRec's ``DLRM_DCN``, whose interaction is a
``LowRankCrossNet`` (``model.dcn_v2``: its layers and rank) over the dense vector and the pooled
embeddings side by side, with the heads of ``model.multitask`` in its over arch's place. Cross
layers learn bounded-degree feature crosses explicitly, where DLRM has only pairwise dot products."""

from __future__ import annotations

import torch
from torch import nn
from torchrec.models.dlrm import DLRM_DCN, InteractionDCNArch

from streamtrain.heads import HEADS
from streamtrain.models.base import ModelSpec


class SizedInteractionDCNArch(InteractionDCNArch):
    """TorchRec's InteractionDCNArch, with the cross net's input width spelt out: its
    ``reshape([B, -1])`` cannot size an empty batch, which a rank with no events trains."""

    def forward(self, dense_features: torch.Tensor, sparse_features: torch.Tensor) -> torch.Tensor:
        if self.F <= 0:
            return dense_features
        batch, dim = dense_features.shape
        combined = torch.cat((dense_features.unsqueeze(1), sparse_features), dim=1)
        return self.crossnet(combined.reshape(batch, (self.F + 1) * dim))


def build(spec: ModelSpec) -> nn.Module:
    net = DLRM_DCN(
        embedding_bag_collection=spec.embedding_bag_collection(),
        dense_in_features=spec.dense_in_features,
        dense_arch_layer_sizes=list(spec.model.dense_arch_layer_sizes),
        over_arch_layer_sizes=list(spec.model.over_arch_layer_sizes),
        dcn_num_layers=spec.model.dcn_v2.num_layers,
        dcn_low_rank_dim=spec.model.dcn_v2.low_rank_dim,
        dense_device=spec.dense_device,
    )
    net.inter_arch = SizedInteractionDCNArch(net.inter_arch.F, net.inter_arch.crossnet)
    width = (len(spec.features.tables) + 1) * spec.features.tables[0].embedding_dim
    net.over_arch = HEADS[spec.model.multitask](width, spec.tasks, spec.model, spec.dense_device)
    return net
