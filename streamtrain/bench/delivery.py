"""delivery: how soon a trained event is servable, and what delivering deltas costs training.

In one run, on one local broker:

1. max throughput: a backlog of --max-events trained by ``streamtrain worker --nproc 2
   --until-end`` (delivery off);
2. servable latency: a worker (2 ranks) with delivery on and ``delivery.delta_interval_seconds:
   1``, a ``ScoringServer`` in this process following its delta topic, and a paced sender writing
   --seconds of events at --load x max, each stamped with its send time. Per event, servable
   latency = the wall time the server applied the first delta whose step is at or after the step
   that trained the event, minus the event's time (the worker's run record gives each step's
   number and its events' times; the server's ``on_delta_applied`` hook each delta's step and apply
   time; one machine, one clock). Events trained in the first --warm-up seconds are not counted;
3. cost: one backlog trained --rounds times with deltas every 1 s and without, the order of the
   two legs reversed every other round (with, without; without, with; ...), each leg a worker of
   its own reading the backlog from the start (checkpoints on in both, to fresh folders). The
   backlog is sized for --leg-seconds of training at step 1's rate after each leg's 5 s warm-up,
   so the figure does not hang on a few seconds: legs of 4 s read ratios from 0.60 to 1.00. Each
   round's ratio is its with over its without, and the figure is the rounds' median, printed and
   saved with its spread (min, max, quartiles). Step 1 warms the broker and the page cache first.
   Both legs publish bases (the step-0 snapshot and the start base's export, which a leg of tens
   of seconds cannot amortise); "without" has no delta due within the leg, so the ratio is what
   the deltas cost. What bases cost is the max leg's rate (delivery off) against "without"'s.

Delta bytes/s is what the server read from the delta topic while the sender ran (after the
warm-up); full-snapshot bytes/s is the largest snapshot of step 2's worker divided by the
configured checkpoint.interval_seconds, and divided by the delta interval (what shipping whole
snapshots as often as deltas would cost).

Goals: servable p99 <= 5 s at 50% load; throughput ratio >= 0.9.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from streamtrain.bench.common import (
    SCHEMA,
    alternated,
    cdf_points,
    machine,
    quantiles,
    rate_text,
    scrape,
    spread,
    spread_text,
    stop_worker,
    wait_until_ready,
    wait_until_trained,
)
from streamtrain.bench.e2e import WORLD_SIZE, worker_environment, worker_leg
from streamtrain.bench.freshness import _send_paced, encoded_pool
from streamtrain.bench.record import RunRecord
from streamtrain.delivery.deltas import DeltaId
from streamtrain.delivery.serve import DeltaSource
from streamtrain.dev import CHECKOUT

DELTA_INTERVAL_SECONDS = 1.0
GOAL_P99_SECONDS = 5.0
GOAL_THROUGHPUT_RATIO = 0.9


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--max-events", type=int, default=300_000, help="backlog trained for the max throughput (default 300,000)"
    )
    parser.add_argument("--load", type=float, default=0.5, help="fraction of the max throughput to send (default 0.5)")
    parser.add_argument("--seconds", type=float, default=40.0, help="producing time of the latency run (default 40)")
    parser.add_argument(
        "--warm-up", type=float, default=10.0, help="first seconds of producing not counted (default 10)"
    )
    parser.add_argument(
        "--leg-seconds",
        type=float,
        default=25.0,
        help="counted seconds of each throughput leg, at the max throughput: sizes the legs' backlog (default 25)",
    )
    parser.add_argument(
        "--leg-events", type=int, default=None, help="the legs' backlog in events, in place of --leg-seconds"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=5,
        help="rounds of (with deltas, without), the order alternating (default 5)",
    )


# The seconds after a leg's first trained event that it does not count.
LEG_WARM_UP_SECONDS = 5.0
# "Without deltas": delivery on, bases published, but no delta due within any leg.
NO_DELTAS_INTERVAL_SECONDS = 86_400.0


def delivery_environment(
    checkpoints: Path, group: str, delta_topic: str | None, delta_interval: float = DELTA_INTERVAL_SECONDS
) -> dict[str, str]:
    """A worker's overrides: snapshots to ``checkpoints``; deltas every ``delta_interval`` seconds
    to ``delta_topic``, or delivery off when it is None."""
    environment = {
        "STREAMTRAIN_KAFKA__GROUP_ID": group,
        "STREAMTRAIN_CHECKPOINT__PATH": str(checkpoints),
        "STREAMTRAIN_DELIVERY__ENABLED": "false" if delta_topic is None else "true",
    }
    if delta_topic is not None:
        environment["STREAMTRAIN_DELIVERY__TOPIC"] = delta_topic
        environment["STREAMTRAIN_DELIVERY__DELTA_INTERVAL_SECONDS"] = str(delta_interval)
    return environment


def run(args: argparse.Namespace, progress: Callable[[str], None]) -> dict:
    from streamtrain.config import load_config
    from streamtrain.dev.kafka import KafkaBroker
    from streamtrain.dev.produce import produce

    if args.rounds < 1:
        raise SystemExit("streamtrain bench delivery: --rounds must be at least 1")
    rounds = args.rounds
    # Quick proves it runs, judges nothing: one leg each, so four worker starts, not eight. A
    # worker's start and stop (with two base exports when delivery is on) cost far more than its events.
    if args.quick:
        max_events, seconds, warm_up, leg_events, leg_warm_up, rounds = 8_000, 4.0, 1.0, 5_000, 0.5, 1
    else:
        max_events, seconds, warm_up, leg_events, leg_warm_up = (
            args.max_events,
            args.seconds,
            args.warm_up,
            args.leg_events,
            LEG_WARM_UP_SECONDS,
        )
    checkpoint_interval = load_config(args.config, {}).checkpoint.interval_seconds
    with KafkaBroker() as broker, tempfile.TemporaryDirectory(prefix="streamtrain-dbench-") as scratch:
        bootstrap, folder = broker.bootstrap_servers, Path(scratch)
        progress(f"max throughput: {max_events:,} events, streamtrain worker --nproc 2 --until-end, delivery off")
        produce(bootstrap, "delivery-max", max_events, partitions=4, seed=3, schema_path=SCHEMA)
        maximum = worker_leg(
            args.config,
            bootstrap,
            "delivery-max",
            leg_warm_up,
            environment=delivery_environment(folder / "max", "bench-delivery-max", None),
        )
        if not maximum["events_per_second"] > 0:
            raise RuntimeError(f"could not measure the max throughput: {maximum}")
        rate = args.load * maximum["events_per_second"]
        progress(f"  max {maximum['events_per_second']:,.0f} events/s")
        progress(
            f"servable latency: {rate:,.0f} events/s for {seconds:.0f}s, deltas every {DELTA_INTERVAL_SECONDS:g}s, "
            f"a server following them"
        )
        pool = encoded_pool(min(200_000, int(rate * seconds) + 1))
        live = _live(args.config, bootstrap, rate, seconds, warm_up, pool, folder / "live", progress)
        if live["servable"]["counted_events"]:
            s = live["servable"]
            progress(f"  servable p50 {s['p50']:.3f}s, p99 {s['p99']:.3f}s, max {s['max']:.3f}s")
        if leg_events is None:
            leg_events = int(maximum["events_per_second"] * (args.leg_seconds + leg_warm_up))
        progress(
            f"throughput legs: {leg_events:,} events each, {rounds} round(s) of with / without deltas, "
            "the order alternating"
        )
        produce(bootstrap, "delivery-legs", leg_events, partitions=4, seed=7, schema_path=SCHEMA)
        legs: dict[str, list[dict]] = {"without": [], "with": []}
        for round_, order in enumerate(alternated(("with", "without"), rounds)):
            for name in order:
                leg = worker_leg(
                    args.config,
                    bootstrap,
                    "delivery-legs",
                    leg_warm_up,
                    environment=delivery_environment(
                        folder / f"{name}-{round_}",
                        f"bench-delivery-{name}-{round_}",
                        f"delivery-legs-{name}-{round_}.model",
                        DELTA_INTERVAL_SECONDS if name == "with" else NO_DELTAS_INTERVAL_SECONDS,
                    ),
                )
                legs[name].append(leg)
                progress(f"  round {round_ + 1} {name} deltas: {leg['events_per_second']:,.0f} events/s")
    without = float(np.median([leg["events_per_second"] for leg in legs["without"]]))
    with_deltas = float(np.median([leg["events_per_second"] for leg in legs["with"]]))
    per_round = [
        w["events_per_second"] / wo["events_per_second"] if wo["events_per_second"] else float("nan")
        for w, wo in zip(legs["with"], legs["without"], strict=True)
    ]
    ratio_spread = spread(per_round)
    ratio = ratio_spread["median"]
    snapshot_bytes = live["snapshot_bytes"]
    servable = live["servable"]
    result = {
        "benchmark": "delivery",
        "machine": machine(),
        "config": str(args.config),
        "ranks": WORLD_SIZE,
        "max_events_per_second": maximum["events_per_second"],
        "max_leg": maximum,
        "load": args.load,
        "delta_interval_seconds": DELTA_INTERVAL_SECONDS,
        "seconds": seconds,
        "warm_up_seconds": warm_up,
        "live": live,
        "servable_p50_seconds": servable["p50"],
        "servable_p99_seconds": servable["p99"],
        "servable_max_seconds": servable["max"],
        "leg_events": leg_events,
        "legs": legs,
        "without_events_per_second": without,
        "with_events_per_second": with_deltas,
        "throughput_ratio": ratio,
        "throughput_ratios": per_round,
        "throughput_ratio_spread": ratio_spread,
        "delta_bytes_per_second": live["delta_bytes_per_second"],
        "snapshot_bytes": snapshot_bytes,
        "checkpoint_interval_seconds": checkpoint_interval,
        "snapshot_bytes_per_second": snapshot_bytes / checkpoint_interval,
        "snapshot_bytes_per_second_at_delta_interval": snapshot_bytes / DELTA_INTERVAL_SECONDS,
        "goals": {
            "servable_p99_seconds": GOAL_P99_SECONDS,
            "throughput_ratio": GOAL_THROUGHPUT_RATIO,
            "met": bool(servable["p99"] <= GOAL_P99_SECONDS and ratio >= GOAL_THROUGHPUT_RATIO),
        },
    }
    if not servable["counted_events"]:
        result["failed"] = "no trained event was served by a delta after the warm-up"
    return result


class _CountingDeltas:
    """A delta source that notes when each chunk's bytes were read, for the delta bytes/s."""

    def __init__(self, inner: DeltaSource):
        self.inner = inner
        self.reads: list[tuple[float, int]] = []

    def rewind(self, since_ms: int) -> None:
        self.inner.rewind(since_ms)

    def poll(self, timeout: float) -> list[bytes]:
        chunks = self.inner.poll(timeout)
        if chunks:
            self.reads.append((time.time(), sum(len(chunk) for chunk in chunks)))
        return chunks

    def caught_up(self) -> bool:
        return self.inner.caught_up()

    def close(self) -> None:
        self.inner.close()


@dataclass
class _AppliedDeltas:
    """(step, wall time) of every delta the server applied; appended on its follower thread."""

    steps: list[int] = field(default_factory=list)
    walls: list[float] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __call__(self, delta: DeltaId, applied: float) -> None:
        with self.lock:
            self.steps.append(delta.step)
            self.walls.append(applied)


def _live(
    config: Path,
    bootstrap: str,
    rate: float,
    seconds: float,
    warm_up: float,
    pool: list[tuple[bytes, bytes]],
    folder: Path,
    progress: Callable[[str], None],
) -> dict:
    from streamtrain.delivery.serve import KafkaDeltas, ScoringServer
    from streamtrain.dev.kafka import create_topic, free_port

    topic, delta_topic = "delivery-live", "delivery-live.model"
    create_topic(bootstrap, topic, 4)
    create_topic(bootstrap, delta_topic, 1)  # before the server reads it
    folder.mkdir(parents=True)
    record, port, checkpoints = folder / "record", free_port(2), folder / "checkpoints"
    environment = {
        **worker_environment(bootstrap, topic, record, port),
        **delivery_environment(checkpoints, "bench-delivery-live", delta_topic),
    }
    applied, log_path = _AppliedDeltas(), folder / "worker.log"
    source = _CountingDeltas(KafkaDeltas(bootstrap, delta_topic))
    with open(log_path, "wb") as log:
        worker = subprocess.Popen(
            [sys.executable, "-m", "streamtrain", "worker", "--config", str(config), "--nproc", str(WORLD_SIZE)],
            cwd=CHECKOUT,
            env=environment,
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
    server = ScoringServer(checkpoints / "serving", source, start_timeout_seconds=180.0, on_delta_applied=applied)
    try:
        for rank in range(WORLD_SIZE):
            wait_until_ready(port + rank, worker)
        server.start()  # once the worker's start base is published
        if not server.wait_ready(60):
            raise RuntimeError("the server did not catch up with the delta topic within 60 s")
        progress("  worker and server ready; sending")
        time.sleep(1.0)  # the consumers' first fetch
        started = time.time()
        sent = _send_paced(bootstrap, topic, pool, rate, seconds)
        produced_seconds = time.time() - started
        _until_served([port + rank for rank in range(WORLD_SIZE)], sent, applied, 3.0 + 2 * DELTA_INTERVAL_SECONDS)
        cuts = [scrape(port + rank) for rank in range(WORLD_SIZE)]
    finally:
        stop_worker(worker, 120)
        server.stop()
    if worker.returncode:
        raise RuntimeError(
            f"the worker exited with {worker.returncode}:\n{log_path.read_text(errors='replace')[-3000:]}"
        )
    data = RunRecord.load(record)
    counted_window = (started + warm_up, started + produced_seconds)
    latency = servable_latency(data, np.array(applied.steps), np.array(applied.walls))
    counted = data.fresh_wall >= counted_window[0]
    values = latency[counted & ~np.isnan(latency)]
    read = [(at, size) for at, size in source.reads if counted_window[0] <= at <= counted_window[1]]
    window_seconds = max(counted_window[1] - counted_window[0], 1e-9)
    in_window = [wall for wall in applied.walls if counted_window[0] <= wall <= counted_window[1]]
    snapshots = [p for p in checkpoints.glob("step-*") if p.is_dir() and not p.name.endswith(".partial")]
    bases = sorted((checkpoints / "serving").glob("base-*/model.pt2"))
    return {
        "rate": rate,
        "produced_events": sent,
        "produced_seconds": produced_seconds,
        "trained_events": int(data.freshness.size),
        "deltas_applied": len(applied.steps),
        "deltas_applied_per_second": len(in_window) / window_seconds,
        "delta_bytes_per_second": sum(size for _at, size in read) / window_seconds,
        "snapshot_bytes": max((_size(p) for p in snapshots), default=0),
        "artifact_bytes": bases[-1].stat().st_size if bases else 0,
        # what a cut held each rank's training thread, on average (streamtrain_delta_cut_seconds)
        "delta_cut_seconds_mean": _mean_cut(cuts),
        "servable": {
            "counted_events": int(values.size),
            "never_served_events": int((counted & np.isnan(latency)).sum()),
            **quantiles(values),
            "max": float(values.max()) if values.size else float("nan"),
        },
        "trained_freshness_p99": float(np.quantile(data.freshness[counted], 0.99)) if counted.any() else float("nan"),
        "cdf": cdf_points(values),
    }


def _mean_cut(samples: list[dict[str, float]]) -> float:
    count = sum(s.get("streamtrain_delta_cut_seconds_count", 0.0) for s in samples)
    total = sum(s.get("streamtrain_delta_cut_seconds_sum", 0.0) for s in samples)
    return total / count if count else float("nan")


def _until_served(ports: list[int], sent: int, applied: _AppliedDeltas, timeout: float) -> None:
    """Until what was sent is trained and a delta at or after its step is applied, for at most
    ``timeout`` seconds: events left out are counted as never served, as before the stop."""
    deadline = time.monotonic() + timeout
    if not wait_until_trained(ports, sent, timeout):
        return
    while time.monotonic() < deadline:
        # Read each time: a rank counts a step's events just before it sets the step's number.
        step = max(scrape(port).get("streamtrain_global_step", 0.0) for port in ports)
        with applied.lock:
            if applied.steps and max(applied.steps) >= step:
                return
        time.sleep(0.1)


def servable_latency(data: RunRecord, delta_steps: np.ndarray, delta_walls: np.ndarray) -> np.ndarray:
    """Per trained event (in ``data``'s order): the apply time of the first delta at or after its
    step, less its event time; NaN where no applied delta covers its step."""
    if data.fresh_step is None:
        raise RuntimeError("the run record has no step numbers: was it written by the worker?")
    latency = np.full(data.freshness.shape, np.nan)
    if delta_steps.size:
        order = np.argsort(delta_steps, kind="stable")
        steps, walls = delta_steps[order], delta_walls[order]
        # the first delta at or after a step is the earliest applied among all those at or after it
        earliest = np.minimum.accumulate(walls[::-1])[::-1]
        at = np.searchsorted(steps, data.fresh_step, side="left")
        covered = at < steps.size
        event_time = data.fresh_wall - data.freshness
        latency[covered] = earliest[at[covered]] - event_time[covered]
    return latency


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _verdict(met: bool) -> str:
    return "met" if met else "NOT met"


def table(result: dict) -> str:
    live, servable = result["live"], result["live"]["servable"]
    p99_met = servable["p99"] <= GOAL_P99_SECONDS
    ratio_met = result["throughput_ratio"] >= GOAL_THROUGHPUT_RATIO
    mib = 2**20
    lines = [
        f"  max throughput measured first: {result['max_events_per_second']:,.0f} events/s "
        f"(worker --until-end, {result['ranks']} ranks, delivery off)",
        f"  servable latency at {result['load']:.0%} load ({live['rate']:,.0f} events/s for "
        f"{result['seconds']:.0f}s, first {result['warm_up_seconds']:.0f}s excluded; "
        f"deltas every {result['delta_interval_seconds']:g}s, {live['deltas_applied']} applied by the server):",
        f"    p50 {servable['p50']:.3f}s   p99 {servable['p99']:.3f}s   max {servable['max']:.3f}s   "
        f"({servable['counted_events']:,} events; {servable['never_served_events']:,} never in an applied delta)",
        *(
            [f"    a cut held the training thread {1000 * live['delta_cut_seconds_mean']:.1f} ms on average"]
            if "delta_cut_seconds_mean" in live
            else []
        ),
        f"  training throughput, {len(result['legs']['with'])} round(s) of with / without deltas, the order "
        f"alternating, each leg {result['leg_events']:,} events:",
        f"    without deltas {result['without_events_per_second']:,.0f} events/s   "
        f"with deltas every {result['delta_interval_seconds']:g}s {result['with_events_per_second']:,.0f} events/s   "
        f"(medians)",
        f"    ratio {result['throughput_ratio']:.3f}{_ratio_spread(result)}",
        f"  delta bytes/s {result['delta_bytes_per_second'] / mib:,.2f} MiB/s   full snapshot "
        f"{result['snapshot_bytes'] / mib:,.1f} MiB: every {result['checkpoint_interval_seconds']:g}s (checkpoint "
        f"interval) {result['snapshot_bytes_per_second'] / mib:,.2f} MiB/s, every "
        f"{result['delta_interval_seconds']:g}s "
        f"{result['snapshot_bytes_per_second_at_delta_interval'] / mib:,.1f} MiB/s",
        f"  servable p99 {servable['p99']:.3f}s: goal <= {GOAL_P99_SECONDS:g} s {_verdict(p99_met)}",
        f"  throughput ratio {result['throughput_ratio']:.3f}: goal >= {GOAL_THROUGHPUT_RATIO:g} {_verdict(ratio_met)}",
    ]
    return "\n".join(lines)


def _ratio_spread(result: dict) -> str:
    """The throughput ratio's spread over the rounds, after it ("; ..."), where the result saved it."""
    figures = result.get("throughput_ratio_spread")
    return f"; {spread_text(figures)}" if figures else ""


def markdown(result: dict) -> str:
    servable = result["live"]["servable"]
    mib = 2**20
    return "\n".join(
        [
            f"Max throughput measured first: {rate_text(result['max_events_per_second'])}; deltas every "
            f"{result['delta_interval_seconds']:g} s at {result['load']:.0%} load.\n",
            "| servable p50 | servable p99 | max | throughput ratio | delta MiB/s | snapshot MiB/s |",
            "|---|---|---|---|---|---|",
            f"| {servable['p50']:.2f} s | **{servable['p99']:.2f} s** (goal ≤ 5 s) | {servable['max']:.2f} s | "
            f"**{result['throughput_ratio']:.2f}** (goal ≥ 0.9{_ratio_spread(result)}) | "
            f"{result['delta_bytes_per_second'] / mib:.2f} | {result['snapshot_bytes_per_second'] / mib:.2f} |",
        ]
    )
