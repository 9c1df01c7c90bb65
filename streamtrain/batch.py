"""Stage 3, batch: a background thread cuts the stream into decoded batches behind a bounded queue.

A batch is cut at ``batch_size`` events, or ``max_batch_wait_ms`` after its first event arrived,
so a quiet stream still trains promptly. The queue bounds memory: when the trainer falls behind,
the backlog stays in Kafka, not in this process. Which batches each rank trains, in step with the
others, is decided in ``streamtrain.lockstep``.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable

import numpy as np
import torch

from streamtrain.config import BatchingConfig
from streamtrain.deadletter import Rejections
from streamtrain.decode import AvroBatchDecoder, ClickBatch
from streamtrain.metrics import WorkerMetrics
from streamtrain.source import EventBatch, KafkaSource
from streamtrain.threads import PREFETCH, name_this_thread, profiled, yield_wakeups_to_the_trainer

log = logging.getLogger(__name__)

_END = object()
_POLL_SECONDS = 0.1
_CPU = torch.device("cpu")


def host_staging(device: torch.device) -> Callable[[ClickBatch], ClickBatch]:
    """What the prefetch thread does to each decoded batch before handing it over. For a CUDA
    trainer it pins the batch: TrainPipelineSparseDist copies batches to the GPU on a side stream,
    and a copy from pageable memory blocks the training thread until it is done. On CPU, nothing."""
    return ClickBatch.pin_memory if device.type == "cuda" else _as_decoded


def _as_decoded(batch: ClickBatch) -> ClickBatch:
    return batch


class Prefetcher:
    """Decodes batches ahead of the trainer on its own thread; ``get`` hands them over.

    The loop polls, decodes and queues; beside it, ``rejections`` deals with the events the
    decoder rejects (before their batch is handed over) and may pause consumption, ``lag``
    refreshes the lag gauges, and ``commits`` forwards the positions the training thread wants
    committed, since only this thread may call the consumer. For a CUDA ``device`` it pins each
    batch (``host_staging``), with the thread's current device set to the trainer's.
    """

    def __init__(
        self,
        source: KafkaSource,
        decoder: AvroBatchDecoder,
        config: BatchingConfig,
        metrics: WorkerMetrics,
        rejections: Rejections,
        lag_refresh_seconds: float = 5.0,
        device: torch.device = _CPU,
    ):
        self.source = source
        self.decoder = decoder
        self.config = config
        self.metrics = metrics
        self.rejections = rejections
        self.device = device
        self.prepare = host_staging(device)
        self.lag = LagGauges(source, metrics, lag_refresh_seconds)
        self.commits = PendingCommits()
        self.queue: queue.Queue = queue.Queue(maxsize=config.queue_size)
        self.stopping = threading.Event()
        self.error: BaseException | None = None
        self._ended = False
        self.thread = threading.Thread(target=self._run, name="streamtrain-prefetch", daemon=True)
        metrics.queue_capacity.set(config.queue_size)
        metrics.topic_partitions.labels(source.topic).set(source.topic_partitions)

    def start(self) -> Prefetcher:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stopping.set()

    def join(self, timeout: float) -> None:
        self.stop()
        self.thread.join(timeout)

    @property
    def finished(self) -> bool:
        """True once the source is exhausted and every batch has been handed over."""
        return self._ended

    def get(self, timeout: float) -> ClickBatch | None:
        """The next decoded batch, or None if none arrived within ``timeout`` seconds."""
        if self._ended:
            return None
        try:
            item = self.queue.get(timeout=timeout)
        except queue.Empty:
            return None
        self.metrics.queue_depth.set(self.queue.qsize())
        if item is _END:
            if self.error is not None:
                raise RuntimeError("the prefetch thread failed") from self.error
            self._ended = True
            return None
        return item

    def waiting(self, limit: int) -> list[int]:
        """The sizes of up to ``limit`` batches that ``get`` would hand over next, in order."""
        with self.queue.mutex:  # queue.Queue's own lock over its deque
            return [item.size for item in itertools.islice(self.queue.queue, limit) if item is not _END]

    def _run(self) -> None:
        name_this_thread(PREFETCH)
        yield_wakeups_to_the_trainer()
        try:
            if self.device.type == "cuda":  # pinned memory is allocated through the current device's context
                torch.cuda.set_device(self.device)
            while not self.stopping.is_set() and not self.source.exhausted:
                self._tend()
                if self.rejections.paused():
                    self.stopping.wait(_POLL_SECONDS)
                    continue
                events = self._collect()
                if len(events):
                    batch = self._decode(events)
                    if batch is not None:
                        self._put(batch)
        except BaseException as error:  # surfaced to the trainer through the iterator
            log.exception("prefetch thread failed")
            self.error = error
        finally:
            self._put(_END)

    def _collect(self) -> EventBatch:
        parts: list[EventBatch] = []
        collected = 0
        deadline = None
        while collected < self.config.batch_size and not self.stopping.is_set() and not self.source.exhausted:
            timeout = _POLL_SECONDS
            if deadline is not None:
                timeout = min(timeout, deadline - time.monotonic())
                if timeout <= 0:
                    break
            self._tend()  # an idle stream can keep this loop polling for long
            got = self.source.poll(self.config.batch_size - collected, timeout)
            if len(got):
                deadline = deadline or time.monotonic() + self.config.max_batch_wait_ms / 1000
                parts.append(got)
                collected += len(got)
        return EventBatch.joined(parts)

    def _tend(self) -> None:
        """What this thread does beside polling, as the only caller of the consumer."""
        self.commits.forward(self.source)
        self._watch_partitions()
        self.lag.refresh()

    def _watch_partitions(self) -> None:
        """Partitions added to the topic: this rank's are read from now on, and counted."""
        known = self.source.topic_partitions
        if picked := self.source.pick_up_new_partitions():
            self.metrics.partitions_picked_up.labels(self.source.topic).inc(len(picked))
            self.lag.due()  # their lag shows at the next refresh
        if self.source.topic_partitions != known:
            self.metrics.topic_partitions.labels(self.source.topic).set(self.source.topic_partitions)

    def _decode(self, events: EventBatch) -> ClickBatch | None:
        """The decoded batch, once its rejected events are dealt with; None if a stop came while
        they could not be written."""
        self._count_consumed(events)
        started = time.perf_counter()
        with profiled("streamtrain.decode"):
            result = self.decoder.decode(events)
        self.metrics.decode_seconds.observe(time.perf_counter() - started)
        if not self.rejections.handle(len(events), result.rejected, self.stopping):
            return None
        with profiled("streamtrain.pin"):
            return self.prepare(result.batch)

    def _count_consumed(self, events: EventBatch) -> None:
        topic, metrics = self.source.topic, self.metrics
        counts = np.bincount(events.partitions)
        nbytes = np.bincount(events.partitions, weights=events.sizes)
        for partition in np.flatnonzero(counts).tolist():
            metrics.events_consumed.labels(topic, str(partition)).inc(int(counts[partition]))
            metrics.consumed_bytes.labels(topic, str(partition)).inc(int(nbytes[partition]))

    def _put(self, item: object) -> None:
        while True:
            try:
                self.queue.put(item, timeout=_POLL_SECONDS)
                self.metrics.queue_depth.set(self.queue.qsize())
                return
            except queue.Full:
                if self.stopping.is_set():
                    return


class PendingCommits:
    """Positions the training thread wants committed to the consumer group, forwarded by the
    prefetch thread: the consumer is not safe to call from two threads at once (a commit beside a
    running consume() can block)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[int, int] = {}

    def offer(self, next_offsets: dict[int, int]) -> None:
        with self._lock:
            self._pending.update(next_offsets)

    def forward(self, source: KafkaSource) -> None:
        with self._lock:
            pending, self._pending = self._pending, {}
        source.commit(pending)


class LagGauges:
    """The consumer-lag gauge of every owned partition (those picked up while running too),
    refreshed at most every ``refresh_seconds``; ``total`` is their sum at the last refresh (None
    before the first fetch), for the progress line."""

    def __init__(self, source: KafkaSource, metrics: WorkerMetrics, refresh_seconds: float):
        self.source = source
        self.metrics = metrics
        self.refresh_seconds = refresh_seconds
        self.total: int | None = None
        self._refreshed = 0.0

    def due(self) -> None:
        """Refresh at the next call."""
        self._refreshed = 0.0

    def refresh(self) -> None:
        if time.monotonic() - self._refreshed < self.refresh_seconds:
            return
        self._refreshed = time.monotonic()
        lags = self.source.lag()
        for partition, lag in lags.items():
            self.metrics.consumer_lag.labels(self.source.topic, str(partition)).set(lag)
        if lags:
            self.total = sum(lags.values())
