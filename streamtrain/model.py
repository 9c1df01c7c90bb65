"""What is trained: the configured architecture (streamtrain/models/: a built-in, or a user's
factory) over the dense features, the target matches' counts (streamtrain/target_match.py) and the
id features, with a loss per task, corrected for late labels as each task's ``correction`` says
(streamtrain/delayed.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torchrec import KeyedJaggedTensor

from streamtrain.config import FeaturesConfig, ModelConfig, TaskConfig
from streamtrain.decode import ClickBatch
from streamtrain.delayed import Corrections
from streamtrain.models import factory, net_name
from streamtrain.models.base import ModelSpec, check_tables
from streamtrain.target_match import match_counts

# TrainPipelineSparseDist traces the model with torch.fx to find the sharded tables' inputs; the
# counts branch on the batch's size, which a trace cannot follow, and feed no table: one node.
torch.fx.wrap("match_counts")


def task_losses(
    logits: torch.Tensor,
    labels: torch.Tensor,
    weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Each event's binary cross-entropy per task (a NaN label as 0: the caller masks it). With
    ``weights`` (positive, negative, retracted), the positive part y log(sigmoid(z)) and the negative
    part (1 - y) log(1 - sigmoid(z)) are weighted apart, as importance-weighted corrections need, and
    a positive takes back ``retracted`` times the negative it was trained as before (pu)."""
    targets = labels.nan_to_num(0.0)
    if weights is None:
        return F.binary_cross_entropy_with_logits(logits, targets, reduction="none")
    positive, negative, retracted = weights
    negative_part = F.softplus(logits)
    return (
        targets * (positive * F.softplus(-logits) - retracted * negative_part)
        + negative * (1 - targets) * negative_part
    )


def net_logits(
    net: nn.Module, pairs: list[tuple[str, str]], dense: torch.Tensor, sparse: KeyedJaggedTensor
) -> torch.Tensor:
    """The net's logits [B, tasks], with the target matches' counts after the dense features: the
    one scoring path of training and of the served program."""
    if pairs:
        dense = torch.cat([dense, match_counts(sparse, pairs).to(dense.dtype)], dim=1)
    return net(dense, sparse)


class ClickModel(nn.Module):
    """The net (the architecture, under its own name: ``dlrm``, ``dcn_v2``, ``deepfm``, ``din``, or
    ``module`` for a user's factory, so a snapshot's parameter names say which it is), and the loss.

    ``forward`` returns what TorchRec's train pipelines expect: (loss to backpropagate, output).
    The output holds the logits computed *before* this batch's update, which is what progressive
    (test-then-train) evaluation needs, as they are served (fnc's tasks calibrated); like the labels,
    they are [B] for one task and [B, tasks] for several.
    """

    def __init__(
        self,
        features: FeaturesConfig,
        model: ModelConfig,
        tasks: list[TaskConfig],
        dense_device: torch.device,
        table_device: torch.device | None = None,
    ):
        super().__init__()
        spec = ModelSpec(features, model, tasks, dense_device, table_device or torch.device("meta"))
        self.net_name = net_name(model)
        with dense_device:  # layers a factory builds without a device go where the dense ones go
            self.add_module(self.net_name, factory(model)(spec))
        check_tables(self.net, features, _where(model))
        # Plain strings: the fx trace records them as the counts' arguments.
        self.pairs = [(m.candidate, m.history) for m in model.target_matches]
        # Not in the state dict: a snapshot restores under other loss weights.
        self.register_buffer(
            "loss_weights", torch.tensor([t.loss_weight for t in tasks], device=dense_device), persistent=False
        )
        corrected = any(t.correction != "none" for t in tasks)
        self.corrections = Corrections(tasks, dense_device) if corrected else None

    @property
    def net(self) -> nn.Module:
        return self.get_submodule(self.net_name)

    def forward(self, batch: ClickBatch) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        logits = net_logits(self.net, self.pairs, batch.dense_features, batch.sparse_features).squeeze(-1)
        corrections, samples = self.corrections, batch.samples
        weights = None
        if corrections is not None and corrections.any_weighted and samples is not None:
            weights = corrections.weights(logits, samples.kind, samples.late_share)
        # A NaN label (a null one of a task that is not required) adds nothing to its task's loss.
        known = ~batch.labels.isnan()
        per_event = task_losses(logits, batch.labels, weights) * known * self.loss_weights
        # A sum, scaled by the batch stage, never a mean: a rank's empty batch must add 0, not NaN.
        # Masked events still count in the scale: each task's gradient is its summed loss over
        # the global batch, whatever share of it carries that task's label.
        loss = per_event.sum() * batch.loss_scale
        served = logits if corrections is None else corrections.served(logits)
        return loss, (per_event.detach().sum(), served.detach(), batch.labels)


def _where(model: ModelConfig) -> str:
    return f"model.module {model.module}" if model.module else f"model.architecture {model.architecture}"
