"""The project's own broker: it starts on loopback, and never outlives its owner."""

import os
import signal
import subprocess
import sys
import time

import pytest

from streamtrain.dev.kafka import BrokerError, KafkaBroker

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
