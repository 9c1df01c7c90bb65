"""What the worker exports to Prometheus, and the progressive (test-then-train) AUC behind it.

Names follow Prometheus conventions: a ``streamtrain_`` prefix, ``_total`` on counters, base units.
One registry per worker, served on ``metrics.host:metrics.port``.
"""

from __future__ import annotations

import threading
from collections import deque

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, start_http_server


def roc_auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Exact ROC AUC (ties count half), or NaN when only one class is present."""
    scores = np.asarray(scores, dtype=np.float64)
    labels = np.asarray(labels).astype(bool)
    positives = int(labels.sum())
    negatives = labels.size - positives
    if positives == 0 or negatives == 0:
        return float("nan")
    order = np.argsort(scores, kind="mergesort")
    sorted_scores = scores[order]
    ranks = np.empty(scores.size, dtype=np.float64)
    # Average ranks within runs of equal scores.
    boundaries = np.flatnonzero(np.diff(sorted_scores)) + 1
    starts = np.concatenate([[0], boundaries])
    ends = np.concatenate([boundaries, [scores.size]])
    average = (starts + ends + 1) / 2.0
    ranks[order] = np.repeat(average, ends - starts)
    return float((ranks[labels].sum() - positives * (positives + 1) / 2.0) / (positives * negatives))


class ProgressiveAUC:
    """AUC of the model's scores on events it had not yet trained on, over the last ``window`` events."""

    def __init__(self, window: int):
        self.scores: deque[np.ndarray] = deque()
        self.labels: deque[np.ndarray] = deque()
        self.window = window
        self.held = 0
        self.lock = threading.Lock()

    def add(self, scores: np.ndarray, labels: np.ndarray) -> None:
        with self.lock:
            self.scores.append(scores)
            self.labels.append(labels)
            self.held += scores.size
            while self.held - self.scores[0].size >= self.window:
                self.held -= self.scores.popleft().size
                self.labels.popleft()

    def value(self) -> float:
        with self.lock:
            if not self.scores:
                return float("nan")
            scores, labels = np.concatenate(self.scores), np.concatenate(self.labels)
        return roc_auc(scores[-self.window:], labels[-self.window:])


class WorkerMetrics:
    def __init__(self, auc_window: int = 100_000):
        self.registry = registry = CollectorRegistry()
        tp = ["topic", "partition"]
        self.info = Info("streamtrain_worker", "The worker's rank, world size and versions.", registry=registry)
        self.events_consumed = Counter(
            "streamtrain_events_consumed", "Events read from Kafka.", tp, registry=registry)
        self.events_trained = Counter(
            "streamtrain_events_trained", "Events whose update has been applied to the model.", tp, registry=registry)
        self.events_dropped = Counter(
            "streamtrain_events_dropped", "Events read but not trained, by reason.", tp + ["reason"],
            registry=registry)
        self.batches = Counter("streamtrain_batches", "Training steps taken.", registry=registry)
        self.step_seconds = Histogram(
            "streamtrain_step_seconds", "Wall time of one training step on this rank, data wait included.",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5), registry=registry)
        self.global_batch_size = Gauge(
            "streamtrain_global_batch_size", "Events in the last step, summed over all ranks.", registry=registry)
        self.global_step = Gauge("streamtrain_global_step", "The trainer's step counter.", registry=registry)
        self.loss = Gauge("streamtrain_loss", "Mean training loss (binary cross-entropy) of the last batch.",
                          registry=registry)
        self.examples_per_second = Gauge(
            "streamtrain_examples_per_second", "Events trained per second over the last log interval.",
            registry=registry)
        self.queue_depth = Gauge("streamtrain_prefetch_queue_depth", "Decoded batches waiting for the trainer.",
                                 registry=registry)
        self.queue_capacity = Gauge("streamtrain_prefetch_queue_capacity", "Capacity of the prefetch queue.",
                                    registry=registry)
        self.progressive_auc_gauge = Gauge(
            "streamtrain_progressive_auc",
            "AUC of scores given before training on each event (test-then-train), over the last "
            "auc_window events.", ["task"], registry=registry)
        self.progressive_auc = ProgressiveAUC(auc_window)
        self.checkpoint_seconds = Histogram(
            "streamtrain_checkpoint_seconds", "From starting a snapshot to its commit.",
            buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300), registry=registry)
        self.checkpoint_bytes = Gauge("streamtrain_checkpoint_bytes", "Size of the last committed snapshot.",
                                      registry=registry)
        self.checkpoint_last_success = Gauge(
            "streamtrain_checkpoint_last_success_timestamp_seconds", "When the last snapshot was committed.",
            registry=registry)
        self.checkpoint_failures = Counter("streamtrain_checkpoint_failures", "Snapshots that failed to write.",
                                           registry=registry)
        self._server = None

    def serve(self, host: str, port: int) -> int:
        """Start the HTTP endpoint; returns the bound port (useful when ``port`` is 0)."""
        self._server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return self._server.server_address[1]

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
