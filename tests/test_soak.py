"""``streamtrain bench soak``: how it judges a run (the lineage's accounting, serve's staleness),
and, behind STREAMTRAIN_TEST_SOAK=1, the soak itself at its quick size (one fault of each kind:
minutes, so not in every run of the suite)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO
from streamtrain.bench.soak import Staleness
from streamtrain.checkpoint import MARKER
from streamtrain.dev.stack import Lineage, TopicContents


def snapshot(root: Path, commit: int, step: int, next_offset: int, trained: int) -> None:
    """A committed snapshot's marker, as the worker writes it, for partition 0 only."""
    folder = root / f"step-{step:09d}"
    folder.mkdir(parents=True, exist_ok=True)
    stream = {"step": step, "next_offsets": {"0": next_offset}, "trained": {"0": trained}}
    (folder / MARKER).write_text(json.dumps({"commit": commit, "wall_time": 1000.0 + commit, "stream": stream}))


# offsets 10 and 20 hold malformed events; 250 events on the partition
TOPIC = TopicContents({0: 250}, {(0, 10), (0, 20)})


def lineage_of(root: Path, final_trained: int = 248, final_offset: int = 250) -> Lineage:
    snapshot(root, 1, 0, 0, 0)
    snapshot(root, 2, 5, 100, 98)
    snapshot(root, 3, 10, 200, 198)  # then killed; the next run restores step 5 and cuts its own step 8
    snapshot(root, 4, 8, 150, 148)
    snapshot(root, 5, 12, final_offset, final_trained)
    lineage = Lineage(root)
    lineage.collect()
    return lineage


def test_events_trained_again_after_a_restore_from_an_earlier_snapshot_are_not_duplicates(tmp_path):
    accounting = lineage_of(tmp_path).account(TOPIC)
    assert [m["stream"]["step"] for m in lineage_of(tmp_path).line()] == [0, 5, 8, 12]  # step 10 abandoned
    assert (accounting.lost, accounting.duplicated, accounting.unread, accounting.mismatches) == (0, 0, 0, [])
    assert accounting.final_step == 12 and accounting.trained == {0: 248} and accounting.snapshots == 4


def test_events_trained_twice_within_the_lineage_are_counted_and_located(tmp_path):
    accounting = lineage_of(tmp_path, final_trained=258).account(TOPIC)
    assert (accounting.lost, accounting.duplicated) == (0, 10)
    assert accounting.mismatches == ["partition 0, steps 8..12: offsets 150..250 hold 100 valid events, 110 trained"]


def test_events_skipped_or_never_read_are_lost(tmp_path):
    skipped = lineage_of(tmp_path / "skipped", final_trained=240).account(TOPIC)
    assert (skipped.lost, skipped.duplicated, skipped.unread) == (8, 0, 0)
    unread = lineage_of(tmp_path / "unread", final_trained=228, final_offset=230).account(TOPIC)
    assert (unread.lost, unread.duplicated, unread.unread, unread.mismatches) == (20, 0, 20, [])


def test_staleness_is_the_longest_wait_of_a_published_delta_or_of_serve_not_ready():
    staleness = Staleness(started=0.0)
    staleness.published((1, 0), at=10.0)
    staleness.published((1, 1), at=11.0)
    staleness.observed(12.0, ready=True, position=(1, 1))  # delta 0 served after 2 s, delta 1 waits
    assert staleness.stale(13.0) == 2.0
    staleness.observed(20.0, ready=False, position=None)  # serve restarted
    staleness.published((2, 5), at=21.0)  # a restarted worker's new chain
    assert staleness.stale(26.0) == 15.0  # delta 1 has waited since 11
    staleness.observed(30.0, ready=True, position=(2, 6))  # a newer chain's base, and its delta 5
    assert staleness.stale(30.0) == 0.0
    assert staleness.max_seconds(30.0) == 19.0
    assert [(e.started, e.seconds, e.what) for e in staleness.worst(3)] == [
        (11.0, 19.0, "delta 1 of chain 1 waited"),
        (20.0, 10.0, "not ready"),
        (21.0, 9.0, "delta 5 of chain 2 waited"),
    ]


def test_soak_help_says_what_it_reports():
    result = subprocess.run(
        [sys.executable, "-m", "streamtrain", "bench", "soak", "--help"], cwd=REPO, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    for words in ("--minutes", "--seed", "lost, duplicated", "max_stale_seconds", "exits 1"):
        assert words in result.stdout


@pytest.mark.integration
@pytest.mark.skipif(not os.environ.get("STREAMTRAIN_TEST_SOAK"), reason="minutes long: STREAMTRAIN_TEST_SOAK=1 runs it")
def test_quick_soak_loses_and_repeats_nothing_through_one_fault_of_each_kind(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "streamtrain", "bench", "soak", "--quick", "--seed", "1"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1800,
        env={**os.environ, "STREAMTRAIN_BENCH_RESULTS": str(tmp_path)},
    )
    assert result.returncode == 0, result.stderr[-5000:]
    (path,) = tmp_path.glob("soak-*.json")
    saved = json.loads(path.read_text())
    assert saved["faults"] == {"broker": 1, "rank": 1, "serve": 1}
    assert (saved["lost"], saved["duplicated"], saved["dead_letters"]["missing"]) == (0, 0, 0)
    assert saved["serve_matches_export"] and saved["restarts"] == {"worker": 1, "serve": 1}
    assert saved["max_stale_seconds"] > 0 and saved["minutes"] > 0
