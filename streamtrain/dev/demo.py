"""``make demo``: a real local Kafka, a synthetic click stream, a worker training on it, and a
scoring server following its deltas (``demo_serve``)."""

from __future__ import annotations

import logging
import os
import shlex
import signal
import subprocess
import sys

import yaml

from streamtrain.config import parse_config
from streamtrain.dev import CHECKOUT
from streamtrain.dev.demo_serve import DemoServer, scraped
from streamtrain.dev.kafka import KafkaBroker
from streamtrain.worker import run_worker

log = logging.getLogger(__name__)

TOPIC = "clicks"
PARTITIONS = 4
BACKLOG_EVENTS = 200_000
LIVE_EVENTS = 20_000_000  # bounds the demo's producer; at 20,000/s that is over 16 minutes


def run_demo(metrics_port: int = 9100, rate: float = 20_000) -> int:
    with KafkaBroker() as broker:
        broker.create_topic(TOPIC, PARTITIONS)
        broker.create_topic(f"{TOPIC}.dlq", PARTITIONS)  # deploy/worker.yaml's dead_letter.topic
        log.info("Kafka %s is up; topic %r has %d partitions", broker.bootstrap_servers, TOPIC, PARTITIONS)
        produce = [
            sys.executable,
            "-m",
            "streamtrain",
            "produce",
            "--bootstrap-servers",
            broker.bootstrap_servers,
            "--topic",
            TOPIC,
        ]
        # A backlog first, so the worker shows its full speed, then a live stream at ``rate``.
        script = (
            f"{_quote(produce)} --count {BACKLOG_EVENTS} --seed 1 && "
            f"exec {_quote(produce)} --count {LIVE_EVENTS} --rate {rate} --seed 2"
        )
        producer = subprocess.Popen(["bash", "-c", script], cwd=CHECKOUT, start_new_session=True)
        raw = yaml.safe_load((CHECKOUT / "deploy" / "worker.yaml").read_text())
        raw["kafka"]["bootstrap_servers"] = broker.bootstrap_servers
        raw["metrics"]["port"] = metrics_port
        # Delivery publishes from snapshots: the demo keeps them beside its broker's data.
        raw.setdefault("checkpoint", {}).setdefault("path", str(broker.workdir / "snapshots"))
        config = parse_config(raw)
        server = DemoServer(config, lambda: scraped(metrics_port, "streamtrain_global_step"))
        server.start()
        try:
            return run_worker(config)
        finally:
            server.stop()
            os.killpg(producer.pid, signal.SIGTERM)
            try:
                producer.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(producer.pid, signal.SIGKILL)


def _quote(argv: list[str]) -> str:
    return " ".join(shlex.quote(a) for a in argv)
