"""freshness: how long an event waits for its update, at 50% and 90% of what the worker sustains.

First the worker's max throughput is measured in this run: a backlog of --max-events events in a
local Kafka, trained by ``streamtrain worker --nproc 2 --until-end`` (warm-up excluded). Then, for
each load, a fresh topic, a worker on it (2 ranks), and a paced sender writing --seconds of events
at R = load x max, each stamped with its send time as event_time. Freshness is
(update applied - event_time) of every event trained after the first --warm-up seconds of
producing, from the worker's run record (the same figure as its streamtrain_freshness_seconds
histogram, per event). Goal: p99 <= 2 s at 50% load.

The producer shares the two cores with the two ranks, as a real one would not. So that it costs
little, it sends a pool of events encoded beforehand (the same synthetic stream and Kafka
producer settings as ``streamtrain produce``), writing each event's event_time, the first field
of the Avro record, as it sends it. ``streamtrain produce --rate`` encodes as it sends and on
this machine cannot keep up with 90% of the worker's rate while the worker runs.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from streamtrain.bench.common import (
    SCHEMA,
    cdf_points,
    cpu_seconds,
    machine,
    quantiles,
    rate_text,
    stop_worker,
    wait_until_ready,
    wait_until_trained,
)
from streamtrain.bench.e2e import WORLD_SIZE, _children, worker_environment, worker_leg
from streamtrain.bench.record import RunRecord
from streamtrain.dev import CHECKOUT


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--max-events",
        type=int,
        default=800_000,
        help="backlog trained to measure the max throughput (default 800,000)",
    )
    parser.add_argument(
        "--loads",
        type=float,
        nargs="+",
        default=[0.5, 0.9],
        help="fractions of the max throughput to produce at (default 0.5 0.9)",
    )
    parser.add_argument("--seconds", type=float, default=40.0, help="producing time per load (default 40)")
    parser.add_argument(
        "--warm-up", type=float, default=10.0, help="first seconds of producing not counted (default 10)"
    )


def run(args: argparse.Namespace, progress: Callable[[str], None]) -> dict:
    from streamtrain.config import load_config
    from streamtrain.dev.kafka import KafkaBroker
    from streamtrain.dev.produce import produce

    max_events, seconds, warm_up = (15_000, 4.0, 1.0) if args.quick else (args.max_events, args.seconds, args.warm_up)
    with KafkaBroker() as broker:
        progress(f"max throughput: {max_events:,} events, streamtrain worker --nproc 2 --until-end")
        produce(broker.bootstrap_servers, "freshness-max", max_events, partitions=4, seed=3, schema_path=SCHEMA)
        maximum = worker_leg(args.config, broker.bootstrap_servers, "freshness-max", 0.5 if args.quick else 5.0)
        if not maximum["events_per_second"] > 0:
            raise RuntimeError(f"could not measure the max throughput: {maximum}")
        progress(f"  max {maximum['events_per_second']:,.0f} events/s")
        pool = encoded_pool(min(200_000, int(max(args.loads) * maximum["events_per_second"] * seconds)))
        loads = []
        for load in args.loads:
            rate = load * maximum["events_per_second"]
            progress(f"{load:.0%} load: producing {rate:,.0f} events/s for {seconds:.0f}s")
            loads.append(
                {
                    "load": load,
                    "rate": rate,
                    **_at_rate(
                        args.config,
                        broker.bootstrap_servers,
                        f"freshness-{int(load * 100)}",
                        rate,
                        seconds,
                        warm_up,
                        pool,
                        broker.pid,
                    ),
                }
            )
            progress(f"  p50 {loads[-1]['freshness']['p50']:.3f}s, p99 {loads[-1]['freshness']['p99']:.3f}s")
    return {
        "benchmark": "freshness",
        "machine": machine(),
        "config": str(args.config),
        "ranks": WORLD_SIZE,
        # the workers' batching.batch_size, environment overrides included
        "batch_size": load_config(args.config).batching.batch_size,
        "max_events_per_second": maximum["events_per_second"],
        "max_leg": maximum,
        "seconds": seconds,
        "warm_up_seconds": warm_up,
        "loads": loads,
    }


def encoded_pool(count: int, seed: int = 5) -> list[tuple[bytes, bytes]]:
    """(key, schemaless Avro body) of ``count`` synthetic events, encoded before any clock starts."""
    from streamtrain.dev.produce import AvroEncoder, ClickStream, encoded_events

    stream = ClickStream(seed, start_time_ms=int(time.time() * 1000))
    return [(key, value) for key, value, _p, _clk in encoded_events(stream, AvroEncoder(SCHEMA), count)]


def _zigzag_varint(value: int) -> bytes:
    """An Avro long: zigzag, then 7 bits a byte, low bits first."""
    z = (value << 1) ^ (value >> 63)
    out = bytearray()
    while z > 0x7F:
        out.append((z & 0x7F) | 0x80)
        z >>= 7
    out.append(z)
    return bytes(out)


def with_event_time(body: bytes, event_time_ms: int) -> bytes:
    """``body`` with its first field, event_time (an Avro long), replaced."""
    end = next(i for i, byte in enumerate(body) if byte < 0x80) + 1
    return _zigzag_varint(event_time_ms) + body[end:]


def _send_paced(bootstrap: str, topic: str, pool: list[tuple[bytes, bytes]], rate: float, seconds: float) -> int:
    """Send ``rate`` events/s for ``seconds`` from ``pool`` (round and round), each stamped with its
    send time; returns how many were sent."""
    from confluent_kafka import Producer

    producer = Producer(
        {
            "bootstrap.servers": bootstrap,
            "linger.ms": 20,
            "compression.type": "lz4",
            "partitioner": "murmur2_random",
            "enable.idempotence": True,
        }
    )
    total, sent, started = int(rate * seconds), 0, time.time()
    while sent < total:
        now = time.time()
        due = min(int((now - started) * rate) + 1, total)
        stamp = int(now * 1000)
        while sent < due:
            key, value = pool[sent % len(pool)]
            try:
                producer.produce(topic, value=with_event_time(value, stamp), key=key)
                sent += 1
            except BufferError:
                producer.poll(0.01)
        producer.poll(0)
        time.sleep(0.001)
    if producer.flush(60):
        raise RuntimeError("the producer could not deliver every event within 60 s")
    return sent


def _at_rate(
    config: Path,
    bootstrap: str,
    topic: str,
    rate: float,
    seconds: float,
    warm_up: float,
    pool: list[tuple[bytes, bytes]],
    broker_pid: int,
) -> dict:
    from streamtrain.dev.kafka import create_topic, free_port

    create_topic(bootstrap, topic, 4)
    with tempfile.TemporaryDirectory(prefix="streamtrain-fresh-") as folder:
        record, port = Path(folder) / "record", free_port(2)
        with open(Path(folder) / "worker.log", "wb") as log:
            worker = subprocess.Popen(
                [sys.executable, "-m", "streamtrain", "worker", "--config", str(config), "--nproc", str(WORLD_SIZE)],
                cwd=CHECKOUT,
                env=worker_environment(bootstrap, topic, record, port),
                stdout=subprocess.DEVNULL,
                stderr=log,
            )
        try:
            for rank in range(WORLD_SIZE):
                wait_until_ready(port + rank, worker)
            time.sleep(1.0)  # the consumers' first fetch
            ranks = _children(worker.pid)
            pids = {"ranks": ranks, "broker": [broker_pid], "sender": [os.getpid()]}
            cpu_before = {k: sum(cpu_seconds(p) for p in v) for k, v in pids.items()}
            started = time.time()
            sent = _send_paced(bootstrap, topic, pool, rate, seconds)
            produced_seconds = time.time() - started
            # cores each part used while sending: on 2 cores, what the ranks get is what is left
            cores = {k: (sum(cpu_seconds(p) for p in v) - cpu_before[k]) / produced_seconds for k, v in pids.items()}
            wait_until_trained([port + rank for rank in range(WORLD_SIZE)], sent, timeout=3.0)
        finally:
            stop_worker(worker, 90)
        if worker.returncode:
            raise RuntimeError(
                f"the worker exited with {worker.returncode}:\n"
                f"{(Path(folder) / 'worker.log').read_text(errors='replace')[-3000:]}"
            )
        data = RunRecord.load(record)
    counted = data.fresh_wall >= started + warm_up
    fresh = data.freshness[counted]
    after = data.step_wall >= started + warm_up
    trained_seconds = float(data.step_wall[after][-1] - (started + warm_up)) if after.any() else 0.0
    return {
        "produced_events": sent,
        "produced_seconds": produced_seconds,
        "cores_used_while_sending": cores,
        "produced_events_per_second": sent / produced_seconds,
        "trained_events": int(data.freshness.size),
        "counted_events": int(fresh.size),
        "trained_events_per_second_after_warm_up": int(data.step_events[after].sum()) / trained_seconds
        if trained_seconds
        else 0.0,
        "freshness": {
            **quantiles(fresh),
            "mean": float(fresh.mean()) if fresh.size else float("nan"),
            "max": float(fresh.max()) if fresh.size else float("nan"),
        },
        "cdf": cdf_points(fresh),
        "freshness_over_time": _over_time(data.fresh_wall[counted] - started, fresh),
    }


def _over_time(at: np.ndarray, fresh: np.ndarray, bucket: float = 1.0) -> list[list[float]]:
    """[[seconds since producing began, p50, p99]] per ``bucket`` seconds: shows a queue building up."""
    rows: list[list[float]] = []
    if at.size == 0:
        return rows
    for start in np.arange(np.floor(at.min()), at.max() + bucket, bucket):
        inside = fresh[(at >= start) & (at < start + bucket)]
        if inside.size:
            rows.append([float(start), float(np.quantile(inside, 0.5)), float(np.quantile(inside, 0.99))])
    return rows


def table(result: dict) -> str:
    lines = [
        f"  max throughput measured first: {result['max_events_per_second']:,.0f} events/s "
        f"(worker --until-end, {result['ranks']} ranks, batches of {result.get('batch_size', '-')}); then "
        f"{result['seconds']:.0f}s of producing per load, "
        f"the first {result['warm_up_seconds']:.0f}s excluded",
        f"  {'load':>5} {'produced/s':>11} {'trained/s':>10} {'p50':>8} {'p99':>8} {'max':>8}   "
        f"cores used by ranks / broker / sender",
    ]
    for load in result["loads"]:
        f = load["freshness"]
        lines.append(
            f"  {load['load']:>5.0%} {load['produced_events_per_second']:>11,.0f} "
            f"{load['trained_events_per_second_after_warm_up']:>10,.0f} {f['p50']:>7.3f}s {f['p99']:>7.3f}s "
            f"{f['max']:>7.3f}s   "
            + " / ".join(f"{load['cores_used_while_sending'][k]:.2f}" for k in ("ranks", "broker", "sender"))
        )
    half = next((load for load in result["loads"] if load["load"] == 0.5), None)
    if half:
        lines.append(f"  p99 at 50% load: {half['freshness']['p99']:.3f}s   (goal <= 2 s)")
    return "\n".join(lines)


def markdown(result: dict) -> str:
    rows = [
        (f"Batches of {result['batch_size']:,} events a rank. " if "batch_size" in result else "")
        + f"Max throughput measured first: {rate_text(result['max_events_per_second'])}; "
        f"{result['seconds']:g} s of producing per load, the first {result['warm_up_seconds']:g} s excluded.\n",
        "| load | produced | trained | p50 | p99 | max |",
        "|---|---|---|---|---|---|",
    ]
    for load in result["loads"]:
        f = load["freshness"]
        goal = " (goal ≤ 2 s)" if load["load"] == 0.5 else ""
        rows.append(
            f"| {load['load']:.0%} | {rate_text(load['produced_events_per_second'])} | "
            f"{rate_text(load['trained_events_per_second_after_warm_up'])} | {f['p50']:.2f} s | "
            f"**{f['p99']:.2f} s**{goal} | {f['max']:.2f} s |"
        )
    return "\n".join(rows)
