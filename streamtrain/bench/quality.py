"""quality: how close each task gets to the stream's Bayes AUC, per multi-task architecture and
per model architecture.

Trains --events planted events (clk and buy, see streamtrain/dev/produce.py) on one rank with the
config's model, once with clk alone (DLRM exactly, the baseline), once per multi-task architecture
with both tasks, and once per built-in model (--models: dlrm, dcn_v2, deepfm, din; streamtrain/models/)
with both tasks under shared_bottom. Each run reports, per task, the progressive (test-then-train) AUC over the last
--window events trained, and the AUC on --holdout fresh events that follow them in the stream,
scored by the final model without training; both beside the task's Bayes AUC on the same events.
buy is predicted over all events; its AUC over the clicks alone is reported too. Every run trains
the same decoded batches, in the same order.

The batch-size axis: the first architecture (both tasks) trains --batch-events events at each of
--batch-sizes events a step, with the learning rates as batching.learning_rate_scaling sets them
(docs/batching.md), and each is scored on the --holdout events that follow. Reported: each task's
holdout AUC per batch size, and per batch size the largest gap over the tasks to the first size's
(``batch_size_gaps``). Goal: within 0.003.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from streamtrain.bench.common import machine

if TYPE_CHECKING:
    from streamtrain.config import WorkerConfig
    from streamtrain.decode import ClickBatch

TASKS = [{"name": "clk", "label": "clk"}, {"name": "buy", "label": "buy"}]
ARCHITECTURES = ("shared_bottom", "mmoe", "dbmtl")
# The built-in models (model.architecture), each a run of its own.
MODELS = ("dlrm", "dcn_v2", "deepfm", "din")
# What each architecture's tasks are: dbmtl's buy reads clk's tower (a purchase follows a click).
ARCHITECTURE_TASKS = {"dbmtl": [TASKS[0], {**TASKS[1], "depends_on": "clk"}]}
# The goals the issue sets: each task's holdout AUC within this of its Bayes AUC, and clk with
# several tasks within CLK_COST of clk alone.
BAYES_GAP, CLK_COST = 0.01, 0.002
# The batch-size axis's goal: each task's holdout AUC at a larger batch within this of the first size's.
BATCH_SIZE_GAP = 0.003
PARTS = ("architectures", "batch_sizes")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--events", type=int, default=1_000_000, help="events trained (default 1,000,000)")
    parser.add_argument("--window", type=int, default=100_000, help="progressive AUC over the last N (default 100,000)")
    parser.add_argument("--holdout", type=int, default=50_000, help="fresh events scored at the end (default 50,000)")
    parser.add_argument("--seed", type=int, default=0, help="the synthetic stream's seed (default 0)")
    parser.add_argument(
        "--architectures", nargs="+", choices=ARCHITECTURES, default=list(ARCHITECTURES), help="default: all"
    )
    parser.add_argument(
        "--batch-sizes",
        type=int,
        nargs="+",
        default=[1024, 8192, 32768],
        help="events a step on the batch-size axis, the first the reference (default 1024 8192 32768)",
    )
    parser.add_argument(
        "--batch-events", type=int, default=4_000_000, help="events trained per batch size (default 4,000,000)"
    )
    parser.add_argument("--only", choices=PARTS, help="run only the architectures or only the batch-size axis")
    parser.add_argument(
        "--models", nargs="*", choices=MODELS, default=list(MODELS), help="built-in models, each a run (default: all)"
    )
    parser.add_argument(
        "--without-target-matches",
        action="store_true",
        help="drop the config's model.target_matches: what each model learns of the planted 'recently clicked this "
        "category' effect by itself (din by attention)",
    )


def run(args: argparse.Namespace, progress: Callable[[str], None]) -> dict:
    events, window, holdout = (20_000, 5_000, 5_000) if args.quick else (args.events, args.window, args.holdout)
    batch_sizes, batch_events = ([256, 1024], 20_000) if args.quick else (args.batch_sizes, args.batch_events)
    parts = [args.only] if args.only else list(PARTS)
    return bench_quality(
        args.config,
        events,
        window,
        holdout,
        args.seed,
        args.architectures,
        progress,
        batch_sizes,
        batch_events,
        parts,
        args.models,
        args.without_target_matches,
    )


def run_configs(
    path: Path, architectures: list[str], models: Sequence[str] = (), without_target_matches: bool = False
) -> dict[str, WorkerConfig]:
    """clk alone, then clk and buy under each multi-task architecture, all on the model of the config
    at ``path`` (less its target matches with ``without_target_matches``); then clk and buy on each
    built-in model of ``models``."""
    import yaml

    from streamtrain.config import parse_config

    raw = yaml.safe_load(path.read_text())
    raw["features"].pop("label", None)  # the tasks name their labels
    model = raw.get("model") or {}
    if without_target_matches:
        model.pop("target_matches", None)
    runs = {"clk_alone": {**model, "tasks": TASKS[:1]}}
    runs |= {name: {**model, "tasks": ARCHITECTURE_TASKS.get(name, TASKS), "multitask": name} for name in architectures}
    runs |= {name: {**model, "tasks": TASKS, "architecture": name} for name in models}
    return {name: parse_config({**raw, "model": section}) for name, section in runs.items()}


def bench_quality(
    config_path: Path,
    events: int,
    window: int,
    holdout: int,
    seed: int,
    architectures: list[str],
    progress: Callable[[str], None],
    batch_sizes: Sequence[int] = (),
    batch_events: int = 0,
    parts: Sequence[str] = PARTS,
    models: Sequence[str] = (),
    without_target_matches: bool = False,
) -> dict:
    configs = run_configs(config_path, architectures, models, without_target_matches)
    result: dict[str, Any] = {
        "benchmark": "quality",
        "machine": machine(),
        "events": events,
        "window": window,
        "holdout": holdout,
        "seed": seed,
        "target_matches": [m.model_dump() for m in configs["clk_alone"].model.target_matches],
        "batch_size": configs["clk_alone"].batching.batch_size,
    }
    started = time.perf_counter()
    # The batch-size axis trains its own, longer stretch of the stream: encoded only when it runs.
    encoded = max(events, batch_events if "batch_sizes" in parts and batch_sizes else 0)
    stream = _Stream(configs[architectures[0]], encoded, holdout, seed)
    progress(f"{len(stream.raw):,} events encoded in {time.perf_counter() - started:.0f}s")
    if "architectures" in parts:
        result.update(_architectures(configs, stream, events, window, progress))
    if "batch_sizes" in parts and batch_sizes:
        result.update(_batch_sizes(configs[architectures[0]], stream, batch_sizes, batch_events, window, progress))
    return result


def _architectures(
    configs: dict[str, WorkerConfig], stream: _Stream, events: int, window: int, progress: Callable[[str], None]
) -> dict[str, Any]:
    """clk alone and each architecture, on the same decoded batches of the config's size."""
    size = configs["clk_alone"].batching.batch_size
    train, test = list(stream.batches(0, events, size)), list(stream.batches(events, stream.holdout, size))
    truth = stream.truth(events)
    bayes = _bayes(truth)
    runs = {}
    for name, config in configs.items():
        batches, held = (train, test) if len(config.tasks()) > 1 else (_first_task(train), _first_task(test))
        runs[name] = _train_and_score(config, batches, held, window, truth)
        for task, figures in runs[name]["tasks"].items():
            figures["bayes_auc"] = bayes[task]
            if task == "buy":
                figures["bayes_auc_over_clicks"] = bayes["buy_given_clk"]
        progress(f"{name}: {_shown(runs[name])}")
    alone = runs["clk_alone"]["tasks"]["clk"]["holdout_auc"]
    return {
        "bayes_auc": bayes,
        "architectures": runs,
        "goals": {
            "holdout_within_bayes": BAYES_GAP,
            "clk_cost": CLK_COST,
            "met": {
                name: {
                    **{task: f["bayes_auc"] - f["holdout_auc"] <= BAYES_GAP for task, f in run["tasks"].items()},
                    "clk_vs_alone": alone - run["tasks"]["clk"]["holdout_auc"] <= CLK_COST,
                }
                for name, run in runs.items()
            },
        },
    }


def _batch_sizes(
    config: WorkerConfig,
    stream: _Stream,
    sizes: Sequence[int],
    events: int,
    window: int,
    progress: Callable[[str], None],
) -> dict[str, Any]:
    """``config`` trained on the first ``events`` at each of ``sizes`` events a step (its learning
    rates scaled as its batching section says), each scored on the holdout that follows."""
    truth = stream.truth(events)
    held = list(stream.batches(events, stream.holdout, sizes[0]))
    runs: dict[str, dict[str, Any]] = {}
    for size in sizes:
        sized = config.model_copy(update={"batching": config.batching.model_copy(update={"batch_size": size})})
        runs[str(size)] = _train_and_score(sized, stream.batches(0, events, size), held, window, truth)
        runs[str(size)]["learning_rate_scales"] = dict(
            zip(("sparse", "dense"), sized.learning_rate_scales(1), strict=True)
        )
        progress(f"batch {size:,}: {_shown(runs[str(size)])}")
    reference = runs[str(sizes[0])]["tasks"]
    gaps = {
        size: max(reference[task]["holdout_auc"] - f["holdout_auc"] for task, f in run["tasks"].items())
        for size, run in runs.items()
        if size != str(sizes[0])
    }
    return {
        "batch_size_axis": {
            "architecture": config.model.multitask,
            "events": events,
            "learning_rate_scaling": config.batching.learning_rate_scaling,
            "reference_batch_size": config.batching.reference_batch_size,
            "runs": runs,
        },
        "batch_size_gaps": gaps,
        "batch_size_goal": {"within": BATCH_SIZE_GAP, "met": all(gap <= BATCH_SIZE_GAP for gap in gaps.values())},
    }


def _shown(run: dict[str, Any]) -> str:
    shown = ", ".join(
        f"{task} progressive {f['progressive_auc']:.4f} holdout {f['holdout_auc']:.4f}"
        + (f" (Bayes {f['bayes_auc']:.4f})" if "bayes_auc" in f else "")
        for task, f in run["tasks"].items()
    )
    return f"{shown}; {run['events_per_second']:,.0f} events/s"


@dataclasses.dataclass
class _Truth:
    p_click: np.ndarray
    p_buy: np.ndarray  # given a click
    clk: np.ndarray
    buy: np.ndarray


class _Stream:
    """``events`` + ``holdout`` events of one planted stream, encoded, with their truth, decoded in
    batches of any size on demand (with both tasks' labels): decoded, 4M events would take gigabytes."""

    def __init__(self, config: WorkerConfig, events: int, holdout: int, seed: int):
        from streamtrain.decode import AvroBatchDecoder
        from streamtrain.dev.produce import AvroEncoder, ClickStream, labelled_events
        from streamtrain.source import RawEvent

        self.decoder = AvroBatchDecoder(config.features, tasks=config.tasks())
        encoder = AvroEncoder(config.features.resolved_schema_path())
        self.holdout = holdout
        self.raw, truths = [], []
        for offset, (_key, value, truth) in enumerate(labelled_events(ClickStream(seed, 0), encoder, events + holdout)):
            self.raw.append(RawEvent(0, offset, value, 0))
            truths.append((truth.p_click, truth.p_buy, truth.clk, truth.buy))
        self.truths = np.array(truths).reshape(-1, 4)

    def batches(self, start: int, count: int, size: int) -> Iterator[ClickBatch]:
        """Events ``start`` to ``start + count``, decoded ``size`` at a time."""
        part = self.raw[start : start + count]
        for i in range(0, len(part), size):
            yield self.decoder.decode(part[i : i + size]).batch

    def truth(self, trained: int) -> _Truth:
        """The truth of the holdout that follows the first ``trained`` events."""
        return _Truth(*self.truths[trained : trained + self.holdout].T)


def _first_task(batches: list[ClickBatch]) -> list[ClickBatch]:
    """The batches as a clk-alone model takes them: one label, [B]."""
    return [dataclasses.replace(b, labels=b.labels[:, 0].contiguous()) for b in batches]


def _bayes(truth: _Truth) -> dict[str, float]:
    from streamtrain.dev.produce import bayes_aucs

    return bayes_aucs(truth.p_click, truth.p_buy, truth.clk, truth.buy)


def _train_and_score(
    config: WorkerConfig, batches: Iterable[ClickBatch], holdout: list[ClickBatch], window: int, truth: _Truth
) -> dict[str, Any]:
    import torch

    from streamtrain.device import init_distributed
    from streamtrain.metrics import TaskQualities, roc_auc
    from streamtrain.train import Trainer

    names = [t.name for t in config.tasks()]
    trainer = Trainer(
        config, init_distributed(device=config.distributed.device, threads=config.distributed.intra_op_threads)
    )
    quality = TaskQualities(names, window)
    started = time.perf_counter()
    events = 0
    for result in trainer.train(iter(batches)):
        quality.add(result.logits.numpy(), result.batch.labels.numpy())
        events += result.batch.size
    seconds = time.perf_counter() - started
    model = trainer.pipeline.detach()  # the model with its own forward again, to score without training
    model.eval()
    with torch.no_grad():
        scores = torch.cat([model(b.to(trainer.env.device))[1][1].float().cpu() for b in holdout]).numpy()
    scores = scores.reshape(len(scores), -1)
    progressive = quality.compute()
    tasks: dict[str, dict[str, float]] = {}
    for t, name in enumerate(names):
        labels = truth.clk if name == "clk" else truth.buy
        tasks[name] = {
            "progressive_auc": progressive[name]["window"]["auc"],
            "holdout_auc": roc_auc(scores[:, t], labels),
        }
        if name == "buy":
            clicked = truth.clk == 1
            tasks[name]["holdout_auc_over_clicks"] = roc_auc(scores[clicked, t], labels[clicked])
    return {"tasks": tasks, "seconds": seconds, "events_per_second": events / seconds}


def table(result: dict) -> str:
    lines = []
    if "architectures" in result:
        lines += _architecture_table(result)
    if "batch_size_axis" in result:
        lines += _batch_size_table(result)
    return "\n".join(lines)


def _architecture_table(result: dict) -> list[str]:
    goals = result["goals"]
    lines = [
        f"  {result['events']:,} events trained, progressive AUC over the last {result['window']:,}, holdout of "
        f"{result['holdout']:,} fresh events; goals: holdout within {goals['holdout_within_bayes']} of Bayes, clk "
        f"within {goals['clk_cost']} of clk alone",
        f"  {'run':<14} {'task':<5} {'progressive':>11} {'holdout':>8} {'Bayes':>7} {'gap':>7}  goal",
    ]
    for name, run in result["architectures"].items():
        met = result["goals"]["met"][name]
        for task, f in run["tasks"].items():
            goal = "met" if met[task] else "missed"
            if task == "clk" and name != "clk_alone":
                goal += f", vs alone {'met' if met['clk_vs_alone'] else 'missed'}"
            lines.append(
                f"  {name:<14} {task:<5} {f['progressive_auc']:>11.4f} {f['holdout_auc']:>8.4f} "
                f"{f['bayes_auc']:>7.4f} {f['bayes_auc'] - f['holdout_auc']:>7.4f}  {goal}"
            )
            if task == "buy":
                lines.append(
                    f"  {'':<14} {'(over clicks)':<19} {f['holdout_auc_over_clicks']:>8.4f} "
                    f"{f['bayes_auc_over_clicks']:>7.4f}"
                )
        lines.append(f"  {'':<14} {run['events_per_second']:,.0f} events/s")
    return lines


def _batch_size_table(result: dict) -> list[str]:
    axis, gaps, goal = result["batch_size_axis"], result["batch_size_gaps"], result["batch_size_goal"]
    lines = [
        f"  batch-size axis: {axis['architecture']}, {axis['events']:,} events per batch size, learning rates "
        f"scaling {axis['learning_rate_scaling']} from {axis['reference_batch_size']:,} (dense: the dense rate's "
        f"factor); goal: every task's "
        f"holdout AUC within {goal['within']} of the first size's ({'met' if goal['met'] else 'missed'})",
        f"  {'batch':>7} {'dense':>6} {'task':<5} {'progressive':>11} {'holdout':>8} {'largest gap':>12}",
    ]
    for size, run in axis["runs"].items():
        gap = f"{gaps[size]:>12.4f}" if size in gaps else f"{'-':>12}"
        for i, (task, f) in enumerate(run["tasks"].items()):
            head = f"{int(size):>7,} {run['learning_rate_scales']['dense']:>6.2f}" if i == 0 else f"{'':>7} {'':>6}"
            lines.append(
                f"  {head} {task:<5} {f['progressive_auc']:>11.4f} {f['holdout_auc']:>8.4f} {gap if i == 0 else ''}"
            )
        lines.append(f"  {'':>7} {'':>6} {run['events_per_second']:,.0f} events/s")
    return lines
