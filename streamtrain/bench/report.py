"""``streamtrain bench report``: the newest result of each benchmark as one markdown table per
benchmark and PNG plots (throughput bars with ratios, RSS over time, freshness CDF), written as the
docs site's page of latest results (docs/bench/report.md, the PNGs beside it). results/ is ignored
by git: the page is committed as last rendered, and without results it is left as it is
(docs/benchmarks.md says so)."""

from __future__ import annotations

import argparse
import datetime
from pathlib import Path

from streamtrain.bench import BENCHMARKS, module
from streamtrain.bench.common import RESULTS, describe_machine, latest
from streamtrain.dev import CHECKOUT

TITLE = "# Latest benchmark results"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--results", type=Path, default=RESULTS, help="where the JSON results are (default results/)")
    parser.add_argument(
        "--out",
        type=Path,
        default=CHECKOUT / "docs" / "bench",
        help="where report.md and the PNGs go (default docs/bench/, the docs site's page)",
    )


def markdown(name: str, result: dict) -> str:
    bench = module(name)
    if hasattr(bench, "markdown"):
        return bench.markdown(result)
    return "\n".join(["```", bench.table(result), "```"])


def plots(results: dict[str, dict], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    bars = []  # (group, [(label, rate)], ratio text)
    if "e2e" in results:
        legs = results["e2e"]["legs"]
        bars.append(
            ("e2e, 2 ranks", [(n, legs[n]["events_per_second"]) for n in ("naive", "worker", "limit") if n in legs])
        )
    if "pipeline" in results:
        legs = results["pipeline"]["legs"]
        bars.append(
            (
                f"pipeline, {results['pipeline']['ranks']} rank(s)",
                [("Base", legs["base"]["events_per_second"]), ("SparseDist", legs["sparse_dist"]["events_per_second"])],
            )
        )
    if "checkpoint" in results:
        r = results["checkpoint"]
        bars.append(
            (
                f"checkpoint every {r['interval_seconds']:g}s",
                [("none", r["baseline_events_per_second"]), ("async", r["async_snapshot_events_per_second"])],
            )
        )
    if "train-step" in results:
        r = max(results["train-step"]["sizes"], key=lambda s: s["batch"] * s["features"])
        bars.append(
            (
                f"train step B={r['batch']} F={r['features']}",
                [("EmbeddingBag", r["per_feature_events_per_second"]), ("TBE", r["fused_events_per_second"])],
            )
        )
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
    if "memory" in results:
        r = results["memory"]
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
    if "freshness" in results:
        r = results["freshness"]
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


def report(results_dir: Path = RESULTS, out: Path | None = None) -> str:
    out = out or CHECKOUT / "docs" / "bench"
    out.mkdir(parents=True, exist_ok=True)
    order = ["e2e", "freshness", "pipeline"] + [
        name for name in BENCHMARKS if name not in ("e2e", "freshness", "pipeline")
    ]
    results = {name: r for name in order if name in BENCHMARKS and (r := latest(name, results_dir)) is not None}
    if not results:
        return f"no results under {results_dir}: run `streamtrain bench all` first"
    first = next(iter(results.values()))
    sections = [
        f"{TITLE}\n",
        f"Measured on {describe_machine(first['machine'])}; each part names the command that made it, "
        f"and `streamtrain bench report` rendered them ({datetime.date.today().isoformat()}) from "
        f"`results/*.json`. Ratios are the figures: each is measured side by side in one run. "
        f"[Benchmarks](../benchmarks.md) says what each measures and how to run it.\n",
    ]
    for name, result in results.items():
        command = result.get("command", f"streamtrain bench {name}").strip()
        quick = " — a --quick run: proves it works, judges nothing" if result.get("quick") else ""
        sections.append(
            f"**{name}** (`{command}`, {result.get('written', 'undated')}{quick})\n\n{markdown(name, result)}\n"
        )
    images = plots(results, out)
    for image in images:
        sections.append(f"![{image.stem}]({image.name})\n")
    text = "\n".join(sections)
    (out / "report.md").write_text(text)
    return text + f"\nwritten: {out / 'report.md'}, " + ", ".join(str(p) for p in images)


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
