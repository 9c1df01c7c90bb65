"""What the worker exports to Prometheus, and the progressive (test-then-train) AUC behind it.

Names follow Prometheus conventions: a ``streamtrain_`` prefix, ``_total`` on counters, base units.
One registry per worker, served on ``metrics.host:metrics.port``.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest
from prometheus_client.core import HistogramMetricFamily

from streamtrain.config import ConfigError


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


def _sigmoid(x: np.ndarray) -> np.ndarray:
    # exp of -|x| only: an untrained or diverging model's logits of +-1000 must not overflow.
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def _log_loss(p: np.ndarray, y: np.ndarray) -> np.ndarray:
    p = np.clip(p, 1e-7, 1 - 1e-7)
    return -(y * np.log(p) + (1 - y) * np.log(1 - p))


def _quality(bce_sum: float, label_sum: float, prob_sum: float, n: float, auc: float) -> dict[str, float]:
    """AUC; NE (cross-entropy over the entropy of the base rate, < 1 beats predicting the rate);
    calibration (predicted over actual clicks, 1 is calibrated)."""
    if n == 0 or label_sum == 0:
        return {"auc": auc, "ne": float("nan"), "calibration": float("nan")}
    rate = label_sum / n
    base = float(_log_loss(np.array([rate]), np.array([rate]))[0]) if 0 < rate < 1 else float("nan")
    return {"auc": auc, "ne": (bce_sum / n) / base if base else float("nan"), "calibration": prob_sum / label_sum}


class ProgressiveQuality:
    """Test-then-train quality of the click model: scores given before training on each event.

    Windowed values are exact over the last ``window`` events. Lifetime NE and calibration are
    exact running sums; lifetime AUC is computed from 10,000 probability bins.
    """

    BINS = 10_000

    def __init__(self, window: int):
        self.scores: deque[np.ndarray] = deque()
        self.labels: deque[np.ndarray] = deque()
        self.window = window
        self.held = 0
        self.lock = threading.Lock()
        self.positives = np.zeros(self.BINS)
        self.negatives = np.zeros(self.BINS)
        self.sums = np.zeros(4)  # bce, labels, probabilities, events

    def add(self, logits: np.ndarray, labels: np.ndarray) -> None:
        """Scores (as logits) given before training on events with these labels; a NaN label (masked:
        not known for this task) leaves its event out."""
        known = ~np.isnan(labels)
        if not known.all():
            logits, labels = logits[known], labels[known]
        probabilities = _sigmoid(logits.astype(np.float64))
        labels = labels.astype(np.float64)
        bins = np.minimum((probabilities * self.BINS).astype(np.int64), self.BINS - 1)
        with self.lock:
            self.scores.append(probabilities)
            self.labels.append(labels)
            self.held += probabilities.size
            while self.held - self.scores[0].size >= self.window:
                self.held -= self.scores.popleft().size
                self.labels.popleft()
            self.positives += np.bincount(bins, weights=labels, minlength=self.BINS)
            self.negatives += np.bincount(bins, weights=1 - labels, minlength=self.BINS)
            self.sums += (_log_loss(probabilities, labels).sum(), labels.sum(), probabilities.sum(), labels.size)

    def compute(self) -> dict[str, dict[str, float]]:
        with self.lock:
            if not self.scores:
                nan = float("nan")
                return {w: {"auc": nan, "ne": nan, "calibration": nan} for w in ("window", "lifetime")}
            p = np.concatenate(self.scores)[-self.window :]
            y = np.concatenate(self.labels)[-self.window :]
            positives, negatives = self.positives.copy(), self.negatives.copy()
            bce_sum, label_sum, prob_sum, events = self.sums.tolist()
        # binned AUC: P(score_pos > score_neg) + half the ties within a bin
        below = np.cumsum(negatives) - negatives
        pairs = positives.sum() * negatives.sum()
        lifetime_auc = (
            float(((positives * below).sum() + 0.5 * (positives * negatives).sum()) / pairs) if pairs else float("nan")
        )
        return {
            "window": _quality(
                float(_log_loss(p, y).sum()), float(y.sum()), float(p.sum()), float(y.size), roc_auc(p, y)
            ),
            "lifetime": _quality(bce_sum, label_sum, prob_sum, events, lifetime_auc),
        }


class TaskQualities:
    """A ``ProgressiveQuality`` per task, fed from the model's logits and the batch's labels: [B]
    with one task, [B, tasks] with several, column t for task t.

    ``add`` is called on the training thread every step, and only keeps the arrays: they are folded
    into the figures ``FOLD_EVENTS`` at a time, or when the figures are read. A fold costs about
    100 µs per task whatever its size (its 10,000 lifetime bins), which at 1,024 events a step was
    half the per-step metrics' cost."""

    FOLD_EVENTS = 16_384

    def __init__(self, tasks: Sequence[str], window: int):
        self.by_task = {name: ProgressiveQuality(window) for name in tasks}
        self._pending: list[tuple[np.ndarray, np.ndarray]] = []
        self._pending_events = 0
        self._lock = threading.Lock()

    def add(self, logits: np.ndarray, labels: np.ndarray) -> None:
        """Scores (as logits) given before training on events with these labels; the arrays must not
        change afterwards."""
        with self._lock:
            self._pending.append((logits, labels))
            self._pending_events += len(labels)
            if self._pending_events < self.FOLD_EVENTS:
                return
        self._fold()

    def compute(self) -> dict[str, dict[str, dict[str, float]]]:
        """task -> window -> figure, as ``ProgressiveQuality.compute`` gives them."""
        self._fold()
        return {name: quality.compute() for name, quality in self.by_task.items()}

    def _fold(self) -> None:
        with self._lock:
            pending, self._pending, self._pending_events = self._pending, [], 0
        if not pending:
            return
        logits = np.concatenate([scores for scores, _labels in pending])
        labels = np.concatenate([known for _scores, known in pending])
        for t, quality in enumerate(self.by_task.values()):
            quality.add(logits if logits.ndim == 1 else logits[:, t], labels if labels.ndim == 1 else labels[:, t])


class BulkHistogram:
    """A Prometheus histogram fed a whole array at a time with numpy: one observe() call per
    event would cost more than the training step for large batches. With ``labelnames``, each
    ``observe_many`` names its series' label values."""

    def __init__(
        self,
        name: str,
        documentation: str,
        buckets: tuple[float, ...],
        registry: CollectorRegistry,
        labelnames: Sequence[str] = (),
    ):
        self.name, self.documentation = name, documentation
        self.labelnames = list(labelnames)
        self.bounds = np.array(buckets, dtype=np.float64)
        # label values -> (bucket counts, sum); the unlabelled histogram has its one series from the start
        self.series: dict[tuple[str, ...], tuple[np.ndarray, list[float]]] = {}
        if not self.labelnames:
            self._series(())
        self.lock = threading.Lock()
        registry.register(self)

    @property
    def sum(self) -> float:
        """The unlabelled histogram's sum of observed values."""
        return self.series[()][1][0]

    def _series(self, labels: tuple[str, ...]) -> tuple[np.ndarray, list[float]]:
        if labels not in self.series:
            self.series[labels] = (np.zeros(len(self.bounds) + 1, dtype=np.int64), [0.0])
        return self.series[labels]

    def observe_many(self, values: np.ndarray, labels: tuple[str, ...] = ()) -> None:
        if values.size == 0:
            return
        index = np.searchsorted(self.bounds, values, side="left")
        with self.lock:
            counts, total = self._series(labels)
            counts += np.bincount(index, minlength=counts.size)
            total[0] += float(values.sum())

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        with self.lock:
            series = [(labels, np.cumsum(counts), total[0]) for labels, (counts, total) in self.series.items()]
        for labels, cumulative, total in series:
            buckets = [(repr(float(b)), int(c)) for b, c in zip(self.bounds, cumulative[:-1], strict=True)]
            buckets.append(("+Inf", int(cumulative[-1])))
            family.add_metric(list(labels), buckets, total)
        yield family


class Health:
    """What /healthz and /readyz answer: the training loop's heartbeat, and readiness."""

    def __init__(self, stall_seconds: float):
        self.stall_seconds = stall_seconds
        self.last_beat = time.monotonic()
        self.ready = False
        self.not_ready_reason = "starting: restoring state"
        self.readiness: Callable[[], bool] = lambda: True  # after start-up: is the broker reachable?

    def beat(self) -> None:
        self.last_beat = time.monotonic()

    def healthz(self) -> tuple[int, str]:
        quiet = time.monotonic() - self.last_beat
        if quiet > self.stall_seconds:
            return 503, f"training loop stalled: no heartbeat for {quiet:.1f}s (threshold {self.stall_seconds:.0f}s)\n"
        return 200, "ok\n"

    def readyz(self) -> tuple[int, str]:
        if self.ready and self.readiness():
            return 200, "ready\n"
        return 503, f"not ready: {self.not_ready_reason}\n"


# from a few ids on one rank (100 us) to a step whose exchange waits on a slow rank (1 s)
_MAP_SECONDS = (0.0001, 0.0003, 0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0)


class IdSpaceMetrics:
    """Managed tables' id space (streamtrain/idspace.py), labelled table=<name>. Each rank holds and
    maps the buckets it owns, so its rows, occupancy, admissions, evictions and memory are its
    share (sum them over the ranks); the unknown lookups are this rank's own events' (sum them too).
    The step time is this rank's, for all its managed tables."""

    def __init__(self, registry: CollectorRegistry):
        self.rows_in_use = Gauge(
            "streamtrain_idspace_rows_in_use",
            "Rows of a managed table holding a live id.",
            ["table"],
            registry=registry,
        )
        self.rows = Gauge(
            "streamtrain_idspace_rows",
            "Rows of a managed table that live ids can hold, in this rank's buckets.",
            ["table"],
            registry=registry,
        )
        self.admissions = Counter(
            "streamtrain_idspace_admissions", "New ids given a row of a managed table.", ["table"], registry=registry
        )
        self.evictions = Counter(
            "streamtrain_idspace_evictions",
            "Ids that lost their row: reason capacity (the table was full) or ttl (unseen past the horizon).",
            ["table", "reason"],
            registry=registry,
        )
        self.unknown_lookups = Counter(
            "streamtrain_idspace_unknown_lookups",
            "This rank's lookups of ids not admitted (yet), which read the table's unknown row.",
            ["table"],
            registry=registry,
        )
        self.memory_bytes = Gauge(
            "streamtrain_idspace_memory_bytes",
            "Host memory of a managed table's mapping: its arrays and index, and the undo of the steps in flight.",
            ["table"],
            registry=registry,
        )
        self.step_seconds = Histogram(
            "streamtrain_idspace_step_seconds",
            "Time to map one step's batch on this rank, every managed table: the ids sent to the ranks owning "
            "their buckets and mapped there, and the step before's rows back.",
            buckets=_MAP_SECONDS,
            registry=registry,
        )
        self.exchange_seconds = Histogram(
            "streamtrain_idspace_exchange_seconds",
            "Time one exchange of a step's ids (and the step before's rows) spent in its all-to-all on this rank (at "
            "2 or more ranks): the collective's latency and the wait for the slowest rank. Part of "
            "streamtrain_idspace_step_seconds.",
            buckets=_MAP_SECONDS,
            registry=registry,
        )


class LateLabelMetrics:
    """Late labels (streamtrain/delayed.py), labelled task=<name>, this rank's events'. The matured
    quality itself is in the progressive gauges, as maturity="matured"."""

    def __init__(self, registry: CollectorRegistry):
        self.late_labels = Counter(
            "streamtrain_late_labels",
            "Late labels' positives trained (outcome trained), and those past the task's attribution window, "
            "which are not positives (outcome past_window).",
            ["task", "outcome"],
            registry=registry,
        )
        self.delay_seconds = BulkHistogram(
            "streamtrain_late_label_delay_seconds",
            "From an impression to its late label's arrival (event times), for the late labels trained.",
            (1, 5, 15, 60, 300, 900, 1800, 3600, 7200, 21600, 86400, 259200, 604800),
            registry,
            labelnames=["task"],
        )
        self.late_share = Gauge(
            "streamtrain_late_positive_share",
            "The share of positives whose label arrives after their impression was emitted, as training "
            "estimates it (es_dfm's s; 1 with a joiner that emits every impression at once).",
            ["task"],
            registry=registry,
        )
        self.matured_waiting = Gauge(
            "streamtrain_matured_waiting",
            "Impressions held until their attribution window closes, for the matured quality.",
            ["task"],
            registry=registry,
        )
        self.matured_dropped = Counter(
            "streamtrain_matured_dropped",
            "Impressions and late positives dropped unmatured past delayed_labels.matured_max_pending.",
            ["task"],
            registry=registry,
        )


class WorkerMetrics:
    def __init__(self, auc_window: int = 100_000, tasks: Sequence[str] = ("clk",)):
        self.registry = registry = CollectorRegistry()
        tp = ["topic", "partition"]
        self.info = Info("streamtrain_worker", "The worker's rank, world size and versions.", registry=registry)
        self.events_consumed = Counter("streamtrain_events_consumed", "Events read from Kafka.", tp, registry=registry)
        self.events_trained = Counter(
            "streamtrain_events_trained", "Events whose update has been applied to the model.", tp, registry=registry
        )
        self.events_dropped = Counter(
            "streamtrain_events_dropped", "Events read but not trained, by reason.", tp + ["reason"], registry=registry
        )
        self.batches = Counter("streamtrain_batches", "Training steps taken.", registry=registry)
        self.step_seconds = Histogram(
            "streamtrain_step_seconds",
            "Wall time of one training step on this rank, data wait included.",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
            registry=registry,
        )
        self.global_batch_size = Gauge(
            "streamtrain_global_batch_size", "Events in the last step, summed over all ranks.", registry=registry
        )
        self.global_step = Gauge("streamtrain_global_step", "The trainer's step counter.", registry=registry)
        self.loss = Gauge(
            "streamtrain_loss", "Mean training loss (binary cross-entropy) of the last batch.", registry=registry
        )
        self.examples_per_second = Gauge(
            "streamtrain_examples_per_second",
            "Events trained per second over the last log interval.",
            registry=registry,
        )
        self.queue_depth = Gauge(
            "streamtrain_prefetch_queue_depth", "Decoded batches waiting for the trainer.", registry=registry
        )
        self.queue_capacity = Gauge(
            "streamtrain_prefetch_queue_capacity", "Capacity of the prefetch queue.", registry=registry
        )
        # maturity: provisional (the labels each event trained with), or matured (with delayed_labels: each
        # impression's final label, once its attribution window closed)
        quality_labels = ["task", "window", "maturity"]
        self.quality_gauges = {
            "auc": Gauge(
                "streamtrain_progressive_auc",
                "AUC of scores given before training on each event (test-then-train); window is "
                "'window' (the last metrics.auc_window events) or 'lifetime'; maturity is 'provisional' "
                "(the labels trained) or 'matured' (final labels, once each impression's window closed).",
                quality_labels,
                registry=registry,
            ),
            "ne": Gauge(
                "streamtrain_progressive_ne",
                "Normalized entropy of test-then-train scores: cross-entropy over the entropy of the "
                "task's positive rate; below 1 beats predicting the rate.",
                quality_labels,
                registry=registry,
            ),
            "calibration": Gauge(
                "streamtrain_progressive_calibration",
                "Predicted positives over actual positives of the task (1 is calibrated).",
                quality_labels,
                registry=registry,
            ),
        }
        self.task_quality = TaskQualities(tasks, auc_window)
        self.consumer_lag = Gauge(
            "streamtrain_consumer_lag_events",
            "High watermark minus the read position, per owned partition.",
            tp,
            registry=registry,
        )
        self.consumed_bytes = Counter(
            "streamtrain_consumed_bytes", "Payload bytes read from Kafka.", tp, registry=registry
        )
        self.topic_partitions = Gauge(
            "streamtrain_topic_partitions",
            "Partitions of the topic, as this rank last saw its metadata.",
            ["topic"],
            registry=registry,
        )
        self.partitions_picked_up = Counter(
            "streamtrain_partitions_picked_up_total",
            "Partitions added to the topic while the worker ran that this rank began reading.",
            ["topic"],
            registry=registry,
        )
        self.kafka_errors = Counter(
            "streamtrain_kafka_errors", "Errors reported by the Kafka client, by code.", ["code"], registry=registry
        )
        self.decode_seconds = Histogram(
            "streamtrain_decode_seconds",
            "Time to decode one batch of payloads into a KJT batch.",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0),
            registry=registry,
        )
        # prometheus_client exports a Counter named with or without "_total" as <name>_total.
        self.decode_errors = Counter(
            "streamtrain_decode_errors_total", "Payloads that could not become examples.", ["reason"], registry=registry
        )
        self.dead_letter_events = Counter(
            "streamtrain_dead_letter_events_total",
            "Events written to the dead-letter topic (acknowledged by all in-sync replicas), by reason.",
            ["reason"],
            registry=registry,
        )
        self.dead_letter_failures = Counter(
            "streamtrain_dead_letter_produce_failures_total",
            "Dead letters whose write attempt failed and is being retried, by Kafka error code.",
            ["code"],
            registry=registry,
        )
        self.dead_letter_blocked = Gauge(
            "streamtrain_dead_letter_blocked",
            "1 while consumption is blocked because the dead-letter topic cannot be written.",
            registry=registry,
        )
        self.consumption_paused = Gauge(
            "streamtrain_consumption_paused",
            "1 while consumption is paused because too many recent events could not be decoded.",
            registry=registry,
        )
        self.consumption_pauses = Counter(
            "streamtrain_consumption_pauses_total",
            "Times consumption was paused for dead_letter.pause_seconds by the error-rate limit.",
            registry=registry,
        )
        self.batch_events = Histogram(
            "streamtrain_batch_events",
            "Events in each batch this rank trained (0 for a lockstep filler).",
            buckets=(0, 1, 16, 64, 256, 512, 1024, 2048, 4096, 8192, 16384),
            registry=registry,
        )
        self.data_wait_seconds = Histogram(
            "streamtrain_data_wait_seconds",
            "Time a step waited for data and for the ranks' vote.",
            buckets=(0.0001, 0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0),
            registry=registry,
        )
        self.compute_seconds = Histogram(
            "streamtrain_compute_seconds",
            "Time a step spent in forward, backward and optimizer.",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
            registry=registry,
        )
        self.freshness = BulkHistogram(
            "streamtrain_freshness_seconds",
            "Time from an event's event_time to the update that trained it.",
            (0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 300, 900, 3600, 21600, 86400),
            registry,
        )
        self.checkpoint_seconds = Histogram(
            "streamtrain_checkpoint_seconds",
            "From starting a snapshot to its commit.",
            buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
            registry=registry,
        )
        self.checkpoint_bytes = Gauge(
            "streamtrain_checkpoint_bytes", "Size of the last committed snapshot.", registry=registry
        )
        self.checkpoint_last_success = Gauge(
            "streamtrain_checkpoint_last_success_timestamp_seconds",
            "When the last snapshot was committed (or restored); the worker's start before the first.",
            registry=registry,
        )
        # Until a snapshot is restored or committed, its age counts from the start, so a fresh
        # worker is not "three intervals late" at once.
        self.checkpoint_last_success.set(time.time())
        # What StreamtrainCheckpointStale measures the age against; 0 (ignored) without checkpoint.path.
        self.checkpoint_interval = Gauge(
            "streamtrain_checkpoint_interval_seconds",
            "checkpoint.interval_seconds: how often a snapshot is due; 0 without checkpoint.path.",
            registry=registry,
        )
        self.checkpoint_failures = Counter(
            "streamtrain_checkpoint_failures", "Snapshots that failed to write.", registry=registry
        )
        self.checkpoint_retention_failures = Counter(
            "streamtrain_checkpoint_retention_failures",
            "Old snapshots that retention could not remove (the commit before it stands).",
            registry=registry,
        )
        self.checkpoint_size_failures = Counter(
            "streamtrain_checkpoint_size_failures",
            "Committed snapshots whose size could not be read (the commit stands; the bytes gauge keeps the last).",
            registry=registry,
        )
        self.event_times_clamped = Counter(
            "streamtrain_event_times_clamped",
            "Events whose event time lay beyond wall time + features.max_event_time_skew_seconds, "
            "taken as that bound for ttl eviction and freshness.",
            registry=registry,
        )
        # Model delivery (streamtrain/delivery/publisher.py): rank 0 publishes; every rank cuts.
        self.deltas_published = Counter(
            "streamtrain_deltas_published", "Deltas delivered whole to the delta topic or directory.", registry=registry
        )
        self.delta_bytes = Counter(
            "streamtrain_delta_bytes", "Bytes of the delta chunks delivered, headers included.", registry=registry
        )
        self.delta_failures = Counter(
            "streamtrain_delta_failures",
            "Delta delivery attempts that failed (each is retried), and deltas given up at a stop.",
            registry=registry,
        )
        self.delta_cut_seconds = Histogram(
            "streamtrain_delta_cut_seconds",
            "Training time a delta's cut takes: the ranks' touched ids gathered and this rank's rows copied.",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
            registry=registry,
        )
        self.delta_publish_seconds = Histogram(
            "streamtrain_delta_publish_seconds",
            "From a delta's cut to its delivery, in the background: gathered, encoded, delivered.",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=registry,
        )
        self.delta_last_sequence = Gauge(
            "streamtrain_delta_last_sequence", "Sequence number of the last delta delivered.", registry=registry
        )
        self.delta_rows = Histogram(
            "streamtrain_delta_rows",
            "Embedding rows (over all tables) per delta delivered.",
            buckets=(0, 10, 100, 1_000, 10_000, 100_000, 1_000_000, 10_000_000),
            registry=registry,
        )
        self.bases_published = Counter(
            "streamtrain_bases_published", "Servable bases exported from snapshots.", registry=registry
        )
        self.bases_failed = Counter(
            "streamtrain_bases_failed", "Base exports that failed or were stopped unfinished.", registry=registry
        )
        self.base_export_seconds = Histogram(
            "streamtrain_base_export_seconds",
            "How long one base export (a background process) took.",
            buckets=(1, 2.5, 5, 10, 30, 60, 120, 300, 600),
            registry=registry,
        )
        self.idspace = IdSpaceMetrics(registry)
        self.late = LateLabelMetrics(registry)
        self._server: ThreadingHTTPServer | None = None

    @property
    def progressive_quality(self) -> ProgressiveQuality:
        """The first task's: the primary one, whose AUC the one-task progress line shows."""
        return next(iter(self.task_quality.by_task.values()))

    def serve(self, host: str, port: int, health: Health) -> int:
        """Serve /metrics, /healthz and /readyz; returns the bound port (useful when ``port`` is 0)."""
        registry = self.registry

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # http.server's naming
                path = self.path.split("?")[0]
                if path == "/metrics":
                    status, body, kind = 200, generate_latest(registry), CONTENT_TYPE_LATEST
                elif path in ("/healthz", "/readyz"):
                    status, text = health.healthz() if path == "/healthz" else health.readyz()
                    body, kind = text.encode(), "text/plain; charset=utf-8"
                else:
                    status, body, kind = 404, b"try /metrics, /healthz or /readyz\n", "text/plain"
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:  # scrapes every few seconds are not news
                pass

        try:
            self._server = ThreadingHTTPServer((host, port), Handler)
        except OSError as error:  # a traceback would not say which setting to change
            raise ConfigError(
                f"metrics: cannot serve on {host}:{port}: {error.strerror}. Set metrics.host to an address of "
                "this host and metrics.port to a free port (each rank serves on metrics.port + its local "
                "rank; 0 takes any free port)"
            ) from None
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, name="streamtrain-metrics", daemon=True).start()
        return self._server.server_address[1]

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
