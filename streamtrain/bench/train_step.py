"""train-step: one nn.EmbeddingBag per feature with torch's sparse Adagrad against the fused TBE path
(an EmbeddingBagCollection under DMP, Adagrad applied in backward), the same batches and the same dense
layers, at several batch sizes, feature counts, dims and table sizes, both on the device the worker
would train on (distributed.device of --config)."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from streamtrain.bench.common import clock, machine, rate_text
from streamtrain.config import load_config
from streamtrain.device import init_distributed


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seconds", type=float, default=20.0, help="per size and round (default 20)")


def run(args: argparse.Namespace, progress: Callable[[str], None]) -> dict:
    sizes = [StepSize(512, 4, 8, 10_000)] if args.quick else TRAIN_STEP_SIZES
    device = load_config(args.config).distributed.device
    return bench_train_step(sizes, 2.0 if args.quick else args.seconds, progress, device)


@dataclass(frozen=True)
class StepSize:
    batch: int
    features: int
    dim: int
    rows: int

    def __str__(self) -> str:
        return f"B={self.batch} F={self.features} D={self.dim} rows={self.rows:,}"


TRAIN_STEP_SIZES = [
    StepSize(1024, 8, 16, 100_000),
    StepSize(4096, 16, 16, 100_000),
    StepSize(4096, 16, 64, 100_000),
    StepSize(4096, 16, 16, 1_000_000),
]


def _step_inputs(size: StepSize, steps: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(ids [features, batch], labels [batch]) per step; ids Zipf-like, one id per feature and event."""
    generator = torch.Generator().manual_seed(seed)
    inputs = []
    for _ in range(steps):
        ranks = torch.rand(size.features, size.batch, generator=generator).pow(4.0)  # skewed to small ids
        inputs.append(
            (
                (ranks * size.rows).long().clamp_(max=size.rows - 1),
                (torch.rand(size.batch, generator=generator) < 0.3).float(),
            )
        )
    return inputs


class _PerFeatureModel(torch.nn.Module):
    """The baseline: one nn.EmbeddingBag per feature with sparse gradients, then the same MLP."""

    def __init__(self, size: StepSize):
        super().__init__()
        self.tables = torch.nn.ModuleList(
            torch.nn.EmbeddingBag(size.rows, size.dim, mode="sum", sparse=True) for _ in range(size.features)
        )
        self.top = torch.nn.Sequential(
            torch.nn.Linear(size.features * size.dim, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        offsets = torch.arange(ids.shape[1], device=ids.device)
        pooled = [table(ids[f], offsets) for f, table in enumerate(self.tables)]
        return self.top(torch.cat(pooled, dim=1)).squeeze(-1)


class _FusedModel(torch.nn.Module):
    """The contender: an EmbeddingBagCollection (fbgemm TBE under DMP, fused Adagrad), same MLP."""

    def __init__(self, size: StepSize):
        from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

        super().__init__()
        self.keys = [f"f{i}" for i in range(size.features)]
        self.ebc = EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(name=k, feature_names=[k], num_embeddings=size.rows, embedding_dim=size.dim)
                for k in self.keys
            ],
            device=torch.device("meta"),
        )
        self.top = torch.nn.Sequential(
            torch.nn.Linear(size.features * size.dim, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)
        )

    def forward(self, features) -> torch.Tensor:
        return self.top(self.ebc(features).values()).squeeze(-1)


def bench_train_step(
    sizes: list[StepSize], seconds: float, progress: Callable[[str], None], device: str = "auto"
) -> dict:
    """Per-feature nn.EmbeddingBag with torch's sparse Adagrad against the fused TBE path (EBC
    under DMP, Adagrad applied in backward), same batches and same dense layers, per size, on the
    device ``select_device`` picks for ``device``."""
    env = init_distributed(device=device)
    rows = []
    for size in sizes:
        rate = _rates(size, seconds, env.device)
        rows.append(
            {
                "size": str(size),
                "batch": size.batch,
                "features": size.features,
                "dim": size.dim,
                "rows": size.rows,
                "per_feature_events_per_second": rate["per_feature"],
                "fused_events_per_second": rate["fused"],
                "ratio": rate["fused"] / rate["per_feature"],
                "device": env.device.type,  # both legs
            }
        )
        progress(
            f"{size} on {env.device.type}: per-feature {rate['per_feature']:,.0f}/s, fused {rate['fused']:,.0f}/s, "
            f"ratio {rows[-1]['ratio']:.2f}"
        )
    return {"benchmark": "train-step", "machine": machine(), "leg_seconds": seconds / 2, "sizes": rows}


def _rates(size: StepSize, seconds: float, device: torch.device) -> dict[str, float]:
    """Events/s of both variants at one size on ``device``, in alternating legs of ``seconds / 2``."""
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    inputs = [(ids.to(device), labels.to(device)) for ids, labels in _step_inputs(size, 16, seed=size.rows + size.dim)]
    baseline = _PerFeatureModel(size).to(device)
    sparse = torch.optim.Adagrad([p for t in baseline.tables for p in t.parameters()], lr=0.05)
    dense = torch.optim.Adam(baseline.top.parameters(), lr=1e-3)

    def baseline_step(index: int) -> None:
        ids, labels = inputs[index]
        sparse.zero_grad()
        dense.zero_grad()
        torch.nn.functional.binary_cross_entropy_with_logits(baseline(ids), labels).backward()
        sparse.step()
        dense.step()

    fused = _FusedModel(size)
    apply_optimizer_in_backward(torch.optim.Adagrad, fused.ebc.parameters(), {"lr": 0.05})
    fused = DistributedModelParallel(fused, device=device, env=ShardingEnv.from_process_group(dist.group.WORLD))
    fused_dense = torch.optim.Adam(fused.module.top.parameters(), lr=1e-3)
    lengths = torch.ones(size.features * size.batch, dtype=torch.int32, device=device)
    kjts = [
        KeyedJaggedTensor(keys=fused.module.keys, values=ids.reshape(-1), lengths=lengths) for ids, _labels in inputs
    ]

    def fused_step(index: int) -> None:
        fused_dense.zero_grad()
        logits = fused(kjts[index])
        torch.nn.functional.binary_cross_entropy_with_logits(logits, inputs[index][1]).backward()
        fused_dense.step()

    legs = {"per_feature": 0.0, "fused": 0.0}
    steps = {"per_feature": 0, "fused": 0}
    for round_ in range(3):  # round 0 warms up and is not counted
        for name, step in (("per_feature", baseline_step), ("fused", fused_step)):
            started, count = clock(device), 0
            while time.perf_counter() - started < seconds / 2:  # when to stop; the leg's time is clock()'s
                step(count % len(inputs))
                count += 1
            if round_:
                legs[name] += clock(device) - started
                steps[name] += count
    return {name: steps[name] * size.batch / legs[name] for name in legs}


def table(result: dict) -> str:
    lines = [f"  {'size':<36} {'device':<6} {'per-feature':>14} {'fused (TBE)':>14} {'ratio':>7}"]
    for row in result["sizes"]:
        lines.append(
            f"  {row['size']:<36} {row.get('device', '-'):<6} {row['per_feature_events_per_second']:>12,.0f}/s "
            f"{row['fused_events_per_second']:>12,.0f}/s {row['ratio']:>7.2f}"
        )
    return "\n".join(lines)


def markdown(result: dict) -> str:
    rows = ["| size | per-feature EmbeddingBag | fused TBE | ratio |", "|---|---|---|---|"]
    rows += [
        f"| {r['size']} | {rate_text(r['per_feature_events_per_second'])} | "
        f"{rate_text(r['fused_events_per_second'])} | **{r['ratio']:.2f}** |"
        for r in result["sizes"]
    ]
    return "\n".join(rows)
