"""The demo's scoring server: ``streamtrain serve`` beside the worker, following its bases and delta
topic, and a line every few seconds that says how fresh what it serves is."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from streamtrain.config import WorkerConfig
from streamtrain.delivery.serve import KafkaDeltas, ScoringServer

log = logging.getLogger(__name__)

SERVE_PORT = 8500
REPORT_INTERVAL_SECONDS = 10.0
# The first base is exported from the worker's start snapshot in the background: it takes a while.
FIRST_BASE_TIMEOUT_SECONDS = 600.0


class DemoServer:
    """Starts the server on a thread once the worker's first base is there; ``stop()`` ends both."""

    def __init__(self, config: WorkerConfig, trained_step: Callable[[], float | None], port: int = SERVE_PORT):
        """``trained_step``: the worker's global step, None while its metrics do not answer."""
        self.config = config
        self.trained_step = trained_step
        self.port = port
        self.stopping = threading.Event()
        self.server: ScoringServer | None = None
        self.thread = threading.Thread(target=self._run, name="demo-serve", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _run(self) -> None:
        delivery = self.config.delivery
        deltas = KafkaDeltas(
            self.config.kafka.bootstrap_servers,
            delivery.resolved_topic(self.config.kafka.topic),
            {"broker.address.family": "v4"},
        )
        server = ScoringServer(
            delivery.resolved_path(self.config.checkpoint.path or ""),
            deltas,
            port=self.port,
            start_timeout_seconds=FIRST_BASE_TIMEOUT_SECONDS,
        )
        log.info(
            "a scoring server starts on port %d once the worker's first base is exported from its start "
            "snapshot (a minute or more on a small machine)",
            self.port,
        )
        try:
            server.start()
        except Exception:  # the worker trains on; the demo says why it serves nothing
            log.exception("the demo's scoring server did not start")
            deltas.close()
            return
        self.server = server
        log.info("serving on http://127.0.0.1:%d (POST /score, /metrics)", server.port)
        while not self.stopping.wait(REPORT_INTERVAL_SECONDS):
            log.info(self.freshness_line(server))

    def freshness_line(self, server: ScoringServer) -> str:
        trained = self.trained_step()
        behind = "" if trained is None else f", {max(trained - server.follower.step, 0):.0f} behind training"
        return (
            f"serving: step {server.follower.step}{behind}, delta {server.follower.next_sequence - 1}, "
            f"freshness {freshness(server):.1f}s (streamtrain_serve_freshness_seconds)"
        )

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(timeout=15)
        if self.server is not None:
            self.server.stop()


def freshness(server: ScoringServer) -> float:
    """``streamtrain_serve_freshness_seconds`` as /metrics would give it now."""
    (metric,) = server.metrics.freshness.collect()
    return float(metric.samples[0].value)


def scraped(port: int, metric: str) -> float | None:
    """A worker's ``metric`` from its metrics port, summed over labels; None while it does not answer."""
    from streamtrain.bench.common import scrape

    samples = scrape(port)
    if not samples:
        return None
    return sum(v for k, v in samples.items() if k == metric or k.startswith(metric + "{"))
