"""Stage 3, batch: a background thread cuts the stream into decoded batches behind a bounded queue.

A batch is cut at ``batch_size`` events, or ``max_batch_wait_ms`` after its first event arrived,
so a quiet stream still trains promptly. The queue bounds memory: when the trainer falls behind,
the backlog stays in Kafka, not in this process.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from typing import Iterator

from streamtrain.config import BatchingConfig
from streamtrain.decode import AvroBatchDecoder, ClickBatch
from streamtrain.metrics import WorkerMetrics
from streamtrain.source import KafkaSource, RawEvent

log = logging.getLogger(__name__)

_END = object()
_POLL_SECONDS = 0.1
# How many batches TrainPipelineSparseDist takes ahead of the one it trains.
PIPELINE_LOOKAHEAD = 2


class Prefetcher:
    """Iterate it for batches; the iteration ends when the source is exhausted or ``stop()`` is called."""

    def __init__(self, source: KafkaSource, decoder: AvroBatchDecoder, config: BatchingConfig,
                 metrics: WorkerMetrics):
        self.source = source
        self.decoder = decoder
        self.config = config
        self.metrics = metrics
        self.queue: queue.Queue = queue.Queue(maxsize=config.queue_size)
        self.stopping = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="streamtrain-prefetch", daemon=True)
        metrics.queue_capacity.set(config.queue_size)

    def start(self) -> "Prefetcher":
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stopping.set()

    def join(self, timeout: float) -> None:
        self.stop()
        self.thread.join(timeout)

    def __iter__(self) -> Iterator[ClickBatch]:
        # TrainPipelineSparseDist trains batch i only once it has taken batch i+2. When the stream
        # pauses, empty batches let it finish the real ones it holds instead of waiting for traffic.
        recent_sizes: deque[int] = deque([0] * PIPELINE_LOOKAHEAD, maxlen=PIPELINE_LOOKAHEAD)
        flush_after = self.config.max_batch_wait_ms / 1000
        waiting_since = time.monotonic()
        while not self.stopping.is_set():
            try:
                item = self.queue.get(timeout=_POLL_SECONDS)
            except queue.Empty:
                if any(recent_sizes) and time.monotonic() - waiting_since >= flush_after:
                    recent_sizes.append(0)
                    waiting_since = time.monotonic()
                    yield self.decoder.decode([]).batch
                continue
            self.metrics.queue_depth.set(self.queue.qsize())
            if item is _END:
                if self.error is not None:
                    raise RuntimeError("the prefetch thread failed") from self.error
                return
            recent_sizes.append(item.size)
            yield item
            waiting_since = time.monotonic()

    def _run(self) -> None:
        try:
            while not self.stopping.is_set() and not self.source.exhausted:
                events = self._collect()
                if events:
                    self._put(self._decode(events))
        except BaseException as error:  # surfaced to the trainer through the iterator
            log.exception("prefetch thread failed")
            self.error = error
        finally:
            self._put(_END)

    def _collect(self) -> list[RawEvent]:
        events: list[RawEvent] = []
        deadline = None
        while len(events) < self.config.batch_size and not self.stopping.is_set() and not self.source.exhausted:
            timeout = _POLL_SECONDS
            if deadline is not None:
                timeout = min(timeout, deadline - time.monotonic())
                if timeout <= 0:
                    break
            got = self.source.poll(self.config.batch_size - len(events), timeout)
            if got and deadline is None:
                deadline = time.monotonic() + self.config.max_batch_wait_ms / 1000
            events.extend(got)
        return events

    def _decode(self, events: list[RawEvent]) -> ClickBatch:
        topic = self.source.topic
        for partition in {e.partition for e in events}:
            self.metrics.events_consumed.labels(topic, str(partition)).inc(
                sum(1 for e in events if e.partition == partition))
        result = self.decoder.decode(events)
        for event, reason in result.rejected:
            log.warning("dropping %s[%d]@%d: %s", topic, event.partition, event.offset, reason)
            self.metrics.events_dropped.labels(topic, str(event.partition), reason.split(":")[0]).inc()
        return result.batch

    def _put(self, item: object) -> None:
        while True:
            try:
                self.queue.put(item, timeout=_POLL_SECONDS)
                self.metrics.queue_depth.set(self.queue.qsize())
                return
            except queue.Full:
                if self.stopping.is_set():
                    return
