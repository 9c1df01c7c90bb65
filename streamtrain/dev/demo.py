"""``make demo``: a real local Kafka, a synthetic click stream, a worker training on it, and a
scoring server following its deltas (``demo_serve``).

The live rate comes from the machine the demo runs on: the worker first trains a backlog at full
speed, the demo measures that rate from the worker's own metrics, and streams live at a safe
fraction of it (``LOAD_FRACTION``), so a newcomer watches a worker that keeps up: the lag on its
progress line stays flat. ``--rate`` sets the live rate instead.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import numpy as np
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
LIVE_EVENTS = 20_000_000  # bounds the demo's producer
# The live stream's share of what the worker trained the backlog at: the live producer and the
# broker take their part of the same cores while it streams, and a worker at full load lags.
LOAD_FRACTION = 0.5
# Where the backlog's measured rate starts and ends (shares of the backlog): before, the worker warms
# up; after, it waits for the last partial batch.
CALIBRATION_WINDOW = (0.25, 0.9)
# ... or how long it lasts at most: on a 2-core machine shared with other jobs the worker trained
# 700 events/s, and the whole window would have kept a newcomer waiting for four minutes.
CALIBRATION_SECONDS = 30.0
# The window is cut into stretches of this many seconds, and the rate is a low quantile of theirs,
# not the window's mean: on a machine shared with other jobs the worker trained 15,900 events/s
# for five seconds and 600-1,900 after; the mean of a window holding that burst (3,779) set a live
# rate the worker could not keep up with.
CALIBRATION_STRETCH_SECONDS = 5.0
CALIBRATION_QUANTILE = 0.25
CALIBRATION_TIMEOUT_SECONDS = 600.0
FALLBACK_RATE = 2_000.0  # if the backlog's rate could not be measured
BACKLOG_TIMEOUT_SECONDS = 300.0


def run_demo(metrics_port: int = 9100, rate: float | None = None, load_fraction: float = LOAD_FRACTION) -> int:
    """``rate`` None: calibrate the live rate (needs ``metrics_port``, which the demo reads)."""
    with KafkaBroker() as broker:
        broker.create_topic(TOPIC, PARTITIONS)
        broker.create_topic(f"{TOPIC}.dlq", PARTITIONS)  # deploy/worker.yaml's dead_letter.topic
        log.info("Kafka %s is up; topic %r has %d partitions", broker.bootstrap_servers, TOPIC, PARTITIONS)
        stream = _Stream(broker.bootstrap_servers, metrics_port, rate, load_fraction)
        # The whole backlog is written before the worker starts, so that its rate on it is the
        # worker's, not the producer's.
        log.info("writing a backlog of %s events", f"{BACKLOG_EVENTS:,}")
        subprocess.run(
            stream.produce + ["--count", str(BACKLOG_EVENTS), "--seed", "1"],
            cwd=CHECKOUT,
            check=True,
            timeout=BACKLOG_TIMEOUT_SECONDS,
        )
        raw = yaml.safe_load((CHECKOUT / "deploy" / "worker.yaml").read_text())
        raw["kafka"]["bootstrap_servers"] = broker.bootstrap_servers
        raw["metrics"]["port"] = metrics_port
        # Delivery publishes from snapshots: the demo keeps them beside its broker's data.
        raw.setdefault("checkpoint", {})["path"] = str(broker.workdir / "snapshots")
        config = parse_config(raw)
        server = DemoServer(config, lambda: scraped(metrics_port, "streamtrain_global_step"))
        stream.start()
        server.start()
        try:
            return run_worker(config)
        finally:
            server.stop()
            stream.stop()


class _Stream:
    """The demo's live producer, started on a thread beside the worker once the worker has trained
    the backlog and its rate is known."""

    def __init__(self, bootstrap: str, metrics_port: int, rate: float | None, load_fraction: float):
        self.produce = [sys.executable, "-m", "streamtrain", "produce", "--bootstrap-servers", bootstrap]
        self.produce += ["--topic", TOPIC]
        self.metrics_port = metrics_port
        self.rate = rate
        self.load_fraction = load_fraction
        self.stopping = threading.Event()
        self.process: subprocess.Popen | None = None
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, name="demo-stream", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _run(self) -> None:
        try:
            rate = self.rate
            if rate is None:
                measured = calibrate(lambda: _trained(self.metrics_port), BACKLOG_EVENTS, self.stopping)
                if measured is None:
                    rate = FALLBACK_RATE
                    log.warning("could not measure the worker's rate on the backlog: streaming %s events/s", rate)
                else:
                    rate = round(self.load_fraction * measured, -2) or 100.0
                    log.info(
                        "calibrated: the worker trained the backlog at %s events/s on this machine; streaming "
                        "live at %s events/s (%.0f%% of it; --rate sets it)",
                        f"{measured:,.0f}",
                        f"{rate:,.0f}",
                        100 * self.load_fraction,
                    )
            with self.lock:
                if not self.stopping.is_set():
                    self.process = subprocess.Popen(
                        self.produce + ["--count", str(LIVE_EVENTS), "--rate", str(rate), "--seed", "2"],
                        cwd=CHECKOUT,
                        start_new_session=True,
                    )
        except Exception:  # the worker runs on; the demo says why its stream did not start
            log.exception("the demo's live producer failed to start")

    def stop(self) -> None:
        with self.lock:
            self.stopping.set()
            process = self.process
        if process is not None and process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
        self.thread.join(5)


def calibrate(
    trained: Callable[[], float | None],
    backlog: int,
    stopping: threading.Event,
    timeout: float = CALIBRATION_TIMEOUT_SECONDS,
    interval: float = 0.5,
    clock: Callable[[], float] = time.monotonic,
    window_seconds: float = CALIBRATION_SECONDS,
) -> float | None:
    """The rate (events/s) the worker sustains on the backlog: ``CALIBRATION_QUANTILE`` of its rates
    over stretches of ``CALIBRATION_STRETCH_SECONDS`` between the shares of the backlog in
    ``CALIBRATION_WINDOW``, or for ``window_seconds`` from the first, whichever ends sooner (a
    window shorter than a stretch is one stretch). ``trained()`` gives the events trained so far
    (None while the worker does not answer). None if it did not reach the window within
    ``timeout`` seconds."""
    low, high = (share * backlog for share in CALIBRATION_WINDOW)
    started = clock()
    mark: tuple[float, float] | None = None  # where the current stretch began
    rates: list[float] = []
    while clock() - started < timeout and not stopping.wait(interval):
        count = trained()
        if count is None:
            continue
        if mark is None:
            if count >= low:
                mark = window_start = (clock(), count)
            continue
        ended = count >= high or clock() - window_start[0] >= window_seconds
        seconds = clock() - mark[0]
        if seconds >= CALIBRATION_STRETCH_SECONDS or (ended and not rates and seconds > 0):
            rates.append((count - mark[1]) / seconds)
            mark = (clock(), count)
        if ended:
            return float(np.quantile(rates, CALIBRATION_QUANTILE)) if rates else None
    return None


def _trained(port: int) -> float | None:
    from streamtrain.bench.common import scrape, trained_in

    samples = scrape(port)
    return trained_in(samples) if samples else None
