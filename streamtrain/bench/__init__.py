"""``streamtrain bench NAME``: a contender and its baseline side by side in one run, reported as a ratio.

Absolute times on shared machines are noise; the ratio of two runs made in the same invocation on
the same data is the figure. Each benchmark prints a table and writes JSON under ``results/``
(ignored by git); ``streamtrain bench report`` renders the newest result of each as markdown and
PNG plots.

Adding a benchmark: write ``streamtrain/bench/<name>.py`` with

- ``add_arguments(parser)``: its own options (``--config`` and ``--quick`` are already there;
  ``DEFAULT_CONFIG``, a path in the checkout, and ``QUICK_HELP`` change their default and help);
- ``run(args, progress) -> dict``: runs it, returns the JSON-able result, with
  ``"benchmark": NAME`` and ``"machine": common.machine()``; ``--quick`` must finish in under a
  minute and prove only that it works (a benchmark in ``ON_DEMAND``, which ``bench all`` leaves
  out, may take longer and says how long);
- ``table(result) -> str``: the text table printed after the run, below a line naming the
  benchmark and the machine;
- optionally ``markdown(result) -> str`` and ``plot(result, directory) -> list[Path]`` for
  ``bench report``;

A result holding ``"failed": why`` (a leg that could not run, say) is printed and saved like any
other, and then the command exits 1 with the reason;

and list it in ``BENCHMARKS`` below. Keep heavy imports (torch, torchrec) inside functions or in
the module itself: this file is imported by `streamtrain bench` and `bench --help` before any
benchmark is chosen.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path
from types import ModuleType

# name -> (module, one line for --help). `bench all` runs them in this order.
BENCHMARKS: dict[str, tuple[str, str]] = {
    "train-step": (
        "streamtrain.bench.train_step",
        "one nn.EmbeddingBag per feature against the fused TBE path, at several sizes",
    ),
    "kernels": (
        "streamtrain.bench.kernels",
        "the worker's interaction and fused dense Adam against TorchRec's InteractionArch and torch's Adam",
    ),
    "pipeline": (
        "streamtrain.bench.pipeline",
        "TrainPipelineSparseDist against TrainPipelineBase at 2 ranks (or --ranks 1), same in-memory batches",
    ),
    "checkpoint": ("streamtrain.bench.checkpoint", "training with an async snapshot every N seconds against none"),
    "memory": ("streamtrain.bench.memory", "the worker's RSS while a backlog far larger than it trains waits in Kafka"),
    "e2e": (
        "streamtrain.bench.e2e",
        "Kafka -> worker at 2 ranks against a naive consume-decode-train loop, and the in-memory limit",
    ),
    "collectives": (
        "streamtrain.bench.collectives",
        "a sum over 2 gloo ranks by all-gather and a local sum against gloo's all-reduce, vote to 4 MiB",
    ),
    "decode": (
        "streamtrain.bench.decode",
        "the compiled Avro batch decoder against fastavro plus a Python loop, same payloads, one core",
    ),
    "datapath": (
        "streamtrain.bench.datapath",
        "Kafka -> decoded, pinned batches for one rank, no training, at 1, 2, ... decode threads",
    ),
    "freshness": (
        "streamtrain.bench.freshness",
        "p50/p99 of (update applied - event time) at 50% and 90% of measured max throughput",
    ),
    "delivery": (
        "streamtrain.bench.delivery",
        "servable latency (delta applied by a server - event time) at 50% load, and throughput with deltas/without",
    ),
    "quality": (
        "streamtrain.bench.quality",
        "each task's progressive and holdout AUC against its Bayes AUC, clk alone and per multi-task architecture",
    ),
    "idspace": (
        "streamtrain.bench.idspace",
        "hash-mod against the managed id mapping at the same memory on a drifting stream, beside a 40x reference",
    ),
    "soak": (
        "streamtrain.bench.soak",
        "3 Kafka nodes, worker, serve for --minutes under random broker, rank and serve faults: lost, trained twice, "
        "stale",
    ),
}
# Run only when named: they last as long as they are told, not a benchmark's minutes.
ON_DEMAND = {"soak"}


def module(name: str) -> ModuleType:
    return importlib.import_module(BENCHMARKS[name][0])


def describe() -> str:
    lines = [f"{name}: {text}" for name, (_m, text) in BENCHMARKS.items()]
    lines += [
        "all: every benchmark above but soak in turn (with --quick: each in its quick size), then report",
        "report: render the newest result of each benchmark as markdown and PNG plots",
    ]
    return "\n".join(lines)


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def parser_for(name: str) -> argparse.ArgumentParser:
    from streamtrain.dev import CHECKOUT

    if name in BENCHMARKS:
        bench = module(name)
        parser = argparse.ArgumentParser(
            prog=f"streamtrain bench {name}",
            description=bench.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        config = getattr(bench, "DEFAULT_CONFIG", Path("deploy") / "worker.yaml")
        parser.add_argument(
            "--config",
            type=Path,
            default=CHECKOUT / config,
            help=f"the worker config whose model is trained (default {config})",
        )
        parser.add_argument(
            "--quick",
            action="store_true",
            help=getattr(bench, "QUICK_HELP", "a small size, under a minute: proves it runs, judges nothing"),
        )
        bench.add_arguments(parser)
        return parser
    parser = argparse.ArgumentParser(prog=f"streamtrain bench {name}")
    if name == "all":
        parser.add_argument("--quick", action="store_true", help="each benchmark in its quick size")
        parser.add_argument("--skip", action="append", default=[], choices=list(BENCHMARKS))
    elif name == "report":
        from streamtrain.bench.report import add_arguments

        add_arguments(parser)
    else:
        raise SystemExit(f"streamtrain bench: unknown benchmark {name!r}; choose from:\n{describe()}")
    return parser


class BenchmarkFailed(RuntimeError):
    """A benchmark ran, saved what it measured, and says why its result is incomplete."""


def run_one(name: str, argv: list[str]) -> Path:
    from streamtrain.bench.common import describe_machine, save

    args = parser_for(name).parse_args(argv)
    bench = module(name)
    result = {
        **bench.run(args, _progress),
        "quick": args.quick,
        "command": " ".join(["streamtrain", "bench", name, *argv]),
    }
    print(f"{name} benchmark on {describe_machine(result['machine'])}\n{bench.table(result)}", flush=True)
    path = save(result)
    print(f"results: {path}", flush=True)
    if "failed" in result:
        raise BenchmarkFailed(f"{name}: {result['failed']}")
    return path


def main(name: str, argv: list[str]) -> int:
    if name in BENCHMARKS:
        try:
            run_one(name, argv)
        except BenchmarkFailed as incomplete:
            _progress(f"bench {incomplete}")
            return 1
        return 0
    args = parser_for(name).parse_args(argv)
    if name == "report":
        from streamtrain.bench.report import report

        print(report(args.results, args.out))
        return 0
    failed = []
    for bench in BENCHMARKS:
        if bench in args.skip or bench in ON_DEMAND:
            continue
        _progress(f"=== bench {bench}{' --quick' if args.quick else ''}")
        try:
            run_one(bench, ["--quick"] if args.quick else [])
        except Exception as error:  # one failing benchmark does not hide the others' results
            _progress(f"bench {bench} failed: {type(error).__name__}: {error}")
            failed.append(bench)
    from streamtrain.bench.common import RESULTS
    from streamtrain.bench.report import report

    print(report(out=RESULTS / "report"))  # docs/bench/ only when asked: `bench report`
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0
