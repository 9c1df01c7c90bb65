"""Stage 1, the source: raw events from the Kafka partitions this rank owns.

Partitions are assigned explicitly (never by group rebalancing), so which rank trains which
partition is deterministic, and the worker, not the group coordinator, decides where reading
starts. The next offset of every owned partition is tracked here.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Literal

import numpy as np
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, Message, TopicPartition
from confluent_kafka.admin import ClusterMetadata

from streamtrain.config import KafkaConfig
from streamtrain.exitcodes import ExitCode
from streamtrain.launch import exit_if_orphaned
from streamtrain.rdkafka import FetchedMessage, FetchQueue
from streamtrain.retry import Backoff, retry

log = logging.getLogger(__name__)
# librdkafka's own log lines, at their levels, instead of raw lines on stderr.
KAFKA_LOG = logging.getLogger("streamtrain.kafka")

# A request while looking for new partitions that takes longer is given up, and asked again at the
# next look.
DISCOVERY_TIMEOUT_SECONDS = 5.0


class KafkaUnavailable(RuntimeError):
    """Kafka cannot be read at all: no broker answered at start-up, or the brokers refused the login.
    ``exit_code`` is what the worker exits with (docs/operating.md, Exit codes)."""

    def __init__(self, message: str, exit_code: ExitCode):
        super().__init__(message)
        self.exit_code = exit_code


@dataclass(slots=True)
class RawEvent:
    """One message as read. Made for every message, so kept cheap: slots, not frozen (a frozen
    dataclass's __init__ costs several times more); treat it as immutable all the same."""

    partition: int
    offset: int
    value: bytes | None
    timestamp_ms: int  # the message timestamp; -1 when the broker gave none
    key: bytes | None = None
    headers: list[tuple[str, bytes | None]] | None = None  # as read, for the dead-letter topic


@dataclass
class EventBatch:
    """Messages as read, in columns: what decoding and position tracking need, made without a
    Python object per message (at the worker's rate that alone took a tenth of a core). The payloads
    lie back to back in ``data``, as the decoder reads them. ``event(i)`` makes one message's
    ``RawEvent`` when it is needed, e.g. for the dead-letter topic."""

    partitions: np.ndarray  # int64 [n]
    offsets: np.ndarray  # int64 [n]
    data: np.ndarray  # uint8, read-only: the payloads back to back; a tombstone's is empty
    bounds: np.ndarray  # int64 [n + 1]: payload i is data[bounds[i]:bounds[i + 1]]
    messages: Sequence[Message | RawEvent | FetchedMessage]  # what ``event(i)`` is made from

    @classmethod
    def of_values(
        cls,
        values: Sequence[bytes | None],
        partitions: np.ndarray,
        offsets: np.ndarray,
        messages: Sequence[Message | RawEvent],
    ) -> EventBatch:
        try:
            sizes = np.fromiter(map(len, values), dtype=np.int64, count=len(values))  # type: ignore[arg-type]
            joined = b"".join(values)  # type: ignore[arg-type]
        except TypeError:  # a tombstone's None, which is rare: the common batch pays one pass in C
            payloads = [v or b"" for v in values]
            sizes = np.fromiter(map(len, payloads), dtype=np.int64, count=len(payloads))
            joined = b"".join(payloads)
        bounds = np.zeros(len(values) + 1, np.int64)
        np.cumsum(sizes, out=bounds[1:])
        return cls(partitions, offsets, np.frombuffer(joined, dtype=np.uint8), bounds, messages)

    @classmethod
    def of_events(cls, events: Sequence[RawEvent]) -> EventBatch:
        n = len(events)
        return cls.of_values(
            [e.value for e in events],
            np.fromiter((e.partition for e in events), dtype=np.int64, count=n),
            np.fromiter((e.offset for e in events), dtype=np.int64, count=n),
            events,
        )

    @classmethod
    def of_messages(cls, messages: list[Message]) -> EventBatch:
        """Of data messages (none carrying an error)."""
        n = len(messages)
        return cls.of_values(
            list(map(Message.value, messages)),
            np.fromiter(map(Message.partition, messages), dtype=np.int64, count=n),
            np.fromiter(map(Message.offset, messages), dtype=np.int64, count=n),
            messages,
        )

    @classmethod
    def joined(cls, parts: Sequence[EventBatch]) -> EventBatch:
        if len(parts) == 1:
            return parts[0]
        if not parts:
            return NO_EVENTS
        shifts = np.cumsum([0] + [len(part.data) for part in parts[:-1]])
        return cls(
            np.concatenate([part.partitions for part in parts]),
            np.concatenate([part.offsets for part in parts]),
            _read_only(np.concatenate([part.data for part in parts])),
            np.concatenate(
                [np.zeros(1, np.int64)] + [part.bounds[1:] + shift for part, shift in zip(parts, shifts, strict=True)]
            ),
            _Chained([part.messages for part in parts]),
        )

    def __len__(self) -> int:
        return len(self.partitions)

    def where(self, keep: np.ndarray) -> EventBatch:
        indices = np.flatnonzero(keep)
        bounds = np.zeros(len(indices) + 1, np.int64)
        np.cumsum(self.sizes[indices], out=bounds[1:])
        return EventBatch(
            self.partitions[indices],
            self.offsets[indices],
            _read_only(self.data[np.repeat(keep, self.sizes)]),
            bounds,
            _Picked(self.messages, indices.tolist()),
        )

    @cached_property
    def sizes(self) -> np.ndarray:
        """Each payload's bytes, 0 for a message without a value (a tombstone)."""
        return np.diff(self.bounds)

    @cached_property
    def payloads(self) -> list[bytes]:
        """Each payload as bytes, an empty one for a message without a value: for the decoders that
        take events one at a time."""
        joined = self.data.tobytes()
        return [
            joined[start:stop] for start, stop in zip(self.bounds[:-1].tolist(), self.bounds[1:].tolist(), strict=True)
        ]

    def event(self, index: int) -> RawEvent:
        m = self.messages[index]
        if isinstance(m, RawEvent):
            return m
        return RawEvent(m.partition(), m.offset(), m.value(), m.timestamp()[1], m.key(), m.headers())


def _read_only(array: np.ndarray) -> np.ndarray:
    """``array``, read-only like the joined bytes of ``of_values``: the decoder's compiled programs
    then see one array type, and compile once."""
    array.flags.writeable = False
    return array


class _Chained(Sequence[Any]):
    """Several batches' messages as one sequence, without copying them."""

    def __init__(self, parts: list[Sequence[Any]]):
        self.parts = parts
        self.starts = list(itertools.accumulate((len(part) for part in parts), initial=0))

    def __len__(self) -> int:
        return self.starts[-1]

    def __getitem__(self, index: int) -> Any:  # type: ignore[override]
        if not 0 <= index < len(self):
            raise IndexError(index)
        part = bisect.bisect_right(self.starts, index) - 1
        return self.parts[part][index - self.starts[part]]


class _Picked(Sequence[Any]):
    """Some of a batch's messages, by index, without copying them."""

    def __init__(self, messages: Sequence[Any], indices: list[int]):
        self.messages = messages
        self.indices = indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index: int) -> Any:  # type: ignore[override]
        return self.messages[self.indices[index]]


NO_EVENTS = EventBatch(
    np.zeros(0, np.int64), np.zeros(0, np.int64), _read_only(np.zeros(0, np.uint8)), np.zeros(1, np.int64), []
)


def partitions_in(partitions: np.ndarray) -> list[int]:
    """The distinct partition numbers, ascending: a count per number instead of a sort, a third of
    the cost at a batch's size, and paid several times per batch."""
    return np.flatnonzero(np.bincount(partitions)).tolist()


class KafkaSource:
    """Reads the partitions ``p`` of ``config.topic`` with ``p % world_size == rank``.

    Reading starts at ``start_offsets`` (a restored snapshot's) if given, else at
    ``config.start_at``, else (if ``committed``) at the consumer group's committed offsets, else
    at the earliest offset.

    ``until_end`` captures each partition's end offset at start-up; once every partition has been
    read up to it, ``exhausted`` turns true. ``max_events`` bounds the total read instead.

    Partitions added to the topic while it runs are found by ``pick_up_new_partitions`` and read by
    the rank the same rule names, from their beginning: their events are all new, whatever
    ``kafka.start_at`` says (where ``start_offsets`` or the group's committed offsets know one, from
    there, so a position that was trained is never read again). Each rank picks up its own without
    asking the others: which rank reads a partition follows from its number alone, and a rank that
    sees the growth later only trains its new partitions later. ``until_end`` reads the partitions
    it started with.
    """

    def __init__(
        self,
        config: KafkaConfig,
        rank: int = 0,
        world_size: int = 1,
        *,
        until_end: bool = False,
        max_events: int | None = None,
        start_offsets: dict[int, int] | None = None,
        committed: bool = True,
        metadata_timeout: float = 30.0,
        on_error: Callable[[str], None] = lambda code: None,
    ):
        self.config = config
        self.topic = config.topic
        self.rank = rank
        self.world_size = world_size
        self.restored = start_offsets
        self.committed = committed
        self.on_error = on_error
        self.brokers_down = False
        self.login_refused: str | None = None
        self.consumer = Consumer(consumer_properties(config, until_end=until_end, error_cb=self._client_error))
        metadata = self._topic_metadata(metadata_timeout)
        topic_meta = metadata.topics.get(self.topic)
        if topic_meta is None or topic_meta.error is not None or not topic_meta.partitions:
            self.consumer.close()
            reason = topic_meta.error if topic_meta is not None else "absent"
            raise KafkaException(f"topic {self.topic!r} is not readable at {config.bootstrap_servers}: {reason}")
        all_partitions = sorted(topic_meta.partitions)
        self.topic_partitions = len(all_partitions)  # as this rank last saw the topic
        self.partitions = [p for p in all_partitions if p % world_size == rank]
        self.next_discovery = time.monotonic() + config.partition_discovery_seconds
        if rank == 0 and len(all_partitions) < world_size:
            log.warning(
                "%s has %d partitions for %d ranks: ranks %d..%d own none and only take part in the collectives",
                self.topic,
                len(all_partitions),
                world_size,
                len(all_partitions),
                world_size - 1,
            )
        elif rank == 0 and len(all_partitions) % world_size:
            log.warning(
                "%s has %d partitions, not a multiple of %d ranks: some ranks own more partitions "
                "than others and will be busier",
                self.topic,
                len(all_partitions),
                world_size,
            )
        self.next_offset: dict[int, int] = {}
        self.end_offset: dict[int, int] = {}
        position = config.start_position()
        if start_offsets is not None:  # a restored snapshot's; a partition it does not know starts at the beginning
            origin = "the snapshot's positions"
            starts = [TopicPartition(self.topic, p, start_offsets.get(p, OFFSET_BEGINNING)) for p in self.partitions]
        elif position is not None:
            origin = f"kafka.start_at {config.start_at}"
            starts = self._positions_at(position, metadata_timeout)
        elif committed:
            origin = "the group's committed offsets, else the earliest"
            starts = retry(
                lambda: self._committed_offsets(self.partitions),
                Backoff(initial=0.5, maximum=0.5, timeout=metadata_timeout),
                retry_on=KafkaException,
                retriable=_not_ready_yet,
                on_retry=lambda error, _attempt, _wait: log.info(
                    "Kafka is not ready (%s); retrying", error.args[0].str()
                ),
            )
        else:
            origin = "the earliest offsets"
            starts = [TopicPartition(self.topic, p, OFFSET_BEGINNING) for p in self.partitions]
        self.until_end = until_end
        self.max_events = max_events
        self.consumed = 0
        self.fetch_queue: FetchQueue | None = None
        self.reads_fetch_queue = config.fetch_queue  # until FetchQueue.attach refuses this consumer
        self._assign(starts, self.consumer.assign, metadata_timeout)
        log.info(
            "rank %d/%d owns partitions %s of %s (of %d); starting at %s (%s)",
            rank,
            world_size,
            self.partitions,
            self.topic,
            len(all_partitions),
            self.next_offset,
            origin,
        )

    def _assign(
        self, starts: list[TopicPartition], assign: Callable[[list[TopicPartition]], None], timeout: float
    ) -> None:
        """Reads each partition of ``starts`` from its offset there (none: its earliest), through
        ``assign``: the consumer's assign at start, incremental_assign for partitions added later.
        ``timeout`` bounds each offset request."""
        assignment = []
        for tp in starts:
            start = tp.offset if tp.offset >= 0 else OFFSET_BEGINNING
            assignment.append(TopicPartition(self.topic, tp.partition, start))
            if start == OFFSET_BEGINNING:
                start, _high = self.consumer.get_watermark_offsets(tp, timeout=timeout)
            self.next_offset[tp.partition] = start
            if self.until_end:
                _low, self.end_offset[tp.partition] = self.consumer.get_watermark_offsets(
                    tp, timeout=timeout, cached=False
                )
        # Before the assignment starts fetching: see streamtrain.rdkafka.
        partitions = [tp.partition for tp in starts]
        if self.reads_fetch_queue and partitions:
            if self.fetch_queue is None:
                self.fetch_queue = FetchQueue.attach(self.consumer, self.topic, partitions)
                self.reads_fetch_queue = self.fetch_queue is not None
            else:
                self.fetch_queue.forward(partitions)
        assign(assignment)

    def _committed_offsets(self, partitions: list[int], timeout: float = 5.0) -> list[TopicPartition]:
        return self.consumer.committed([TopicPartition(self.topic, p) for p in partitions], timeout=timeout)

    def pick_up_new_partitions(self) -> list[int]:
        """Looks for partitions added to the topic, at most every ``kafka.partition_discovery_seconds``
        (one metadata request), and starts reading this rank's; returns those. Called by the thread
        that polls. A look that fails (the brokers are down) is tried again at the next."""
        interval = self.config.partition_discovery_seconds
        if not interval or self.brokers_down or time.monotonic() < self.next_discovery:
            return []
        self.next_discovery = time.monotonic() + interval
        try:
            found = self.consumer.list_topics(self.topic, timeout=DISCOVERY_TIMEOUT_SECONDS).topics.get(self.topic)
            if found is None or found.error is not None or len(found.partitions) <= self.topic_partitions:
                return []
            mine = [
                p for p in sorted(found.partitions) if p >= self.topic_partitions and p % self.world_size == self.rank
            ]
            if mine and not self.until_end:
                # A request that outlasts the look's bound (a new partition's leader not elected yet)
                # leaves the polling thread free: the next look tries again.
                self._assign(self._later_starts(mine), self.consumer.incremental_assign, DISCOVERY_TIMEOUT_SECONDS)
        except KafkaException as error:
            log.warning(
                "looking for partitions added to %s failed (%s); looking again in %gs", self.topic, error, interval
            )
            return []
        if not mine:
            reads = "none of them"
        elif self.until_end:
            reads = "none of them: --until-end reads the partitions it started with, the next run reads them"
        else:
            reads = ", ".join(f"{p} from offset {self.next_offset[p]}" for p in mine)
        log.info(
            "topic %s grew from %d to %d partitions; rank %d reads %s",
            self.topic, self.topic_partitions, len(found.partitions), self.rank, reads,
        )  # fmt: skip
        self.topic_partitions = len(found.partitions)
        if self.until_end:
            return []
        self.partitions = sorted(self.partitions + mine)
        return mine

    def _later_starts(self, partitions: list[int]) -> list[TopicPartition]:
        """Where partitions added while running start: at a restored snapshot's or the group's
        position if it knows one (the start-up metadata may have missed a partition it trained),
        else at their beginning."""
        if self.restored is not None:
            return [TopicPartition(self.topic, p, self.restored.get(p, OFFSET_BEGINNING)) for p in partitions]
        if self.committed:
            return self._committed_offsets(partitions, DISCOVERY_TIMEOUT_SECONDS)
        return [TopicPartition(self.topic, p, OFFSET_BEGINNING) for p in partitions]

    def _positions_at(self, position: Literal["earliest", "latest"] | int, timeout: float) -> list[TopicPartition]:
        """Each owned partition's offset for ``kafka.start_at``: its earliest, its end, or its first
        message whose timestamp is at or after ``position`` (epoch ms), else its end."""
        if position == "earliest":
            return [TopicPartition(self.topic, p, OFFSET_BEGINNING) for p in self.partitions]
        if position == "latest":
            found = [TopicPartition(self.topic, p, -1) for p in self.partitions]
        elif self.partitions:
            found = self.consumer.offsets_for_times(
                [TopicPartition(self.topic, p, position) for p in self.partitions], timeout=timeout
            )
        else:
            found = []
        for tp in found:
            if tp.error is not None:
                raise KafkaException(tp.error)
        return [
            tp
            if tp.offset >= 0
            else TopicPartition(
                self.topic, tp.partition, self.consumer.get_watermark_offsets(tp, timeout=timeout, cached=False)[1]
            )
            for tp in found
        ]

    def _topic_metadata(self, timeout: float) -> ClusterMetadata:
        """The topic's metadata, asked for during ``timeout`` seconds, and given up at once when the
        brokers refuse the login: librdkafka retries a refused login for ever, and says so only to
        error_cb, which the consumer serves in poll()."""
        try:
            return retry(
                lambda: self.consumer.list_topics(self.topic, timeout=1.0),
                Backoff(initial=0.1, maximum=0.1, timeout=timeout),
                retry_on=KafkaException,
                retriable=lambda _error: self.login_refused is None,
                on_retry=lambda _error, _attempt, _wait: self.consumer.poll(0),
            )
        except KafkaException as error:
            self.consumer.close()
            if self.login_refused is not None:
                raise KafkaUnavailable(
                    f"the Kafka brokers at {self.config.bootstrap_servers} refused the login: "
                    f"{self.login_refused}; check kafka.client_config and client_config_files",
                    ExitCode.LOGIN_REFUSED,
                ) from error
            raise KafkaUnavailable(
                f"no Kafka broker at {self.config.bootstrap_servers} answered within {timeout:.0f}s "
                f"(kafka.connect_timeout_seconds): {error.args[0].str()}",
                ExitCode.KAFKA_UNREACHABLE,
            ) from error

    def _client_error(self, error: KafkaError) -> None:
        self.on_error(error.name())
        if error.code() == KafkaError._ALL_BROKERS_DOWN:
            self.brokers_down = True
        if error.code() == KafkaError._AUTHENTICATION:
            self.login_refused = error.str()
        log.warning("Kafka client: %s", error.str())

    def _broker_answers(self) -> bool:
        """Whether a broker answers a request now. Returned messages prove nothing: librdkafka hands
        out what it fetched before the brokers went down after reporting them down."""
        try:
            self.consumer.get_watermark_offsets(
                TopicPartition(self.topic, self.partitions[0]), timeout=1.0, cached=False
            )
            return True
        except KafkaException:
            return False

    def lag(self) -> dict[int, int]:
        """High watermark minus read position per owned partition, from the watermarks the client
        cached with its last fetches (no request); partitions not fetched yet are left out."""
        lags = {}
        for partition in self.partitions:
            _low, high = self.consumer.get_watermark_offsets(TopicPartition(self.topic, partition), cached=True)
            if high >= 0:
                lags[partition] = max(high - self.next_offset[partition], 0)
        return lags

    @property
    def exhausted(self) -> bool:
        if self.max_events is not None and self.consumed >= self.max_events:
            return True
        if self.until_end:
            return all(self.next_offset[p] >= self.end_offset[p] for p in self.partitions)
        return False

    def poll(self, max_events: int, timeout: float) -> EventBatch:
        """Up to ``max_events`` events, waiting at most ``timeout`` seconds for the first."""
        if self.max_events is not None:
            max_events = min(max_events, self.max_events - self.consumed)
        if max_events <= 0 or not self.partitions:
            time.sleep(timeout)
            return NO_EVENTS
        if self.fetch_queue is not None:
            events = self._read_fetch_queue(max_events, timeout)
        else:
            messages = self.consumer.consume(num_messages=max_events, timeout=timeout)
            # Per message, only calls into C; the checks and the positions are per partition.
            if any(map(Message.error, messages)):
                messages = [
                    m for m in messages if m.error() is None or self._accept_error(m.error(), m.partition(), m.offset())
                ]
            events = EventBatch.of_messages(messages)
        if self.brokers_down and self._broker_answers():
            self.brokers_down = False
        if self.until_end and len(events):
            events = self._before_end(events)
        for partition in partitions_in(events.partitions):
            # max: a partition's EOF, met while filtering this same batch, may already lie past its
            # last message (a transaction's marker follows it).
            last = int(events.offsets[events.partitions == partition].max())
            self.next_offset[partition] = max(self.next_offset[partition], last + 1)
        self.consumed += len(events)
        return events

    def _read_fetch_queue(self, max_events: int, timeout: float) -> EventBatch:
        messages, (data, bounds, partitions, offsets, errors) = self.fetch_queue.read(max_events, timeout)  # type: ignore[union-attr]
        events = EventBatch(partitions, offsets, _read_only(data), bounds, messages)
        if errors.any():
            for i in np.flatnonzero(errors).tolist():
                code, text = int(errors[i]), messages[i].error_text()
                self._accept_error(
                    KafkaError(code, text) if text else KafkaError(code), int(partitions[i]), int(offsets[i])
                )
            events = events.where(errors == 0)
        self._serve_consumer_queue()
        return events

    def _serve_consumer_queue(self) -> None:
        """Runs the callbacks (errors, logs) waiting in the consumer's own queue, which no longer
        carries messages once the fetch queue holds them all."""
        message = self.consumer.poll(0)
        if message is None:
            return
        if message.error() is None:  # the forwarding failed: refuse to go on rather than skip it
            raise RuntimeError(
                f"librdkafka delivered {self.topic} [{message.partition()}] offset {message.offset()} "
                "outside the fetch queue"
            )
        self._accept_error(message.error(), message.partition(), message.offset())

    def _accept_error(self, error: KafkaError, partition: int, offset: int) -> bool:
        """Deals with an error message; False, so that a filter drops it."""
        if error.code() == KafkaError._PARTITION_EOF:
            # The read position has reached the log end; transaction markers can leave it
            # past the last message's offset + 1.
            self.next_offset[partition] = max(self.next_offset[partition], offset)
            return False
        self.on_error(error.name())
        if error.fatal() or not error.retriable():
            raise KafkaException(error)
        log.warning("Kafka: %s", error)
        return False

    def _before_end(self, events: EventBatch) -> EventBatch:
        """The events before the end offsets captured at start-up. A partition read past its end is
        paused: what follows is left for the next run."""
        past = np.zeros(len(events), dtype=np.bool_)
        for partition in partitions_in(events.partitions):
            past |= (events.partitions == partition) & (events.offsets >= self.end_offset[partition])
        if not past.any():
            return events
        self.consumer.pause([TopicPartition(self.topic, p) for p in partitions_in(events.partitions[past])])
        return events.where(~past)

    def commit(self, next_offsets: dict[int, int]) -> None:
        """Record trained positions in the consumer group, for lag dashboards; never blocks."""
        exit_if_orphaned("committing offsets")  # a replacement worker may be committing by now
        if next_offsets:
            self.consumer.commit(
                offsets=[TopicPartition(self.topic, p, o) for p, o in next_offsets.items()], asynchronous=True
            )

    def close(self) -> None:
        if self.fetch_queue is not None:
            self.fetch_queue.close()
        self.consumer.close()


def consumer_properties(
    config: KafkaConfig, *, until_end: bool, error_cb: Callable[[KafkaError], None]
) -> dict[str, Any]:
    """The consumer's librdkafka properties, secrets included; never log the result.

    Defaults first, then ``kafka.client_config``, which may change them (an IPv6-only cluster needs
    another broker.address.family), then what streamtrain owns (``OWNED_PROPERTIES``: the
    config refuses them in client_config)."""
    return {
        "broker.address.family": "v4",
        "fetch.wait.max.ms": 50,
        **config.librdkafka(),
        "group.id": config.group_id,
        "enable.auto.commit": False,
        "enable.auto.offset.store": False,
        "enable.partition.eof": until_end,
        "auto.offset.reset": "earliest",
        "error_cb": error_cb,
        "logger": KAFKA_LOG,
    }


def _not_ready_yet(error: KafkaException) -> bool:
    """Whether Kafka answered with an error that passes on a retry, e.g. the group coordinator is
    still loading."""
    kafka_error = error.args[0] if error.args else None
    return isinstance(kafka_error, KafkaError) and (
        kafka_error.retriable()
        or kafka_error.code()
        in (
            KafkaError.NOT_COORDINATOR,
            KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
            KafkaError.COORDINATOR_NOT_AVAILABLE,
            KafkaError._TIMED_OUT,
        )
    )
