"""quality: how close each task gets to the stream's Bayes AUC, per multi-task architecture and
per model architecture.

Trains --events planted events (clk and buy, see streamtrain/dev/produce.py) on one rank with the
config's model, once with clk alone (DLRM exactly, the baseline), once per multi-task architecture
with both tasks, and once per built-in model (--models: dlrm, dcn_v2, deepfm; streamtrain/models/)
with both tasks under shared_bottom. Each run reports, per task, the progressive (test-then-train) AUC over the last
--window events trained, and the AUC on --holdout fresh events that follow them in the stream,
scored by the final model without training; both beside the task's Bayes AUC on the same events.
buy is predicted over all events; its AUC over the clicks alone is reported too. Every run trains
the same decoded batches, in the same order.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable, Sequence
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
MODELS = ("dlrm", "dcn_v2", "deepfm")
# What each architecture's tasks are: dbmtl's buy reads clk's tower (a purchase follows a click).
ARCHITECTURE_TASKS = {"dbmtl": [TASKS[0], {**TASKS[1], "depends_on": "clk"}]}
# The goals the issue sets: each task's holdout AUC within this of its Bayes AUC, and clk with
# several tasks within CLK_COST of clk alone.
BAYES_GAP, CLK_COST = 0.01, 0.002


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--events", type=int, default=1_000_000, help="events trained (default 1,000,000)")
    parser.add_argument("--window", type=int, default=100_000, help="progressive AUC over the last N (default 100,000)")
    parser.add_argument("--holdout", type=int, default=50_000, help="fresh events scored at the end (default 50,000)")
    parser.add_argument("--seed", type=int, default=0, help="the synthetic stream's seed (default 0)")
    parser.add_argument(
        "--architectures", nargs="+", choices=ARCHITECTURES, default=list(ARCHITECTURES), help="default: all"
    )
    parser.add_argument(
        "--models", nargs="*", choices=MODELS, default=list(MODELS), help="built-in models, each a run (default: all)"
    )


def run(args: argparse.Namespace, progress: Callable[[str], None]) -> dict:
    events, window, holdout = (20_000, 5_000, 5_000) if args.quick else (args.events, args.window, args.holdout)
    return bench_quality(args.config, events, window, holdout, args.seed, args.architectures, progress, args.models)


def run_configs(path: Path, architectures: list[str], models: Sequence[str] = ()) -> dict[str, WorkerConfig]:
    """clk alone, then clk and buy under each multi-task architecture, all on the model of the config
    at ``path``; then clk and buy on each built-in model of ``models``."""
    import yaml

    from streamtrain.config import parse_config

    raw = yaml.safe_load(path.read_text())
    raw["features"].pop("label", None)  # the tasks name their labels
    model = raw.get("model") or {}
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
    models: Sequence[str] = (),
) -> dict:
    configs = run_configs(config_path, architectures, models)
    started = time.perf_counter()
    train, test, truth = _stream(configs[architectures[0]], events, holdout, seed)
    progress(f"{events:,} + {holdout:,} events encoded and decoded in {time.perf_counter() - started:.0f}s")
    bayes = _bayes(truth)
    runs = {}
    for name, config in configs.items():
        batches, held = (train, test) if len(config.tasks()) > 1 else (_first_task(train), _first_task(test))
        runs[name] = _train_and_score(config, batches, held, window, truth)
        for task, figures in runs[name]["tasks"].items():
            figures["bayes_auc"] = bayes[task]
            if task == "buy":
                figures["bayes_auc_over_clicks"] = bayes["buy_given_clk"]
        shown = (
            f"{task} progressive {f['progressive_auc']:.4f} holdout {f['holdout_auc']:.4f} (Bayes {f['bayes_auc']:.4f})"
            for task, f in runs[name]["tasks"].items()
        )
        progress(f"{name}: {', '.join(shown)}; {runs[name]['events_per_second']:,.0f} events/s")
    alone = runs["clk_alone"]["tasks"]["clk"]["holdout_auc"]
    return {
        "benchmark": "quality",
        "machine": machine(),
        "events": events,
        "window": window,
        "holdout": holdout,
        "seed": seed,
        "batch_size": configs["clk_alone"].batching.batch_size,
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


@dataclasses.dataclass
class _Truth:
    p_click: np.ndarray
    p_buy: np.ndarray  # given a click
    clk: np.ndarray
    buy: np.ndarray


def _stream(config: WorkerConfig, events: int, holdout: int, seed: int) -> tuple[list, list, _Truth]:
    """The training batches, the holdout batches, and the holdout's truth: one stream, decoded with
    both tasks' labels; the holdout is the ``holdout`` events after the trained ones."""
    from streamtrain.decode import AvroBatchDecoder
    from streamtrain.dev.produce import AvroEncoder, ClickStream, labelled_events
    from streamtrain.source import RawEvent

    decoder = AvroBatchDecoder(config.features, tasks=config.tasks())
    encoder = AvroEncoder(config.features.resolved_schema_path())
    size = config.batching.batch_size
    raw, truths = [], []
    for offset, (_key, value, truth) in enumerate(labelled_events(ClickStream(seed, 0), encoder, events + holdout)):
        raw.append(RawEvent(0, offset, value, 0))
        if offset >= events:
            truths.append((truth.p_click, truth.p_buy, truth.clk, truth.buy))

    def batches(part: list) -> list[ClickBatch]:
        return [decoder.decode(part[i : i + size]).batch for i in range(0, len(part), size)]

    columns = np.array(truths).reshape(-1, 4).T
    return batches(raw[:events]), batches(raw[events:]), _Truth(*columns)


def _first_task(batches: list[ClickBatch]) -> list[ClickBatch]:
    """The batches as a clk-alone model takes them: one label, [B]."""
    return [dataclasses.replace(b, labels=b.labels[:, 0].contiguous()) for b in batches]


def _bayes(truth: _Truth) -> dict[str, float]:
    from streamtrain.dev.produce import bayes_aucs

    return bayes_aucs(truth.p_click, truth.p_buy, truth.clk, truth.buy)


def _train_and_score(
    config: WorkerConfig, batches: list[ClickBatch], holdout: list[ClickBatch], window: int, truth: _Truth
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
    for result in trainer.train(iter(batches)):
        quality.add(result.logits.numpy(), result.batch.labels.numpy())
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
    events = sum(b.size for b in batches)
    return {"tasks": tasks, "seconds": seconds, "events_per_second": events / seconds}


def table(result: dict) -> str:
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
    return "\n".join(lines)
