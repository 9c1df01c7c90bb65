"""What sits above DLRM's interaction when the model predicts several tasks (``model.multitask``).

Every task shares the sparse arch, the dense arch and the interaction; the heads turn the
interaction's output ([B, F]) into one logit per task ([B, T]):

- ``shared_bottom``: a tower per task over the interaction, each one TorchRec's ``OverArch``
  (the tower a one-task DLRM has), so a task learns only what its tower adds.
- ``mmoe`` (Ma et al., KDD 2018): ``num_experts`` expert MLPs (TorchRec's ``MLP``) over the
  interaction, a softmax gate per task that mixes them per event, and a tower per task over its
  mix. Tasks that conflict can then lean on different experts.

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


HEADS: dict[str, type[SharedBottom] | type[MMoE]] = {"shared_bottom": SharedBottom, "mmoe": MMoE}
