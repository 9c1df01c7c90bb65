"""``streamtrain bench report``: every figure the docs quote, made from ``results/*.json``.

It writes the docs site's page of results (docs/bench/report.md, the PNGs beside it): first the
figures table (each figure with the date, host, command and results file it comes from, or the
command that would make it where no results file measures it), then the full table of every
result a figure draws from and of each benchmark's newest result. The README's headline figures
are the same table's headline rows, written between its markers by the same call, so no page
quotes a figure by hand (tests/test_docs_claims.py holds both to this code).

Benchmark code writes results; this module only reads them. ``--results`` and ``--out`` point it
elsewhere: then only report.md and its PNGs are written, never the README.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from streamtrain.bench import BENCHMARKS, module
from streamtrain.bench.common import RESULTS, describe_machine
from streamtrain.dev import CHECKOUT

TITLE = "# Latest benchmark results"
README = CHECKOUT / "README.md"
DOCS_OUT = CHECKOUT / "docs" / "bench"
HEADLINE_START = "<!-- streamtrain bench report writes the table below from results/*.json; do not edit it -->"
HEADLINE_END = "<!-- end of the table streamtrain bench report writes -->"
PLOTS = ("throughput", "memory_rss", "freshness_cdf")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--results", type=Path, default=RESULTS, help="where the JSON results are (default results/)")
    parser.add_argument(
        "--out",
        type=Path,
        default=DOCS_OUT,
        help="where report.md and the PNGs go (default docs/bench/, the docs site's page, and then the "
        "README's headline figures too)",
    )


@dataclass(frozen=True)
class Result:
    """One results file: what a benchmark run measured, where and when."""

    path: Path
    data: dict

    @property
    def benchmark(self) -> str:
        return str(self.data["benchmark"])

    @property
    def quick(self) -> bool:
        return bool(self.data.get("quick"))

    @property
    def command(self) -> str:
        return str(self.data.get("command", f"streamtrain bench {self.benchmark}")).strip()

    @property
    def when(self) -> str:
        """The UTC time it was written, to the minute (the file name's, when the JSON has none)."""
        written = self.data.get("written")
        if written:
            return f"{written[:10]} {written[11:16]} UTC"
        stamp = re.search(r"-(\d{8})-(\d{4})", self.path.name)
        if stamp is None:
            return "undated"
        day, time = stamp.groups()
        return f"{day[:4]}-{day[4:6]}-{day[6:]} {time[:2]}:{time[2:]} UTC"

    @property
    def host(self) -> str:
        """The host in a few words: cores and the device the run trained on."""
        machine = self.data.get("machine", {})
        gpus = f", {machine['gpus']} GPU(s)" if machine.get("gpus") else ""
        return f"{machine.get('cores', '?')} cores, {machine.get('device', '?')}{gpus}"

    @property
    def source(self) -> str:
        return f"results/{self.path.name}"


def load(results_dir: Path = RESULTS) -> dict[str, list[Result]]:
    """Every benchmark's results under ``results_dir``, oldest first (the file names sort by time)."""
    found: dict[str, list[Result]] = {}
    for name in BENCHMARKS:
        for path in sorted(results_dir.glob(f"{name}-[0-9]*.json")):
            data = json.loads(path.read_text())
            if data.get("benchmark") == name:
                found.setdefault(name, []).append(Result(path, data))
    return found


# --- the figures the docs quote -----------------------------------------------------------------


def _goal(text: str, met: bool) -> str:
    return f"({text}: {'met' if met else 'missed'})"


def _e2e(
    key: str, goal: str, at_least: float | None = None, at_most: float | None = None
) -> Callable[[dict], str | None]:
    def read(r: dict) -> str | None:
        value = r.get(key)
        if value is None:
            return None
        met = (at_least is None or value >= at_least) and (at_most is None or value <= at_most)
        return f"**{value:.2f}** {_goal(goal, met)}{_spread(r, key)}"

    return read


def _spread(r: dict, key: str) -> str:
    """How far a median ratio's rounds spread: the result's saved spread (``spread[key]``, or
    ``<key>_spread``); for older results of several rounds, their range."""
    saved = r.get("spread", {}).get(key) or r.get(f"{key}_spread")
    if saved and saved.get("rounds", 0) > 1:
        return (
            f", {saved['rounds']} rounds {saved['min']:.2f}-{saved['max']:.2f} "
            f"(IQR {saved['q25']:.2f}-{saved['q75']:.2f})"
        )
    rounds = [x[key] for x in r.get("rounds") or [] if isinstance(x, dict) and x.get(key) is not None]
    return f", rounds {min(rounds):.2f}-{max(rounds):.2f}" if rounds else ""


def _ratio(key: str, goal: str, at_least: float) -> Callable[[dict], str | None]:
    def read(r: dict) -> str | None:
        value = r.get(key)
        return None if value is None else f"**{value:.2f}** {_goal(goal, value >= at_least)}{_spread(r, key)}"

    return read


def _freshness(r: dict) -> str | None:
    """p99 at 50% load, at the batch the worker takes on the run's device when none is configured."""
    from streamtrain.config import DEFAULT_BATCH_SIZE

    if r.get("batch_size") != DEFAULT_BATCH_SIZE.get(r.get("machine", {}).get("device", "cpu")):
        return None
    half = next((load for load in r.get("loads", []) if load["load"] == 0.5), None)
    if half is None:
        return None
    p99 = half["freshness"]["p99"]
    return f"**{p99:.2f} s** at batches of {r['batch_size']:,} {_goal('goal ≤ 2 s', p99 <= 2)}"


def _servable(r: dict) -> str | None:
    p99 = r.get("servable_p99_seconds")
    return None if p99 is None else f"**{p99:.2f} s** {_goal('goal ≤ 5 s', p99 <= 5)}"


def _quality_gap(r: dict) -> str | None:
    alone = r.get("architectures", {}).get("clk_alone", {}).get("tasks", {}).get("clk")
    if alone is None:
        return None
    gap = alone["bayes_auc"] - alone["holdout_auc"]
    return f"**{gap:.4f}** {_goal('goal ≤ 0.01', gap <= 0.01)}"


def _idspace(r: dict) -> str | None:
    if r.get("managed_auc") is None or r.get("hash_auc") is None:
        return None
    won, lost = r["managed_auc"] - r["hash_auc"], r["reference_auc"] - r["hash_auc"]
    goals = r["goals"]
    # three places: the throughput goal's margin is within a hundredth
    speed = f"{r['throughput_ratio']:.3f}"
    if "throughput_ratio_2_ranks" in r:
        speed += f" at 1 rank and {r['throughput_ratio_2_ranks']:.3f} at 2"
    speed_met = goals["throughput_met"] and goals.get("throughput_2_ranks_met", True)
    speed_goal = f"goal ≥ {goals['throughput_ratio']}"
    return (
        f"**{won:+.4f}** (a table of 40x the rows: {lost:+.4f}; "
        f"{_goal('goal ≥ half of that', won >= goals['win_back'] * lost)[1:-1]}), "
        f"at {speed} of hash-mod's events/s {_goal(speed_goal, speed_met)}"
    )


def _delayed(r: dict) -> str | None:
    """Per task, the best correction's holdout AUC against the oracle's, and its calibration, on the
    reference joiner's stream (a run with ``--wait`` plants another joiner, and is shown in full)."""
    goals, tasks = r.get("goals"), r.get("tasks")
    if not goals or not tasks or r.get("stream", {}).get("delays_events", {}).get("wait"):
        return None
    parts = []
    for task, legs in tasks.items():
        best = goals[task]["best_correction"]
        gap = legs["oracle"]["holdout_auc"] - legs[best]["holdout_auc"]
        calibration = legs[best]["calibration"]
        parts.append(
            f"{task}: {best} **{gap:+.4f}** below the oracle, calibration **{calibration:.3f}** "
            f"{_goal('goal ≤ 0.003 and within [0.97, 1.03]', goals[task]['best_met'])}"
        )
    return "; ".join(parts)


def _soak(r: dict) -> str | None:
    if r.get("lost") is None or r.get("max_stale_seconds") is None:
        return None
    faults = sum(r["faults"].values())
    exact = r["lost"] == 0 and r["duplicated"] == 0
    stale = r["max_stale_seconds"]
    return (
        f"**{r['lost']:,}** lost, **{r['duplicated']:,}** trained twice {_goal('goal 0', exact)}; serve stale "
        f"**{stale:.1f} s** at most {_goal('goal ≤ 10 s', stale <= 10)}; {faults} faults in {r['minutes']:g} minutes"
    )


def _memory(r: dict) -> str | None:
    growth = r.get("growth_after_warm_up")
    return None if growth is None else f"**{100 * growth:.1f}%** {_goal('goal < 10%', growth < 0.1)}"


BUILT_INS = ("dlrm", "dcn_v2", "deepfm", "din")


def _per_built_in_gap(task: str) -> Callable[[dict], str | None]:
    def read(r: dict) -> str | None:
        runs = r.get("architectures", {})
        gaps = [
            f"{name} {t['bayes_auc'] - t['holdout_auc']:.4f}"
            for name in BUILT_INS
            if (t := runs.get(name, {}).get("tasks", {}).get(task)) is not None
        ]
        return ", ".join(gaps) if len(gaps) > 1 else None

    return read


def _per_built_in_speed(r: dict) -> str | None:
    models = r.get("models")
    if not models:
        return None
    return ", ".join(f"{name} {m['over_dlrm']:.2f}" for name, m in models.items())


@dataclass(frozen=True)
class Figure:
    """A figure the docs quote: what it is, the benchmark that measures it, how to read it from a
    result (None where that result does not measure it), and the section that explains it."""

    name: str
    benchmark: str
    read: Callable[[dict], str | None]
    explained: str  # a docs page and anchor, relative to docs/
    headline: bool = True


FIGURES = [
    Figure(
        "worker (2 ranks) ÷ a naive consume-decode-train loop, events/s",
        "e2e",
        _e2e("worker_over_naive", "goal ≥ 2", at_least=2),
        "benchmarks.md#bench-e2e",
    ),
    Figure(
        "worker ÷ the same trainer on in-memory batches, events/s",
        "e2e",
        _e2e("worker_over_limit", "goal ≥ 0.8", at_least=0.8),
        "benchmarks.md#bench-e2e",
    ),
    Figure(
        "CPU per trained event, worker ÷ in-memory trainer",
        "e2e",
        _e2e("cpu_per_event_ratio", "goal ≤ 1.2", at_most=1.2),
        "benchmarks.md#bench-e2e",
    ),
    Figure(
        "compiled decoder ÷ fastavro and a Python loop, events per CPU-second",
        "decode",
        _ratio("ratio", "goal ≥ 5", 5),
        "benchmarks.md#bench-decode",
    ),
    Figure(
        "throughput kept with an async snapshot every few seconds",
        "checkpoint",
        _ratio("ratio", "goal ≥ 0.8", 0.8),
        "benchmarks.md#bench-checkpoint",
    ),
    Figure("event to trained update, p99 at 50% load", "freshness", _freshness, "benchmarks.md#bench-freshness"),
    Figure("event to served model, p99, deltas every 1 s", "delivery", _servable, "benchmarks.md#bench-delivery"),
    Figure(
        "training throughput with deltas every 1 s ÷ without",
        "delivery",
        _ratio("throughput_ratio", "goal ≥ 0.9", 0.9),
        "benchmarks.md#bench-delivery",
    ),
    Figure("holdout AUC's gap to the Bayes AUC, `clk` alone", "quality", _quality_gap, "benchmarks.md#bench-quality"),
    Figure(
        "managed ids − hash-mod at the same memory, progressive AUC",
        "idspace",
        _idspace,
        "benchmarks.md#bench-idspace",
    ),
    Figure(
        "late labels: the best correction's holdout AUC and calibration, per task",
        "delayed",
        _delayed,
        "benchmarks.md#bench-delayed",
    ),
    Figure(
        "corrections' events/s ÷ no correction's, slowest correction",
        "delayed",
        _ratio("throughput_ratio", "goal ≥ 0.95", 0.95),
        "benchmarks.md#bench-delayed",
    ),
    Figure(
        "3 Kafka nodes, worker and serve under random broker, rank and serve faults",
        "soak",
        _soak,
        "benchmarks.md#bench-soak",
    ),
    Figure(
        "worker RSS growth after the warm-up, a backlog waiting in Kafka",
        "memory",
        _memory,
        "benchmarks.md#bench-memory",
    ),
    Figure(
        "holdout AUC's gap to Bayes per built-in, `clk` (shared_bottom with `buy`)",
        "quality",
        _per_built_in_gap("clk"),
        "models.md#what-each-built-in-costs-and-learns",
        headline=False,
    ),
    Figure(
        "holdout AUC's gap to Bayes per built-in, `buy`",
        "quality",
        _per_built_in_gap("buy"),
        "models.md#what-each-built-in-costs-and-learns",
        headline=False,
    ),
    Figure(
        "the worker's events/s per built-in ÷ DLRM's, same run",
        "e2e",
        _per_built_in_speed,
        "models.md#what-each-built-in-costs-and-learns",
        headline=False,
    ),
]


def source_of(figure: Figure, results: dict[str, list[Result]]) -> tuple[Result, str] | None:
    """The newest full-size result that measures ``figure``, and the figure; None if none does."""
    for result in reversed(results.get(figure.benchmark, [])):
        if not result.quick and (value := figure.read(result.data)) is not None:
            return result, value
    return None


def figures_table(results: dict[str, list[Result]], docs: str, headline_only: bool = False) -> str:
    """The figures as a markdown table; ``docs`` is the path from the page to docs/."""
    rows = [
        "| figure | measured | when, where | reproduce | explained in |",
        "|---|---|---|---|---|",
    ]
    for figure in FIGURES:
        if headline_only and not figure.headline:
            continue
        link = f"[{_page_title(figure.explained.split('#')[0])}]({docs}{figure.explained})"
        found = source_of(figure, results)
        if found is None:
            rows.append(f"| {figure.name} | no results file | | `streamtrain bench {figure.benchmark}` | {link} |")
            continue
        result, value = found
        rows.append(
            f"| {figure.name} | {value} | {result.when}, {result.host} (`{result.source}`) | "
            f"`{result.command}` | {link} |"
        )
    return "\n".join(rows)


def _page_title(page: str) -> str:
    return {"benchmarks.md": "Benchmarks", "models.md": "Models"}.get(page, page)


def headline(results: dict[str, list[Result]]) -> str:
    """The README's headline table, between its markers."""
    return f"{HEADLINE_START}\n{figures_table(results, 'docs/', headline_only=True)}\n{HEADLINE_END}"


# --- the page -----------------------------------------------------------------------------------


def shown(results: dict[str, list[Result]]) -> list[Result]:
    """What the page shows in full: each benchmark's newest result (a full-size one if any), and
    every result a figure comes from; by benchmark, newest first."""
    chosen: list[Result] = []
    for name in BENCHMARKS:
        runs = results.get(name, [])
        full = [r for r in runs if not r.quick]
        picks = ([full[-1]] if full else runs[-1:]) + [
            found[0] for f in FIGURES if f.benchmark == name and (found := source_of(f, results)) is not None
        ]
        chosen += sorted({r.path: r for r in picks}.values(), key=lambda r: r.path.name, reverse=True)
    return chosen


def markdown(name: str, result: dict) -> str:
    bench = module(name)
    if hasattr(bench, "markdown"):
        return bench.markdown(result)
    return "\n".join(["```", bench.table(result), "```"])


def page(results: dict[str, list[Result]]) -> str:
    """docs/bench/report.md: the figures, then each result shown in full, then the plots."""
    missing = sorted({f.benchmark for f in FIGURES if source_of(f, results) is None})
    sections = [
        f"{TITLE}\n",
        "`streamtrain bench report` writes this page from the results files under `results/`: nothing on it "
        "is typed by hand. Each figure names the run it comes from (its date, host, command and file). Ratios "
        "are the figures: each is measured side by side in one run, while absolute rates move with the host. "
        "[Benchmarks](../benchmarks.md) says what each benchmark measures and how to run it.\n",
        "## Figures\n",
        figures_table(results, "../"),
        "",
    ]
    if missing:
        sections.append(
            "No results file holds the figures of "
            + ", ".join(f"`streamtrain bench {name}`" for name in missing)
            + " yet: run them on a quiet host, then `streamtrain bench report`.\n"
        )
    sections.append("## Results\n")
    for result in shown(results):
        quick = " A `--quick` run: it proves the benchmark works and judges nothing." if result.quick else ""
        machine = result.data.get("machine")
        host = describe_machine(machine) if machine and "torch" in machine else result.host
        sections.append(
            f"### {result.benchmark}, {result.when}\n\n`{result.command}` on {host} (`{result.source}`).{quick}\n\n"
            f"{markdown(result.benchmark, result.data)}\n"
        )
    for name in plot_names(results):
        sections.append(f"![{name}]({name}.png)\n")
    return "\n".join(sections)


def newest_full(results: dict[str, list[Result]]) -> dict[str, dict]:
    """Each benchmark's newest full-size result (its newest quick one where it has none)."""
    newest = {}
    for name, runs in results.items():
        full = [r for r in runs if not r.quick]
        newest[name] = (full or runs)[-1].data
    return newest


def _bars(newest: dict[str, dict]) -> list[tuple[str, list[tuple[str, float]]]]:
    """The throughput plot's groups: a title and (label, events/s) bars, the baseline first."""
    bars = []
    if "e2e" in newest and {"naive", "worker"} <= set(newest["e2e"]["legs"]):
        legs = newest["e2e"]["legs"]
        bars.append(
            ("e2e, 2 ranks", [(n, legs[n]["events_per_second"]) for n in ("naive", "worker", "limit") if n in legs])
        )
    if "pipeline" in newest:
        legs = newest["pipeline"]["legs"]
        bars.append(
            (
                f"pipeline, {newest['pipeline']['ranks']} rank(s)",
                [("Base", legs["base"]["events_per_second"]), ("SparseDist", legs["sparse_dist"]["events_per_second"])],
            )
        )
    if "checkpoint" in newest:
        r = newest["checkpoint"]
        bars.append(
            (
                f"checkpoint every {r['interval_seconds']:g}s",
                [("none", r["baseline_events_per_second"]), ("async", r["async_snapshot_events_per_second"])],
            )
        )
    if "train-step" in newest:
        r = max(newest["train-step"]["sizes"], key=lambda s: s["batch"] * s["features"])
        bars.append(
            (
                f"train step B={r['batch']} F={r['features']}",
                [("EmbeddingBag", r["per_feature_events_per_second"]), ("TBE", r["fused_events_per_second"])],
            )
        )
    return bars


def plot_names(results: dict[str, list[Result]]) -> list[str]:
    """The plots the newest results make: throughput bars, the RSS curve, the freshness CDF."""
    newest = newest_full(results)
    drawn = {
        "throughput": bool(_bars(newest)),
        "memory_rss": "memory" in newest,
        "freshness_cdf": "freshness" in newest,
    }
    return [name for name in PLOTS if drawn[name]]


def plots(results: dict[str, list[Result]], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    newest = newest_full(results)
    bars = _bars(newest)
    if bars:
        fig, axes = plt.subplots(1, len(bars), figsize=(3.4 * len(bars), 3.6), squeeze=False)
        for ax, (title, items) in zip(axes[0], bars, strict=True):
            labels, rates = zip(*items, strict=True)
            colors = ["#999999"] + ["#1f77b4"] * (len(items) - 1)
            drawn = ax.bar(labels, [r / 1000 for r in rates], color=colors)
            for bar, rate in zip(drawn, rates, strict=True):
                ax.annotate(
                    f"{rate / rates[0]:.2f}x",
                    (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center",
                    va="bottom",
                    fontsize=9,
                )
            ax.set_title(title, fontsize=10)
            ax.set_ylabel("thousand events/s")
            ax.margins(y=0.15)
        fig.suptitle("Throughput; ratios against the first bar of each group", fontsize=10)
        written.append(_save(fig, out / "throughput.png"))
    if "memory" in newest:
        r = newest["memory"]
        t, rss = zip(*r["samples"], strict=True)
        fig, ax = plt.subplots(figsize=(6, 3.2))
        ax.plot(t, [b / 2**20 for b in rss])
        ax.axvline(r["warm_up_seconds"], color="#999999", linestyle="--", label="end of warm-up")
        ax.set_xlabel("seconds since the worker began training")
        ax.set_ylabel("RSS (MiB)")
        ax.set_ylim(bottom=0)
        ax.set_title(
            f"Worker RSS with {r['backlog_events']:,} events waiting in Kafka "
            f"(growth {100 * r['growth_after_warm_up']:.1f}%)",
            fontsize=10,
        )
        ax.legend(fontsize=8)
        written.append(_save(fig, out / "memory_rss.png"))
    if "freshness" in newest:
        r = newest["freshness"]
        fig, ax = plt.subplots(figsize=(6, 3.2))
        for load in r["loads"]:
            if load["cdf"]:
                x, y = zip(*load["cdf"], strict=True)
                ax.plot(x, y, label=f"{load['load']:.0%} load ({load['rate']:,.0f} events/s)")
        ax.axvline(2.0, color="#999999", linestyle="--", label="goal: p99 ≤ 2 s at 50%")
        ax.axhline(0.99, color="#dddddd", linewidth=0.8)
        ax.set_xscale("log")
        ax.set_xlabel("update applied − event time (s)")
        ax.set_ylabel("fraction of events")
        ax.set_title("Freshness CDF, 2 ranks", fontsize=10)
        ax.legend(fontsize=8)
        written.append(_save(fig, out / "freshness_cdf.png"))
    return written


def with_headline(readme: str, table: str) -> str:
    """The README with ``table`` in place of the one between its markers."""
    start, end = readme.index(HEADLINE_START), readme.index(HEADLINE_END) + len(HEADLINE_END)
    return readme[:start] + table + readme[end:]


def report(results_dir: Path = RESULTS, out: Path | None = None) -> str:
    out = out or DOCS_OUT
    results = load(results_dir)
    if not results:
        return f"no results under {results_dir}: run `streamtrain bench all` first"
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.md").write_text(page(results))
    for stale in set(PLOTS) - set(plot_names(results)):  # a plot whose results are gone
        (out / f"{stale}.png").unlink(missing_ok=True)
    images = plots(results, out)
    written = [out / "report.md", *images]
    if out.resolve() == DOCS_OUT.resolve():
        README.write_text(with_headline(README.read_text(), headline(results)))
        written.append(README)
    return page(results) + "\nwritten: " + ", ".join(str(p) for p in written)


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
