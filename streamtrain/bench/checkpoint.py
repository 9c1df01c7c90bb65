"""checkpoint: training throughput with an async snapshot every --interval-seconds against none,
in alternating legs on one trainer and the same in-memory batches."""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from streamtrain.bench.common import Leg, machine, rate_text, synthetic_batches, train_for

if TYPE_CHECKING:
    from streamtrain.checkpoint import Checkpointer
    from streamtrain.config import WorkerConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seconds", type=float, default=20.0, help="length of each leg (default 20)")
    parser.add_argument("--rounds", type=int, default=2, help="baseline/contender pairs (default 2)")
    parser.add_argument("--interval-seconds", type=float, default=3.0, help="snapshot interval (default 3)")


def run(args: argparse.Namespace, progress: Callable[[str], None]) -> dict:
    from streamtrain.config import load_config

    seconds, rounds = (4.0, 1) if args.quick else (args.seconds, args.rounds)
    return bench_checkpoint(load_config(args.config), seconds, rounds, args.interval_seconds, progress)


def bench_checkpoint(
    config: WorkerConfig, seconds: float, rounds: int, interval_seconds: float, progress: Callable[[str], None]
) -> dict:
    """Training throughput with an async snapshot every ``interval_seconds`` against none,
    in alternating legs on one trainer and the same batches, after a warm-up that includes one
    snapshot."""
    import torch

    from streamtrain.checkpoint import Checkpointer, StreamState
    from streamtrain.device import init_distributed
    from streamtrain.train import Trainer

    env = init_distributed(device=config.distributed.device, threads=config.distributed.intra_op_threads)
    trainer = Trainer(config, env)
    batches = synthetic_batches(config, 32)
    train_for(trainer, batches, 3.0)  # warm-up, excluded
    with tempfile.TemporaryDirectory(prefix="streamtrain-bench-") as root:
        checkpoint = config.checkpoint.model_copy(update={"path": root, "keep_last": 1})
        checkpointer = Checkpointer(checkpoint, config, trainer.model, trainer.optimizer, 0, 1, None)
        # Also warm-up: the first snapshot makes the host buffers every later one refills, once in
        # the worker's life; the legs measure what snapshots cost from then on.
        checkpointer.start_save(StreamState(step=0))
        _committed(checkpointer)
        baseline, contender = Leg(), Leg()
        for round_ in range(rounds):
            leg = train_for(trainer, batches, seconds)
            baseline.events += leg.events
            baseline.seconds += leg.seconds
            progress(f"round {round_ + 1}/{rounds}: no snapshots   {leg.rate:>10,.0f} events/s")

            last = time.perf_counter() - interval_seconds

            def snapshot_when_due(step: int) -> None:
                nonlocal last
                if checkpointer.save_done():
                    contender.snapshots.append(time.perf_counter() - last)
                    _committed(checkpointer)
                if not checkpointer.save_in_flight and time.perf_counter() - last >= interval_seconds:
                    last = time.perf_counter()  # when this snapshot started
                    checkpointer.start_save(StreamState(step=step))

            leg = train_for(trainer, batches, seconds, snapshot_when_due)
            if checkpointer.save_in_flight:
                _committed(checkpointer)
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
        "device": env.device.type,  # both legs: one trainer
        "intra_op_threads": torch.get_num_threads(),
        "snapshots": len(contender.snapshots),
        "snapshot_seconds_mean": sum(contender.snapshots) / max(len(contender.snapshots), 1),
        "snapshot_bytes": snapshot_bytes,
    }


def _committed(checkpointer: Checkpointer) -> None:
    """Finish the save in flight; a failed one would leave the contender leg a snapshot short."""
    if checkpointer.finish_save() is None:
        raise RuntimeError(f"a snapshot failed, so the figures would not be what they say: {checkpointer.last_failure}")


def table(result: dict) -> str:
    lines = [
        f"  both legs on {result.get('device', '-')}, {result.get('intra_op_threads', '-')} intra-op thread(s)",
        f"  without snapshots            {result['baseline_events_per_second']:>12,.0f} events/s",
        f"  async snapshot every {result['interval_seconds']:>4.0f}s  "
        f"{result['async_snapshot_events_per_second']:>12,.0f} events/s",
        f"  ratio                        {result['ratio']:>12.3f}   (goal >= 0.8)",
        f"  snapshots: {result['snapshots']}, {result['snapshot_bytes'] / 2**20:,.1f} MiB each, "
        f"{result['snapshot_seconds_mean']:.2f}s from start to commit on average",
    ]
    return "\n".join(lines)


def markdown(result: dict) -> str:
    return "\n".join(
        [
            "| snapshot interval | without | with async snapshots | ratio |",
            "|---|---|---|---|",
            f"| {result['interval_seconds']:g} s | {rate_text(result['baseline_events_per_second'])} | "
            f"{rate_text(result['async_snapshot_events_per_second'])} | **{result['ratio']:.2f}** |",
        ]
    )
