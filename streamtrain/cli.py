"""``streamtrain``: a thin command line over the stages. Each command's --help says what it does."""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import signal
import sys
import threading
import traceback
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from streamtrain.config import PACKAGE_DIR, ConfigError
from streamtrain.exitcodes import ExitCode

if TYPE_CHECKING:
    from streamtrain.delivery.serve import DeltaSource

DEFAULT_SCHEMA = PACKAGE_DIR / "schemas" / "click_event.avsc"

# The docs page that explains each command (docs/ in the source tree; `make docs` builds the site).
DOCS_PAGES = {
    "streamtrain": "index.md",
    "worker": "getting-started.md",
    "torchrun": "ranks.md",
    "plan": "ranks.md",
    "produce": "development.md",
    "dev-kafka": "development.md",
    "checkpoints": "checkpoints.md",
    "export": "model-delivery.md",
    "serve": "model-delivery.md",
    "bench": "benchmarks.md",
    "demo": "getting-started.md",
}


# Messages the pinned torchrec and fbgemm print on every start that ask nothing of the operator.
_LIBRARY_NOISE = (
    "Sharding spec not found for",
    "caching params will be ignored",
    "known issue with TorchRec's dense tensor size",
)


def _setup_logging(verbose: bool = False) -> None:
    # fbgemm and torchrec log every table at INFO on the root logger; keep them to warnings.
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("streamtrain").setLevel(logging.DEBUG if verbose else logging.INFO)
    if not verbose:
        for handler in logging.getLogger().handlers:
            handler.addFilter(lambda record: not any(n in record.getMessage() for n in _LIBRARY_NOISE))
        warnings.filterwarnings("ignore", category=FutureWarning, module=r"torchrec\.")
        warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"fbgemm_gpu\.")
        # fbgemm's CPU lookup for data-parallel tables lacks an autograd registration; the tables
        # are still updated (tests/test_train.py checks it), so the warning only alarms.
        warnings.filterwarnings("ignore", message=r".*dense_embedding_codegen_lookup_function.*")


def _worker(args: argparse.Namespace) -> int:
    from streamtrain.config import load_config

    environ = dict(os.environ)
    if args.init_from:  # validated like the config field it sets
        environ["STREAMTRAIN_CHECKPOINT__INIT_FROM"] = json.dumps(args.init_from)
    if args.start_at is not None:  # validated, and named in errors, as kafka.start_at
        environ["STREAMTRAIN_KAFKA__START_AT"] = args.start_at
    config = load_config(args.config, environ)  # fail on a bad config before any rank starts
    if args.nproc and "LOCAL_RANK" not in os.environ:
        from streamtrain.device import select_device

        select_device(config.distributed.device)  # refuse distributed.device: cuda here, not in every rank
        return _launch_local_ranks(args, config.distributed.shutdown_grace_seconds)
    from streamtrain.source import KafkaUnavailable
    from streamtrain.worker import run_worker

    observers = []
    if record := os.environ.get("STREAMTRAIN_RUN_RECORD"):  # a benchmark runs this worker, measured by its record
        from streamtrain.bench.record import RunRecorder

        observers.append(RunRecorder(Path(record), rank=int(os.environ.get("RANK", "0"))))
    try:
        return run_worker(
            config,
            until_end=args.until_end,
            max_events=args.max_events,
            allow_partial_restore=args.allow_partial_restore,
            fresh_start=args.fresh_start,
            observers=observers,
        )
    except KafkaUnavailable as error:
        print(f"streamtrain: {error}", file=sys.stderr)
        return error.exit_code


def _launch_local_ranks(args: argparse.Namespace, shutdown_grace: float) -> int:
    """Start ``--nproc`` ranks on this host with torch's elastic launcher, exactly as torchrun would;
    the ranks' exit code, the most severe if several failed."""
    from streamtrain.launch import launch

    worker_args = ["worker", "--config", str(args.config)]
    if args.until_end:
        worker_args.append("--until-end")
    if args.max_events is not None:
        worker_args += ["--max-events", str(args.max_events)]
    if args.allow_partial_restore:
        worker_args.append("--allow-partial-restore")
    if args.fresh_start:
        worker_args.append("--fresh-start")
    if args.init_from:
        worker_args += ["--init-from", args.init_from]
    if args.start_at is not None:
        worker_args += ["--start-at", args.start_at]
    return launch(
        ["--standalone", f"--nproc-per-node={args.nproc}", "--max-restarts=0", "--module", "streamtrain", *worker_args],
        shutdown_grace,
    )


def _torchrun(args: argparse.Namespace) -> int:
    from streamtrain.launch import launch

    if not args.options or args.options[0] in ("-h", "--help"):
        from torch.distributed.run import get_args_parser

        print(args.describe)
        parser = get_args_parser()
        parser.prog = "streamtrain torchrun"
        parser.print_help()
        return ExitCode.OK
    return launch(args.options)


def _plan(args: argparse.Namespace) -> int:
    from streamtrain.config import load_config

    config = load_config(args.config)  # a bad config is refused before torchrec is imported
    from streamtrain.train import describe_plan, describe_topology, plan_sharding, topology, write_plan_json

    caps = {name: gib for name, gib in (("hbm_gb", args.hbm_gb), ("ddr_gb", args.ddr_gb)) if gib is not None}
    if caps:  # the flags win over the config's values
        config = config.model_copy(update={"distributed": config.distributed.model_copy(update=caps)})
    planner_topology = topology(config, args.world_size, args.compute_device, args.local_world_size, dry_run=True)
    _model, plan = plan_sharding(config, args.world_size, args.compute_device, planner_topology=planner_topology)
    print(f"sharding plan for {args.world_size} rank(s) on {args.compute_device}")
    print(describe_topology(planner_topology))
    print(describe_plan(plan, config, args.world_size))
    if args.json:
        write_plan_json(plan, config, args.world_size, args.json)
        print(f"written to {args.json}")
    return 0


def _gib(text: str) -> float:
    if not float(text) > 0:
        raise argparse.ArgumentTypeError(f"{text} GiB: must be more than 0")
    return float(text)


def _count(text: str) -> int:
    if int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text}: must be at least 1")
    return int(text)


def _produce(args: argparse.Namespace) -> int:
    from streamtrain.dev.drift import Drift
    from streamtrain.dev.produce import produce

    knobs = {name: getattr(args, f"drift_{name}") for name in ("users", "ads", "lifetime", "id_effect", "one_off")}
    given = {name: value for name, value in knobs.items() if value is not None}
    if given and not args.drift:
        flags = ", ".join(f"--drift-{name.replace('_', '-')}" for name in given)
        print(f"streamtrain produce: {flags}: only the drifting stream takes these; add --drift", file=sys.stderr)
        return ExitCode.CONFIG
    try:
        drift = Drift(**given) if args.drift else None
    except ValueError as error:
        print(f"streamtrain produce: {error}", file=sys.stderr)
        return ExitCode.CONFIG
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    produce(
        args.bootstrap_servers,
        args.topic,
        args.count,
        partitions=args.partitions,
        partition=args.partition,
        seed=args.seed,
        rate=args.rate,
        schema_path=args.schema,
        start_time_ms=args.start_time_ms,
        progress=lambda line: print(line, file=sys.stderr, flush=True),
        should_stop=stop.is_set,
        drift=drift,
    )
    return 0


def _dev_kafka(args: argparse.Namespace) -> int:
    from streamtrain.dev.kafka import KafkaBroker

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    with KafkaBroker(port=args.port) as broker:
        for topic in args.topic:
            broker.create_topic(topic, args.partitions)
        print(f"Kafka {broker.bootstrap_servers} is up (log: {broker.log_path}); Ctrl-C stops it", flush=True)
        stop.wait()
    return 0


def _demo(args: argparse.Namespace) -> int:
    from streamtrain.dev.demo import run_demo

    if args.rate is None and not args.metrics_port:
        print(
            "streamtrain demo: --metrics-port 0 leaves nothing to calibrate from; give a port, or --rate",
            file=sys.stderr,
        )
        return ExitCode.CONFIG
    return run_demo(metrics_port=args.metrics_port, rate=args.rate, load_fraction=args.load_fraction)


def _checkpoints(args: argparse.Namespace) -> int:
    import datetime
    import json

    from streamtrain.checkpoint import list_snapshots, verify_snapshot

    if args.action == "list":
        snapshots = list_snapshots(args.path)
        if not snapshots:
            print(f"no snapshots under {args.path}")
            return 0
        print(f"{'snapshot':<24} {'step':>10} {'ranks':>5} {'size':>10}  {'written':<19}  state")
        for s in snapshots:
            meta = s.metadata or {}
            written = (
                datetime.datetime.fromtimestamp(meta["wall_time"]).strftime("%Y-%m-%d %H:%M:%S")
                if "wall_time" in meta
                else "-"
            )
            print(
                f"{s.path.rstrip('/').rsplit('/', 1)[-1]:<24} {s.step:>10,} {meta.get('world_size', '-'):>5} "
                f"{s.bytes / 2**20:>8.1f}Mi  {written:<19}  {'complete' if s.complete else s.problem}"
            )
        return 0
    path = args.path
    snapshots = list_snapshots(path) if _step_dir_name(path) is None else [verify_snapshot(path)]
    if not snapshots:
        print(f"no snapshot at {path}", file=sys.stderr)
        return 1
    snapshot = next((s for s in snapshots if s.complete), snapshots[0])
    print(
        json.dumps(
            {
                "path": snapshot.path,
                "complete": snapshot.complete,
                "problem": snapshot.problem,
                "bytes": snapshot.bytes,
                **(snapshot.metadata or {}),
            },
            indent=2,
        )
    )
    return 0 if snapshot.complete else 1


def _export(args: argparse.Namespace) -> int:
    from streamtrain.delivery.artifact import ExportError, export_snapshot

    record = None
    if args.config is not None:
        from streamtrain.config import load_config

        record = load_config(args.config).model_record()
    try:
        base = export_snapshot(
            args.checkpoint, args.step, args.out, args.version, args.new_chain, args.keep, config_record=record
        )
    except ExportError as error:
        print(f"streamtrain: {error}", file=sys.stderr)
        return 1
    print(base)
    return 0


def _serve(args: argparse.Namespace) -> int:
    from streamtrain.delivery.serve import DeltaSourceUnavailable, ScoringServer, ServeLimits

    model, deltas = _serving_sources(args)
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    limits = ServeLimits(
        args.max_request_bytes, args.max_events, args.max_in_flight, args.token_file, args.body_timeout_seconds
    )
    try:
        server = ScoringServer(
            model, deltas, args.host, args.port, args.base_wait_seconds, args.base_wait_seconds, limits=limits
        )
    except (OSError, ValueError) as error:  # the token file
        print(f"streamtrain: --token-file: {error}", file=sys.stderr)
        return ExitCode.CONFIG
    try:
        server.start()
    except TimeoutError as error:  # no base to serve yet
        print(f"streamtrain: {error}", file=sys.stderr)
        return 1
    except DeltaSourceUnavailable as error:
        # the same exit code as a worker whose brokers do not answer: an orchestrator retries both
        print(f"streamtrain: the deltas cannot be read: {error}", file=sys.stderr)
        return ExitCode.KAFKA_UNREACHABLE
    print(f"serving {model} on http://{args.host}:{server.port} (POST /score, /readyz, /metrics)", flush=True)
    stop.wait()
    server.stop()
    return 0


def _serving_sources(args: argparse.Namespace) -> tuple[Path, DeltaSource | None]:
    """The bases' folder and the deltas to follow: the flags, else the worker's config (its
    delivery target, brokers and client properties, so a secured cluster needs no flags)."""
    from streamtrain.config import load_config
    from streamtrain.delivery.serve import DirectoryDeltas, KafkaDeltas

    config = load_config(args.config) if args.config else None
    model = args.model
    if model is None and config is not None and (config.delivery.path or config.checkpoint.path):
        model = Path(config.delivery.resolved_path(config.checkpoint.path or ""))
    if model is None:
        raise ConfigError("serve needs --model DIR, or a --config with delivery.path or checkpoint.path")
    directory = args.delta_dir or (config.delivery.directory if config and not args.deltas else None)
    if directory:
        return model, DirectoryDeltas(directory)
    if config is None:
        if not args.deltas:
            return model, None
        if not args.bootstrap_servers:
            raise ConfigError("--deltas TOPIC needs --bootstrap-servers HOST:PORT, or the worker's --config")
        return model, KafkaDeltas(args.bootstrap_servers, args.deltas)
    kafka = config.kafka
    config.check_clients()  # a property librdkafka refuses is named now, not at the first poll
    return model, KafkaDeltas(
        args.bootstrap_servers or kafka.bootstrap_servers,
        args.deltas or config.delivery.resolved_topic(kafka.topic),
        kafka.client_properties(),
    )


def _bench(args: argparse.Namespace) -> int:
    from streamtrain import bench

    return bench.main(args.name, args.options)


class _BenchHelp(argparse.Action):
    """Lists the benchmarks only when asked, so that building the parser never imports streamtrain.bench."""

    def __init__(self, option_strings: list[str], dest: str, help: str | None = None):
        super().__init__(option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, nargs=0, help=help)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> None:
        from streamtrain.bench import describe

        parser.description = (parser.description or "") + "\n\n" + describe()
        parser.print_help()
        parser.exit()


def _step_dir_name(path: Path) -> str | None:
    name = str(path).rstrip("/").rsplit("/", 1)[-1]
    return name if name.startswith("step-") else None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="streamtrain",
        description="Train TorchRec recommendation models continuously from Kafka click streams.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    worker = commands.add_parser(
        "worker",
        help="consume, decode and train; serve Prometheus metrics",
        description="Run one training worker. Under torchrun, each rank runs this command. Every config "
        "field can be overridden with STREAMTRAIN_<SECTION>__<FIELD> environment variables.",
    )
    worker.add_argument("--config", required=True, type=Path, help="the worker's YAML config (see deploy/worker.yaml)")
    bound = worker.add_mutually_exclusive_group()
    bound.add_argument(
        "--until-end", action="store_true", help="train up to the end offsets seen at start-up, then exit 0"
    )
    bound.add_argument("--max-events", type=int, metavar="N", help="train N events, then exit 0")
    worker.add_argument(
        "--allow-partial-restore",
        action="store_true",
        help="restore a snapshot written for another feature config: load only the tensors "
        "whose names and shapes still match",
    )
    worker.add_argument(
        "--fresh-start",
        action="store_true",
        help="move checkpoint.path's snapshots aside into aside-<UTC time>/ there (never deleted) and start "
        "at kafka.start_at (or checkpoint.init_from); without it, snapshots that all fail to load stop the "
        "worker with exit code 7",
    )
    worker.add_argument(
        "--init-from",
        metavar="SNAPSHOT_DIR",
        help="while checkpoint.path holds no snapshot, take the weights from another run's "
        "snapshot (checkpoint.init_from); its Kafka positions are not taken",
    )
    worker.add_argument(
        "--start-at",
        metavar="WHEN",
        help="where reading starts when no snapshot is restored: earliest, latest, an ISO-8601 time "
        "with a timezone, or epoch milliseconds (overrides kafka.start_at)",
    )
    worker.add_argument(
        "--nproc",
        type=int,
        metavar="N",
        help="launch N ranks on this host through torch's elastic launcher (as torchrun does)",
    )
    worker.set_defaults(run=_worker)

    torchrun_description = (
        "torchrun, returning the ranks' exit code: the most severe of the failed ranks' codes, or after a stop "
        "the ranks' own (3 for a rank that did not stop within torchrun's --shutdown-timeout). It takes torchrun's "
        "options and command line unchanged, e.g. `streamtrain torchrun --nnodes 2 --nproc-per-node 4 "
        "--rdzv-backend c10d --rdzv-endpoint HOST:29400 -m streamtrain worker --config worker.yaml`; its ranks die "
        "with it. torchrun's own options follow."
    )
    torchrun = commands.add_parser(
        "torchrun",
        help="torchrun for streamtrain ranks, exiting with the ranks' exit code",
        description=torchrun_description,
        add_help=False,
        prefix_chars="\0",  # every argument is torchrun's
    )
    torchrun.add_argument("options", nargs=argparse.REMAINDER, help="torchrun's options and command line")
    torchrun.set_defaults(run=_torchrun, describe=torchrun_description)

    plan = commands.add_parser(
        "plan",
        help="print the sharding plan for any world size, without training or Kafka",
        description="A dry run of TorchRec's EmbeddingShardingPlanner over the configured tables, for capacity "
        "planning: how each table is sharded, where, and the embedding memory per rank.",
    )
    plan.add_argument("--config", required=True, type=Path)
    plan.add_argument("--world-size", type=int, default=1)
    plan.add_argument(
        "--compute-device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="plan for CPU ranks or GPU ranks (row-wise sharding needs cuda)",
    )
    plan.add_argument(
        "--hbm-gb",
        type=_gib,
        metavar="GIB",
        help="GPU memory per rank in GiB (default distributed.hbm_gb, else 32, TorchRec's default)",
    )
    plan.add_argument(
        "--ddr-gb",
        type=_gib,
        metavar="GIB",
        help="host memory per rank in GiB (default distributed.ddr_gb, else this host's memory "
        "divided by the local world size)",
    )
    plan.add_argument(
        "--local-world-size", type=_count, metavar="N", help="ranks per host (default: the world size, all on one host)"
    )
    plan.add_argument("--json", type=Path, help="also write the plan as JSON here")
    plan.set_defaults(run=_plan)

    produce = commands.add_parser(
        "produce",
        help="write a synthetic click stream with a planted signal to a topic",
        description="Write synthetic Taobao-like click events (schemaless Avro) whose labels follow a hidden "
        "logistic model, then print the stream's Bayes-optimal AUC of each label.",
    )
    produce.add_argument("--bootstrap-servers", default="127.0.0.1:9092")
    produce.add_argument("--topic", default="clicks")
    produce.add_argument("--count", type=int, default=100_000, help="events to write (default 100,000)")
    produce.add_argument("--rate", type=float, default=None, help="events per second (default: as fast as possible)")
    produce.add_argument("--partitions", type=int, default=4, help="partitions, if the topic is created (default 4)")
    produce.add_argument(
        "--partition",
        type=int,
        default=None,
        help="write every event to this partition (a skewed stream); default: by user id",
    )
    produce.add_argument("--seed", type=int, default=0, help="the same seed writes the same events")
    produce.add_argument("--start-time-ms", type=int, default=None, help="event time of the first event (default: now)")
    produce.add_argument("--schema", type=Path, default=DEFAULT_SCHEMA)
    drift = produce.add_argument_group(
        "drift",
        "--drift writes an open-ended id space instead: users and ads are born and retire at steady rates, "
        "and each has an effect of its own on the click, so ids folded into too few rows cost AUC",
    )
    drift.add_argument("--drift", action="store_true", help="write the drifting stream")
    drift.add_argument("--drift-users", type=int, metavar="N", help="users live at any moment (default 20,000)")
    drift.add_argument("--drift-ads", type=int, metavar="N", help="ads live at any moment (default 10,000)")
    drift.add_argument(
        "--drift-lifetime", type=int, metavar="EVENTS", help="events an id lives before it retires (default 200,000)"
    )
    drift.add_argument(
        "--drift-id-effect",
        type=float,
        metavar="SD",
        help="standard deviation of each id's own effect on the click logit (default 1.0)",
    )
    drift.add_argument(
        "--drift-one-off",
        type=float,
        metavar="SHARE",
        help="the share of events whose user, and independently whose ad, is seen in that event alone: the "
        "one-off tail of a real click log (default 0; real logs have about a third)",
    )
    produce.set_defaults(run=_produce)

    dev_kafka = commands.add_parser(
        "dev-kafka",
        help="run a local single-node Apache Kafka broker (KRaft) until Ctrl-C",
        description="Start a throwaway Kafka broker from the jars `make setup` fetched, on 127.0.0.1.",
    )
    dev_kafka.add_argument("--port", type=int, default=9092)
    dev_kafka.add_argument("--topic", action="append", default=[], help="create this topic (repeatable)")
    dev_kafka.add_argument("--partitions", type=int, default=4)
    dev_kafka.set_defaults(run=_dev_kafka)

    checkpoints = commands.add_parser(
        "checkpoints",
        help="list or inspect snapshots: step, positions, sizes, completeness",
        description="`list ROOT` shows every snapshot under a checkpoint.path; `inspect PATH` shows one snapshot "
        "(or the newest complete one under ROOT): its Kafka positions, trained-event counts per "
        "partition, world size, versions and config fingerprint. Exit 1 if it is incomplete.",
    )
    checkpoints.add_argument("action", choices=["list", "inspect"])
    checkpoints.add_argument("path", type=str)
    checkpoints.set_defaults(run=_checkpoints)

    export = commands.add_parser(
        "export",
        help="turn a snapshot (any number of ranks) into a servable base",
        description="Flatten a snapshot, export the unsharded model with torch.export (a dynamic batch "
        "dimension) and publish it under --out as base-<version>/ (model.pt2, manifest.json, schemas), "
        "then point --out/current.json at it. It loads in one CPU process: no process group, no TorchRec "
        "sharding.",
    )
    export.add_argument(
        "--checkpoint", required=True, help="a checkpoint.path (its newest complete snapshot) or a step-<N> folder"
    )
    export.add_argument("--step", type=int, help="export the snapshot of this step (default: the newest)")
    export.add_argument("--out", required=True, type=Path, help="the bases' folder (delivery.path)")
    export.add_argument("--version", type=int, help="this base's version (default: one past the newest under --out)")
    export.add_argument(
        "--new-chain",
        action="store_true",
        help="start a delta chain at this base (a worker's start); default: the snapshot's own chain",
    )
    export.add_argument("--keep", type=_count, default=3, help="keep the newest K bases (default 3)")
    export.add_argument(
        "--config",
        type=Path,
        help="the worker's YAML config, for a snapshot written before snapshots carried their config",
    )
    export.set_defaults(run=_export)

    serve = commands.add_parser(
        "serve",
        help="score events over HTTP with the newest base, following its deltas",
        description="Load the newest base under --model (current.json) and apply the deltas of its chain in order, "
        "from a Kafka topic (--deltas) or a folder (--delta-dir); a gap or a newer chain reloads the newest "
        "base. POST /score takes events as base64 Avro (the topic's wire format) or JSON objects; "
        "/healthz, /readyz and /metrics (Prometheus) too.",
    )
    serve.add_argument(
        "--config",
        type=Path,
        help="the worker's YAML (environment overrides apply): the bases' folder, the delta topic or folder, the "
        "brokers and their client properties (SASL/TLS secrets from files) default to what the worker uses",
    )
    serve.add_argument(
        "--model", type=Path, help="the bases' folder (export's --out; default with --config: delivery.path)"
    )
    source = serve.add_mutually_exclusive_group()
    source.add_argument("--deltas", metavar="TOPIC", help="the delta topic (delivery.topic)")
    source.add_argument("--delta-dir", type=Path, help="the delta folder, for a worker with a directory target")
    serve.add_argument(
        "--bootstrap-servers", metavar="HOST:PORT", help="the brokers of --deltas (default with --config: the worker's)"
    )
    serve.add_argument("--host", default="127.0.0.1", help="the address to listen on (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8500, help="the HTTP port (default 8500; 0: any free port)")
    serve.add_argument(
        "--base-wait-seconds",
        type=float,
        default=60.0,
        help="how long to wait for a base: at start, and after a gap in the deltas (default 60)",
    )
    serve.add_argument(
        "--threads",
        type=_count,
        metavar="N",
        help="torch's threads for scoring (default: torch's own); on a shared host, the cores it may really use",
    )
    serve.add_argument(
        "--max-request-bytes", type=_count, default=8 * 2**20, help="a larger /score body gets 413 (default 8 MiB)"
    )
    serve.add_argument(
        "--max-events", type=_count, default=10_000, help="more events in one /score request get 413 (default 10000)"
    )
    serve.add_argument(
        "--max-in-flight",
        type=_count,
        default=8,
        help="/score requests handled at once; more get 503 with Retry-After (default 8)",
    )
    serve.add_argument(
        "--body-timeout-seconds",
        type=float,
        default=10.0,
        help="a /score body not received within this many seconds gets 408, freeing its slot (default 10)",
    )
    serve.add_argument(
        "--token-file",
        type=Path,
        help="a file holding a bearer token /score requests must send (Authorization: Bearer ...); TLS is the "
        "mesh's or ingress's job",
    )
    serve.set_defaults(run=_serve)

    bench = commands.add_parser(
        "bench",
        help="benchmarks that run a contender beside its baseline and print the ratio",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        add_help=False,
        description="Each benchmark runs a contender and its baseline in one run on the same data, prints a "
        "table with their ratio and writes JSON under results/. `streamtrain bench NAME --help` "
        "shows a benchmark's options.",
    )
    bench.add_argument("-h", "--help", action=_BenchHelp, help="show this help, with the benchmarks, and exit")
    bench.add_argument("name", metavar="NAME", help="a benchmark, `all` or `report`")
    bench.add_argument("options", nargs=argparse.REMAINDER, help="the benchmark's options, e.g. --quick")
    bench.set_defaults(run=_bench)

    demo = commands.add_parser(
        "demo",
        help="local Kafka + synthetic stream + a worker training on it, until Ctrl-C",
        description="Start a local broker, create a 4-partition topic, produce a synthetic click stream and "
        "train on it, printing throughput and loss; metrics on http://127.0.0.1:PORT/metrics.",
    )
    demo.add_argument(
        "--metrics-port",
        type=int,
        default=9100,
        help="the worker's metrics port, which the calibration reads (default 9100)",
    )
    demo.add_argument(
        "--rate",
        type=float,
        default=None,
        help="live events per second (default: --load-fraction of the rate the worker trained the backlog at)",
    )
    demo.add_argument(
        "--load-fraction",
        type=float,
        default=0.5,
        help="the live rate's share of the worker's measured rate, when --rate is not given (default 0.5)",
    )
    demo.set_defaults(run=_demo)
    for name, command in {"streamtrain": parser, **commands.choices}.items():
        command.epilog = f"Documentation: docs/{DOCS_PAGES[name]} (`make docs` builds the site into site/)."
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _setup_logging(args.verbose)
    try:
        return args.run(args)
    except ConfigError as error:
        print(f"streamtrain: {error}", file=sys.stderr)
        return ExitCode.CONFIG


def program() -> int:
    """``main`` as the ``streamtrain`` program runs it (the console script, ``python -m streamtrain``):
    in a rank, dying with its launcher and recording its exit code for it (streamtrain.launch)."""
    from streamtrain.launch import die_with_parent, record_exit

    die_with_parent()
    try:
        code = main()
    except SystemExit as stop:  # argparse's, or a command's message
        record_exit(stop.code if isinstance(stop.code, int) else ExitCode.OK if stop.code is None else ExitCode.FAILED)
        raise
    except BaseException:
        record_exit(ExitCode.FAILED, traceback.format_exc())
        raise
    record_exit(code)
    # The interpreter's last full collection walks every object torch, TorchRec and numba made: a
    # 1-rank worker took 1.35 s to exit, 0.25 s without it. Everything is closed and flushed by
    # now, so cyclic garbage is left to the OS, and a restart, or each torchrun rank, ends sooner.
    gc.freeze()
    return code
