"""What is trained: a DLRM over the configured tables and dense features (and the target matches'
counts, streamtrain/target_match.py), with a head per task."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, KeyedTensor, PoolingType
from torchrec.models.dlrm import DLRM, InteractionArch, SparseArch

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


class _Permute(torch.autograd.Function):
    """``values.index_select(1, order)`` for a permutation ``order``; its backward is the gather by
    the inverse permutation, where index_select's would zero a tensor and scatter-add into it."""

    @staticmethod
    def forward(ctx: Any, values: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
        ctx.inverse = inverse
        return values.index_select(1, order)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad.index_select(1, ctx.inverse), None, None


_ORDERS: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def pooled_in_order(embeddings: KeyedTensor, names: list[str], dim: int) -> torch.Tensor:
    """The pooled embeddings as [B, features, dim], the features in the order of ``names``."""
    keys, values = embeddings.keys(), embeddings.values()
    pooled = values.view(values.shape[0], len(keys), dim)
    if keys == names:
        return pooled
    cached = (tuple(keys), tuple(names), values.device)
    if cached not in _ORDERS:
        order = torch.tensor([keys.index(name) for name in names], device=values.device)
        _ORDERS[cached] = order, torch.argsort(order)
    return _Permute.apply(pooled, *_ORDERS[cached])


# TrainPipelineSparseDist traces the model with torch.fx; the order is read from the sharded
# collection's output, which a trace cannot look into: one node.
torch.fx.wrap("pooled_in_order")


class OrderedSparseArch(SparseArch):
    """TorchRec's SparseArch, the same numbers, at less cost. A sharded collection's pooled
    embeddings come grouped by sharding type and rank; SparseArch puts them back in the tables'
    order with a slice per feature and a cat of them all, and autograd undoes that with a cat of
    the slices' gradients. Here that is one gather each way, and no copy at all when the order is
    already the tables' (an unsharded collection, as served)."""

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        return pooled_in_order(self.embedding_bag_collection(features), self.sparse_feature_names, self.D)


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
        self.dlrm.sparse_arch = OrderedSparseArch(self.dlrm.sparse_arch.embedding_bag_collection)
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
