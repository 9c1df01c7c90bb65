"""The project's own broker: it starts on loopback, and never outlives its owner."""

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from streamtrain.dev.kafka import CLAIM_SECONDS, PORT_CLAIMS, BrokerError, KafkaBroker, free_port

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
            "print(b.pid, flush=True); time.sleep(600)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    jvm = int(owner.stdout.readline())
    assert alive(jvm)
    owner.send_signal(signal.SIGKILL)
    owner.wait(timeout=10)
    deadline = time.monotonic() + 15
    while alive(jvm) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive(jvm)


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
