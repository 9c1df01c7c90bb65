"""delayed: late labels, trained as they come under each correction, against waiting for them and
against knowing them at once.

Plants a drifting stream (``streamtrain produce --drift --delays``: users and ads born and retired,
each with an effect of its own on the click, so a stale model loses AUC) whose clicks arrive an
exponential delay after their impression and purchases a heavy-tailed one after the click, and
trains its first --impressions impressions on one rank, each leg the config's model with clk and
buy as tasks (docs/delayed-labels.md):

- oracle: every impression with its final labels at once, an upper bound no platform has;
- window: every impression with its final labels once the longest attribution window has passed
  (a joiner that waits, so that each sample carries both tasks' final labels);
- bound: every impression once with its final labels when its last positive's label arrives, a
  negative at once: what a learner of arrived labels could do at best, knowing besides which
  impressions stay negative. Its gap to the oracle is what the delay itself costs, which no
  correction wins back;
- naive: the joiner's samples (impressions at once, positives later as label samples), correction none;
- fnw, fnc, es_dfm, pu: the same samples under each correction.

The legs train segment by segment of the stream, so that a load change on a shared machine
hits all of them; within a segment the joiner's legs take rounds of 4 batches, the order
rotating. Each then scores the --holdout impressions that
follow, without training, against their final labels: per task, AUC, normalized entropy and
calibration (mean prediction over the rate of final labels; calibration_vs_truth divides by the
planted probability of a final positive instead, free of the holdout's draw). The naive leg and
the corrections train the same decoded batches: their throughput ratio (each correction's rate
over naive's, per round after the first segment, the median over the rounds) is the training's
own cost of a correction; ``throughput_ratio`` is the slowest. Goals: the best correction within 0.003 of
the oracle's holdout AUC and calibrated within [0.97, 1.03], per task; naive's calibration and
the window's AUC reported beside it; the corrections' throughput ratio at least 0.95.
"""

from __future__ import annotations

import argparse
import bisect
import copy
import itertools
import math
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from streamtrain.bench.common import machine

if TYPE_CHECKING:
    from streamtrain.config import WorkerConfig
    from streamtrain.decode import AvroBatchDecoder, ClickBatch
    from streamtrain.dev.delays import Delays, Impressions, SampleEncoder
    from streamtrain.dev.drift import Drift
    from streamtrain.train import Trainer

CORRECTIONS = ("fnw", "fnc", "es_dfm", "pu")
JOINED_LEGS = ("naive", *CORRECTIONS)
PLAIN_LEGS = ("oracle", "window", "bound")  # final labels, each at its own time
LEGS = (*PLAIN_LEGS, *JOINED_LEGS)
# Batches each of the joiner's legs trains in a round of the throughput's comparison.
ROUND_BATCHES = 4
TASKS = ("clk", "buy")
AUC_GOAL, CALIBRATION_GOAL, THROUGHPUT_GOAL, NAIVE_MISCALIBRATED = 0.003, (0.97, 1.03), 0.95, 0.9


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--impressions", type=int, default=500_000, help="impressions trained by each leg (default 500,000)"
    )
    parser.add_argument("--holdout", type=int, default=100_000, help="impressions scored at the end (default 100,000)")
    parser.add_argument(
        "--segments", type=int, default=10, help="turns the legs take, the first a warm-up (default 10)"
    )
    parser.add_argument(
        "--evaluations",
        type=int,
        default=5,
        help="holdouts: after each of the last N segments, the --holdout impressions that follow, scored before "
        "they train (the last after every impression); the figures pool them (default 5)",
    )
    parser.add_argument("--seed", type=int, default=0, help="the stream's seed (default 0)")
    stream = parser.add_argument_group("the planted stream (streamtrain produce --drift --delays)")
    stream.add_argument("--users", type=int, default=2_000, help="live users at any moment (default 2,000)")
    stream.add_argument("--ads", type=int, default=2_000, help="live ads at any moment (default 2,000)")
    stream.add_argument("--lifetime", type=int, default=1_000_000, help="events an id lives (default 1,000,000)")
    stream.add_argument("--id-effect", type=float, default=1.0, help="std of each id's own effect (default 1.0)")
    stream.add_argument(
        "--click-mean", type=float, default=20_000, help="a click's mean delay, events (default 20,000)"
    )
    stream.add_argument(
        "--buy-median", type=float, default=40_000, help="a purchase's median delay after its click (default 40,000)"
    )
    stream.add_argument("--buy-sigma", type=float, default=1.0, help="that delay's log-scale spread (default 1.0)")
    stream.add_argument("--click-window", type=float, default=100_000, help="clk's window, events (default 100,000)")
    stream.add_argument("--buy-window", type=float, default=250_000, help="buy's window, events (default 250,000)")
    stream.add_argument("--stream-rate", type=float, default=100.0, help="events a second of stream time (default 100)")
    stream.add_argument(
        "--wait",
        type=float,
        default=0.0,
        help="events the joiner holds each impression, emitting it with the positives known by then (ES-DFM's "
        "elapsed time; default 0: at once, as the reference joiner)",
    )


def run(args: argparse.Namespace, progress: Callable[[str], None]) -> dict:
    from streamtrain.dev.delays import Delays
    from streamtrain.dev.drift import Drift

    if args.quick:
        drift, delays = Drift(users=200, ads=200, lifetime=6_000), Delays(300, 500, 1.0, 1_500, 3_000)
        sizes = Sizes(6_000, 1_500, 3, drift, delays, evaluations=2)
    else:
        drift = Drift(users=args.users, ads=args.ads, lifetime=args.lifetime, id_effect=args.id_effect)
        delays = Delays(
            args.click_mean,
            args.buy_median,
            args.buy_sigma,
            args.click_window,
            args.buy_window,
            args.stream_rate,
            args.wait,
        )
        if not 1 <= args.evaluations < args.segments:
            raise SystemExit("streamtrain bench delayed: --evaluations must be at least 1 and below --segments")
        sizes = Sizes(args.impressions, args.holdout, args.segments, drift, delays, args.evaluations)
    return bench_delayed(args.config, sizes, args.seed, progress)


@dataclass(frozen=True)
class Sizes:
    impressions: int
    holdout: int
    segments: int
    drift: Drift
    delays: Delays
    evaluations: int = 1  # holdouts, after each of the last segments

    def bounds(self) -> np.ndarray:
        """The segments' edges, in impressions."""
        return np.linspace(0, self.impressions, self.segments + 1).astype(np.int64)

    def evaluated_after(self) -> list[int]:
        """The positions after which each holdout starts: the ends of the last ``evaluations`` segments."""
        return self.bounds()[-self.evaluations :].tolist()


def leg_configs(config_path: Path, delays: Delays) -> dict[str, WorkerConfig]:
    """Each leg's config: the model at ``config_path`` on the sample schema, with clk and buy as tasks
    at the stream's windows; the joiner's legs with delayed_labels and their correction."""
    import yaml

    from streamtrain.config import parse_config

    raw = yaml.safe_load(config_path.read_text())
    raw["features"]["schema_path"] = "schemas/click_sample.avsc"
    raw["features"].pop("label", None)
    for key in ("tasks", "multitask"):
        (raw.get("model") or {}).pop(key, None)
    windows = delays.window_seconds()
    configs = {}
    for leg in LEGS:
        leg_raw = copy.deepcopy(raw)
        correction = leg if leg in CORRECTIONS else "none"
        joined = leg not in PLAIN_LEGS
        leg_raw["model"]["tasks"] = [
            {"name": task, "label": task}
            | ({"attribution_window_seconds": windows[task], "correction": correction} if joined else {})
            for task in TASKS
        ]
        if joined:
            leg_raw["delayed_labels"] = {}
        configs[leg] = parse_config(leg_raw, environ={})
    return configs


@dataclass
class _Planted:
    """The four streams the legs train, as (emission position, payload), and the impressions the
    holdouts are cut from (from ``scored_from`` on), each with its truth."""

    scored_from: int
    joined: list[tuple[float, bytes]] = field(default_factory=list)
    oracle: list[tuple[float, bytes]] = field(default_factory=list)
    window: list[tuple[float, bytes]] = field(default_factory=list)
    bound: list[tuple[float, bytes]] = field(default_factory=list)
    scored: list[bytes] = field(default_factory=list)  # plain, with final labels
    final: dict[str, list[int]] = field(default_factory=lambda: {t: [] for t in TASKS})
    planted: dict[str, list[float]] = field(default_factory=lambda: {t: [] for t in TASKS})
    late_labels: int = 0
    rates: dict[str, float] = field(default_factory=dict)  # final positives per training impression

    def holdout(self, start: int, count: int) -> tuple[list[bytes], dict[str, np.ndarray], dict[str, np.ndarray]]:
        """Impressions [start, start + count): payloads, final labels and planted probabilities per task."""
        part = slice(start - self.scored_from, start - self.scored_from + count)
        return (
            self.scored[part],
            {task: np.array(self.final[task][part]) for task in TASKS},
            {task: np.array(self.planted[task][part]) for task in TASKS},
        )


def plant(sizes: Sizes, seed: int, encoder: SampleEncoder) -> _Planted:
    from streamtrain.dev.delays import impressions, joined_samples
    from streamtrain.dev.drift import DriftingClickStream

    delays = sizes.delays
    stream = DriftingClickStream(seed, 0, delays.stream_rate, sizes.drift)
    wait = max(delays.windows().values())
    attributed = delays.attributed()
    planted = _Planted(sizes.evaluated_after()[0])
    positives = dict.fromkeys(TASKS, 0)

    def plain(record: dict) -> bytes:
        return encoder.encode({**record, "sample_kind": None, "impression_id": None, "impression_time": None})

    def training() -> Iterator[Impressions]:
        for chunk in impressions(stream, delays, sizes.impressions + sizes.holdout, seed, encoder):
            trained = chunk.position < sizes.impressions
            for i in np.flatnonzero(trained).tolist():
                record, position = chunk.records[i], int(chunk.position[i])
                planted.oracle.append((position, plain(record)))
                if position + wait < sizes.impressions:
                    planted.window.append((position + wait, plain(record)))
                arrivals = [at for at in (chunk.clk_at[i], chunk.buy_at[i]) if at != np.inf]
                known_at = max(arrivals, default=position)
                if known_at < sizes.impressions:
                    planted.bound.append((known_at, plain(record)))
                for task in TASKS:
                    positives[task] += record[task]
            for i in np.flatnonzero(chunk.position >= planted.scored_from).tolist():
                record = chunk.records[i]
                planted.scored.append(plain(record))
                for task in TASKS:
                    planted.final[task].append(record[task])
                # the planted probability of a final positive: a positive, within its window
                p_click = float(chunk.p_click[i])
                planted.planted["clk"].append(p_click * attributed["clk"])
                planted.planted["buy"].append(p_click * float(chunk.p_buy[i]) * attributed["buy"])
            if trained.any():
                yield chunk.part(trained)

    for sample in joined_samples(training(), stream.start_time_ms, delays.stream_rate, delays.wait):
        planted.joined.append((sample.position, encoder.encode(sample.record)))
        planted.late_labels += sample.record["sample_kind"] == "label"
    planted.window.sort(key=lambda message: message[0])
    planted.bound.sort(key=lambda message: message[0])
    planted.rates = {task: int(n) / sizes.impressions for task, n in positives.items()}
    return planted


@dataclass
class _Leg:
    config: WorkerConfig
    trainer: Trainer
    stream: str  # which of the planted streams it trains
    seconds: list[float] = field(default_factory=list)  # the joiner's legs: per round after the first segment


def bench_delayed(config_path: Path, sizes: Sizes, seed: int, progress: Callable[[str], None]) -> dict:
    from streamtrain.decode import AvroBatchDecoder
    from streamtrain.dev.delays import SampleEncoder
    from streamtrain.device import init_distributed
    from streamtrain.source import RawEvent
    from streamtrain.train import Trainer

    configs = leg_configs(config_path, sizes.delays)
    started = time.perf_counter()
    planted = plant(sizes, seed, SampleEncoder(configs["naive"].features.resolved_schema_path()))
    progress(
        f"{sizes.impressions:,} impressions planted in {time.perf_counter() - started:.0f}s: "
        f"{len(planted.joined):,} samples ({planted.late_labels:,} late labels); the window leg trains "
        f"{len(planted.window):,}; final positive rates "
        + ", ".join(f"{task} {rate:.4f}" for task, rate in planted.rates.items())
    )
    decoders = {
        "joined": AvroBatchDecoder(
            configs["naive"].features, tasks=configs["naive"].tasks(), delayed=configs["naive"].delayed_labels
        ),
        "plain": AvroBatchDecoder(configs["oracle"].features, tasks=configs["oracle"].tasks()),
    }
    env = init_distributed(
        device=configs["naive"].distributed.device, threads=configs["naive"].distributed.intra_op_threads
    )
    streams = {"oracle": planted.oracle, "window": planted.window, "bound": planted.bound, "joined": planted.joined}
    legs = {
        name: _Leg(configs[name], Trainer(configs[name], env), name if name in PLAIN_LEGS else "joined")
        for name in LEGS
    }
    batch_size = configs["naive"].batching.batch_size
    bounds = sizes.bounds()
    evaluated_after = sizes.evaluated_after()
    # leg -> task -> per holdout: (predictions, final labels, planted probabilities)
    scored: dict[str, dict[str, list[tuple[np.ndarray, ...]]]] = {name: {t: [] for t in TASKS} for name in LEGS}
    timed_samples = 0
    for segment, (low, high) in enumerate(itertools.pairwise(bounds)):
        batches = {
            name: _batches(
                decoders["joined" if name == "joined" else "plain"],
                [RawEvent(0, i, payload, 0) for i, (_at, payload) in enumerate(_between(messages, low, high))],
                batch_size,
            )
            for name, messages in streams.items()
        }
        timed = segment > 0 or sizes.segments == 1  # the first warms up numba's and TorchRec's first calls
        for name in PLAIN_LEGS[:: 1 if segment % 2 else -1]:
            _train(legs[name].trainer, batches[name])
        # The joiner's legs train the same batches in rounds, the order rotating: each round's times
        # are side by side, whatever the shared machine's load does from one round to the next.
        joined = batches["joined"]
        timed_samples += sum(batch.size for batch in joined) if timed else 0
        for turn, start in enumerate(range(0, len(joined), ROUND_BATCHES)):
            for name in _rotated(JOINED_LEGS, segment + turn):
                seconds = _train(legs[name].trainer, joined[start : start + ROUND_BATCHES])
                if timed:
                    legs[name].seconds.append(seconds)
        if high in evaluated_after:
            payloads, final, chance = planted.holdout(int(high), sizes.holdout)
            holdout = _batches(decoders["plain"], [RawEvent(0, i, p, 0) for i, p in enumerate(payloads)], batch_size)
            for name, leg in legs.items():
                scores = _scores(leg.trainer, holdout)
                for t, task in enumerate(TASKS):
                    scored[name][task].append((scores[:, t], final[task], chance[task]))
        progress(f"segment {segment + 1}/{sizes.segments}: impressions up to {int(high):,} trained by every leg")
    tasks = {task: {name: _figures(scored[name][task]) for name in LEGS} for task in TASKS}
    final_holdout = {task: {name: _figures(scored[name][task][-1:]) for name in LEGS} for task in TASKS}
    from streamtrain.metrics import roc_auc

    rounds = {
        name: [naive / mine for naive, mine in zip(legs["naive"].seconds, legs[name].seconds, strict=True)]
        for name in CORRECTIONS
    }
    ratios = {name: statistics.median(values) for name, values in rounds.items()}
    result: dict[str, Any] = {
        "benchmark": "delayed",
        "machine": machine(),
        "impressions": sizes.impressions,
        "holdout": sizes.holdout,
        "segments": sizes.segments,
        "evaluations": sizes.evaluations,
        "seed": seed,
        "batch_size": batch_size,
        "stream": {
            "drift": {k: getattr(sizes.drift, k) for k in ("users", "ads", "lifetime", "id_effect")},
            "delays_events": {
                k: getattr(sizes.delays, k)
                for k in ("click_mean", "buy_median", "buy_sigma", "click_window", "buy_window", "wait")
            },
            "stream_rate": sizes.delays.stream_rate,
            "windows_seconds": sizes.delays.window_seconds(),
            "attributed": sizes.delays.attributed(),
            "samples": len(planted.joined),
            "late_labels": planted.late_labels,
            "final_positive_rates": planted.rates,
        },
        "evaluated_after": evaluated_after,
        "bayes_auc": {task: float(np.mean([roc_auc(c, y) for _p, y, c in scored["oracle"][task]])) for task in TASKS},
        "tasks": tasks,
        "final_holdout": final_holdout,
        "throughput": {name: {"ratio": ratios[name], "rounds": rounds[name]} for name in CORRECTIONS},
        "throughput_ratio": min(ratios.values()),
        # the joiner's legs' samples a second of training, after the first segment
        "training_events_per_second": {name: timed_samples / sum(legs[name].seconds) for name in JOINED_LEGS},
    }
    result["goals"] = _goals(result)
    return result


def _between(messages: list[tuple[float, bytes]], low: float, high: float) -> list[tuple[float, bytes]]:
    """The messages emitted at positions in [low, high): ``messages`` is in emission order."""
    return messages[bisect.bisect_left(messages, (low,)) : bisect.bisect_left(messages, (high,))]


def _rotated(names: tuple[str, ...], by: int) -> list[str]:
    return [names[(by + i) % len(names)] for i in range(len(names))]


def _batches(decoder: AvroBatchDecoder, events: list, size: int) -> list[ClickBatch]:
    return [decoder.decode(events[i : i + size]).batch for i in range(0, len(events), size)]


def _train(trainer: Trainer, batches: list[ClickBatch]) -> float:
    started = time.perf_counter()
    for _result in trainer.train(batches):
        pass
    return time.perf_counter() - started


def _scores(trainer: Trainer, holdout: list[ClickBatch]) -> np.ndarray:
    """Each holdout event's served probability per task, by the leg's final model, without training."""
    import torch

    model = trainer.pipeline.detach()  # the pipeline attaches it again at its next step
    model.eval()
    with torch.no_grad():
        logits = torch.cat([model(b.to(trainer.env.device))[1][1].float().cpu() for b in holdout])
    model.train()
    return torch.sigmoid(logits).numpy().reshape(len(logits), -1)


def _figures(holdouts: list[tuple[np.ndarray, ...]]) -> dict[str, float]:
    """A leg's figures on its holdouts ((predictions, final labels, planted probabilities) each): the
    mean of their AUCs; NE and calibration over them pooled."""
    from streamtrain.metrics import roc_auc

    p = np.concatenate([h[0] for h in holdouts]).astype(np.float64)
    y = np.concatenate([h[1] for h in holdouts]).astype(np.float64)
    planted = np.concatenate([h[2] for h in holdouts])
    clipped = np.clip(p, 1e-7, 1 - 1e-7)
    loss = -(y * np.log(clipped) + (1 - y) * np.log(1 - clipped)).mean()
    rate = y.mean()
    entropy = -(rate * math.log(rate) + (1 - rate) * math.log(1 - rate)) if 0 < rate < 1 else math.nan
    return {
        "holdout_auc": float(np.mean([roc_auc(h[0], h[1]) for h in holdouts])),
        "ne": float(loss / entropy),
        "calibration": float(p.mean() / rate) if rate else math.nan,
        "calibration_vs_truth": float(p.mean() / planted.mean()),
        "mean_prediction": float(p.mean()),
    }


def _goals(result: dict) -> dict:
    goals: dict[str, Any] = {
        "auc_within": AUC_GOAL,
        "calibration_within": list(CALIBRATION_GOAL),
        "throughput_ratio": THROUGHPUT_GOAL,
        "naive_miscalibrated_below": NAIVE_MISCALIBRATED,
        "throughput_met": result["throughput_ratio"] >= THROUGHPUT_GOAL,
    }
    low, high = CALIBRATION_GOAL
    for task, legs in result["tasks"].items():
        oracle = legs["oracle"]["holdout_auc"]
        met = {
            name: oracle - legs[name]["holdout_auc"] <= AUC_GOAL and low <= legs[name]["calibration"] <= high
            for name in CORRECTIONS
        }
        best = max(CORRECTIONS, key=lambda name: (met[name], legs[name]["holdout_auc"]))
        goals[task] = {
            "best_correction": best,
            "best_met": met[best],
            "met_by": [name for name in CORRECTIONS if met[name]],
            "oracle_minus_best_auc": oracle - legs[best]["holdout_auc"],
            "oracle_minus_window_auc": oracle - legs["window"]["holdout_auc"],
            # what the delay itself costs: no correction of arrived labels is expected past it
            "oracle_minus_bound_auc": oracle - legs["bound"]["holdout_auc"],
            "naive_calibration": legs["naive"]["calibration"],
            "naive_miscalibrated": legs["naive"]["calibration"] < NAIVE_MISCALIBRATED,
        }
    return goals


def table(result: dict) -> str:
    stream = result["stream"]
    delays = stream["delays_events"]
    lines = [
        f"  {result['impressions']:,} impressions of a drifting stream ({stream['drift']['users']:,} live users and "
        f"{stream['drift']['ads']:,} ads, each live {stream['drift']['lifetime']:,} events), "
        f"{stream['samples']:,} samples with {stream['late_labels']:,} late labels; holdout {result['holdout']:,}",
        f"  clicks arrive after {delays['click_mean']:,.0f} events on average (window {delays['click_window']:,.0f}), "
        f"purchases {delays['buy_median']:,.0f} after the click at the median, sigma {delays['buy_sigma']} "
        f"(window {delays['buy_window']:,.0f}); at {stream['stream_rate']:g} events/s the windows are "
        + ", ".join(f"{task} {seconds:,.0f} s" for task, seconds in stream["windows_seconds"].items()),
        f"  {'task':<5} {'leg':<8} {'AUC':>7} {'- oracle':>9} {'NE':>7} {'calibration':>12} {'vs truth':>9}",
    ]
    for task, legs in result["tasks"].items():
        oracle = legs["oracle"]["holdout_auc"]
        for name, f in legs.items():
            lines.append(
                f"  {task:<5} {name:<8} {f['holdout_auc']:>7.4f} {f['holdout_auc'] - oracle:>+9.4f} {f['ne']:>7.4f} "
                f"{f['calibration']:>12.3f} {f['calibration_vs_truth']:>9.3f}"
            )
        lines.append(f"  {task:<5} {'Bayes':<8} {result['bayes_auc'][task]:>7.4f}")
    goals = result["goals"]
    low, high = goals["calibration_within"]
    for task in result["tasks"]:
        g = goals[task]
        met = "met" if g["best_met"] else "missed"
        below = "below" if g["naive_miscalibrated"] else "not below"
        lines.append(
            f"  {task}: best correction {g['best_correction']} at oracle {-g['oracle_minus_best_auc']:+.4f} AUC "
            f"(goal within {goals['auc_within']}, calibration in [{low}, {high}]): {met}; naive calibration "
            f"{g['naive_calibration']:.3f} ({below} {goals['naive_miscalibrated_below']}); window at oracle "
            f"{-g['oracle_minus_window_auc']:+.4f}"
            + (
                f"; the delay's own cost (bound) {-g['oracle_minus_bound_auc']:+.4f}"
                if "oracle_minus_bound_auc" in g
                else ""
            )
        )
    shown = ", ".join(f"{name} {t['ratio']:.3f}" for name, t in result["throughput"].items())
    rounds = len(next(iter(result["throughput"].values()))["rounds"])
    met = "met" if goals["throughput_met"] else "missed"
    lines.append(
        f"  training throughput over naive's (median of {rounds} alternated rounds): {shown}; slowest "
        f"{result['throughput_ratio']:.3f}, goal >= {goals['throughput_ratio']}: {met}"
    )
    return "\n".join(lines)
