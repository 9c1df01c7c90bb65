"""Sharded (merge-shard-try) against replicated (main) managed id map, 2 ranks, same drifting topic, ABAB.

TREES names the two checkouts: REPLICATED_TREE holds main at 1dac7b8 (the replicated map; `git worktree
add /work/wt/replicated 1dac7b8`), SHARDED_TREE the sharded map (the merge-shard-try branch at first,
main since). Reads each rank's last progressive AUC line and its summary (events trained in Xs, events/s)."""

import json
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, "/work/main")
from streamtrain.dev.kafka import KafkaBroker, free_port

REPLICATED = os.environ.get("REPLICATED_TREE", "/work/wt/replicated")
SHARDED = os.environ.get("SHARDED_TREE", "/work/main")
TREES = {"replicated": REPLICATED, "sharded": SHARDED, "sharded16": SHARDED}
BUCKETS = {"sharded16": 16}
PY = "/work/main/.venv/bin/python"
EVENTS = int(os.environ.get("EVENTS", 450_000))
ORDER = os.environ.get("ORDER", "replicated sharded sharded replicated").split()
# e.g. "table_wise": both maps' tables planned alike (1dac7b8's default let the planner pick column_wise)
SHARDING_TYPES = os.environ.get("SHARDING_TYPES", "").split()


def config(name: str, tree: str, out: Path) -> Path:
    import yaml

    raw = yaml.safe_load(Path(tree, "deploy/worker.yaml").read_text())
    for t in raw["features"]["tables"]:
        if t["name"] in ("user_id", "adgroup_id"):
            t.pop("num_embeddings", None)
            t.update(id_mapping="managed", rows=1501)
            if name in BUCKETS:
                t["buckets"] = BUCKETS[name]
            if SHARDING_TYPES:
                t["sharding_types"] = SHARDING_TYPES
    raw.pop("checkpoint", None)
    raw.pop("delivery", None)
    raw["metrics"]["log_interval_seconds"] = 2
    path = out / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def run(tree: str, cfg: Path, broker, topic: str) -> dict:
    env = {
        **os.environ,
        "PYTHONPATH": tree,
        "PYTHONUNBUFFERED": "1",
        "STREAMTRAIN_KAFKA__BOOTSTRAP_SERVERS": broker.bootstrap_servers,
        "STREAMTRAIN_KAFKA__TOPIC": topic,
        "STREAMTRAIN_KAFKA__GROUP_ID": f"cmp-{uuid.uuid4().hex[:8]}",
        "STREAMTRAIN_METRICS__PORT": str(free_port()),
    }
    env.pop("STREAMTRAIN_DEAD_LETTER__ENABLED", None)
    done = subprocess.run(
        [PY, "-m", "streamtrain", "worker", "--config", str(cfg), "--nproc", "2", "--until-end"],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    text = done.stdout + done.stderr
    if done.returncode:
        print(text[-3000:])
        raise SystemExit(f"{tree}: rc {done.returncode}")
    aucs, rates = {}, {}
    for line in text.splitlines():
        if m := re.search(r"rank (\d) step \d+ \| .*progressive AUC ([0-9.]+)", line):
            aucs[m[1]] = float(m[2])
        if m := re.search(r"rank (\d) stopped after \d+ steps, ([\d,]+) events trained in ([\d.]+)s", line):
            rates[m[1]] = (int(m[2].replace(",", "")), float(m[3]))
    events = sum(e for e, _ in rates.values())
    seconds = max(s for _, s in rates.values())
    return {
        "auc_by_rank": aucs,
        "auc": sum(aucs.values()) / len(aucs),
        "events": events,
        "seconds": seconds,
        "events_per_second": events / seconds,
    }


def main():
    out = Path("/work/wt/cmp")
    results = {name: [] for name in TREES if name in ORDER}
    with KafkaBroker() as broker:
        topic = "drift"
        subprocess.run(
            [
                PY,
                "-m",
                "streamtrain",
                "produce",
                "--bootstrap-servers",
                broker.bootstrap_servers,
                "--topic",
                topic,
                "--count",
                str(EVENTS),
                "--partitions",
                "4",
                "--seed",
                "0",
                "--drift",
                "--drift-users",
                "1200",
                "--drift-ads",
                "1200",
                "--drift-lifetime",
                "30000",
                "--drift-one-off",
                "0.333",
            ],
            cwd="/work/main",
            check=True,
            env={**os.environ, "PYTHONPATH": "/work/main"},
        )
        cfgs = {name: config(name, tree, out) for name, tree in TREES.items() if name in ORDER}
        for name in ORDER:
            r = run(TREES[name], cfgs[name], broker, topic)
            results[name].append(r)
            print(name, json.dumps(r), flush=True)
    summary = {
        name: {
            "auc": sum(r["auc"] for r in rs) / len(rs),
            "events_per_second": sum(r["events_per_second"] for r in rs) / len(rs),
        }
        for name, rs in results.items()
    }
    for name in summary.copy():
        if name != "replicated":
            summary[f"{name}_vs_replicated_auc"] = summary[name]["auc"] - summary["replicated"]["auc"]
            summary[f"{name}_events_per_second_ratio"] = (
                summary[name]["events_per_second"] / summary["replicated"]["events_per_second"]
            )
    print(json.dumps(summary, indent=1))
    commits = {
        name: subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tree, capture_output=True, text=True).stdout.strip()
        for name, tree in TREES.items()
        if name in ORDER
    }
    Path(out, f"shardcmp-{time.strftime('%Y%m%d-%H%M%S')}.json").write_text(
        json.dumps({"commits": commits, "sharding_types": SHARDING_TYPES, "runs": results, **summary}, indent=1)
    )


main()
