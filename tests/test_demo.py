"""The demo's calibration: the live rate comes from the rate the worker trained the backlog at."""

from __future__ import annotations

import threading

from streamtrain.dev.demo import CALIBRATION_SECONDS, CALIBRATION_WINDOW, calibrate


class _Worker:
    """Trains ``rate`` events/s after a slow start, as the worker's metrics would say, on a clock
    that advances with each wait."""

    def __init__(self, rate: float, slow_until: float):
        self.rate, self.slow_until, self.now = rate, slow_until, 0.0

    def clock(self) -> float:
        return self.now

    def trained(self) -> float | None:
        if self.now < 1.0:
            return None  # not serving metrics yet
        if self.now < self.slow_until:
            return 100.0 * self.now
        return 100.0 * self.slow_until + self.rate * (self.now - self.slow_until)


class _Ticks(threading.Event):
    def __init__(self, worker: _Worker):
        super().__init__()
        self.worker = worker

    def wait(self, timeout: float | None = None) -> bool:
        self.worker.now += timeout or 0.0
        return False


def test_calibration_measures_the_rate_inside_the_backlog_after_the_warm_up():
    worker = _Worker(rate=10_000.0, slow_until=5.0)
    backlog = 200_000
    assert CALIBRATION_WINDOW[0] * backlog > 100.0 * 5.0  # the window starts after the slow start
    rate = calibrate(worker.trained, backlog, _Ticks(worker), interval=0.5, clock=worker.clock)
    assert rate is not None and abs(rate - 10_000.0) / 10_000.0 < 0.05


def test_calibration_gives_up_within_its_timeout_when_the_backlog_is_not_trained():
    worker = _Worker(rate=0.0, slow_until=1e9)
    assert calibrate(worker.trained, 200_000, _Ticks(worker), timeout=30, interval=0.5, clock=worker.clock) is None
    assert worker.now <= 31


def test_calibration_on_a_slow_machine_ends_after_its_seconds_not_at_the_end_of_the_backlog():
    worker = _Worker(rate=700.0, slow_until=5.0)
    backlog = 200_000
    rate = calibrate(worker.trained, backlog, _Ticks(worker), interval=0.5, clock=worker.clock)
    assert rate is not None and abs(rate - 700.0) / 700.0 < 0.05
    reached_window = 5.0 + (CALIBRATION_WINDOW[0] * backlog - 500.0) / 700.0
    assert worker.now <= reached_window + CALIBRATION_SECONDS + 1.0


def test_calibration_takes_what_the_worker_sustains_not_a_burst_inside_the_window():
    worker = _Worker(rate=1_000.0, slow_until=5.0)
    backlog = 200_000
    at_window = 5.0 + (CALIBRATION_WINDOW[0] * backlog - 500.0) / 1_000.0
    trained = worker.trained

    def with_a_burst() -> float | None:
        # Five seconds at 16x the rate as the window opens, as when the machine's other jobs paused.
        count = trained()
        if count is None or worker.now < at_window:
            return count
        return count + 15_000.0 * min(worker.now - at_window, 5.0)

    rate = calibrate(with_a_burst, backlog, _Ticks(worker), interval=0.5, clock=worker.clock)
    assert rate is not None and abs(rate - 1_000.0) / 1_000.0 < 0.15
