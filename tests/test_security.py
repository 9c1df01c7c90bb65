"""SASL/SCRAM-SHA-512 on a real broker: a worker logs in with the password from a file, trains and
publishes deltas; `streamtrain serve --config` with the worker's YAML follows them, logged in the
same way; a wrong password stops a worker at once with exit code 5; the password never reaches a
log, the metrics, the snapshots or the bases."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest
import yaml
from confluent_kafka import Producer

from conftest import REPO, SCHEMA, SMALL_CONFIG, scrape
from streamtrain.dev.kafka import KafkaBroker, free_port
from streamtrain.dev.produce import produce

pytestmark = pytest.mark.integration

USER = "trainer"
PASSWORD = f"pw-{uuid.uuid4().hex}"  # unique, so that finding it anywhere is a leak


@pytest.fixture(scope="module")
def sasl_kafka():
    with KafkaBroker(sasl=(USER, PASSWORD)) as broker:
        yield broker


def sasl_worker_config(tmp_path: Path, password: str) -> Path:
    """The small test config, logging in as docs/getting-started.md's "Training from your own Kafka cluster" shows."""
    secret = tmp_path / "kafka-password"
    secret.write_text(password + "\n")
    raw = yaml.safe_load(SMALL_CONFIG.read_text())
    raw["kafka"]["client_config"] = {
        "security.protocol": "SASL_PLAINTEXT",
        "sasl.mechanism": "SCRAM-SHA-512",
        "sasl.username": USER,
    }
    raw["kafka"]["client_config_files"] = {"sasl.password": str(secret)}
    raw["features"]["schema_path"] = str(SCHEMA)
    raw["checkpoint"] = {"path": str(tmp_path / "snapshots")}
    raw["delivery"] = {"enabled": True, "delta_interval_seconds": 1}
    config = tmp_path / "worker.yaml"
    config.write_text(yaml.safe_dump(raw))
    return config


def test_sasl_login_from_a_file_trains_and_a_wrong_password_exits_5_without_leaking(
    sasl_kafka, topic_name, start_worker, tmp_path
):
    produce(
        sasl_kafka.bootstrap_servers,
        topic_name,
        2000,
        partitions=4,
        seed=80,
        schema_path=SCHEMA,
        client_config=sasl_kafka.client_config,
    )
    sasl_kafka.create_topic(topic_name + ".dlq", 1)
    producer = Producer({"bootstrap.servers": sasl_kafka.bootstrap_servers, **sasl_kafka.client_config})
    producer.produce(topic_name, value=b"", partition=0)  # one dead letter: that producer logs in too
    assert producer.flush(30) == 0

    (tmp_path / "good").mkdir()
    (tmp_path / "bad").mkdir()
    worker = start_worker(topic_name, config=sasl_worker_config(tmp_path / "good", PASSWORD), broker=sasl_kafka)
    wrong_password = f"wrong-{uuid.uuid4().hex}"
    # A long connect timeout: only failing on the refused login, not on the timeout, passes.
    refused = start_worker(
        topic_name,
        config=sasl_worker_config(tmp_path / "bad", wrong_password),
        broker=sasl_kafka,
        env={"STREAMTRAIN_KAFKA__CONNECT_TIMEOUT_SECONDS": "600"},
    )

    worker.wait_for(
        lambda: (
            worker.total("streamtrain_events_trained_total") == 2000
            and worker.total("streamtrain_dead_letter_events_total") == 1
        ),
        timeout=180,
        what="2000 events trained and 1 dead-lettered over SASL",
    )
    with urllib.request.urlopen(f"http://127.0.0.1:{worker.metrics_port}/metrics", timeout=10) as reply:
        metrics_text = reply.read().decode()
    assert "streamtrain_events_trained_total" in metrics_text
    serve_metrics = follow_deltas_with_the_workers_config(tmp_path / "good", sasl_kafka, topic_name)
    worker.signal()
    assert worker.wait(timeout=120) == 0
    snapshot_files = [p for p in (tmp_path / "good" / "snapshots").rglob("*") if p.is_file()]
    assert any(p.name == "streamtrain.json" for p in snapshot_files)
    assert any(p.name == "manifest.json" for p in snapshot_files), "no base was exported"
    logs = [(worker.output(), "the worker's log"), ((tmp_path / "good" / "serve.log").read_text(), "serve's log")]
    for text, where in [*logs, (metrics_text, "/metrics"), (serve_metrics, "serve's /metrics")]:
        assert PASSWORD not in text, f"the password is in {where}"
    for path in snapshot_files:
        assert PASSWORD.encode() not in path.read_bytes(), f"the password is in {path}"

    assert refused.wait(timeout=120) == 5, refused.output()[-3000:]
    output = refused.output()
    assert f"the Kafka brokers at {sasl_kafka.bootstrap_servers} refused the login" in output
    assert "Authentication failed" in output and wrong_password not in output


def follow_deltas_with_the_workers_config(folder: Path, broker: KafkaBroker, topic: str) -> str:
    """``streamtrain serve --config`` with nothing else: the bases' folder, the delta topic, the
    brokers and the SASL login all come from the worker's YAML, with the environment overrides the
    worker was started with. Its /metrics text once it applied a delta."""
    port = free_port()
    log = folder / "serve.log"
    server = subprocess.Popen(
        [sys.executable, "-m", "streamtrain", "serve", "--config", str(folder / "worker.yaml"), "--port", str(port),
         "--threads", "1", "--base-wait-seconds", "240"],
        cwd=REPO, stdout=log.open("ab"), stderr=subprocess.STDOUT,
        env={**os.environ, "STREAMTRAIN_KAFKA__BOOTSTRAP_SERVERS": broker.bootstrap_servers,
             "STREAMTRAIN_KAFKA__TOPIC": topic},
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while scrape(port).get("streamtrain_serve_deltas_applied_total", 0) < 1:
            assert server.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, f"serve applied no delta over SASL: {log.read_text()[-3000:]}"
            time.sleep(1)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            return reply.read().decode()
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_client_properties_set_wholly_from_the_environment_log_in_and_a_wrong_name_exits_2_at_once(
    sasl_kafka, topic_name, start_worker, tmp_path
):
    """The SASL login from variables alone, each dot of a property written __ (as an operator's
    pod spec sets them), trains; a property librdkafka does not know stops the worker at start-up
    with exit code 2 naming it and the variable meant, not at the first connection."""
    produce(
        sasl_kafka.bootstrap_servers,
        topic_name,
        500,
        partitions=2,
        seed=81,
        schema_path=SCHEMA,
        client_config=sasl_kafka.client_config,
    )
    secret = tmp_path / "kafka-password"
    secret.write_text(PASSWORD + "\n")
    login = {
        "STREAMTRAIN_KAFKA__CLIENT_CONFIG__SECURITY__PROTOCOL": "SASL_PLAINTEXT",
        "STREAMTRAIN_KAFKA__CLIENT_CONFIG__SASL__MECHANISM": "SCRAM-SHA-512",
        "STREAMTRAIN_KAFKA__CLIENT_CONFIG__SASL__USERNAME": USER,
        "STREAMTRAIN_KAFKA__CLIENT_CONFIG_FILES__SASL__PASSWORD": str(secret),
        "STREAMTRAIN_DEAD_LETTER__ENABLED": "false",
    }
    worker = start_worker(topic_name, "--until-end", broker=sasl_kafka, env=login)
    # A long connect timeout: a refusal at connect would take it, a refusal at start-up does not.
    misnamed = start_worker(
        topic_name,
        broker=sasl_kafka,
        env={
            **login,
            "STREAMTRAIN_KAFKA__CLIENT_CONFIG__SASL_MECHANISM": "SCRAM-SHA-512",
            "STREAMTRAIN_KAFKA__CONNECT_TIMEOUT_SECONDS": "600",
        },
    )
    assert misnamed.wait(timeout=120) == 2, misnamed.output()[-3000:]
    assert (
        "kafka.client_config: 'sasl_mechanism': librdkafka has no such property; did you mean 'sasl.mechanism'? "
        "In an environment variable, write each dot of a property as __: "
        "STREAMTRAIN_KAFKA__CLIENT_CONFIG__SASL__MECHANISM" in misnamed.output()
    ), misnamed.output()[-3000:]
    assert worker.wait(timeout=180) == 0, worker.output()[-3000:]
    assert "500 events trained" in worker.output()
    assert PASSWORD not in worker.output() + misnamed.output()
