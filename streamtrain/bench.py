"""``streamtrain bench``: contender and baseline side by side in one run, reported as a ratio.

Absolute times on shared machines are noise; the ratio of two runs interleaved on the same data
and the same process is the figure. Each benchmark prints a table and writes JSON under
``results/``.
"""

from __future__ import annotations

import itertools
import json
import platform
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import torch

from streamtrain.checkpoint import Checkpointer, StreamState
from streamtrain.config import PACKAGE_ROOT, WorkerConfig
from streamtrain.decode import AvroBatchDecoder, ClickBatch
from streamtrain.produce import AvroEncoder, ClickStream, encoded_events
from streamtrain.source import RawEvent
from streamtrain.train import Trainer, init_distributed

RESULTS = PACKAGE_ROOT / "results"


def machine() -> dict:
    import os

    from streamtrain.checkpoint import _version

    return {"cores": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
            "torchrec": _version("torchrec"), "fbgemm_gpu": _version("fbgemm_gpu"),
            "device": "cuda" if torch.cuda.is_available() else "cpu"}


def synthetic_batches(config: WorkerConfig, count: int, seed: int = 0) -> list[ClickBatch]:
    decoder = AvroBatchDecoder(config.features)
    size = config.batching.batch_size
    events = [RawEvent(0, i, value, 0) for i, (_key, value, _p, _clk) in enumerate(
        encoded_events(ClickStream(seed, 0), AvroEncoder(config.features.resolved_schema_path()), count * size))]
    return [decoder.decode(events[i:i + size]).batch for i in range(0, len(events), size)]


@dataclass
class Leg:
    events: int = 0
    seconds: float = 0.0
    snapshots: list[float] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return self.events / self.seconds if self.seconds else 0.0


def _train_for(trainer: Trainer, batches: list[ClickBatch], seconds: float,
               after_step: Callable[[int], None] = lambda step: None) -> Leg:
    deadline = time.perf_counter() + seconds

    def until_deadline() -> Iterator[ClickBatch]:
        for batch in itertools.cycle(batches):
            if time.perf_counter() >= deadline:
                return
            yield batch

    leg = Leg()
    started = time.perf_counter()
    for result in trainer.train(until_deadline()):
        leg.events += result.batch.size
        after_step(result.step)
    leg.seconds = time.perf_counter() - started
    return leg


def bench_checkpoint(config: WorkerConfig, seconds: float, rounds: int, interval_seconds: float,
                     progress: Callable[[str], None]) -> dict:
    """Training throughput with an async snapshot every ``interval_seconds`` against none,
    in alternating legs on one trainer and the same batches."""
    env = init_distributed()
    trainer = Trainer(config, env)
    batches = synthetic_batches(config, 32)
    _train_for(trainer, batches, 3.0)  # warm-up, excluded
    with tempfile.TemporaryDirectory(prefix="streamtrain-bench-") as root:
        checkpoint = config.checkpoint.model_copy(update={"path": root, "keep_last": 1})
        checkpointer = Checkpointer(checkpoint, config, trainer.model, trainer.optimizer, 0, 1, None)
        baseline, contender = Leg(), Leg()
        for round_ in range(rounds):
            leg = _train_for(trainer, batches, seconds)
            baseline.events += leg.events
            baseline.seconds += leg.seconds
            progress(f"round {round_ + 1}/{rounds}: no snapshots   {leg.rate:>10,.0f} events/s")

            last = time.perf_counter() - interval_seconds

            def snapshot_when_due(step: int) -> None:
                nonlocal last
                if checkpointer.save_done():
                    contender.snapshots.append(time.perf_counter() - checkpointer.in_flight[3])
                    checkpointer.finish_save()
                if not checkpointer.save_in_flight and time.perf_counter() - last >= interval_seconds:
                    last = time.perf_counter()
                    checkpointer.start_save(StreamState(step=step))

            leg = _train_for(trainer, batches, seconds, snapshot_when_due)
            if checkpointer.save_in_flight:
                checkpointer.finish_save()
            contender.events += leg.events
            contender.seconds += leg.seconds
            progress(f"round {round_ + 1}/{rounds}: async snapshots {leg.rate:>10,.0f} events/s")
        snapshot_bytes = sum(p.stat().st_size for p in Path(root).rglob("*") if p.is_file())
    return {
        "benchmark": "checkpoint",
        "machine": machine(),
        "batch_size": config.batching.batch_size,
        "tables": len(config.features.tables),
        "interval_seconds": interval_seconds,
        "legs_seconds": seconds,
        "rounds": rounds,
        "baseline_events_per_second": baseline.rate,
        "async_snapshot_events_per_second": contender.rate,
        "ratio": contender.rate / baseline.rate,
        "snapshots": len(contender.snapshots),
        "snapshot_seconds_mean": sum(contender.snapshots) / max(len(contender.snapshots), 1),
        "snapshot_bytes": snapshot_bytes,
    }


def report(result: dict) -> str:
    lines = [f"{result['benchmark']} benchmark on {result['machine']['cores']} cores "
             f"({result['machine']['device']}, torch {result['machine']['torch']}, torchrec "
             f"{result['machine']['torchrec']})"]
    if result["benchmark"] == "checkpoint":
        lines += [
            f"  without snapshots            {result['baseline_events_per_second']:>12,.0f} events/s",
            f"  async snapshot every {result['interval_seconds']:>4.0f}s  "
            f"{result['async_snapshot_events_per_second']:>12,.0f} events/s",
            f"  ratio                        {result['ratio']:>12.3f}   (goal >= 0.8)",
            f"  snapshots: {result['snapshots']}, {result['snapshot_bytes'] / 2**20:,.1f} MiB each, "
            f"{result['snapshot_seconds_mean']:.2f}s from start to commit on average",
        ]
    return "\n".join(lines)


def save(result: dict) -> Path:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{result['benchmark']}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(result, indent=2))
    return path
