"""Render the Grafana dashboard's panels from a live Prometheus to one PNG, without Grafana.

    python deploy/grafana/render_png.py --prometheus http://127.0.0.1:9090 --minutes 10 --out docs/dashboard.png

Each panel's queries are read from streamtrain.json and fetched with query_range, so the picture
shows exactly what the dashboard would.
"""

from __future__ import annotations

import argparse
import json
import time
import urllib.parse
import urllib.request
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

DASHBOARD = Path(__file__).resolve().parent / "dashboards" / "streamtrain.json"


def query_range(prometheus: str, expr: str, start: float, end: float, step: float) -> list[dict]:
    params = urllib.parse.urlencode({"query": expr, "start": start, "end": end, "step": step})
    with urllib.request.urlopen(f"{prometheus}/api/v1/query_range?{params}", timeout=30) as reply:
        return json.load(reply)["data"]["result"]


def legend(template: str, labels: dict) -> str:
    for key, value in labels.items():
        template = template.replace("{{" + key + "}}", value)
    return template


def render(prometheus: str, minutes: float, out: Path) -> None:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    end = time.time()
    start = end - minutes * 60
    columns = 2
    rows = (len(panels) + columns - 1) // columns
    figure, axes = plt.subplots(rows, columns, figsize=(14, 3.2 * rows), squeeze=False)
    for axis, panel in zip(axes.flat, panels):
        for target in panel["targets"]:
            for series in query_range(prometheus, target["expr"], start, end, max(minutes * 60 / 300, 1)):
                times = [(float(t) - end) / 60 for t, _ in series["values"]]
                values = [float(v) for _, v in series["values"]]
                axis.plot(times, values, label=legend(target["legendFormat"], series["metric"]))
        axis.set_title(panel["title"], fontsize=10)
        axis.set_xlabel("minutes ago", fontsize=8)
        axis.tick_params(labelsize=8)
        if axis.lines:
            axis.legend(fontsize=7, loc="best")
    for axis in list(axes.flat)[len(panels):]:
        axis.axis("off")
    figure.suptitle("streamtrain dashboard, rendered from Prometheus", fontsize=12)
    figure.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=80)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prometheus", default="http://127.0.0.1:9090")
    parser.add_argument("--minutes", type=float, default=10)
    parser.add_argument("--out", type=Path, default=Path("docs/dashboard.png"))
    args = parser.parse_args()
    render(args.prometheus.rstrip("/"), args.minutes, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
