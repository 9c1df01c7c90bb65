"""memory: the worker's RSS, sampled every second, while a backlog far larger than it can train waits
in a local Kafka."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

from streamtrain.bench.common import SCHEMA, machine, rss_bytes, wait_until_training, worker_device


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seconds", type=float, default=60.0, help="how long RSS is sampled (default 60)")
    parser.add_argument(
        "--backlog",
        type=int,
        default=4_000_000,
        help="events waiting in Kafka, far more than the worker trains (default 4,000,000)",
    )


def run(args: argparse.Namespace, progress: Callable[[str], None]) -> dict:
    return bench_memory(
        args.config, 12.0 if args.quick else args.seconds, 100_000 if args.quick else args.backlog, progress
    )


def bench_memory(config_path: Path, seconds: float, backlog_events: int, progress: Callable[[str], None]) -> dict:
    """The worker's RSS while a backlog far larger than it can train in ``seconds`` waits in Kafka:
    flat memory means the prefetch queue and the client's fetch buffers bound what the worker holds."""
    import signal
    import subprocess
    import sys
    import tempfile

    from streamtrain.bench.e2e import worker_environment
    from streamtrain.dev.kafka import KafkaBroker, free_port
    from streamtrain.dev.produce import produce

    with KafkaBroker() as broker, tempfile.TemporaryDirectory(prefix="streamtrain-memory-") as folder:
        progress(f"writing a backlog of {backlog_events:,} events")
        produce(broker.bootstrap_servers, "memory", backlog_events, partitions=4, seed=7, schema_path=SCHEMA)
        # as bench e2e's workers: snapshots in the run's own folder, no delta publisher
        environ = worker_environment(broker.bootstrap_servers, "memory", Path(folder) / "record", free_port())
        worker = subprocess.Popen(
            [sys.executable, "-m", "streamtrain", "worker", "--config", str(config_path)],
            env=environ,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        samples: list[tuple[float, int]] = []
        try:
            wait_until_training(int(environ["STREAMTRAIN_METRICS__PORT"]), worker)
            started = time.monotonic()
            while time.monotonic() - started < seconds and worker.poll() is None:
                samples.append((time.monotonic() - started, rss_bytes(worker.pid)))
                if len(samples) % 10 == 0:
                    progress(f"{samples[-1][0]:5.0f}s  RSS {samples[-1][1] / 2**20:,.0f} MiB")
                time.sleep(1.0)
        finally:
            worker.send_signal(signal.SIGTERM)
            _out, log_text = worker.communicate(timeout=120)
    trained = [line for line in log_text.splitlines() if "stopped after" in line]
    # Warm-up, excluded: the first 10 s of training or the first fifth of the run, whichever is longer.
    warm_up = max(1, sum(1 for t, _rss in samples if t < max(10.0, seconds / 5)))
    warm = samples[warm_up - 1][1]
    peak_after = max(rss for _t, rss in samples[warm_up - 1 :])
    return {
        "benchmark": "memory",
        "machine": machine(),
        "seconds": seconds,
        "backlog_events": backlog_events,
        "warm_up_seconds": samples[warm_up - 1][0],
        "rss_after_warm_up_bytes": warm,
        "rss_peak_after_warm_up_bytes": peak_after,
        "rss_final_bytes": samples[-1][1],
        "growth_after_warm_up": (peak_after - warm) / warm,
        "samples": samples,
        "worker_summary": trained[-1] if trained else log_text[-2000:],
        "device": worker_device(config_path),
    }


def table(result: dict) -> str:
    lines = [
        f"  backlog in Kafka: {result['backlog_events']:,} events; worker ran {result['seconds']:.0f}s, "
        f"warm-up ({result['warm_up_seconds']:.0f}s) excluded",
        f"  RSS after warm-up        {result['rss_after_warm_up_bytes'] / 2**20:>8,.0f} MiB",
        f"  peak RSS after warm-up   {result['rss_peak_after_warm_up_bytes'] / 2**20:>8,.0f} MiB",
        f"  growth                   {100 * result['growth_after_warm_up']:>8.1f} %   (goal < 10%)",
        f"  {result['worker_summary'].split('INFO ')[-1]}",
    ]
    return "\n".join(lines)


def markdown(result: dict) -> str:
    return "\n".join(
        [
            "| backlog | RSS after warm-up | peak after warm-up | growth |",
            "|---|---|---|---|",
            f"| {result['backlog_events']:,} events | {result['rss_after_warm_up_bytes'] / 2**20:,.0f} MiB | "
            f"{result['rss_peak_after_warm_up_bytes'] / 2**20:,.0f} MiB | "
            f"**{100 * result['growth_after_warm_up']:.1f}%** (goal < 10%) |",
        ]
    )
