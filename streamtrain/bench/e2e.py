"""e2e: what the whole data path sustains, Kafka to applied update, at 2 ranks.

N planted-signal events are written to a local Kafka topic with several partitions. Then, on
that same topic and in the same run:

- worker: ``streamtrain worker --nproc 2 --until-end`` (torch's elastic launcher, gloo);
- naive: a plain consume-decode-train loop with the same model arithmetic
  (``streamtrain/bench/naive.py``: fastavro per record, Python lists to tensors, one
  nn.EmbeddingBag per table, DDP, no prefetch, no overlap), 2 ranks;
- limit: the worker's Trainer on 2 ranks from pre-built in-memory batches (each rank as many
  distinct events as its partitions held, in full batches, then empty steps until the other
  rank is done, as the worker's lockstep does; decoded before the clock starts), no Kafka and no
  decoding: the ceiling the data path can approach. Keys are user ids, so the partitions hold
  unequal shares, and the ranks' steps are bound by the rank with the most events in every leg.

Each figure is events/s over both ranks from the end of the warm-up to the last trained event;
the warm-up is the first --warm-up seconds after the first trained event. Printed ratios: worker
over naive (goal >= 2) and worker over limit (goal >= 0.8). Each is the median of --rounds rounds
(3), each round running every leg once, the order reversed every other round, after a worker leg
that is not counted (the broker settles and the page cache fills during the first leg: a single
round read 1.95 / 0.66 / 1.22 where the median of three read 2.20 / 0.77 / 1.30); the spread of
the rounds' ratios (min, max, quartiles) is printed and saved beside each.

With --models, the worker leg runs again per built-in model (``model.architecture``,
streamtrain/models/), and each one's events/s is stated over DLRM's worker leg of the same run:
the price of the architecture on this host.

Each leg also reports its CPU-seconds per trained event over the same window (``bench/cpu.py``):
every thread of every rank, split by thread (trainer, prefetch, librdkafka, gloo, other), and the
broker's apart; ``cpu_per_event_ratio`` is the worker's over the limit's (goal <= 1.2). Beside it,
the share of the time the trainers were runnable but waiting for a core. The load
average before and after the run says how busy the machine was beside it.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from streamtrain.bench.common import (
    RESULTS,
    SCHEMA,
    alternated,
    local_rank_env,
    machine,
    rate_text,
    spread,
    spread_text,
    throughput,
    worker_device,
)
from streamtrain.bench.cpu import GROUPS, CpuSampler, cpu_per_event, descendants, loadavg
from streamtrain.bench.ranks import PortTaken, wait_together
from streamtrain.bench.record import RunRecord
from streamtrain.dev import CHECKOUT

WORLD_SIZE = 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--events", type=int, default=1_000_000, help="events written and trained (default 1,000,000)")
    parser.add_argument("--partitions", type=int, default=4, help="partitions of the topic (default 4)")
    parser.add_argument(
        "--warm-up",
        type=float,
        default=5.0,
        help="seconds after the first trained event that are not counted (default 5)",
    )
    parser.add_argument(
        "--baseline",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the naive consume-decode-train loop (default on)",
    )
    parser.add_argument(
        "--limit",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the in-memory limit: the same model from pre-built batches (default on)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="run the legs this many times, in turn, the order reversed every other round, and report "
        "each round's ratios, their median and their spread: the machine's speed drifts between legs "
        "(default 3; 1 with --quick)",
    )
    parser.add_argument(
        "--warm-up-leg",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="first train the topic once with the worker, not counted, while the broker settles and the "
        "page cache fills (default on; off with --quick)",
    )
    parser.add_argument(
        "--models",
        nargs="+",
        choices=("dcn_v2", "deepfm", "din"),
        default=[],
        help="also run the worker leg with each of these built-in models, and state its events/s over DLRM's",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="sample the worker and naive ranks with py-spy (collapsed stacks under results/) "
        "and report where their CPU time goes",
    )


def run(args: argparse.Namespace, progress: Callable[[str], None]) -> dict:
    from streamtrain.dev.kafka import KafkaBroker
    from streamtrain.dev.produce import produce

    events = 60_000 if args.quick else args.events
    warm_up = 0.5 if args.quick else args.warm_up
    rounds_wanted = 1 if args.quick else args.rounds
    load_before = loadavg()
    rounds: list[dict[str, dict]] = []
    with KafkaBroker() as broker:
        progress(f"writing {events:,} events to a {args.partitions}-partition topic")
        produce(broker.bootstrap_servers, "e2e", events, partitions=args.partitions, seed=11, schema_path=SCHEMA)
        rank_events = events_per_rank(broker.bootstrap_servers, "e2e")
        names = ["worker", *(["naive"] if args.baseline else []), *(["limit"] if args.limit else [])]
        kafka = {"bootstrap": broker.bootstrap_servers, "topic": "e2e", "warm_up": warm_up, "profile": args.profile,
                 "broker_pid": broker.pid}  # fmt: skip
        if args.warm_up_leg and not args.quick:
            progress(f"warm-up, not counted: {LEGS['worker']}")
            worker_leg(args.config, **kafka, environment={"STREAMTRAIN_KAFKA__GROUP_ID": "bench-e2e-warm-up"})
        for round_, order in enumerate(alternated(names, rounds_wanted)):
            legs: dict[str, dict] = {}
            for name in order:
                progress(f"{f'round {round_ + 1}/{rounds_wanted}, ' if rounds_wanted > 1 else ''}{name}: {LEGS[name]}")
                if name == "worker":  # a group of its own each round, or it would resume where the last one stopped
                    group = {"STREAMTRAIN_KAFKA__GROUP_ID": f"bench-e2e-{round_}"}
                    legs[name] = worker_leg(args.config, **kafka, environment=group)
                elif name == "naive":
                    legs[name] = naive_leg(args.config, **kafka)
                else:
                    legs[name] = limit_leg(args.config, rank_events, warm_up)
                progress(f"  {legs[name]['events_per_second']:,.0f} events/s")
            rounds.append(legs)
        models = {}
        for model in args.models:
            progress(f"worker with model.architecture {model}")
            environment = {
                "STREAMTRAIN_KAFKA__GROUP_ID": f"bench-e2e-{model}",
                "STREAMTRAIN_MODEL__ARCHITECTURE": model,
            }
            rate = worker_leg(args.config, **kafka, environment=environment)["events_per_second"]
            models[model] = {"events_per_second": rate, "over_dlrm": rate / rounds[0]["worker"]["events_per_second"]}
            progress(f"  {rate:,.0f} events/s, {models[model]['over_dlrm']:.2f} of DLRM's")
    per_round = [ratios(legs) for legs in rounds]
    medians = {key: _median([r[key] for r in per_round]) for key in RATIOS}
    return {
        "benchmark": "e2e",
        "machine": machine(),
        "config": str(args.config),
        "events": events,
        "partitions": args.partitions,
        "ranks": WORLD_SIZE,
        "rank_events": rank_events,  # what each rank's partitions held: the limit's shares
        "warm_up_seconds": warm_up,
        "legs": rounds[0],
        # With several rounds, each ratio is the median of the rounds'; "legs" is the first round.
        **medians,
        # and how far the rounds' ratios spread around it
        "spread": {key: spread([r[key] for r in per_round]) for key, median in medians.items() if median is not None},
        "rounds": per_round,
        "warm_up_leg": bool(args.warm_up_leg and not args.quick),
        **({"models": models} if models else {}),
        "loadavg": {"before": load_before, "after": loadavg()},
    }


RATIOS = ("worker_over_naive", "worker_over_limit", "cpu_per_event_ratio")
# The goals: the two throughput ratios at least these, the CPU ratio at most its.
NAIVE_GOAL, LIMIT_GOAL, CPU_RATIO_GOAL = 2.0, 0.8, 1.2
LEGS = {
    "worker": "streamtrain worker --nproc 2 --until-end",
    "naive": "consume, fastavro per record, lists -> tensors, EmbeddingBag per table, DDP",
    "limit": "the worker's trainer from in-memory batches, no Kafka, no decoding",
}


def ratios(legs: dict[str, dict]) -> dict:
    """One round's ratios (throughput worker ÷ naive and ÷ limit, CPU per event worker ÷ limit), and
    each leg's rate, events trained and CPU per event."""
    rate = {name: leg["events_per_second"] for name, leg in legs.items()}
    cpu = {name: leg.get("cpu", {}).get("cpu_seconds_per_event") for name, leg in legs.items()}
    return {
        "worker_over_naive": rate["worker"] / rate["naive"] if rate.get("naive") else None,
        "worker_over_limit": rate["worker"] / rate["limit"] if rate.get("limit") else None,
        "cpu_per_event_ratio": cpu["worker"] / cpu["limit"] if cpu.get("worker") and cpu.get("limit") else None,
        "legs": {
            name: {
                "events_per_second": rate[name],
                "total_events": leg.get("total_events"),
                "cpu_seconds_per_event": cpu[name],
                "stolen_share": leg.get("cpu", {}).get("stolen_share"),
            }
            for name, leg in legs.items()
        },
    }


def _spread(result: dict, key: str) -> str:
    """A ratio's spread over the rounds, where the result saved one."""
    figures = result.get("spread", {}).get(key)
    return f"   {spread_text(figures)}" if figures else ""


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return float(np.median(known)) if len(known) == len(values) else None


def worker_environment(bootstrap: str, topic: str, record: Path, metrics_port: int = 0) -> dict[str, str]:
    """A bench worker's environment; its snapshots go beside its run ``record``, a folder of its own:
    a worker that found the config's checkpoint path holding another leg's snapshot would resume
    from it, and train nothing of a backlog already trained."""
    return {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "STREAMTRAIN_KAFKA__BOOTSTRAP_SERVERS": bootstrap,
        "STREAMTRAIN_KAFKA__TOPIC": topic,
        "STREAMTRAIN_KAFKA__GROUP_ID": f"bench-{topic}",
        "STREAMTRAIN_CHECKPOINT__PATH": str(record.parent / "snapshots"),
        "STREAMTRAIN_METRICS__PORT": str(metrics_port),
        "STREAMTRAIN_RUN_RECORD": str(record),
        # Training alone, without snapshots to publish from; delivery's cost is measured on its own.
        "STREAMTRAIN_DELIVERY__ENABLED": "false",
    }


def worker_leg(
    config: Path,
    bootstrap: str,
    topic: str,
    warm_up: float,
    timeout: float = 900.0,
    profile: bool = False,
    broker_pid: int | None = None,
    environment: dict[str, str] | None = None,
    ranks: int = WORLD_SIZE,
) -> dict:
    """``streamtrain worker --nproc RANKS --until-end`` on the topic; its run record gives the rate.
    ``environment`` overrides the worker's (config fields as STREAMTRAIN_SECTION__FIELD)."""
    from streamtrain.bench.common import wait_until_training
    from streamtrain.dev.kafka import free_port

    with tempfile.TemporaryDirectory(prefix="streamtrain-e2e-") as folder:
        record, port, log_path = Path(folder) / "record", free_port(2), Path(folder) / "worker.log"
        started = time.time()
        with open(log_path, "wb") as log:
            worker = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "streamtrain",
                    "worker",
                    "--config",
                    str(config),
                    "--nproc",
                    str(ranks),
                    "--until-end",
                ],
                cwd=CHECKOUT,
                env={**worker_environment(bootstrap, topic, record, port), **(environment or {})},
                stdout=subprocess.DEVNULL,
                stderr=log,
            )
            samplers = []
            try:
                with CpuSampler(lambda: descendants(worker.pid), broker_pid) as cpu:
                    if profile:
                        wait_until_training(port, worker)
                        time.sleep(warm_up)
                        samplers = _sample(_children(worker.pid), "worker")
                    worker.wait(timeout)
            finally:
                if worker.poll() is None:
                    worker.kill()
                    worker.wait(10)
                _stop(samplers)
        text = log_path.read_text(errors="replace")
        if worker.returncode != 0:
            raise RuntimeError(f"the worker exited with {worker.returncode}:\n{text[-4000:]}")
        data = RunRecord.load(record)
        result = {
            **data.window(warm_up),
            "data_wait_share": data.data_wait_share(warm_up),
            "cpu": _window_cpu(cpu, data.step_wall, data.step_events, warm_up),
        }
    summaries = [line.split("INFO ")[-1] for line in text.splitlines() if "stopped after" in line]
    return {
        **result,
        "device": worker_device(config),
        "process_seconds": time.time() - started,
        "log": summaries,
        **({"profile": profile_summary([p for _s, p in samplers])} if profile else {}),
    }


def naive_leg(
    config: Path,
    bootstrap: str,
    topic: str,
    warm_up: float,
    timeout: float = 1200.0,
    profile: bool = False,
    broker_pid: int | None = None,
) -> dict:
    """The naive loop on ``WORLD_SIZE`` ranks, started again once if a rank found its port taken."""
    try:
        return _naive_ranks(config, bootstrap, topic, warm_up, timeout, profile, broker_pid)
    except PortTaken:
        return _naive_ranks(config, bootstrap, topic, warm_up, timeout, profile, broker_pid)


def _naive_ranks(
    config: Path, bootstrap: str, topic: str, warm_up: float, timeout: float, profile: bool, broker_pid: int | None
) -> dict:
    from streamtrain.dev.kafka import free_port

    with tempfile.TemporaryDirectory(prefix="streamtrain-naive-") as scratch:
        folder = Path(scratch)
        record, port, started = folder / "record", free_port(), time.time()
        deadline = time.monotonic() + timeout
        logs = [folder / f"rank-{rank}.log" for rank in range(WORLD_SIZE)]
        ranks = []
        for number, log in enumerate(logs):
            with log.open("w") as output:  # a file, not a pipe: the ranks are waited on together
                ranks.append(
                    subprocess.Popen(
                        [
                            sys.executable,
                            "-m",
                            "streamtrain.bench.naive",
                            "--config",
                            str(config),
                            "--bootstrap-servers",
                            bootstrap,
                            "--topic",
                            topic,
                            "--record",
                            str(record),
                        ],
                        cwd=CHECKOUT,
                        env={**os.environ, **local_rank_env(number, WORLD_SIZE, port)},
                        stdout=output,
                        stderr=subprocess.STDOUT,
                        text=True,
                    )
                )
        samplers = []
        cpu = CpuSampler(lambda: [rank.pid for rank in ranks], broker_pid)
        try:
            with cpu:
                if profile:
                    profile_deadline = time.monotonic() + 300
                    while not all((record / f"rank-{r}.started").exists() for r in range(WORLD_SIZE)):
                        if time.monotonic() > profile_deadline or any(rank.poll() is not None for rank in ranks):
                            break
                        time.sleep(0.1)
                    time.sleep(warm_up)
                    samplers = _sample([rank.pid for rank in ranks], "naive")
                wait_together(ranks, deadline, "the naive baseline")
        finally:
            for rank in ranks:
                if rank.poll() is None:
                    rank.send_signal(signal.SIGKILL)
                    rank.wait(10)
            _stop(samplers)
        outputs = [log.read_text(errors="replace") for log in logs]
        if any(rank.returncode for rank in ranks):
            codes = ", ".join(f"rank {r} exited with {rank.returncode}" for r, rank in enumerate(ranks))
            failure = PortTaken if any("EADDRINUSE" in output for output in outputs) else RuntimeError
            raise failure(f"the naive baseline failed ({codes}):\n" + "\n".join(o[-3000:] for o in outputs))
        data = RunRecord.load(record)
        result = {**data.window(warm_up), "cpu": _window_cpu(cpu, data.step_wall, data.step_events, warm_up)}
    return {
        **result,
        "device": worker_device(config),
        "process_seconds": time.time() - started,
        "log": [line for o in outputs for line in o.splitlines() if "stopped after" in line],
        **({"profile": profile_summary([p for _s, p in samplers])} if profile else {}),
    }


def events_per_rank(bootstrap_servers: str, topic: str) -> list[int]:
    """The events each rank's partitions (``p % WORLD_SIZE == rank``) hold."""
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer(
        {"bootstrap.servers": bootstrap_servers, "group.id": "e2e-sizes", "broker.address.family": "v4"}
    )
    try:
        partitions = consumer.list_topics(topic, timeout=30).topics[topic].partitions
        held = [0] * WORLD_SIZE
        for p in partitions:
            low, high = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=30, cached=False)
            held[p % WORLD_SIZE] += high - low
        return held
    finally:
        consumer.close()


def limit_leg(config: Path, rank_events: list[int], warm_up: float) -> dict:
    from streamtrain.bench.ranks import run_ranks

    pids: list[int] = []
    with CpuSampler(lambda: pids) as cpu:
        ranks = run_ranks(
            "streamtrain.bench.e2e:limit_rank",
            {"config": str(config), "rank_events": rank_events, "min_seconds": 3 * warm_up},
            started=pids.extend,
        )
    wall = np.concatenate([np.array(r["step_wall"]) for r in ranks])
    counts = np.concatenate([np.array(r["step_events"]) for r in ranks])
    order = np.argsort(wall, kind="stable")
    return {
        **throughput(wall[order], counts[order], warm_up),
        "cpu": _window_cpu(cpu, wall[order], counts[order], warm_up),
        "device": ranks[0]["device"],
    }


def _window_cpu(cpu: CpuSampler, step_wall: np.ndarray, step_events: np.ndarray, warm_up: float) -> dict:
    """The leg's CPU per trained event over its counted window (``throughput``'s, from the same steps)."""
    window = throughput(step_wall, step_events, warm_up)
    trained = step_wall[step_events > 0]
    if trained.size < 2:
        return {}
    return cpu_per_event(
        cpu.samples, trained, step_events[step_events > 0], float(trained[0]) + window["warm_up_seconds"]
    )


def limit_rank(config: str, rank_events: list[int], min_seconds: float) -> dict:
    """One rank of the limit: the worker's Trainer (TrainPipelineSparseDist) on pre-built batches,
    ``rank_events[rank]`` events of them, then empty steps while another rank still trains."""
    import torch
    import torch.distributed as dist

    from streamtrain.bench.common import synthetic_batches, train_for
    from streamtrain.config import load_config
    from streamtrain.decode import AvroBatchDecoder
    from streamtrain.device import init_distributed
    from streamtrain.train import Trainer

    worker_config = load_config(config)
    env = init_distributed(device=worker_config.distributed.device, threads=worker_config.distributed.intra_op_threads)
    size = worker_config.batching.batch_size
    full = [max(round(events / size), 1) for events in rank_events]
    # As many distinct events as this rank's partitions held, from the same stream model (a seed
    # per rank), so the tables see as many distinct rows as in the Kafka legs; decoded before the
    # clock starts.
    empty = AvroBatchDecoder(worker_config.features, tasks=worker_config.tasks()).decode([]).batch
    batches = synthetic_batches(worker_config, full[env.rank], seed=11 + env.rank)
    batches += [empty] * (max(full) - full[env.rank])
    # Each step's events over both ranks, as the lockstep tells the worker's batches.
    global_sizes = [size * sum(step < batches_of_rank for batches_of_rank in full) for step in range(max(full))]
    batches = [b.in_global_step(events, env.world_size) for b, events in zip(batches, global_sizes, strict=True)]
    trainer = Trainer(worker_config, env)
    step_wall: list[float] = []
    step_events: list[int] = []

    def after_step(_step: int) -> None:
        step_events.append(batches[len(step_wall) % len(batches)].size)  # the chunks below go round in order
        step_wall.append(time.time())

    # Every batch once, in chunks; a small fast model goes round again until it has trained for
    # ``min_seconds``, so the counted window is not empty. The ranks agree on when to stop.
    started, done = time.monotonic(), 0
    while True:
        at = done % len(batches)
        train_for(trainer, batches[at:] + batches[:at], steps=50, after_step=after_step)
        done = len(step_wall)
        elapsed = torch.tensor([time.monotonic() - started])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MIN)
        if done >= len(batches) and elapsed.item() >= min_seconds:
            break
    return {"step_wall": step_wall, "step_events": step_events, "device": env.device.type}


def _children(pid: int) -> list[int]:
    """The launcher's children: the ranks."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        children = [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
        if len(children) >= WORLD_SIZE:
            return children
        time.sleep(0.2)
    raise RuntimeError("the worker's ranks did not start")


def _sample(pids: list[int], name: str) -> list[tuple[subprocess.Popen, Path]]:
    """py-spy attached to running ranks (after their warm-up) until they exit: collapsed stacks,
    100 samples/s, every thread, under results/."""
    import shutil

    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    RESULTS.mkdir(exist_ok=True)
    samplers = []
    for rank, pid in enumerate(pids):
        path = RESULTS / f"e2e-profile-{name}-rank{rank}.txt"
        samplers.append(
            (
                subprocess.Popen(
                    [
                        py_spy,
                        "record",
                        "--format",
                        "raw",
                        "--rate",
                        "100",
                        "--nonblocking",
                        "--pid",
                        str(pid),
                        "-o",
                        str(path),
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                ),
                path,
            )
        )
    return samplers


def _stop(samplers: list[tuple[subprocess.Popen, Path]]) -> None:
    for sampler, _path in samplers:
        try:
            sampler.wait(30)  # it writes its file once the process it samples has exited
        except subprocess.TimeoutExpired:
            sampler.kill()
            sampler.wait(10)


# Where a sample's time goes, by the first rule its stack (root to leaf, as py-spy writes it) matches.
_CATEGORIES = (
    (
        "decode: Avro per record, columns, KJT",
        ("schemaless_reader", "streamtrain/decode.py", "decode_record (", "_as_id_array", "map_ids"),
    ),
    ("Kafka: consume, poll", ("consume (", "poll (streamtrain/source.py")),
    ("lists -> tensors (naive)", ("to_tensors (",)),
    ("lockstep: the ranks' vote, waiting for a batch", ("Lockstep.__iter__",)),
    (
        "train: forward, backward, optimizer, collectives",
        ("progress (", "backward (", "forward (", "step (", "_call_impl (", "all_reduce"),
    ),
    ("metrics and progress", ("streamtrain/metrics.py", "record (streamtrain/worker.py")),
)


def profile_summary(paths: list[Path]) -> dict:
    """Shares of py-spy's samples by category, over every process and thread sampled that had a
    Python frame; samples of threads without one (native threads py-spy cannot attribute) are
    counted apart. Also the innermost two frames that hold the most samples: [share, 'caller;callee']."""
    counts: dict[str, int] = {}
    frames: dict[str, int] = {}
    total = frameless = 0
    for path in paths:
        if not path.exists():
            continue
        for line in path.read_text(errors="replace").splitlines():
            stack, _, n = line.rpartition(" ")
            if not n.isdigit():
                continue
            if not stack:
                frameless += int(n)
                continue
            category = next((name for name, marks in _CATEGORIES if any(m in stack for m in marks)), "other")
            counts[category] = counts.get(category, 0) + int(n)
            innermost = ";".join(stack.split(";")[-2:])
            frames[innermost] = frames.get(innermost, 0) + int(n)
            total += int(n)
    top = sorted(frames.items(), key=lambda kv: -kv[1])[:12]
    return {
        "samples": total,
        "samples_without_python_frame": frameless,
        "files": [str(p) for p in paths],
        "top": [[v / (total or 1), k] for k, v in top],
        "shares": {k: v / total for k, v in sorted(counts.items(), key=lambda kv: -kv[1])} if total else {},
    }


def table(result: dict) -> str:
    legs = result["legs"]
    lines = [
        f"  {result['events']:,} events in a {result['partitions']}-partition local Kafka topic, "
        f"{result['ranks']} ranks; warm-up (first {result['warm_up_seconds']:g}s after the first trained "
        f"event) excluded",
        "  events per rank (its partitions' share, the limit's too): "
        + ", ".join(f"{n:,}" for n in result.get("rank_events", [])),
        f"  {'leg':<44} {'device':<6} {'events/s':>12} {'counted':>10} {'seconds':>8}",
    ]
    names = {
        "naive": "naive consume-decode-train loop (baseline)",
        "worker": "streamtrain worker --until-end",
        "limit": "limit: in-memory batches, no Kafka/decode",
    }
    for name in ("naive", "worker", "limit"):
        if name in legs:
            leg = legs[name]
            lines.append(
                f"  {names[name]:<44} {leg.get('device', '-'):<6} {leg['events_per_second']:>12,.0f} "
                f"{leg['events']:>10,} {leg['seconds']:>8.1f}"
            )
    if len(result.get("rounds", [])) > 1:
        lines.append(f"  (the legs of round 1 of {len(result['rounds'])}; the ratios below are the rounds' median)")
        for i, r in enumerate(result["rounds"], 1):
            lines.append(
                f"  round {i}: worker / naive {r['worker_over_naive'] or 0:.2f}, worker / limit "
                f"{r['worker_over_limit'] or 0:.2f}, CPU per event worker / limit {r['cpu_per_event_ratio'] or 0:.2f}"
                + _stolen_by_leg(r["legs"])
            )
    for key, baseline, goal in (("worker_over_naive", "naive", NAIVE_GOAL), ("worker_over_limit", "limit", LIMIT_GOAL)):
        if result.get(key):
            lines.append(
                f"  worker / {baseline} = {result[key]:.2f}   (goal >= {goal:g}: {_verdict(result[key] >= goal)})"
                + _spread(result, key)
            )
    for model, figures in result.get("models", {}).items():
        lines.append(
            f"  worker with {model}: {figures['events_per_second']:,.0f} events/s = {figures['over_dlrm']:.2f} x DLRM's"
        )
    lines.extend(cpu_lines(result))
    if legs["worker"].get("data_wait_share") is not None:
        lines.append(
            f"  the worker's trainer waited for data (and the ranks' vote) "
            f"{100 * legs['worker']['data_wait_share']:.0f}% of its step time after the warm-up"
        )
    for name in ("worker", "naive"):
        if "profile" in legs.get(name, {}):
            profile = legs[name]["profile"]
            lines.append(
                f"  py-spy, {name} ({profile['samples']:,} samples with a Python frame, every thread of "
                f"both ranks): " + ", ".join(f"{k} {100 * v:.0f}%" for k, v in profile["shares"].items())
            )
    return "\n".join(lines)


def markdown(result: dict) -> str:
    legs = result["legs"]
    rows = [
        f"{result['events']:,} events, {result['partitions']} partitions, {result['ranks']} ranks, "
        f"first {result['warm_up_seconds']:g} s of each leg excluded.\n",
        "| leg | events/s | ratio |",
        "|---|---|---|",
    ]
    if "naive" in legs:
        rows.append(f"| naive consume-decode-train loop | {rate_text(legs['naive']['events_per_second'])} | 1.00 |")
    versus_naive = (
        f"**{result['worker_over_naive']:.2f}** x naive (goal ≥ {NAIVE_GOAL:g})"
        if result["worker_over_naive"]
        else "(no naive leg in this run)"
    )
    rows.append(
        f"| `streamtrain worker --nproc 2 --until-end` | {rate_text(legs['worker']['events_per_second'])} | "
        f"{versus_naive} |"
    )
    if "limit" in legs:
        rows.append(
            f"| limit: in-memory batches, no Kafka, no decoding | "
            f"{rate_text(legs['limit']['events_per_second'])} | "
            f"worker / limit = **{result['worker_over_limit']:.2f}** (goal ≥ {LIMIT_GOAL:g}) |"
        )
    if len(result.get("rounds", [])) > 1:
        rows.append(
            f"\nThe legs of round 1 of {len(result['rounds'])} (each round in turn, the order reversed every other "
            "round); the ratios are the rounds' median. Each round: "
            + "; ".join(
                f"{r['worker_over_naive'] or 0:.2f} x naive, {r['worker_over_limit'] or 0:.2f} of the limit, CPU "
                f"{r['cpu_per_event_ratio'] or 0:.2f}"
                for r in result["rounds"]
            )
            + "."
            + "".join(
                f" {label}: {spread_text(result['spread'][key])}."
                for key, label in (("worker_over_naive", "Worker ÷ naive"), ("worker_over_limit", "worker ÷ limit"))
                if key in result.get("spread", {})
            )
        )
    for model, figures in result.get("models", {}).items():
        rows.append(
            f"\nThe worker with `{model}`: {rate_text(figures['events_per_second'])}, "
            f"**{figures['over_dlrm']:.2f}** x DLRM's in the same run."
        )
    if legs["worker"].get("data_wait_share") is not None:
        rows.append(
            f"\nThe worker's trainer waited for data (and the ranks' vote) "
            f"{100 * legs['worker']['data_wait_share']:.0f}% of its step time after the warm-up."
        )
    split = cpu_table(result)
    if split:
        rows.extend(["", *split])
    return "\n".join(rows)


def _microseconds(seconds: float) -> str:
    return f"{1e6 * seconds:.1f} µs"


def cpu_lines(result: dict) -> list[str]:
    """The CPU per trained event of each leg and the worker's split by thread, for the terminal."""
    legs, lines = result["legs"], []
    for name in ("worker", "naive", "limit"):
        cpu = legs.get(name, {}).get("cpu")
        if cpu:
            lines.append(
                f"  CPU per event, {name}: {_microseconds(cpu['cpu_seconds_per_event'])} on the ranks "
                f"({cpu['cores_busy']:.2f} cores), broker {_microseconds(cpu['broker_cpu_seconds_per_event'])}"
                + _contention_text(cpu)
            )
    if result.get("cpu_per_event_ratio"):
        ratio = result["cpu_per_event_ratio"]
        lines.append(
            f"  CPU per event, worker / limit = {ratio:.2f}   "
            f"(goal <= {CPU_RATIO_GOAL:g}: {_verdict(ratio <= CPU_RATIO_GOAL)})"
            + _spread(result, "cpu_per_event_ratio")
        )
    worker = legs.get("worker", {}).get("cpu")
    if worker:
        lines.append(
            "  the worker's CPU by thread: "
            + ", ".join(
                f"{g} {_microseconds(worker['by_thread'][g]['cpu_seconds_per_event'])} "
                f"({100 * worker['by_thread'][g]['share']:.0f}%)"
                for g in GROUPS
            )
        )
    if result.get("loadavg"):
        lines.append(f"  load average before {result['loadavg']['before']}, after {result['loadavg']['after']}")
    return lines


def _contention_text(cpu: dict) -> str:
    """What kept a leg from its cores: the trainers' wait for one, and the host's steal."""
    if "trainer_waiting_share" not in cpu:  # results from before the run queue was sampled
        return ""
    text = f"; the trainers waited for a core {100 * cpu['trainer_waiting_share']:.0f}% of the time"
    if "stolen_share" in cpu:
        text += f"; the host took {100 * cpu['stolen_share']:.0f}% of the machine's cores (steal)"
    return text


def _stolen_by_leg(legs: dict[str, dict]) -> str:
    """The share of the cores the host took during each leg, where it was measured."""
    stolen = {name: leg["stolen_share"] for name, leg in legs.items() if leg.get("stolen_share") is not None}
    if not stolen:
        return ""
    return "; steal " + ", ".join(f"{name} {100 * share:.0f}%" for name, share in stolen.items())


def cpu_table(result: dict) -> list[str]:
    """CPU per trained event by thread, worker and limit side by side, as markdown."""
    legs = result["legs"]
    shown = [name for name in ("worker", "limit", "naive") if legs.get(name, {}).get("cpu")]
    if not shown:
        return []
    rows = [
        "CPU-seconds per trained event over the counted window, every thread of both ranks "
        "(`/proc/<pid>/task/*/stat`), the broker apart:\n",
        "| thread | " + " | ".join(shown) + " |",
        "|---|" + "---|" * len(shown),
    ]
    for group in GROUPS:
        rows.append(
            f"| {group} | "
            + " | ".join(_microseconds(legs[n]["cpu"]["by_thread"][group]["cpu_seconds_per_event"]) for n in shown)
            + " |"
        )
    rows.append(
        "| **ranks, all threads** | "
        + " | ".join(f"**{_microseconds(legs[n]['cpu']['cpu_seconds_per_event'])}**" for n in shown)
        + " |"
    )
    rows.append(
        "| broker | " + " | ".join(_microseconds(legs[n]["cpu"]["broker_cpu_seconds_per_event"]) for n in shown) + " |"
    )
    if all("trainer_waiting_share" in legs[n]["cpu"] for n in shown):
        rows.append(
            "| trainers runnable, waiting for a core (share of the time) | "
            + " | ".join(f"{100 * legs[n]['cpu']['trainer_waiting_share']:.0f}%" for n in shown)
            + " |"
        )
    if all("stolen_share" in legs[n]["cpu"] for n in shown):
        rows.append(
            "| the host's steal (share of the machine's cores) | "
            + " | ".join(f"{100 * legs[n]['cpu']['stolen_share']:.0f}%" for n in shown)
            + " |"
        )
    if result.get("cpu_per_event_ratio"):
        rows.append(
            f"\nCPU per event, worker ÷ limit = **{result['cpu_per_event_ratio']:.2f}** (goal ≤ {CPU_RATIO_GOAL:g})."
        )
    if result.get("loadavg"):
        rows.append(
            ("" if result.get("cpu_per_event_ratio") else "\n")
            + f"Load average (1, 5, 15 min) before the run {result['loadavg']['before']}, "
            f"after {result['loadavg']['after']}."
        )
    return rows


def _verdict(met: bool) -> str:
    """Printed beside a goal's ratio, which two decimals would show as 0.80 next to a goal of 0.8
    when it is 0.797."""
    return "met" if met else "missed"
