"""gpu: the worker on one GPU end to end from a local broker, against its trainer alone on the same
batches; the pipeline's choice; managed ids against hashed ones. One command for a lent GPU machine
(deploy/gpu/check.sh unpacks what the machine lacks and runs it); ``--device cpu`` runs the same
legs on the CPU, which CI does at its quick size.

On one rank, at the device's default batch (16,384 events on cuda, batching.batch_size unset), on
a pool of --pool-batches batches of distinct synthetic events, encoded once:

1. trainers, in one process on the pool's batches (decoded, and pinned on cuda, before any clock
   starts): ``trainer``, the worker's Trainer (TrainPipelineSparseDist, the config's tables);
   ``base``, the same with TrainPipelineBase; ``managed``, the same with the config's two largest
   id tables on ``id_mapping: managed`` at the same rows. They train in --rounds rounds of
   --leg-seconds each, the order reversed every other round, after a round that is not counted;
2. worker: the pool written to a local broker again and again, enough for --worker-seconds of
   training at the trainer's rate after the warm-up (or --events), then trained by
   ``streamtrain worker --nproc 1 --until-end``: events/s after its first --warm-up seconds. Sized
   from the trainer's rate, the leg takes about as long on a GPU as on a CPU, and a slow data path
   shows as a low ratio, not as a run that outlasts its machine.

Printed and saved: worker ÷ trainer (goal >= 0.9: the data path keeps the GPU fed), base ÷
sparse_dist, managed ÷ hash (medians of the rounds, with their spread), the worker's events/s
(goal >= 2M on one GPU), the device's name and the versions. With --out, the result so far is
written there after every leg, so a machine taken back mid-run leaves what was done; a leg that
fails is recorded with its reason and the others still run.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from streamtrain.bench.common import SCHEMA, alternated, machine, spread, spread_text

# The legs of the trainers' process; "trainer" is the worker's own Trainer, the others' baseline.
TRAINERS = ("trainer", "base", "managed")
PARTITIONS = 4
WORKER_GOAL, EVENTS_GOAL = 0.9, 2_000_000
MANAGED_TABLES = 2
# The worker's topic when the trainer's rate is unknown (its leg failed), and at most.
FALLBACK_EVENTS = {"cuda": 16_000_000, "cpu": 600_000}
MAX_EVENTS = 40_000_000


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device",
        choices=("auto", "cuda", "cpu"),
        default="auto",
        help="what the ranks train on (default auto: cuda where the worker would train on it)",
    )
    parser.add_argument(
        "--worker-seconds",
        type=float,
        default=8.0,
        help="the worker's topic holds this many seconds of training at the trainer's rate, after the "
        "warm-up (default 8)",
    )
    parser.add_argument("--events", type=int, default=None, help="the worker's topic in events, in its place")
    parser.add_argument(
        "--pool-batches", type=int, default=16, help="batches of distinct events, encoded once (default 16)"
    )
    parser.add_argument(
        "--warm-up", type=float, default=3.0, help="first seconds of the worker leg not counted (default 3)"
    )
    parser.add_argument("--leg-seconds", type=float, default=5.0, help="seconds of each trainer leg (default 5)")
    parser.add_argument("--rounds", type=int, default=3, help="counted rounds of the trainer legs (default 3)")
    parser.add_argument("--out", type=Path, default=None, help="also write the result here, after every leg")


def run(args: argparse.Namespace, progress: Callable[[str], None]) -> dict:
    from streamtrain.bench.e2e import worker_leg
    from streamtrain.bench.ranks import run_ranks
    from streamtrain.config import load_config
    from streamtrain.dev.kafka import KafkaBroker
    from streamtrain.device import select_device

    # Every process of the run (worker, ranks) trains on the device asked for.
    device = select_device(args.device).type
    os.environ["STREAMTRAIN_DISTRIBUTED__DEVICE"] = device
    if args.quick:
        pool_batches, warm_up, leg_seconds, rounds = 4, 0.5, 0.5, 1
    else:
        pool_batches, warm_up, leg_seconds, rounds = args.pool_batches, args.warm_up, args.leg_seconds, args.rounds
    config = load_config(args.config)
    batch = config.batching.batch_size
    pool_events = pool_batches * batch
    result: dict = {
        "benchmark": "gpu",
        "machine": machine(),
        "config": str(args.config),
        "device": device,
        "ranks": 1,
        "batch_size": batch,
        "pool_events": pool_events,
        "warm_up_seconds": warm_up,
        "leg_seconds": leg_seconds,
        "rounds": rounds,
        "errors": {},
    }

    def record(leg: str, outcome: Callable[[], None]) -> None:
        started = time.monotonic()
        try:
            outcome()
        except Exception as error:  # the other legs still run; the result says why this one did not
            result["errors"][leg] = f"{type(error).__name__}: {str(error)[-2000:]}"
            progress(f"  {leg} failed: {result['errors'][leg][:300]}")
        result.setdefault("leg_wall_seconds", {})[leg] = time.monotonic() - started
        _write(args.out, _with_ratios(result))

    with KafkaBroker() as broker, tempfile.TemporaryDirectory(prefix="streamtrain-gpu-") as scratch:
        pool = Path(scratch) / "pool.npz"
        progress(f"encoding {pool_events:,} distinct events ({pool_batches} batches of {batch:,})")
        _encode_pool(pool, pool_events)

        def trainers() -> None:
            progress(f"trainers: {', '.join(TRAINERS)}, {rounds} round(s) of {leg_seconds:g}s after a warm-up round")
            (rank,) = run_ranks(
                "streamtrain.bench.gpu:trainers_rank",
                {"config": str(args.config), "pool": str(pool), "rounds": rounds, "leg_seconds": leg_seconds},
                world_size=1,
                timeout=600.0,
            )
            result["trainers"] = rank
            for name in TRAINERS:
                if rank["legs"].get(name, {}).get("events_per_second"):
                    progress(f"  {name}: {np.median(rank['legs'][name]['events_per_second']):,.0f} events/s")
            for name, error in rank.get("errors", {}).items():
                result["errors"][name] = error
                progress(f"  {name} failed: {error[:300]}")

        def worker() -> None:
            rate = _with_ratios(result)["trainer_events_per_second"]
            if args.quick:
                events = 3 * pool_events
            elif args.events:
                events = args.events
            elif rate:
                events = min(int(rate * (args.worker_seconds + warm_up)), MAX_EVENTS)
            else:
                events = FALLBACK_EVENTS[device]
            copies = max(-(-events // pool_events), 2)
            result["events"] = copies * pool_events
            progress(f"writing the pool {copies} times to a {PARTITIONS}-partition topic ({result['events']:,} events)")
            written = time.monotonic()
            _write_topic(broker.bootstrap_servers, "gpu", pool, copies, args.quick)
            result["write_seconds"] = time.monotonic() - written
            progress(f"worker: streamtrain worker --nproc 1 --until-end, on {device}")
            leg = worker_leg(
                args.config,
                broker.bootstrap_servers,
                "gpu",
                warm_up,
                timeout=600.0,
                environment={"STREAMTRAIN_KAFKA__GROUP_ID": "bench-gpu"},
                ranks=1,
            )
            result["worker"] = leg
            progress(f"  {leg['events_per_second']:,.0f} events/s")

        record("trainers", trainers)
        record("worker", worker)
    result = _with_ratios(result)
    if result["errors"]:
        result["failed"] = "; ".join(f"{leg}: {error.splitlines()[0][:200]}" for leg, error in result["errors"].items())
    return result


def _with_ratios(result: dict) -> dict:
    """The result with the figures its legs so far give."""
    figures: dict = {"worker_events_per_second": result.get("worker", {}).get("events_per_second")}
    legs = result.get("trainers", {}).get("legs", {})
    rates = {name: np.array(leg["events_per_second"]) for name, leg in legs.items()}
    trainer = rates.get("trainer")
    figures["trainer_events_per_second"] = float(np.median(trainer)) if trainer is not None else None
    if figures["worker_events_per_second"] and figures["trainer_events_per_second"]:
        figures["worker_over_trainer"] = figures["worker_events_per_second"] / figures["trainer_events_per_second"]
    else:
        figures["worker_over_trainer"] = None
    spreads = {}
    for key, name in (("pipeline_base_over_sparsedist", "base"), ("managed_over_hash", "managed")):
        if trainer is not None and name in rates:
            spreads[key] = spread(list(rates[name] / trainer))  # the same round's legs
            figures[key] = spreads[key]["median"]
        else:
            figures[key] = None
    rank = result.get("trainers", {})
    versions = {k: result["machine"].get(k) for k in ("python", "torch", "torchrec", "fbgemm_gpu", "fbgemm_variant")}
    return {
        **result,
        **figures,
        "spread": spreads,
        "device_name": rank.get("device_name"),
        "versions": {**versions, "cuda": rank.get("cuda")},
        "goals": {
            "worker_over_trainer": WORKER_GOAL,
            "worker_events_per_second": EVENTS_GOAL,
            "met": bool(
                (figures["worker_over_trainer"] or 0) >= WORKER_GOAL
                and (figures["worker_events_per_second"] or 0) >= EVENTS_GOAL
            ),
        },
    }


def _write(out: Path | None, result: dict) -> None:
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))


def _encode_pool(path: Path, count: int) -> None:
    """``count`` synthetic events' schemaless Avro bodies, as one byte string and their offsets."""
    from streamtrain.dev.produce import AvroEncoder, ClickStream, encoded_events

    values = [value for _key, value, _p, _clk in encoded_events(ClickStream(21, 0), AvroEncoder(SCHEMA), count)]
    offsets = np.cumsum([0, *map(len, values)])
    np.savez(path, data=np.frombuffer(b"".join(values), dtype=np.uint8), offsets=offsets)


def load_pool(path: Path) -> list[bytes]:
    saved = np.load(path)
    data, offsets = saved["data"].tobytes(), saved["offsets"]
    return [data[a:b] for a, b in itertools.pairwise(offsets)]


def _write_topic(bootstrap: str, topic: str, pool: Path, copies: int, quick: bool) -> None:
    """The pool written ``copies`` times to ``topic``, by one writer process per partition (one in
    all on a small machine or a quick run), each to partitions of its own."""
    from streamtrain.dev.kafka import create_topic

    create_topic(bootstrap, topic, PARTITIONS)
    writers = 1 if quick else max(1, min(PARTITIONS, (os.cpu_count() or 1) // 4))
    if writers == 1:
        _write_partitions(bootstrap, topic, str(pool), copies, list(range(PARTITIONS)))
        return
    context = multiprocessing.get_context("spawn")  # not a fork of a process that may hold threads
    with context.Pool(writers) as workers:
        workers.starmap(
            _write_partitions,
            [(bootstrap, topic, str(pool), copies, list(range(w, PARTITIONS, writers))) for w in range(writers)],
        )


def _write_partitions(bootstrap: str, topic: str, pool: str, copies: int, partitions: list[int]) -> None:
    """This writer's share of ``copies`` times the pool: every event once per copy, to
    ``partitions`` in turn, so that together the writers hold each copy once."""
    from confluent_kafka import Producer

    values = load_pool(Path(pool))
    producer = Producer(
        {
            "bootstrap.servers": bootstrap,
            "broker.address.family": "v4",
            "linger.ms": 50,
            "batch.size": 1 << 20,
            "compression.type": "lz4",
            "queue.buffering.max.messages": 1_000_000,
        }
    )
    failures: list[str] = []

    def delivered(error, _message) -> None:
        if error is not None:
            failures.append(str(error))

    share = [i for i in range(len(values)) if i % PARTITIONS in partitions]
    for _copy in range(copies):
        for i in share:
            while True:
                try:
                    producer.produce(topic, values[i], partition=i % PARTITIONS, on_delivery=delivered)
                    break
                except BufferError:
                    producer.poll(0.05)
        producer.poll(0)
    if producer.flush(120) or failures:
        raise RuntimeError(f"the topic's writer could not deliver every event: {failures[:3]}")


def trainers_rank(config: str, pool: str, rounds: int, leg_seconds: float) -> dict:
    """One rank (world size 1): each of TRAINERS on the pool's batches, in alternated rounds after
    a warm-up round; each leg's events/s per counted round. A variant that cannot be built is
    reported under ``errors`` and the others still run."""
    import torch

    from streamtrain.bench.common import train_for
    from streamtrain.config import load_config
    from streamtrain.decode import AvroBatchDecoder
    from streamtrain.device import init_distributed
    from streamtrain.source import RawEvent
    from streamtrain.train import Trainer

    base_config = load_config(config)
    env = init_distributed(device=base_config.distributed.device, threads=base_config.distributed.intra_op_threads)
    events = [RawEvent(i % PARTITIONS, i, value, 0) for i, value in enumerate(load_pool(Path(pool)))]
    trainers, batches, errors = {}, {}, {}
    for name in TRAINERS:
        try:
            variant = load_config(config, {**os.environ, **variant_environment(name, base_config)})
            decoder = AvroBatchDecoder(variant.features, tasks=variant.tasks())
            size = variant.batching.batch_size
            decoded = [decoder.decode(events[i : i + size]).batch for i in range(0, len(events) - size + 1, size)]
            batches[name] = [b.pin_memory() for b in decoded] if env.device.type == "cuda" else decoded
            trainers[name] = Trainer(variant, env)
        except Exception as error:
            errors[name] = f"{type(error).__name__}: {str(error)[-2000:]}"
    rates: dict[str, list[float]] = {name: [] for name in trainers}
    for round_, order in enumerate(alternated(list(trainers), rounds + 1)):
        for name in order:
            if name in errors:
                continue
            trainer = trainers[name]
            try:
                if name == "base":  # TrainPipelineBase does not restart after its iterator ended
                    from torchrec.distributed.train_pipeline import TrainPipelineBase

                    trainer.pipeline = TrainPipelineBase(trainer.model, trainer.optimizer, env.device)
                leg = train_for(trainer, batches[name], seconds=leg_seconds)
            except Exception as error:  # the other legs go on
                errors[name] = f"{type(error).__name__}: {str(error)[-2000:]}"
                continue
            if round_:  # round 0 warms up
                rates[name].append(leg.rate)
    cuda = env.device.type == "cuda"
    return {
        "legs": {name: {"events_per_second": rates[name]} for name in trainers if name not in errors},
        "errors": errors,
        "device": env.device.type,
        "device_name": torch.cuda.get_device_name(env.device) if cuda else None,
        "cuda": torch.version.cuda if cuda else None,
    }


def variant_environment(name: str, config) -> dict[str, str]:
    """The config overrides of a trainer leg: ``managed`` puts the largest id tables that no other
    feature shares (MANAGED_TABLES of them) on the managed id map at the same rows."""
    if name != "managed":
        return {}
    shared = {t.shares_table_with for t in config.features.tables if t.shares_table_with}
    candidates = [
        (i, t)
        for i, t in enumerate(config.features.tables)
        if t.shares_table_with is None and t.name not in shared and t.id_mapping != "managed"
    ]
    largest = sorted(candidates, key=lambda it: -it[1].num_embeddings)[:MANAGED_TABLES]
    environment = {}
    for i, table in largest:
        environment[f"STREAMTRAIN_FEATURES__TABLES__{i}__ID_MAPPING"] = "managed"
        environment[f"STREAMTRAIN_FEATURES__TABLES__{i}__ROWS"] = str(table.num_embeddings)
    return environment


def table(result: dict) -> str:
    worker = result.get("worker_events_per_second")
    lines = [
        f"  1 rank on {result['device']} ({result.get('device_name') or 'no GPU name'}), batches of "
        f"{result['batch_size']:,}; the worker's topic {result.get('events', 0):,} events ({result['pool_events']:,} "
        f"distinct, repeated)",
        f"  {'worker end to end':<32} {worker or 0:>12,.0f} events/s   (goal >= {EVENTS_GOAL:,}: "
        f"{_verdict((worker or 0) >= EVENTS_GOAL)})",
        f"  {'trainer alone':<32} {result.get('trainer_events_per_second') or 0:>12,.0f} events/s",
    ]
    if result.get("worker_over_trainer"):
        ratio = result["worker_over_trainer"]
        verdict = _verdict(ratio >= WORKER_GOAL)
        lines.append(f"  {'worker / trainer':<32} {ratio:>12.2f}   (goal >= {WORKER_GOAL:g}: {verdict})")
    for key, label in (
        ("pipeline_base_over_sparsedist", "TrainPipelineBase / SparseDist"),
        ("managed_over_hash", "managed / hash"),
    ):
        if result.get(key):
            lines.append(f"  {label:<32} {result[key]:>12.2f}   ({spread_text(result['spread'][key])})")
    versions = result.get("versions", {})
    lines.append(
        "  versions: " + ", ".join(f"{name} {version}" for name, version in versions.items() if version is not None)
    )
    for leg, error in result.get("errors", {}).items():
        lines.append(f"  {leg} FAILED: {error.splitlines()[0][:200]}")
    return "\n".join(lines)


def _verdict(met: bool) -> str:
    return "met" if met else "missed"
