"""Several real ranks (gloo) on the real broker: sharding, lockstep on uneven streams, shutdown, failures."""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import REPO, SCHEMA, committed_offsets, cpu_seconds, end_offsets
from streamtrain.checkpoint import list_snapshots
from streamtrain.dev.produce import produce
from test_delivery_publisher import snapshot_models

pytestmark = pytest.mark.integration

PARTITIONS = 4


def trained_by_partition(ranks) -> dict[int, float]:
    totals: dict[int, float] = {}
    for rank in ranks:
        for key, value in rank.scrape().items():
            if key.startswith("streamtrain_events_trained_total{"):
                partition = int(key.split('partition="')[1].split('"')[0])
                totals[partition] = totals.get(partition, 0) + value
    return totals


def test_two_ranks_train_every_event_once_on_sharded_tables(kafka, topic_name, start_ranks, tmp_path):
    produce(kafka.bootstrap_servers, topic_name, 8000, partitions=PARTITIONS, seed=11, schema_path=SCHEMA)
    expected = end_offsets(kafka, topic_name)
    plan_path = tmp_path / "plan.json"
    ranks = start_ranks(topic_name, 2, env={"STREAMTRAIN_DISTRIBUTED__PLAN_PATH": str(plan_path)})
    ranks[0].wait_for(
        lambda: sum(trained_by_partition(ranks).values()) >= 8000,
        timeout=180,
        what="8000 events trained over both ranks",
    )
    time.sleep(1.0)
    assert trained_by_partition(ranks) == expected
    # each rank trains exactly the partitions it owns
    for rank_index, rank in enumerate(ranks):
        owned = {
            int(k.split('partition="')[1].split('"')[0])
            for k, v in rank.scrape().items()
            if k.startswith("streamtrain_events_trained_total{") and v > 0
        }
        assert owned == {p for p in range(PARTITIONS) if p % 2 == rank_index}
    plan = json.loads(plan_path.read_text())
    sharded_ranks = {s["rank"] for t in plan["tables"] if t["sharding_type"] != "data_parallel" for s in t["shards"]}
    assert plan["world_size"] == 2 and sharded_ranks == {0, 1}

    ranks[1].signal(signal.SIGTERM)  # a signal to one rank stops all of them
    assert [r.wait(timeout=30) for r in ranks] == [0, 0]
    assert committed_offsets(kafka, topic_name, f"group-{topic_name}") == expected


def test_all_traffic_on_one_rank_the_other_idle(kafka, topic_name, start_ranks):
    produce(kafka.bootstrap_servers, topic_name, 5000, partitions=PARTITIONS, partition=0, seed=12, schema_path=SCHEMA)
    ranks = start_ranks(topic_name, 2, "--until-end")
    assert [r.wait(timeout=180) for r in ranks] == [0, 0], ranks[0].output()[-3000:] + ranks[1].output()[-3000:]
    assert "rank 0 stopped after" in ranks[0].output() and "5,000 events trained" in ranks[0].output()
    assert "rank 1 stopped after" in ranks[1].output() and " 0 events trained" in ranks[1].output()
    steps = [int(r.output().split("stopped after ")[1].split(" steps")[0]) for r in ranks]
    assert steps[0] == steps[1] > 0  # lockstep: the idle rank took part in every step
    assert committed_offsets(kafka, topic_name, f"group-{topic_name}")[0] == 5000


def test_idle_rank_metrics_stay_finite_and_idle_gaps_do_not_spin(kafka, topic_name, start_ranks):
    produce(kafka.bootstrap_servers, topic_name, 2000, partitions=PARTITIONS, partition=2, seed=13, schema_path=SCHEMA)
    ranks = start_ranks(topic_name, 2)
    trained = lambda: sum(trained_by_partition(ranks).values())  # noqa: E731
    ranks[0].wait_for(lambda: trained() >= 2000, timeout=180, what="the first burst")
    for sample, value in ranks[1].scrape().items():
        assert math.isfinite(value), f"rank 1 (idle) exports {sample} = {value}"

    # 10 s without events: the ranks poll with a bounded wait instead of spinning a core.
    time.sleep(1.0)
    before = [cpu_seconds(r.process.pid) for r in ranks]
    time.sleep(10.0)
    used = [cpu_seconds(r.process.pid) - b for r, b in zip(ranks, before, strict=True)]
    assert all(u < 3.0 for u in used), f"CPU seconds used by idle ranks over 10 s: {used}"

    produce(kafka.bootstrap_servers, topic_name, 2000, partitions=PARTITIONS, partition=1, seed=14, schema_path=SCHEMA)
    ranks[0].wait_for(lambda: trained() >= 4000, timeout=60, what="the burst after the gap")
    assert trained_by_partition(ranks) == {1: 2000, 2: 2000}
    ranks[0].signal(signal.SIGINT)
    assert [r.wait(timeout=30) for r in ranks] == [0, 0]


def test_an_idle_stream_leaves_the_model_as_its_last_event_left_it(kafka, topic_name, start_ranks, tmp_path):
    # On a quiet stream the ranks still step empty batches: the lockstep's flushes, and its votes
    # on the snapshots due every second. Adam's momentum must not move the model at those steps.
    produce(kafka.bootstrap_servers, topic_name, 3000, partitions=PARTITIONS, seed=17, schema_path=SCHEMA)
    root = tmp_path / "snapshots"
    settings = {
        "STREAMTRAIN_CHECKPOINT__PATH": str(root),
        "STREAMTRAIN_CHECKPOINT__INTERVAL_SECONDS": "1",
        "STREAMTRAIN_CHECKPOINT__KEEP_LAST": "1000",
    }
    ranks = start_ranks(topic_name, 2, env=settings)
    ranks[0].wait_for(lambda: sum(trained_by_partition(ranks).values()) >= 3000, timeout=180, what="3000 events")
    time.sleep(6.0)
    ranks[0].signal(signal.SIGINT)
    assert [r.wait(timeout=60) for r in ranks] == [0, 0], ranks[0].output()[-3000:] + ranks[1].output()[-3000:]

    idle = [s for s in list_snapshots(str(root)) if sum(s.metadata["stream"]["trained"].values()) == 3000]
    assert len({s.step for s in idle}) >= 3, [(s.step, s.metadata["stream"]["trained"]) for s in idle]
    models = snapshot_models(root, tmp_path)
    first, *later = sorted(s.step for s in idle)
    for step in later:
        for name, value in models[first].items():
            assert torch.equal(models[step][name], value), f"{name} moved between steps {first} and {step}, idle"


def test_signal_to_one_rank_mid_stream_stops_all(kafka, topic_name, start_ranks, live_producer):
    produce(kafka.bootstrap_servers, topic_name, 100, partitions=PARTITIONS, seed=15, schema_path=SCHEMA)
    producer = live_producer(kafka.bootstrap_servers, topic_name, 60000, 2000, "--seed", "16")
    try:
        ranks = start_ranks(topic_name, 2)
        ranks[0].wait_for(
            lambda: sum(trained_by_partition(ranks).values()) > 2000, timeout=120, what="training under way"
        )
        assert producer.running
        ranks[1].signal(signal.SIGTERM)
        assert [r.wait(timeout=30) for r in ranks] == [0, 0]
    finally:
        producer.stop(timeout=30)


@pytest.mark.parametrize("failure", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "frozen"])
def test_a_dead_or_frozen_rank_makes_the_others_fail_within_the_timeout(kafka, topic_name, start_ranks, failure):
    produce(kafka.bootstrap_servers, topic_name, 2000, partitions=PARTITIONS, seed=17, schema_path=SCHEMA)
    ranks = start_ranks(topic_name, 2, env={"STREAMTRAIN_DISTRIBUTED__TIMEOUT_SECONDS": "10"})
    ranks[0].wait_for(lambda: sum(trained_by_partition(ranks).values()) >= 2000, timeout=180, what="training under way")
    failed = time.monotonic()
    ranks[1].signal(failure)  # a killed peer closes its sockets; a frozen one just stops answering
    code = ranks[0].wait(timeout=60)
    assert code != 0
    assert time.monotonic() - failed < 10 + 15
    assert "a peer rank failed or stopped answering" in ranks[0].output()


@pytest.mark.parametrize("world_size", [1, 2, 8])
def test_plan_dry_run_for_any_world_size(world_size, tmp_path):
    out = tmp_path / "plan.json"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "streamtrain",
            "plan",
            "--config",
            str(REPO / "deploy" / "worker.yaml"),
            "--world-size",
            str(world_size),
            "--json",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert f"sharding plan for {world_size} rank(s)" in result.stdout
    assert all(f"rank {r}: " in result.stdout for r in range(world_size))
    plan = json.loads(out.read_text())
    assert len(plan["tables"]) == 16
    used = {s["rank"] for t in plan["tables"] for s in t["shards"]}
    assert used == set(range(world_size))


def test_nproc_launches_ranks_through_the_elastic_launcher(kafka, topic_name, start_worker):
    produce(kafka.bootstrap_servers, topic_name, 3000, partitions=PARTITIONS, seed=18, schema_path=SCHEMA)
    launcher = start_worker(topic_name, "--nproc", "2", "--until-end")
    assert launcher.wait(timeout=180) == 0, launcher.output()[-4000:]
    output = launcher.output()
    assert "rank 0 stopped after" in output and "rank 1 stopped after" in output
    assert committed_offsets(kafka, topic_name, f"group-{topic_name}") == end_offsets(kafka, topic_name)

    # A SIGTERM to the launcher is a requested stop: it reaches every rank, and the exit code is 0.
    live = start_worker(topic_name, "--nproc", "2")
    live.wait_for(live.scrape, timeout=120, what="rank 0's metrics")
    produce(kafka.bootstrap_servers, topic_name, 1000, partitions=PARTITIONS, seed=19, schema_path=SCHEMA)
    live.wait_for(lambda: live.total("streamtrain_events_trained_total") > 0, timeout=60, what="training")
    live.signal(signal.SIGTERM)
    assert live.wait(timeout=60) == 0, live.output()[-3000:]
    assert "stopped by SIGTERM" in live.output()


def test_max_events_counts_across_ranks_and_stops_them_together(kafka, topic_name, start_ranks):
    # Every event on partition 0, which rank 0 owns: rank 1 reads nothing, yet both stop.
    produce(kafka.bootstrap_servers, topic_name, 3000, partitions=PARTITIONS, partition=0, seed=21, schema_path=SCHEMA)
    ranks = start_ranks(topic_name, 2, "--max-events", "1000")
    assert [r.wait(timeout=180) for r in ranks] == [0, 0], ranks[0].output()[-3000:] + ranks[1].output()[-3000:]
    assert "rank 0 stopped after" in ranks[0].output() and " 1,000 events trained" in ranks[0].output()
    assert "rank 1 stopped after" in ranks[1].output() and " 0 events trained" in ranks[1].output()
    steps = [int(r.output().split("stopped after ")[1].split(" steps")[0]) for r in ranks]
    assert steps[0] == steps[1] > 0
    assert committed_offsets(kafka, topic_name, f"group-{topic_name}")[0] == 1000
