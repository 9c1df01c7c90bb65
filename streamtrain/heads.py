"""What sits above a built-in model's interaction (DLRM's when it predicts several tasks; DCN-v2's
and DeepFM's always, streamtrain/models/), as ``model.multitask`` says.

Every task shares the sparse arch, the dense arch and the interaction; the heads turn the
interaction's output ([B, F]) into one logit per task ([B, T]):

- ``shared_bottom``: a tower per task over the interaction, each one TorchRec's ``OverArch``
  (the tower a one-task DLRM has), so a task learns only what its tower adds.
- ``mmoe`` (Ma et al., KDD 2018): ``num_experts`` expert MLPs (TorchRec's ``MLP``) over the
  interaction, a softmax gate per task that mixes them per event, and a tower per task over its
  mix. Tasks that conflict can then lean on different experts.
- ``dbmtl`` (Alibaba's Deep Bayesian Multi-Target Learning, TorchEasyRec's DBMTL): a tower per
  task over the interaction, as shared_bottom; a task that ``depends_on`` another reads that
  task's last hidden layer beside its own before its logit, so buy builds on what clk's tower
  learnt, and buy's loss trains clk's tower too.

Towers are keyed by task name, so a snapshot's parameter names say which head they belong to.
"""

from __future__ import annotations

import torch
from torch import nn
from torchrec.models.dlrm import OverArch
from torchrec.modules.mlp import MLP

from streamtrain.config import ModelConfig, TaskConfig


def architecture(tasks: list[TaskConfig], model: ModelConfig) -> str:
    """ "dlrm" for one shared_bottom task (DLRM's own over arch is its tower), else model.multitask."""
    return "dlrm" if len(tasks) == 1 and model.multitask == "shared_bottom" else model.multitask


def interaction_size(num_tables: int, embedding_dim: int) -> int:
    """Width of DLRM's interaction output: the dense vector plus one dot product per pair of
    (sparse features and the dense vector)."""
    return embedding_dim + num_tables * (num_tables + 1) // 2


class SharedBottom(nn.Module):
    def __init__(self, in_features: int, tasks: list[TaskConfig], model: ModelConfig, device: torch.device):
        super().__init__()
        self.towers = nn.ModuleDict(
            {t.name: OverArch(in_features, list(model.over_arch_layer_sizes), device) for t in tasks}
        )

    def forward(self, interaction: torch.Tensor) -> torch.Tensor:
        return torch.cat([tower(interaction) for tower in self.towers.values()], dim=1)


class MMoE(nn.Module):
    def __init__(self, in_features: int, tasks: list[TaskConfig], model: ModelConfig, device: torch.device):
        super().__init__()
        sizes = list(model.expert_layer_sizes)
        self.experts = nn.ModuleList([MLP(in_features, sizes, device=device) for _ in range(model.num_experts)])
        self.gates = nn.ModuleDict({t.name: nn.Linear(in_features, model.num_experts, device=device) for t in tasks})
        self.towers = nn.ModuleDict(
            {t.name: OverArch(sizes[-1], list(model.over_arch_layer_sizes), device) for t in tasks}
        )

    def forward(self, interaction: torch.Tensor) -> torch.Tensor:
        experts = torch.stack([expert(interaction) for expert in self.experts], dim=1)  # [B, E, H]
        logits = []
        for name, tower in self.towers.items():
            weights = torch.softmax(self.gates[name](interaction), dim=1)  # [B, E]
            logits.append(tower(torch.einsum("be,beh->bh", weights, experts)))
        return torch.cat(logits, dim=1)


class DBMTL(nn.Module):
    def __init__(self, in_features: int, tasks: list[TaskConfig], model: ModelConfig, device: torch.device):
        super().__init__()
        hidden = list(model.over_arch_layer_sizes[:-1])
        # An OverArch split where its logit layer starts, so that another task can read the tower.
        self.towers = nn.ModuleDict({t.name: MLP(in_features, hidden, device=device) for t in tasks})
        self.logits = nn.ModuleDict(
            {t.name: nn.Linear(hidden[-1] * (1 if t.depends_on is None else 2), 1, device=device) for t in tasks}
        )
        # The config lists a task after the one it depends on, so its tower is computed first.
        self.depends_on = {t.name: t.depends_on for t in tasks}

    def forward(self, interaction: torch.Tensor) -> torch.Tensor:
        towers: dict[str, torch.Tensor] = {}
        logits = []
        for name, tower in self.towers.items():
            towers[name] = tower(interaction)
            parent = self.depends_on[name]
            read = towers[name] if parent is None else torch.cat([towers[name], towers[parent]], dim=1)
            logits.append(self.logits[name](read))
        return torch.cat(logits, dim=1)


HEADS: dict[str, type[SharedBottom] | type[MMoE] | type[DBMTL]] = {
    "shared_bottom": SharedBottom,
    "mmoe": MMoE,
    "dbmtl": DBMTL,
}
