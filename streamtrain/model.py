"""What is trained: a DLRM over the configured tables and dense features, predicting the click."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, PoolingType
from torchrec.models.dlrm import DLRM

from streamtrain.config import FeaturesConfig, ModelConfig
from streamtrain.decode import ClickBatch

_POOLING = {"sum": PoolingType.SUM, "mean": PoolingType.MEAN}


def embedding_configs(features: FeaturesConfig) -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(
            name=t.name,
            feature_names=[t.name],
            num_embeddings=t.num_embeddings,
            embedding_dim=t.embedding_dim,
            pooling=_POOLING[t.pooling],
        )
        for t in features.tables
    ]


class ClickModel(nn.Module):
    """DLRM: tables -> pooled embeddings, an MLP over dense features, pairwise interaction, top MLP.

    ``forward`` returns what TorchRec's train pipelines expect: (loss to backpropagate, output).
    The output holds the logits computed *before* this batch's update, which is what progressive
    (test-then-train) evaluation needs.
    """

    def __init__(self, features: FeaturesConfig, model: ModelConfig, dense_device: torch.device):
        super().__init__()
        self.dlrm = DLRM(
            embedding_bag_collection=EmbeddingBagCollection(
                tables=embedding_configs(features), device=torch.device("meta")
            ),
            dense_in_features=len(features.dense),
            dense_arch_layer_sizes=list(model.dense_arch_layer_sizes),
            over_arch_layer_sizes=list(model.over_arch_layer_sizes),
            dense_device=dense_device,
        )

    def forward(self, batch: ClickBatch) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        logits = self.dlrm(batch.dense_features, batch.sparse_features).squeeze(-1)
        per_event = F.binary_cross_entropy_with_logits(logits, batch.labels, reduction="none")
        # A sum, scaled by the batch stage, never a mean: a rank's empty batch must add 0, not NaN.
        loss = per_event.sum() * batch.loss_scale
        return loss, (per_event.detach().sum(), logits.detach(), batch.labels)
