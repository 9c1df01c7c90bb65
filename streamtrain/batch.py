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
from collections import Counter, deque
from typing import Callable, Iterator

import numpy as np
import torch
import torch.distributed as dist

from streamtrain.config import BatchingConfig
from streamtrain.deadletter import DeadLetterWriter, ErrorRateLimit, reason_code
from streamtrain.decode import AvroBatchDecoder, ClickBatch
from streamtrain.metrics import WorkerMetrics
from streamtrain.source import KafkaSource, RawEvent

log = logging.getLogger(__name__)

_END = object()
_POLL_SECONDS = 0.1
# How many batches TrainPipelineSparseDist takes ahead of the one it trains.
PIPELINE_LOOKAHEAD = 2


class Prefetcher:
    """Decodes batches ahead of the trainer on its own thread; ``get`` hands them over.

    Events the decoder rejects go to ``dead_letters`` before their batch is handed over (without
    it they are only logged and counted). ``error_limit`` pauses consumption while too many recent
    events were rejected: this rank then hands over no batches, and still answers a stop.
    """

    def __init__(self, source: KafkaSource, decoder: AvroBatchDecoder, config: BatchingConfig,
                 metrics: WorkerMetrics, lag_refresh_seconds: float = 5.0, *,
                 dead_letters: DeadLetterWriter | None = None, error_limit: ErrorRateLimit | None = None):
        self.source = source
        self.dead_letters = dead_letters
        self.error_limit = error_limit
        self.decoder = decoder
        self.config = config
        self.metrics = metrics
        self.queue: queue.Queue = queue.Queue(maxsize=config.queue_size)
        self.stopping = threading.Event()
        self.error: BaseException | None = None
        self._ended = False
        self._commit_lock = threading.Lock()
        self._pending_commit: dict[int, int] = {}
        self.lag_refresh_seconds = lag_refresh_seconds
        self._lag_refreshed = 0.0
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

    def commit_soon(self, next_offsets: dict[int, int]) -> None:
        """Have the prefetch thread commit these positions: the consumer is not safe to call from
        two threads at once (a commit beside a running consume() can block)."""
        with self._commit_lock:
            self._pending_commit.update(next_offsets)

    def _commit_pending(self) -> None:
        with self._commit_lock:
            pending, self._pending_commit = self._pending_commit, {}
        self.source.commit(pending)

    def _run(self) -> None:
        try:
            while not self.stopping.is_set() and not self.source.exhausted:
                self._commit_pending()
                self._refresh_lag()
                if self._paused():
                    self.stopping.wait(_POLL_SECONDS)
                    continue
                events = self._collect()
                if events:
                    batch = self._decode(events)
                    if batch is not None:
                        self._put(batch)
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

    def _decode(self, events: list[RawEvent]) -> ClickBatch | None:
        """The decoded batch, once its rejected events are in the dead-letter topic; None if a stop
        came while they could not be written (the batch must then not train: its positions
        cover them)."""
        topic, metrics = self.source.topic, self.metrics
        # One pass over the events (this runs for every batch); the per-partition sums in numpy.
        partitions = [e.partition for e in events]
        sizes = [len(e.value) if e.value is not None else 0 for e in events]
        counts = np.bincount(partitions)
        nbytes = np.bincount(partitions, weights=sizes)
        for partition in np.flatnonzero(counts).tolist():
            metrics.events_consumed.labels(topic, str(partition)).inc(int(counts[partition]))
            metrics.consumed_bytes.labels(topic, str(partition)).inc(int(nbytes[partition]))
        started = time.perf_counter()
        result = self.decoder.decode(events)
        metrics.decode_seconds.observe(time.perf_counter() - started)
        reasons: Counter[str] | None = None
        if result.rejected:
            reasons = Counter(reason_code(reason) for _event, reason in result.rejected)
            for (partition, code), n in Counter(
                    (event.partition, reason_code(reason)) for event, reason in result.rejected).items():
                metrics.events_dropped.labels(topic, str(partition), code).inc(n)
            for code, n in reasons.items():
                metrics.decode_errors.labels(code).inc(n)
            if self.dead_letters is not None:
                if not self.dead_letters.write(result.rejected, self.stopping):
                    return None
            else:
                event, reason = result.rejected[0]
                log.warning("skipping %d events of %s that cannot be decoded (dead_letter.enabled is false: they are "
                            "lost): %s; the first at partition %d offset %d: %s", len(result.rejected), topic,
                            ", ".join(f"{code} x{n}" for code, n in reasons.most_common()), event.partition,
                            event.offset, reason)
        if self.error_limit is not None:
            self._limit_errors(len(events), reasons)
        return result.batch

    def _limit_errors(self, events: int, reasons: Counter[str] | None) -> None:
        limit = self.error_limit
        seen = limit.record(events, reasons)
        if seen is None:
            return
        self.metrics.consumption_pauses.inc()
        self.metrics.consumption_paused.set(1)
        rejected, window = sum(seen.values()), limit.tripped_at_events
        log.error("PAUSING consumption of %s for %.0fs: %d of the last %d events could not be decoded (%.0f%%, over "
                  "dead_letter.max_error_rate %.0f%%): %s. The topic may be poisoned: check its producers; the "
                  "rejected events are in %s", self.source.topic, limit.pause_seconds, rejected, window,
                  100 * rejected / window,
                  100 * limit.max_error_rate, ", ".join(f"{code} x{n}" for code, n in seen.most_common()),
                  self.dead_letters.topic if self.dead_letters is not None else "no dead-letter topic (disabled)")

    def _paused(self) -> bool:
        if self.error_limit is None or self.error_limit.paused_until is None:
            return False
        if self.error_limit.paused():
            return True
        self.metrics.consumption_paused.set(0)
        log.warning("resuming consumption of %s after a %.0fs pause; it pauses again if over %.0f%% of the next "
                    "%d events cannot be decoded", self.source.topic, self.error_limit.pause_seconds,
                    100 * self.error_limit.max_error_rate, self.error_limit.window_events)
        return False

    def _refresh_lag(self) -> None:
        if time.monotonic() - self._lag_refreshed < self.lag_refresh_seconds:
            return
        self._lag_refreshed = time.monotonic()
        for partition, lag in self.source.lag().items():
            self.metrics.consumer_lag.labels(self.source.topic, str(partition)).set(lag)

    def _put(self, item: object) -> None:
        while True:
            try:
                self.queue.put(item, timeout=_POLL_SECONDS)
                self.metrics.queue_depth.set(self.queue.qsize())
                return
            except queue.Full:
                if self.stopping.is_set():
                    return


class Lockstep:
    """The batches one rank trains, in step with every other rank.

    Each step, the ranks all-reduce (events held, batches held, stop requested, finished) on a
    group of their own. A step is taken when any rank holds a batch; a rank without one
    contributes an empty batch, so every rank enters every collective of the step. Nobody steps
    when no rank has data: each waits on its own queue for a bounded time and asks again. A stop
    (a signal to any rank) or the end of every rank's stream ends the iteration on all ranks at
    the same step. The iterator never yields None, which TrainPipelineSparseDist would take for
    the end of the stream.
    """

    BUSY_WAIT_SECONDS = 0.005
    IDLE_WAIT_SECONDS = 0.1

    def __init__(self, prefetcher: Prefetcher, empty_batch: Callable[[], ClickBatch], world_size: int,
                 group: dist.ProcessGroup | None, flush_after_seconds: float,
                 votes: dict[str, tuple[Callable[[], bool], str]] | None = None,
                 heartbeat: Callable[[], None] = lambda: None):
        """``votes`` names extra questions put to every rank each step, each with "any" or "all":
        e.g. {"checkpoint": (due, "any")}. ``take_agreed()`` returns the answers of the last vote.
        An agreed question is a reason to step even when no rank has data."""
        self.prefetcher = prefetcher
        self.empty_batch = empty_batch
        self.world_size = world_size
        self.group = group
        self.flush_after = flush_after_seconds
        self.votes = votes or {}
        self.heartbeat = heartbeat  # the loop turns at least every IDLE_WAIT_SECONDS unless it hangs
        self.agreed: dict[str, bool] = dict.fromkeys(self.votes, False)
        self.global_batch_size = 0

    def take_agreed(self) -> dict[str, bool]:
        """What the ranks agreed at the last vote; each answer is handed out once."""
        agreed, self.agreed = self.agreed, dict.fromkeys(self.votes, False)
        return agreed

    def __iter__(self) -> Iterator[ClickBatch]:
        # TrainPipelineSparseDist trains batch i once it has taken batch i+2. When the stream
        # pauses, empty steps let it finish the real batches it holds instead of waiting for
        # traffic. The global sizes of the last steps are the same on every rank.
        recent_global_sizes: deque[int] = deque([0] * PIPELINE_LOOKAHEAD, maxlen=PIPELINE_LOOKAHEAD)
        busy = False
        last_step = time.monotonic()
        while True:
            self.heartbeat()
            batch = self.prefetcher.get(self.BUSY_WAIT_SECONDS if busy else self.IDLE_WAIT_SECONDS)
            votes = torch.tensor([
                batch.size if batch is not None else 0,
                batch is not None,
                self.prefetcher.stopping.is_set(),
                self.prefetcher.finished,
                *(bool(ask()) for ask, _mode in self.votes.values()),
            ], dtype=torch.int64)
            if self.world_size > 1:
                dist.all_reduce(votes, group=self.group)
            global_size, batches_held, stops, finished, *answers = votes.tolist()
            self.agreed = {name: count > 0 if mode == "any" else count == self.world_size
                           for (name, (_ask, mode)), count in zip(self.votes.items(), answers)}
            if stops or finished == self.world_size:
                return
            if batches_held:
                step = batch if batch is not None else self.empty_batch()
            elif any(self.agreed.values()):
                step = self.empty_batch()
            elif any(recent_global_sizes) and time.monotonic() - last_step >= self.flush_after:
                step = self.empty_batch()
            else:
                busy = False
                continue
            # Each rank sums its loss; scaling by world/global size makes the gradients TorchRec's
            # usual per-rank mean when batches are even, and keeps an empty rank's loss at 0.
            step.loss_scale = torch.tensor(self.world_size / max(global_size, 1), dtype=torch.float32)
            self.global_batch_size = global_size
            recent_global_sizes.append(global_size)
            busy = True
            yield step
            last_step = time.monotonic()
