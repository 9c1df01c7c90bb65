"""Dead letters: payloads that cannot become training examples, and the error-rate pause.

``DeadLetterWriter`` produces each rejected event to the dead-letter topic with its key, value,
timestamp and headers as read, plus headers saying why and where it came from. The prefetch
thread calls ``write`` before it hands over the batch whose positions cover those events, so a
position the trainer records (and later commits or snapshots) never covers an event that is in
neither the model nor the dead-letter topic. A write that fails is retried with exponential
backoff for as long as it takes: consumption blocks, loudly, and the event is never dropped. The
topic is made sure of at start (``dead_letter_topic``, ``streamtrain.topics``); one deleted while
the worker runs is created again, with the same settings, at the first write that finds it gone.
Delivery is at least once: a retried or re-read event can reach the topic twice; the source
headers identify it.

``ErrorRateLimit`` pauses consumption when too many of the recent events were rejected, so a
poisoned topic stops loudly instead of emptying into the dead-letter topic.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable

from confluent_kafka import KafkaError, KafkaException, Producer

from streamtrain.config import DeadLetterConfig, KafkaConfig
from streamtrain.metrics import WorkerMetrics
from streamtrain.retry import Backoff, retry
from streamtrain.source import KAFKA_LOG, RawEvent
from streamtrain.topics import NO_AUTO_CREATE, OutputTopic, OutputTopicMissing, ensure_topics

log = logging.getLogger(__name__)

# Headers added to every dead letter, after the event's own. Values are UTF-8 text; partition and
# offset are decimal, as Kafka Connect writes its __connect.errors.* headers.
HEADER_REASON = "streamtrain.error.reason"  # one of the decoder's reason codes, e.g. truncated
HEADER_DETAIL = "streamtrain.error.detail"  # the decoder's full message, when it says more than the code
HEADER_TOPIC = "streamtrain.source.topic"
HEADER_PARTITION = "streamtrain.source.partition"
HEADER_OFFSET = "streamtrain.source.offset"
HEADER_GROUP = "streamtrain.source.group"  # the worker's consumer group

# While stopping, a write already under way gets this long to be acknowledged before it is
# abandoned (its batch is then not trained, and the events are read again on the next start).
STOPPING_GRACE_SECONDS = 5.0
SUMMARY_INTERVAL_SECONDS = 10.0


def reason_code(reason: str) -> str:
    """The decoder's reason code: the text before any ':' detail."""
    return reason.split(":", 1)[0].strip()


def dead_letter_topic(config: DeadLetterConfig, kafka: KafkaConfig) -> OutputTopic:
    """The dead-letter topic, as the worker creates it."""
    retention = config.topic_retention_seconds
    return OutputTopic(
        config.resolved_topic(kafka.topic),
        "dead-letter",
        "dead_letter.topic",
        config.topic_partitions,
        config.topic_replication_factor,
        {"retention.ms": str(int(retention * 1000))} if retention is not None else {},
    )


class DeadLetterWriter:
    """Writes rejected events to ``dead_letter.topic`` (default ``<kafka.topic>.dlq``) with an
    idempotent producer (acks=all) that uses the consumer's client properties (security)."""

    def __init__(self, config: DeadLetterConfig, kafka: KafkaConfig, metrics: WorkerMetrics):
        self.config = config
        self.kafka = kafka
        self.metrics = metrics
        self.source_topic = kafka.topic
        self.output_topic = dead_letter_topic(config, kafka)
        self.topic = self.output_topic.name
        self._fatal: KafkaError | None = None
        self.brokers_down = False  # since the producer said so, until it writes again; /readyz reads it
        self._producer = self._new_producer()
        self._summary: Counter[str] = Counter()
        self._summary_since = time.monotonic()
        self._summarised = False

    def _new_producer(self) -> Producer:
        self._fatal = None
        return Producer(
            {
                "broker.address.family": "v4",  # as the consumer; kafka.client_config may override it
                **self.kafka.librdkafka(),
                "error_cb": self._client_error,
                "logger": KAFKA_LOG,
                **NO_AUTO_CREATE,
                "enable.idempotence": True,
                "acks": "all",
                "partitioner": "murmur2_random",  # the Java client's: one key, one dead-letter partition
                "linger.ms": 5,
                "message.timeout.ms": max(int(self.config.delivery_timeout_seconds * 1000), 100),
                # An absent topic fails the attempt within it, instead of librdkafka's 30 s default.
                "topic.metadata.propagation.max.ms": max(int(self.config.delivery_timeout_seconds * 1000), 100),
            }
        )

    def _client_error(self, error: KafkaError) -> None:
        self.metrics.kafka_errors.labels(error.name()).inc()
        if error.fatal():
            self._fatal = error
        if error.code() == KafkaError._ALL_BROKERS_DOWN:
            self.brokers_down = True
        log.warning("Kafka dead-letter producer: %s", error.str())

    def write(self, rejected: list[tuple[RawEvent, str]], stopping: threading.Event) -> bool:
        """Produces every rejected event and waits until each is acknowledged by all in-sync
        replicas, retrying failures with exponential backoff for as long as it takes.

        Returns True once all are written; False only if ``stopping`` was set first (the caller
        must then not hand over the batch these events belong to)."""
        pending = rejected
        attempts = 0
        blocked_since: float | None = None

        def deliver() -> bool:
            nonlocal pending, attempts
            attempts += 1
            outcome = self._attempt(pending, stopping)
            if outcome is None:
                return False
            written, failures = outcome
            self._count(written)
            if written:
                self.brokers_down = False
            if failures:
                pending = [(event, reason) for event, reason, _error in failures]
                raise _Unwritten(failures)
            return True

        def blocked(unwritten: _Unwritten, attempt: int, wait: float) -> None:
            nonlocal blocked_since
            failures = unwritten.failures
            codes = Counter(error.name() for _event, _reason, error in failures)
            for code, n in codes.items():
                self.metrics.dead_letter_failures.labels(code).inc(n)
            if blocked_since is None:
                blocked_since = time.monotonic()
                self.metrics.dead_letter_blocked.set(1)
            first = min(failures, key=lambda f: (f[0].partition, f[0].offset))[0]
            log.error(
                "cannot write %d dead letters to %s (%s): consumption of %s is BLOCKED at partition %d "
                "offset %d until they are written; attempt %d, retrying in %.1fs",
                len(failures),
                self.topic,
                "; ".join(f"{code} x{n}: {_first_message(failures, code)}" for code, n in codes.items()),
                self.source_topic,
                first.partition,
                first.offset,
                attempt,
                wait,
            )
            if self._fatal is not None:
                log.error("the dead-letter producer failed fatally (%s); starting a new one", self._fatal.str())
                self._producer.purge()
                self._producer = self._new_producer()
            # A deleted topic fails a write in several ways (unknown topic or partition, or a plain
            # timeout while librdkafka waits for its metadata): after any failure, look.
            self._create_topic_if_gone()

        try:
            written = retry(
                deliver,
                Backoff(initial=self.config.retry_backoff_seconds, maximum=self.config.retry_backoff_max_seconds),
                retry_on=_Unwritten,
                on_retry=blocked,
                stopping=stopping,
            )
        except _Unwritten as unwritten:  # only a stop ends the retries with events unwritten
            log.error(
                "stopping while %d dead letters are unwritten: their batch is not trained, and the "
                "events are read again on the next start",
                len(unwritten.failures),
            )
            return False
        if written and blocked_since is not None:
            self.metrics.dead_letter_blocked.set(0)
            log.warning(
                "the dead-letter topic %s took the events after %d attempts and %.1fs: consuming %s again",
                self.topic,
                attempts,
                time.monotonic() - blocked_since,
                self.source_topic,
            )
        return written

    def _create_topic_if_gone(self) -> None:
        """A topic deleted while the worker runs is created again, as at start (one metadata
        request; the retries' backoff bounds how often)."""
        try:
            if ensure_topics(self.kafka, [self.output_topic], self.config.delivery_timeout_seconds, say_existing=False):
                log.warning("the dead-letter topic %s was gone while the worker ran: created it again", self.topic)
        except OutputTopicMissing as error:
            log.error("%s", error)

    def _attempt(
        self, pending: list[tuple[RawEvent, str]], stopping: threading.Event
    ) -> tuple[list[tuple[RawEvent, str]], list[tuple[RawEvent, str, KafkaError]]] | None:
        """One try at writing ``pending``: those written and those that failed, or None if a stop
        cut it short."""
        results: list[KafkaError | bool | None] = [None] * len(pending)
        producer = self._producer

        def delivered(index: int) -> Callable[[KafkaError | None, object], None]:
            return lambda error, _message: results.__setitem__(index, True if error is None else error)

        for index, (event, reason) in enumerate(pending):
            headers = list(event.headers or ())
            code = reason_code(reason)
            headers.append((HEADER_REASON, code.encode()))
            if code != reason:
                headers.append((HEADER_DETAIL, reason.encode()))
            headers += [
                (HEADER_TOPIC, self.source_topic.encode()),
                (HEADER_PARTITION, b"%d" % event.partition),
                (HEADER_OFFSET, b"%d" % event.offset),
                (HEADER_GROUP, self.kafka.group_id.encode()),
            ]
            timestamp = {"timestamp": event.timestamp_ms} if event.timestamp_ms > 0 else {}
            while True:
                try:
                    producer.produce(
                        self.topic,
                        value=event.value,
                        key=event.key,
                        headers=headers,
                        on_delivery=delivered(index),
                        **timestamp,
                    )
                    break
                except BufferError:  # the local queue is full: let it drain
                    producer.poll(0.1)
                except KafkaException as error:
                    results[index] = error.args[0]
                    break
        deadline = time.monotonic() + self.config.delivery_timeout_seconds + 5.0
        while any(r is None for r in results):
            if stopping.is_set():
                deadline = min(deadline, time.monotonic() + STOPPING_GRACE_SECONDS)
            if time.monotonic() >= deadline:
                if stopping.is_set():
                    return None
                break
            producer.flush(0.1)
        timed_out = KafkaError(KafkaError._MSG_TIMED_OUT, "no delivery report within the attempt")
        written = [item for item, result in zip(pending, results, strict=True) if result is True]
        failures = [
            (event, reason, timed_out if result is None else result)
            for (event, reason), result in zip(pending, results, strict=True)
            if result is not True
        ]
        return written, failures

    def _count(self, written: list[tuple[RawEvent, str]]) -> None:
        if not written:
            return
        codes = Counter(reason_code(reason) for _event, reason in written)
        for code, n in codes.items():
            self.metrics.dead_letter_events.labels(code).inc(n)
        self._summary.update(codes)
        now = time.monotonic()
        if not self._summarised or now - self._summary_since >= SUMMARY_INTERVAL_SECONDS:
            self.log_summary()

    def log_summary(self) -> None:
        """Logs what was dead-lettered since the last summary; the first one at once."""
        if self._summary:
            self._summarised = True
            log.warning(
                "%d events of %s could not be decoded and went to %s in the last %.0fs: %s",
                sum(self._summary.values()),
                self.source_topic,
                self.topic,
                time.monotonic() - self._summary_since,
                _describe(self._summary),
            )
        self._summary = Counter()
        self._summary_since = time.monotonic()

    def close(self, timeout: float = 5.0) -> None:
        self.log_summary()
        self._producer.flush(timeout)


class ErrorRateLimit:
    """Pauses when more than ``max_error_rate`` of the last ``window_events`` events (at least)
    were rejected, for ``pause_seconds``; then starts a fresh window."""

    def __init__(
        self,
        max_error_rate: float,
        window_events: int,
        pause_seconds: float,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.max_error_rate = max_error_rate
        self.window_events = window_events
        self.pause_seconds = pause_seconds
        self.clock = clock
        self._window: deque[tuple[int, Counter[str] | None]] = deque()  # per batch: events, reasons
        self.events = 0
        self.rejected = 0
        self.paused_until: float | None = None
        self.tripped_at_events = 0

    def record(self, events: int, reasons: Counter[str] | None) -> Counter[str] | None:
        """Counts one batch: ``events`` read, ``reasons`` of those rejected. Returns the reasons
        seen in the window when this batch starts a pause, else None."""
        rejected = sum(reasons.values()) if reasons else 0
        self._window.append((events, reasons or None))
        self.events += events
        self.rejected += rejected
        while len(self._window) > 1 and self.events - self._window[0][0] >= self.window_events:
            old_events, old_reasons = self._window.popleft()
            self.events -= old_events
            self.rejected -= sum(old_reasons.values()) if old_reasons else 0
        if self.events < self.window_events or self.rejected <= self.max_error_rate * self.events:
            return None
        seen: Counter[str] = Counter()
        for _events, batch_reasons in self._window:
            if batch_reasons:
                seen.update(batch_reasons)
        self.paused_until = self.clock() + self.pause_seconds
        self.tripped_at_events = self.events  # the window that tripped, for the log
        self._window.clear()
        self.events = self.rejected = 0
        return seen

    def paused(self) -> bool:
        """True until the pause has lasted ``pause_seconds``."""
        if self.paused_until is None:
            return False
        if self.clock() >= self.paused_until:
            self.paused_until = None
            return False
        return True


class _Unwritten(Exception):
    """An attempt left these dead letters unwritten, each with its error."""

    def __init__(self, failures: list[tuple[RawEvent, str, KafkaError]]):
        super().__init__(f"{len(failures)} dead letters unwritten")
        self.failures = failures


def _describe(reasons: Counter[str]) -> str:
    return ", ".join(f"{reason} x{n}" for reason, n in reasons.most_common())


def _first_message(failures: list[tuple[RawEvent, str, KafkaError]], code: str) -> str:
    return next(error.str() for _e, _r, error in failures if error.name() == code)


class Rejections:
    """What becomes of the events the decoder rejects, for one rank: counted by partition and
    reason, written to the dead-letter topic (or logged and lost when ``dead_letter.enabled`` is
    false), and watched by the error-rate limit, which pauses consumption."""

    def __init__(self, config: DeadLetterConfig, kafka: KafkaConfig, metrics: WorkerMetrics, rank: int):
        self.topic = kafka.topic
        self.metrics = metrics
        self.writer: DeadLetterWriter | None = None
        if config.enabled:
            self.writer = DeadLetterWriter(config, kafka, metrics)
            if rank == 0:
                log.info(
                    "events that cannot be decoded go to the dead-letter topic %s, with header %s saying why",
                    self.writer.topic,
                    HEADER_REASON,
                )
        elif rank == 0:
            log.warning(
                "dead_letter.enabled is false: events that cannot be decoded are logged, counted in "
                "streamtrain_decode_errors_total and LOST"
            )
        self.limit: ErrorRateLimit | None = None
        if config.max_error_rate < 1.0:
            self.limit = ErrorRateLimit(config.max_error_rate, config.window_events, config.pause_seconds)

    def handle(self, events_read: int, rejected: list[tuple[RawEvent, str]], stopping: threading.Event) -> bool:
        """Deals with the ``rejected`` events of a batch of ``events_read``. Returns False only if a
        stop came while they could not be written: the batch must then not train, since its
        positions cover them."""
        reasons: Counter[str] | None = None
        if rejected:
            reasons = Counter(reason_code(reason) for _event, reason in rejected)
            for (partition, code), n in Counter(
                (event.partition, reason_code(reason)) for event, reason in rejected
            ).items():
                self.metrics.events_dropped.labels(self.topic, str(partition), code).inc(n)
            for code, n in reasons.items():
                self.metrics.decode_errors.labels(code).inc(n)
            if self.writer is not None:
                if not self.writer.write(rejected, stopping):
                    return False
            else:
                event, reason = rejected[0]
                log.warning(
                    "skipping %d events of %s that cannot be decoded (dead_letter.enabled is false: they are "
                    "lost): %s; the first at partition %d offset %d: %s",
                    len(rejected),
                    self.topic,
                    _describe(reasons),
                    event.partition,
                    event.offset,
                    reason,
                )
        if self.limit is not None:
            self._watch_rate(events_read, reasons)
        return True

    def _watch_rate(self, events: int, reasons: Counter[str] | None) -> None:
        limit = self.limit
        assert limit is not None
        seen = limit.record(events, reasons)
        if seen is None:
            return
        self.metrics.consumption_pauses.inc()
        self.metrics.consumption_paused.set(1)
        rejected, window = sum(seen.values()), limit.tripped_at_events
        log.error(
            "PAUSING consumption of %s for %.0fs: %d of the last %d events could not be decoded (%.0f%%, over "
            "dead_letter.max_error_rate %.0f%%): %s. The topic may be poisoned: check its producers; the "
            "rejected events are in %s",
            self.topic,
            limit.pause_seconds,
            rejected,
            window,
            100 * rejected / window,
            100 * limit.max_error_rate,
            _describe(seen),
            self.writer.topic if self.writer is not None else "no dead-letter topic (disabled)",
        )

    def paused(self) -> bool:
        """True while the error-rate limit holds consumption."""
        limit = self.limit
        if limit is None or limit.paused_until is None:
            return False
        if limit.paused():
            return True
        self.metrics.consumption_paused.set(0)
        log.warning(
            "resuming consumption of %s after a %.0fs pause; it pauses again if over %.0f%% of the next "
            "%d events cannot be decoded",
            self.topic,
            limit.pause_seconds,
            100 * limit.max_error_rate,
            limit.window_events,
        )
        return False

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
