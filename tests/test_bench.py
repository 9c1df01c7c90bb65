"""Benchmarks run in quick mode once, to prove they work; their figures are judged by people, not here."""

import json
import subprocess
import sys

from conftest import REPO, SMALL_CONFIG


def test_checkpoint_benchmark_runs_and_reports_a_ratio(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "streamtrain", "bench", "checkpoint", "--quick", "--config", str(SMALL_CONFIG)],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "ratio" in result.stdout
    saved = json.loads(open(result.stdout.split("results: ")[1].strip()).read())
    assert saved["snapshots"] >= 1 and saved["baseline_events_per_second"] > 0 and saved["ratio"] > 0


def test_train_step_benchmark_runs_both_paths_and_reports_a_ratio():
    result = subprocess.run([sys.executable, "-m", "streamtrain", "bench", "train-step", "--quick"],
                            cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    saved = json.loads(open(result.stdout.split("results: ")[1].strip()).read())
    (row,) = saved["sizes"]
    assert row["per_feature_events_per_second"] > 0 and row["fused_events_per_second"] > 0
    assert row["ratio"] == row["fused_events_per_second"] / row["per_feature_events_per_second"]


def test_memory_benchmark_samples_the_workers_rss():
    result = subprocess.run([sys.executable, "-m", "streamtrain", "bench", "memory", "--quick", "--config",
                             str(SMALL_CONFIG)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    saved = json.loads(open(result.stdout.split("results: ")[1].strip()).read())
    assert len(saved["samples"]) >= 10 and all(rss > 0 for _t, rss in saved["samples"])
    assert "events trained" in saved["worker_summary"]
