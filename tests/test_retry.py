"""The retry helper: its waits, its deadline, what it does not retry, and how a stop ends it."""

from __future__ import annotations

import itertools
import threading
import time

import pytest

from streamtrain.retry import Backoff, retry


class FakeTime(threading.Event):
    """A clock that moves only when the retry waits on it; never set, unless ``stop_after`` waits."""

    def __init__(self, stop_after: int | None = None) -> None:
        super().__init__()
        self.now = 100.0
        self.waits: list[float] = []
        self.stop_after = stop_after

    def clock(self) -> float:
        return self.now

    def wait(self, timeout: float | None = None) -> bool:
        assert timeout is not None
        self.waits.append(timeout)
        self.now += timeout
        return self.stop_after is not None and len(self.waits) >= self.stop_after


class Failing:
    """Raises each error in turn, then returns "done"."""

    def __init__(self, *errors: Exception) -> None:
        self.errors = list(errors)
        self.calls = 0

    def __call__(self) -> str:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return "done"


def test_waits_double_from_the_first_up_to_the_maximum():
    assert list(itertools.islice(Backoff(initial=0.5, maximum=10.0).waits(), 7)) == [0.5, 1, 2, 4, 8, 10, 10]
    assert list(itertools.islice(Backoff(initial=0.5, maximum=0.5).waits(), 3)) == [0.5, 0.5, 0.5]
    assert list(itertools.islice(Backoff(initial=3.0, maximum=2.0).waits(), 3)) == [3.0, 2.0, 2.0]


def test_retries_with_the_backoff_and_reports_each_failure_before_its_wait():
    time_ = FakeTime()
    call = Failing(*[OSError(f"down {i}") for i in range(6)])
    reported: list[tuple[str, int, float]] = []
    result = retry(
        call,
        Backoff(initial=0.5, maximum=4.0, timeout=60),
        retry_on=OSError,
        clock=time_.clock,
        stopping=time_,
        on_retry=lambda error, attempt, wait: reported.append((str(error), attempt, wait)),
    )
    assert result == "done" and call.calls == 7
    assert time_.waits == [0.5, 1, 2, 4, 4, 4]
    assert reported == [(f"down {i}", i + 1, wait) for i, wait in enumerate(time_.waits)]


def test_gives_up_with_the_last_error_rather_than_wait_past_the_deadline():
    time_ = FakeTime()
    call = Failing(*[OSError(f"down {i}") for i in range(100)])
    with pytest.raises(OSError, match="down 4"):
        retry(
            call, Backoff(initial=0.5, maximum=10.0, timeout=8.0), retry_on=OSError, clock=time_.clock, stopping=time_
        )
    # 0.5 + 1 + 2 + 4 = 7.5 s of waits end in time; an 8 s wait after the fifth failure would not.
    assert time_.waits == [0.5, 1, 2, 4] and call.calls == 5


def test_an_error_it_is_not_told_to_retry_is_raised_at_once():
    time_ = FakeTime()
    with pytest.raises(KeyError):
        retry(
            Failing(KeyError("not an OSError")),
            Backoff(0.5, 10.0, timeout=60),
            retry_on=OSError,
            clock=time_.clock,
            stopping=time_,
        )
    refused = ConnectionRefusedError("refused")
    with pytest.raises(ConnectionRefusedError):
        retry(
            Failing(refused),
            Backoff(0.5, 10.0, timeout=60),
            retry_on=OSError,
            retriable=lambda error: not isinstance(error, ConnectionRefusedError),
            clock=time_.clock,
            stopping=time_,
        )
    assert time_.waits == []


def test_a_stop_during_a_wait_raises_the_last_error():
    time_ = FakeTime(stop_after=2)
    call = Failing(*[OSError(f"down {i}") for i in range(100)])
    with pytest.raises(OSError, match="down 1"):
        retry(call, Backoff(initial=1.0, maximum=60.0), retry_on=OSError, stopping=time_, clock=time_.clock)
    assert call.calls == 2


def test_a_stop_ends_a_long_wait_promptly():
    stopping = threading.Event()
    stopper = threading.Timer(0.2, stopping.set)
    started = time.monotonic()
    stopper.start()
    try:
        with pytest.raises(OSError):
            retry(
                Failing(*[OSError("down")] * 3),
                Backoff(initial=30.0, maximum=30.0),
                retry_on=OSError,
                stopping=stopping,
            )
    finally:
        stopper.cancel()
    assert time.monotonic() - started < 5


def test_a_retry_that_could_never_end_is_refused():
    with pytest.raises(ValueError, match="timeout or a stop event"):
        retry(Failing(), Backoff(0.5, 10.0), retry_on=OSError)
