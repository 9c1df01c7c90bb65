"""The shutdown watchdog: a stop, the final snapshot included, is bounded by
distributed.shutdown_grace_seconds."""

from __future__ import annotations

import threading
import time

from streamtrain.worker import _Shutdown


def test_a_shutdown_within_the_grace_is_left_alone():
    gave_up = threading.Event()
    shutdown = _Shutdown(0.5, give_up=lambda grace: gave_up.set())
    shutdown.begin()
    time.sleep(0.2)  # e.g. the final snapshot being written
    shutdown.end()
    assert not gave_up.wait(0.6)


def test_a_shutdown_past_the_grace_gives_up_and_begin_counts_from_the_first_call():
    gave_up = threading.Event()
    shutdown = _Shutdown(0.3, give_up=lambda grace: gave_up.set())
    assert not gave_up.wait(0.5)  # nothing began: no bound yet
    shutdown.begin()
    time.sleep(0.1)
    shutdown.begin()  # a later stop signal does not extend it
    assert 0.1 < shutdown.remaining() <= 0.2
    assert gave_up.wait(2.0)
