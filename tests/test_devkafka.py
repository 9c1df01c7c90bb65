"""The project's own brokers, one or a cluster of three: they start on loopback, and never outlive their owner."""

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition

import streamtrain.dev.kafka as kafka_module
from streamtrain.dev.kafka import (
    CLAIM_SECONDS,
    LOWEST_FREE_PORT,
    PORT_CLAIMS,
    BrokerError,
    KafkaBroker,
    KafkaCluster,
    free_port,
)

pytestmark = pytest.mark.integration


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead for our purposes
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split(")")[1].split()[0] != "Z"


def test_close_leaves_no_jvm_behind():
    broker = KafkaBroker()
    broker.start()
    pid = broker.pid
    assert broker.bootstrap_servers.startswith("127.0.0.1:")
    broker.close()
    assert not alive(pid)
    assert not broker.workdir.exists()


def test_the_jvm_dies_with_a_killed_parent():
    owner = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from streamtrain.dev.kafka import KafkaBroker; import time; b = KafkaBroker(); b.start(); "
            "print(b.pid, b.workdir, flush=True); time.sleep(600)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    pid, workdir = owner.stdout.readline().split()
    jvm = int(pid)
    assert alive(jvm)
    owner.send_signal(signal.SIGKILL)
    owner.wait(timeout=10)
    deadline = time.monotonic() + 15
    while alive(jvm) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive(jvm)
    shutil.rmtree(workdir)  # its owner, killed, could not


def test_missing_jars_say_how_to_get_them(tmp_path):
    with pytest.raises(BrokerError, match="make setup") as missing:
        KafkaBroker(libs=tmp_path).start()
    assert "STREAMTRAIN_KAFKA_LIBS" in str(missing.value)  # the way for an installed package


def test_ports_handed_out_are_free_and_not_handed_to_another_process_within_the_hour():
    """The suite's pytest-xdist workers each ask for ports; a port given to one must not reach the
    other before the worker it was meant for has bound it."""
    port = free_port(2)
    for taken in (port, port + 1):
        with socket.socket() as s:
            s.bind(("127.0.0.1", taken))  # free
    ask = "from streamtrain.dev.kafka import _claim; print(_claim(range({}, {})))"
    other = [sys.executable, "-c", ask.format(port + 1, port + 2)]
    assert subprocess.run(other, capture_output=True, text=True, check=True).stdout.split() == ["False"]
    lapsed = time.time() - CLAIM_SECONDS - 1
    for taken in (port, port + 1):
        os.utime(PORT_CLAIMS / str(taken), (lapsed, lapsed))
    assert subprocess.run(other, capture_output=True, text=True, check=True).stdout.split() == ["True"]


def test_ports_handed_out_lie_below_the_kernels_ephemeral_range(monkeypatch):
    """A port from the ephemeral range, free when handed out, may meanwhile become a connection's
    source port or a listener's on port 0 (gloo's, torchrun's store) before its worker binds it."""
    ephemeral_from = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    below = kafka_module._below_ephemeral_ports()
    if ephemeral_from - LOWEST_FREE_PORT >= 1000:
        assert below == range(LOWEST_FREE_PORT, ephemeral_from)
    else:  # no room below this host's range: the kernel's pick, as before
        assert below is None
    # whatever this host's range, ports come from the room below it
    monkeypatch.setattr(kafka_module, "_below_ephemeral_ports", lambda: range(20_000, 21_000))
    for _ in range(20):
        port = free_port(2)
        assert port >= 20_000 and port + 1 < 21_000


def write(bootstrap_servers: str, topic: str, count: int, tag: bytes) -> None:
    """``count`` messages, each acknowledged by the in-sync replicas (acks=all), or the test fails."""
    producer = Producer({"bootstrap.servers": bootstrap_servers, "acks": "all", "message.timeout.ms": 60000})
    failed = []
    for i in range(count):
        producer.produce(topic, b"%s-%d" % (tag, i), on_delivery=lambda error, _m: error and failed.append(error))
    assert producer.flush(90) == 0 and not failed, failed[:3]


def read(bootstrap_servers: str, topic: str, partitions: int) -> list[bytes]:
    consumer = Consumer({"bootstrap.servers": bootstrap_servers, "group.id": "reader", "enable.auto.commit": False})
    try:
        ends = [consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in range(partitions)]
        consumer.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
        values: list[bytes] = []
        deadline = time.monotonic() + 30
        while len(values) < sum(ends) and time.monotonic() < deadline:
            message = consumer.poll(0.5)
            if message is not None and message.error() is None:
                values.append(message.value())
        return values
    finally:
        consumer.close()


def test_three_nodes_keep_every_acknowledged_write_through_a_kill_and_a_stop_and_leave_no_jvm():
    cluster = KafkaCluster()
    cluster.start()
    try:
        pids = [node.pid for node in cluster.nodes]
        assert all(server.startswith("127.0.0.1:") for server in cluster.bootstrap_servers.split(","))
        cluster.create_topic("events", 3)
        assert cluster.under_replicated() == []  # three replicas of every partition, all in sync
        write(cluster.bootstrap_servers, "events", 100, b"before")

        victim = cluster.leader("events", 0)
        cluster.kill(victim)
        with pytest.raises(BrokerError, match=f"node\\(s\\) \\[{victim}\\] are down"):
            cluster.wait_until_fully_replicated(5)
        # Two replicas stay in sync (min.insync.replicas 2): writes go on once a new leader is elected.
        write(cluster.bootstrap_servers, "events", 100, b"killed")
        assert cluster.leader("events", 0) not in (victim, -1)
        assert any("events/0: " in problem for problem in cluster.under_replicated())
        cluster.restart(victim)
        cluster.wait_until_fully_replicated(120)

        other = next(node.node_id for node in cluster.nodes if node.node_id != victim)
        cluster.stop(other)  # a clean stop hands its leaderships over first
        assert other not in cluster.leaders("events").values()
        write(cluster.bootstrap_servers, "events", 100, b"stopped")
        cluster.restart(other)
        cluster.wait_until_fully_replicated(120)
        values = read(cluster.bootstrap_servers, "events", 3)
        assert sorted(values) == sorted(
            b"%s-%d" % (tag, i) for tag in (b"before", b"killed", b"stopped") for i in range(100)
        )
    finally:
        cluster.close()
    assert not any(alive(pid) for pid in pids)
    assert not any(node.workdir.exists() for node in cluster.nodes)
