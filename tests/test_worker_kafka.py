"""The worker end to end against the real broker: consume, decode, train, export, stop."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime

import pytest
from confluent_kafka import KafkaException

from conftest import REPO, SCHEMA, committed_offsets, end_offsets
from streamtrain.dev.produce import produce

pytestmark = pytest.mark.integration

EVENTS = 20_000
PARTITIONS = 4


def test_worker_trains_every_event_and_learns_the_planted_signal(kafka, topic_name, start_worker):
    report = produce(kafka.bootstrap_servers, topic_name, EVENTS, partitions=PARTITIONS, seed=7, schema_path=SCHEMA)
    assert report.produced == EVENTS and report.bayes_auc >= 0.75
    per_partition = end_offsets(kafka, topic_name)
    assert sum(per_partition.values()) == EVENTS and all(per_partition.values())

    worker = start_worker(topic_name)
    trained = lambda: worker.total("streamtrain_events_trained_total")  # noqa: E731
    worker.wait_for(lambda: trained() >= EVENTS, timeout=60, what=f"{EVENTS} trained events")
    time.sleep(1.0)  # nothing beyond the stream may be counted
    samples = worker.scrape()
    assert worker.total("streamtrain_events_trained_total", samples) == EVENTS
    for partition, count in per_partition.items():
        key = f'streamtrain_events_trained_total{{partition="{partition}",topic="{topic_name}"}}'
        assert samples[key] == count
    assert worker.total("streamtrain_events_consumed_total", samples) == EVENTS
    auc = samples['streamtrain_progressive_auc{task="clk",window="window"}']
    assert auc > 0.65, f"progressive AUC over the last 5,000 events is {auc}; Bayes AUC {report.bayes_auc}"
    assert samples["streamtrain_loss"] < 0.69  # better than the untrained model's log(2)
    # The progress line says how far behind the end offsets the rank is: nothing, once all is trained.
    worker.wait_for(lambda: re.search(r"\| lag 0$", worker.output(), re.M), timeout=20, what="a progress line at lag 0")

    worker.signal(signal.SIGTERM)
    assert worker.wait(timeout=30) == 0
    assert committed_offsets(kafka, topic_name, f"group-{topic_name}") == per_partition


def test_until_end_trains_the_backlog_and_exits_zero(kafka, topic_name, start_worker):
    produce(kafka.bootstrap_servers, topic_name, 3_000, partitions=PARTITIONS, seed=3, schema_path=SCHEMA)
    per_partition = end_offsets(kafka, topic_name)
    worker = start_worker(topic_name, "--until-end")
    assert worker.wait(timeout=180) == 0, worker.output()[-3000:]
    assert "3,000 events trained" in worker.output()
    assert committed_offsets(kafka, topic_name, f"group-{topic_name}") == per_partition

    # The next run starts where the last one stopped: nothing is left, so it trains nothing.
    again = start_worker(topic_name, "--until-end")
    assert again.wait(timeout=180) == 0
    assert "0 events trained" in again.output()


def test_sigterm_mid_stream_exits_zero_promptly(kafka, topic_name, start_worker, live_producer):
    # 3,000 events/s for up to a minute (the test stops it sooner): the stream must still flow when
    # the signal arrives, also on a slow machine.
    producer = live_producer(kafka.bootstrap_servers, topic_name, 180_000, 3000, "--partitions", str(PARTITIONS))
    try:
        worker_started = time.monotonic()
        deadline = worker_started + 60
        while time.monotonic() < deadline:  # the worker needs the topic, which the producer creates
            try:
                if sum(end_offsets(kafka, topic_name).values()) > 0:
                    break
            except KafkaException:  # not created yet
                pass
            time.sleep(0.2)
        worker = start_worker(topic_name)
        worker.wait_for(
            lambda: worker.total("streamtrain_events_trained_total") > 1000,
            timeout=120,
            what="training to be under way",
        )
        assert producer.running, "the stream must still be flowing when the signal arrives"
        signalled = time.monotonic()
        worker.signal(signal.SIGTERM)
        assert worker.wait(timeout=15) == 0
        elapsed = time.monotonic() - signalled
        assert elapsed < 15
        assert "SIGTERM received" in worker.output()
    finally:
        producer.stop(timeout=30)
    assert producer.produced() > 0


def test_a_stop_and_a_snapshot_asked_for_while_the_worker_starts_are_carried_out_not_fatal(
    kafka, topic_name, start_worker, tmp_path
):
    # The metrics port (and the probes on it) answers long before the worker trains: a supervisor may
    # stop it, or ask for a snapshot, from then on, and neither may kill it with the signal's default.
    produce(kafka.bootstrap_servers, topic_name, 2_000, partitions=PARTITIONS, schema_path=SCHEMA)
    worker = start_worker(topic_name, env={"STREAMTRAIN_CHECKPOINT__PATH": str(tmp_path / "snapshots")})
    worker.wait_for(lambda: "metrics on http" in worker.output(), timeout=120, what="the metrics port")
    worker.signal(signal.SIGUSR1)
    worker.signal(signal.SIGTERM)
    assert worker.wait(timeout=180) == 0, worker.output()[-3000:]
    assert "SIGTERM received: stopping as soon as the worker has started" in worker.output()


def test_bad_config_is_rejected_naming_the_field(tmp_path, kafka):
    config = tmp_path / "worker.yaml"
    config.write_text((REPO / "tests" / "worker-small.yaml").read_text().replace("batch_size: 256", "batch_size: -5"))
    result = subprocess.run(
        [sys.executable, "-m", "streamtrain", "worker", "--config", str(config)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "batching.batch_size" in result.stderr
    assert "greater than 0" in result.stderr


def complete_snapshots(root) -> list:
    return [p for p in root.glob("step-*") if not p.name.endswith(".partial")] if root.exists() else []


def test_shutdown_grace_bounds_the_whole_shutdown_with_the_final_snapshot(kafka, topic_name, start_worker, tmp_path):
    produce(kafka.bootstrap_servers, topic_name, 2_000, partitions=PARTITIONS, seed=5, schema_path=SCHEMA)
    snapshots = tmp_path / "snapshots"
    env = {"STREAMTRAIN_CHECKPOINT__PATH": str(snapshots)}
    hurried = start_worker(
        topic_name, "--until-end", env={**env, "STREAMTRAIN_DISTRIBUTED__SHUTDOWN_GRACE_SECONDS": "0.01"}
    )
    assert hurried.wait(timeout=180) == 3, hurried.output()[-3000:]
    assert "shutdown did not finish within 0.01s" in hurried.output()
    assert complete_snapshots(snapshots) == []

    patient = start_worker(
        topic_name, "--until-end", env={**env, "STREAMTRAIN_DISTRIBUTED__SHUTDOWN_GRACE_SECONDS": "60"}
    )
    assert patient.wait(timeout=180) == 0, patient.output()[-3000:]
    assert "2,000 events trained" in patient.output()  # the hurried run's training was never durable
    assert len(complete_snapshots(snapshots)) == 1


def test_start_at_flag_starts_at_a_time_and_a_snapshot_wins_over_it(kafka, topic_name, start_worker, tmp_path):
    produce(kafka.bootstrap_servers, topic_name, 600, partitions=PARTITIONS, seed=6, schema_path=SCHEMA)
    time.sleep(0.05)  # Kafka stamps each message with its send time (CreateTime)
    moment = datetime.now(UTC).isoformat()
    time.sleep(0.05)
    produce(kafka.bootstrap_servers, topic_name, 400, partitions=PARTITIONS, seed=7, schema_path=SCHEMA)
    env = {"STREAMTRAIN_CHECKPOINT__PATH": str(tmp_path / "snapshots")}
    first = start_worker(topic_name, "--until-end", "--start-at", moment, env=env)
    assert first.wait(timeout=180) == 0, first.output()[-3000:]
    assert " 400 events trained" in first.output()

    produce(kafka.bootstrap_servers, topic_name, 300, partitions=PARTITIONS, seed=8, schema_path=SCHEMA)
    second = start_worker(topic_name, "--until-end", "--start-at", "earliest", env=env)
    assert second.wait(timeout=180) == 0, second.output()[-3000:]
    assert " 300 events trained" in second.output()  # from the snapshot's positions, not the earliest
