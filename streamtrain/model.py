"""What is trained: a DLRM over the configured tables and dense features (and the target matches'
counts, streamtrain/target_match.py), with a head per task."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, PoolingType
from torchrec.models.dlrm import DLRM, InteractionArch

from streamtrain.config import FeaturesConfig, ModelConfig, TaskConfig
from streamtrain.decode import ClickBatch
from streamtrain.heads import HEADS, architecture, interaction_size
from streamtrain.target_match import TargetMatchDLRM

_POOLING = {"sum": PoolingType.SUM, "mean": PoolingType.MEAN}


def embedding_configs(features: FeaturesConfig) -> list[EmbeddingBagConfig]:
    """A table per entry that owns one, looked up by its own feature and by those sharing it."""
    return [
        EmbeddingBagConfig(
            name=t.name,
            feature_names=[t.name, *(f.name for f in features.tables if f.shares_table_with == t.name)],
            num_embeddings=t.num_embeddings,
            embedding_dim=t.embedding_dim,
            pooling=_POOLING[t.pooling],
        )
        for t in features.owned_tables()
    ]


class FlatInteractionArch(InteractionArch):
    """TorchRec's InteractionArch, the same numbers bit for bit, at less cost: the upper triangle of
    the pairwise products is picked with ``index_select`` from the products flattened per event,
    where TorchRec indexes rows and columns with two index tensors, whose backward is an
    accumulating ``index_put``. At the reference sizes forward and backward take about 0.6 of the
    time (``streamtrain bench kernels``). The buffers are not persistent: snapshots and served
    bases are unchanged."""

    def __init__(self, num_sparse_features: int) -> None:
        super().__init__(num_sparse_features)
        rows, columns = self.triu_indices
        self.register_buffer("triu_flat_indices", rows * (self.F + 1) + columns, persistent=False)

    def forward(self, dense_features: torch.Tensor, sparse_features: torch.Tensor) -> torch.Tensor:
        if self.F <= 0:
            return dense_features
        combined = torch.cat((dense_features.unsqueeze(1), sparse_features), dim=1)
        products = torch.bmm(combined, torch.transpose(combined, 1, 2))
        return torch.cat((dense_features, products.flatten(1).index_select(1, self.triu_flat_indices)), dim=1)


class ClickModel(nn.Module):
    """DLRM: tables -> pooled embeddings, an MLP over dense features, pairwise interaction, then a
    logit per task: DLRM's own over arch for one task with shared_bottom, else the heads of
    ``model.multitask`` (streamtrain/heads.py) in the over arch's place.

    ``forward`` returns what TorchRec's train pipelines expect: (loss to backpropagate, output).
    The output holds the logits computed *before* this batch's update, which is what progressive
    (test-then-train) evaluation needs; like the labels, they are [B] for one task and [B, tasks]
    for several.
    """

    def __init__(
        self, features: FeaturesConfig, model: ModelConfig, tasks: list[TaskConfig], dense_device: torch.device
    ):
        super().__init__()
        dlrm_arguments = {
            "embedding_bag_collection": EmbeddingBagCollection(
                tables=embedding_configs(features), device=torch.device("meta")
            ),
            "dense_in_features": len(features.dense),
            "dense_arch_layer_sizes": list(model.dense_arch_layer_sizes),
            "over_arch_layer_sizes": list(model.over_arch_layer_sizes),
            "dense_device": dense_device,
        }
        # Without target matches, DLRM itself: its forward, and every snapshot made before them.
        self.dlrm = (
            TargetMatchDLRM(model.target_matches, **dlrm_arguments) if model.target_matches else DLRM(**dlrm_arguments)
        )
        self.dlrm.inter_arch = FlatInteractionArch(self.dlrm.inter_arch.F)
        if architecture(tasks, model) != "dlrm":
            # DLRM's forward ends in over_arch(interaction): the heads take its place, and the
            # sparse arch, dense arch and interaction stay DLRM's, shared by every task. One
            # shared_bottom task keeps DLRM's own over arch, and the names its snapshots use.
            width = interaction_size(len(features.tables), features.tables[0].embedding_dim)
            self.dlrm.over_arch = HEADS[model.multitask](width, tasks, model, dense_device)
        # Not in the state dict: a snapshot restores under other loss weights.
        self.register_buffer(
            "loss_weights", torch.tensor([t.loss_weight for t in tasks], device=dense_device), persistent=False
        )

    def forward(self, batch: ClickBatch) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        logits = self.dlrm(batch.dense_features, batch.sparse_features).squeeze(-1)
        # A NaN label (a null one of a task that is not required) adds nothing to its task's loss.
        known = ~batch.labels.isnan()
        per_event = F.binary_cross_entropy_with_logits(logits, batch.labels.nan_to_num(0.0), reduction="none")
        per_event = per_event * known * self.loss_weights
        # A sum, scaled by the batch stage, never a mean: a rank's empty batch must add 0, not NaN.
        # Masked events still count in the scale: each task's gradient is its summed loss over
        # the global batch, whatever share of it carries that task's label.
        loss = per_event.sum() * batch.loss_scale
        return loss, (per_event.detach().sum(), logits.detach(), batch.labels)
