"""The delta sources ``streamtrain serve`` follows: a Kafka topic's one partition, or a folder of
complete delta folders. Each can be rewound to a base's cut, polled for chunks, and asked whether
it has returned everything present at the rewind."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Protocol

from streamtrain.delivery.spec import COMPLETE, parse_delta, parse_part
from streamtrain.source import KAFKA_LOG

log = logging.getLogger(__name__)


class DeltaSource(Protocol):
    def rewind(self, since_ms: int) -> None:
        """Read again from the deltas published at or after ``since_ms``; what was present at this
        moment is what ``caught_up`` waits for."""

    def poll(self, timeout: float) -> list[bytes]:
        """The chunks that arrived, waiting at most ``timeout`` seconds for one."""

    def caught_up(self) -> bool:
        """Whether everything present at the last ``rewind`` has been returned."""

    def close(self) -> None: ...


class DeltaSourceUnavailable(ConnectionError):
    """The delta source cannot be read for now (brokers down, a folder unreadable): retried."""


class KafkaDeltas:
    """The delta topic's single partition, read with an assignment (no consumer group state)."""

    def __init__(self, bootstrap_servers: str, topic: str, client_config: dict[str, str] | None = None):
        from confluent_kafka import Consumer, TopicPartition

        self._partition = TopicPartition(topic, 0)
        self.topic = topic
        self._consumer = Consumer(
            {
                "bootstrap.servers": bootstrap_servers,
                "group.id": f"streamtrain-serve-{topic}",
                "enable.auto.commit": False,
                "enable.partition.eof": False,
                "fetch.wait.max.ms": 50,
                # a delta is chunked below the topic's max.message.bytes; a fetch holds many chunks
                "fetch.max.bytes": 64 * 2**20,
                "logger": KAFKA_LOG,
                **(client_config or {}),
            }
        )
        self._end = 0
        self._position = 0

    def rewind(self, since_ms: int) -> None:
        from confluent_kafka import KafkaException, TopicPartition

        try:
            low, high = self._consumer.get_watermark_offsets(self._partition, timeout=10)
            found = self._consumer.offsets_for_times([TopicPartition(self.topic, 0, max(since_ms, 0))], timeout=10)[0]
        except KafkaException as error:
            raise DeltaSourceUnavailable(f"delta topic {self.topic}: {error.args[0]}") from None
        if found.error is not None:  # a partition's own failure is reported, not raised
            raise DeltaSourceUnavailable(
                f"delta topic {self.topic}: looking up the first delta at or after {since_ms} ms failed: {found.error}"
            )
        start = found.offset if found.offset >= 0 else high  # -1: nothing at or after that time
        self._end, self._position = high, max(start, low)
        self._consumer.assign([TopicPartition(self.topic, 0, self._position)])

    def poll(self, timeout: float) -> list[bytes]:
        messages = self._consumer.consume(num_messages=500, timeout=timeout)
        chunks = []
        for message in messages:
            if message.error():
                log.warning("delta topic %s: %s", self.topic, message.error())
                continue
            self._position = message.offset() + 1
            chunks.append(message.value() or b"")
        return chunks

    def caught_up(self) -> bool:
        return self._position >= self._end

    def close(self) -> None:
        self._consumer.close()


class DirectoryDeltas:
    """``<dir>/delta-<chain>-<sequence>/part-<i>`` files, each delta read once its ``COMPLETE``
    marker is there, in (chain, sequence) order. Other names (``delta-3-7.bak``) are not deltas."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._seen: set[str] = set()
        self._present: set[str] = set()

    def _complete(self) -> list[Path]:
        try:
            named = [(position, d) for d in self.path.iterdir() if (position := parse_delta(d.name)) is not None]
            return [d for _position, d in sorted(named) if (d / COMPLETE).exists()]
        except FileNotFoundError:  # not created yet
            return []
        except OSError as error:
            raise DeltaSourceUnavailable(f"delta folder {self.path}: {error}") from None

    def rewind(self, since_ms: int) -> None:
        self._seen = set()
        self._present = {d.name for d in self._complete()}

    def poll(self, timeout: float) -> list[bytes]:
        deadline = time.monotonic() + timeout
        while True:
            complete = self._complete()
            # one present at the rewind and pruned since is not waited for
            self._present &= self._seen | {folder.name for folder in complete}
            for folder in complete:
                if folder.name in self._seen:
                    continue
                self._seen.add(folder.name)
                try:
                    parts = sorted((n, p) for p in folder.iterdir() if (n := parse_part(p.name)) is not None)
                    return [p.read_bytes() for _n, p in parts]
                except FileNotFoundError:  # pruned while read: a base past it exists, as for a lost delta
                    log.warning("delta %s was removed while read", folder.name)
                except OSError as error:
                    self._seen.discard(folder.name)  # read again once the folder can be
                    raise DeltaSourceUnavailable(f"delta folder {folder}: {error}") from None
            if time.monotonic() >= deadline:
                return []
            time.sleep(min(0.1, timeout))

    def caught_up(self) -> bool:
        return self._present <= self._seen

    def close(self) -> None:
        pass
