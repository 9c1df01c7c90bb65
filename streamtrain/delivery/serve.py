"""``streamtrain serve``: a reference scoring server that follows the newest base and its deltas.

It loads the base ``current.json`` points to (``artifact.ServableModel``), then applies the deltas
of that base's chain in order from its ``delta_sequence`` (docs/delivery-format.md is the format,
docs/delivery.md the design):

- a delta of an older chain, or one already applied, is skipped;
- a gap in the sequence, or a delta of a newer chain, makes it look (``base_wait_seconds`` at
  most, reading on meanwhile) for a base past what it serves, load it, and replay the delta source
  from that base on. Without one in time, the delta is counted failed and the server keeps what it
  serves, until a later delta tries again;
- a chunk or delta that is not in the format, or does not fit the base, is refused whole before
  any of it is written, counted by reason, and leaves a gap like a lost delta;
- a source that cannot be read (brokers down, a folder unreadable) is retried until it can.

Replaying a Kafka delta topic (one partition) starts at the first message whose timestamp is at
or after the base's cut (the snapshot's wall time less its save time, ``cut_wall_time_ms``) less
``REPLAY_MARGIN_MS``, found with ``offsets_for_times``: a delta cut after the snapshot was produced
after it, and what the margin adds is skipped as already applied. Chunks may come in any order
and repeat (the producer's retries); ``Assembler`` makes whole deltas of them.

A score sees one whole delta or none: the forward pass holds the state lock shared, applying a
delta holds it alone; decoding and encoding hold nothing.

HTTP is aiohttp's server rather than ``http.server``: HTTP/1.1 keep-alive for clients that send
many small score requests, a bounded request size, and requests handled concurrently on one event
loop while the scoring itself runs in a thread (torch releases the GIL); its runner also starts
and stops cleanly inside a test process, on a port the OS picks.
"""

from __future__ import annotations

import asyncio
import base64
import hmac
import io
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

import fastavro
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from streamtrain.decode import AvroBatchDecoder, ClickBatch
from streamtrain.delivery.artifact import DeltaMismatch, ServableModel
from streamtrain.delivery.deltas import Assembler, Delta, DeltaFormatError, DeltaId
from streamtrain.delivery.spec import (
    COMPLETE,
    FormatError,
    Manifest,
    parse_delta,
    parse_part,
    read_current,
    read_manifest,
)
from streamtrain.registry import schema_source
from streamtrain.retry import Backoff, retry
from streamtrain.source import KAFKA_LOG, RawEvent

log = logging.getLogger(__name__)

T = TypeVar("T")
REPLAY_MARGIN_MS = 60_000
# A delta source or the bases' folder that fails is tried again after 0.5 s, doubling to 5 s, until a stop.
SOURCE_BACKOFF = Backoff(initial=0.5, maximum=5.0)


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


class ServeMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.step = Gauge("streamtrain_serve_step", "The training step of the state served", registry=r)
        self.delta_sequence = Gauge(
            "streamtrain_serve_delta_sequence",
            "The sequence of the newest delta applied (-1: the base alone)",
            registry=r,
        )
        self.base_version = Gauge("streamtrain_serve_base_version", "The version of the base loaded", registry=r)
        self.chain = Gauge("streamtrain_serve_chain", "The delta chain the base belongs to", registry=r)
        self.deltas_applied = Counter("streamtrain_serve_deltas_applied_total", "Deltas applied", registry=r)
        self.deltas_failed = Counter(
            "streamtrain_serve_deltas_failed_total",
            "Deltas after a gap that no base covered in time",
            registry=r,
        )
        self.bad_deltas = Counter(
            "streamtrain_serve_bad_deltas_total",
            "Chunks and deltas refused, by reason (not in the format, disagreeing parts, not fitting the base, ...)",
            ["reason"],
            registry=r,
        )
        self.source_retries = Counter(
            "streamtrain_serve_source_retries_total",
            "Retries after the delta source or the bases' folder failed for a while",
            registry=r,
        )
        self.deltas_skipped = Counter(
            "streamtrain_serve_deltas_skipped_total", "Deltas of an older chain or already applied", registry=r
        )
        self.base_loads = Counter(
            "streamtrain_serve_base_loads_total", "Bases loaded, the first one included", registry=r
        )
        self.apply_seconds = Histogram(
            "streamtrain_serve_delta_apply_seconds",
            "Time to write one delta into the served model, waiting for the scores in progress included",
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5),
            registry=r,
        )
        self.freshness = Gauge(
            "streamtrain_serve_freshness_seconds",
            "Now minus the event-time high-water of the state served (its newest delta's, else its base's)",
            registry=r,
        )
        self.score_requests = Counter(
            "streamtrain_serve_score_requests_total", "Score requests, by outcome", ["outcome"], registry=r
        )
        self.score_seconds = Histogram(
            "streamtrain_serve_score_seconds",
            "Score request latency, decoding included",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1),
            registry=r,
        )
        self.scored_events = Counter("streamtrain_serve_scored_events_total", "Events scored", registry=r)
        self.rejected_events = Counter(
            "streamtrain_serve_rejected_events_total", "Events in score requests that could not be scored", registry=r
        )
        self.high_water_ms = 0
        self.freshness.set_function(lambda: time.time() - self.high_water_ms / 1000 if self.high_water_ms else 0.0)


class StateLock:
    """Guards the served state: scores read it together, a delta writes it alone. A waiting writer
    holds off new readers, so a delta waits for the forward passes already running, no more."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._readers = 0
        self._writers = 0  # waiting or writing
        self._writing = False

    @contextmanager
    def read(self) -> Iterator[None]:
        with self._changed:
            self._changed.wait_for(lambda: self._writers == 0)
            self._readers += 1
        try:
            yield
        finally:
            with self._changed:
                self._readers -= 1
                self._changed.notify_all()

    @contextmanager
    def write(self) -> Iterator[None]:
        with self._changed:
            self._writers += 1
            self._changed.wait_for(lambda: self._readers == 0 and not self._writing)
            self._writing = True
        try:
            yield
        finally:
            with self._changed:
                self._writing = False
                self._writers -= 1
                self._changed.notify_all()


@dataclass(frozen=True)
class Served:
    """What a score sees: the model and where in its chain it is. Replaced whole, under the write lock."""

    model: ServableModel
    step: int
    next_sequence: int


class Follower:
    """Keeps ``model`` at the newest base plus the deltas of its chain, in order. It never stops on
    bad input: a chunk or delta that is not in the format, or does not fit the base, is counted by
    reason and skipped whole (it is validated before any of it is written), and the gap it leaves
    waits for a newer base, as a lost delta does. A source that cannot be read is retried."""

    def __init__(
        self,
        model_dir: Path,
        source: DeltaSource | None,
        metrics: ServeMetrics,
        base_wait_seconds: float,
        on_delta_applied: Callable[[DeltaId, float], None] | None = None,
    ):
        self.model_dir = model_dir
        self.source = source
        self.metrics = metrics
        self.base_wait_seconds = base_wait_seconds
        self.on_delta_applied = on_delta_applied
        self.lock = StateLock()  # apply writes, score reads: a score sees a whole delta or none
        self.served: Served | None = None
        self.loads = 0
        self.assembler = Assembler()
        self.ready = threading.Event()
        self.stopping = threading.Event()
        # Why the served state is not current (None: it is): /readyz says it.
        self.behind: str | None = None
        # The first delta past a gap, and until when a base past it is waited for.
        self._gap: tuple[int, int] | None = None
        self._gap_deadline = 0.0
        self._logged: set[str] = set()

    @property
    def model(self) -> ServableModel:
        assert self.served is not None, "a base is loaded before the follower runs"
        return self.served.model

    @property
    def manifest(self) -> Manifest:
        return self.model.manifest

    @property
    def next_sequence(self) -> int:
        assert self.served is not None
        return self.served.next_sequence

    @property
    def step(self) -> int:
        assert self.served is not None
        return self.served.step

    def load(self, base_dir: Path, source_timeout: float | None = None) -> None:
        """Serves the base in ``base_dir`` and rewinds the source to it, retrying a source that
        fails (for ``source_timeout`` seconds at most; None: until a stop)."""
        model = ServableModel(base_dir)  # outside the lock: scores go on from the old base meanwhile
        manifest = model.manifest
        with self.lock.write():
            self.served = Served(model, manifest.step, manifest.delta_sequence)
            self.loads += 1
        self.metrics.base_loads.inc()
        self.metrics.base_version.set(manifest.base_version)
        self.metrics.chain.set(manifest.chain)
        self.metrics.step.set(manifest.step)
        self.metrics.delta_sequence.set(manifest.delta_sequence - 1)
        self.metrics.high_water_ms = manifest.event_time_high_water_ms
        self.assembler = Assembler()
        self._gap, self.behind = None, None
        log.info(
            "serving base %s (step %d, chain %d, deltas from %d)",
            base_dir.name,
            manifest.step,
            manifest.chain,
            manifest.delta_sequence,
        )
        if self.source is not None:
            since = manifest.cut_wall_time_ms - REPLAY_MARGIN_MS
            source = self.source
            self._retrying("rewinding the delta source", lambda: source.rewind(since), source_timeout)

    def _retrying(self, what: str, call: Callable[[], T], timeout: float | None = None) -> T:
        """``call()``, retried while it fails for a while (until a stop); meanwhile /readyz says so."""

        def waiting(error: OSError, attempt: int, wait: float) -> None:
            self.metrics.source_retries.inc()
            self.behind = f"{what} failed: {error}"
            log.warning("%s failed (attempt %d, again in %.1fs): %s", what, attempt, wait, error)

        backoff = Backoff(SOURCE_BACKOFF.initial, SOURCE_BACKOFF.maximum, timeout)
        result = retry(call, backoff, retry_on=OSError, on_retry=waiting, stopping=self.stopping)
        if self.behind is not None and self.behind.startswith(what):
            self.behind = None
        return result

    def newest_base(self) -> Path | None:
        current = read_current(self.model_dir)
        return None if current is None else self.model_dir / current["path"]

    def run(self) -> None:
        """The follower thread: until ``stopping``, read chunks and apply whole deltas. An error
        it does not expect is logged and counted, and it goes on: the state served is whole."""
        while not self.stopping.is_set():
            try:
                self._follow()
            except Exception as error:
                if self.stopping.is_set():
                    break
                self._refuse("error", f"the delta follower failed, and goes on: {error!r}")
                self.stopping.wait(1.0)

    def _follow(self) -> None:
        if self.source is None:
            self.ready.set()
            self.stopping.wait(1.0)
            return
        source = self.source
        loads = self.loads
        for chunk in self._retrying("reading the delta source", lambda: source.poll(0.2)):
            if self.loads != loads:  # a base was loaded and the source rewound: the rest is read again
                return
            self._take(chunk)
        if self._gap is not None:
            self._look_for_base()
        if not self.ready.is_set() and source.caught_up():
            self.ready.set()
            log.info("ready: the deltas present at start are applied (sequence %d next)", self.next_sequence)

    def _refuse(self, reason: str, message: str) -> None:
        """Counts a refused chunk or delta; logs the first of each reason (the metric counts the rest)."""
        self.metrics.bad_deltas.labels(reason).inc()
        if reason not in self._logged:
            self._logged.add(reason)
            log.error(
                "%s (further ones of reason %r are counted in streamtrain_serve_bad_deltas_total)", message, reason
            )

    def _take(self, chunk: bytes) -> None:
        try:
            delta = self.assembler.add(chunk)
        except DeltaFormatError as error:
            self._refuse(error.reason, f"skipping a delta chunk: {error}")
            return
        if delta is not None:
            self.offer(delta)

    def offer(self, delta: Delta) -> None:
        manifest = self.manifest
        chain, sequence = delta.id.base_version, delta.id.sequence
        if delta.id.model_id != manifest.model_id:
            self.metrics.deltas_skipped.inc()
            log.warning("skipping a delta of model %r; this base is %r", delta.id.model_id, manifest.model_id)
            return
        if (chain, sequence) < (manifest.chain, self.next_sequence):
            self.metrics.deltas_skipped.inc()
            return
        if chain == manifest.chain and sequence == self.next_sequence:
            self._apply(delta)
            return
        if self._gap is None or (chain, sequence) < self._gap:
            if self._gap is None:
                self._gap_deadline = time.monotonic() + self.base_wait_seconds
                log.warning(
                    "delta %d of chain %d while %d of chain %d is next: waiting up to %.0fs for a newer base",
                    sequence,
                    chain,
                    self.next_sequence,
                    manifest.chain,
                    self.base_wait_seconds,
                )
            self._gap = (chain, sequence)
            self.behind = f"waiting for a base past delta {self.next_sequence} of chain {manifest.chain}"
        self._look_for_base()

    def _apply(self, delta: Delta) -> None:
        served = self.served
        assert served is not None
        started = time.perf_counter()
        try:
            with self.lock.write():
                served.model.apply(delta)  # checks the whole delta first: a refused one changes nothing
                self.served = Served(served.model, delta.id.step, delta.id.sequence + 1)
        except DeltaMismatch as error:
            self._refuse(
                "mismatch", f"delta {delta.id.sequence} of chain {delta.id.base_version} does not fit: {error}"
            )
            return
        self.metrics.apply_seconds.observe(time.perf_counter() - started)
        self.metrics.deltas_applied.inc()
        self.metrics.step.set(delta.id.step)
        self.metrics.delta_sequence.set(delta.id.sequence)
        self.metrics.high_water_ms = delta.id.event_time_high_water_ms
        self.assembler.forget_before(delta.id.base_version, delta.id.sequence + 1)
        self._gap = None
        if self.behind is not None and self.behind.startswith("waiting for a base"):
            self.behind = None
        if self.on_delta_applied is not None:
            self.on_delta_applied(delta.id, time.time())

    def _look_for_base(self) -> None:
        """Loads the newest base if it is past what is served; gives up waiting, and counts the
        delta failed, once ``base_wait_seconds`` have passed since the gap was found."""
        assert self._gap is not None
        path = self._retrying("reading current.json", self._newest_readable_base)
        if path is not None and path != self.model.path:
            try:
                manifest = read_manifest(path)
            except (OSError, FormatError) as error:
                log.warning("base %s is not readable yet: %s", path, error)
            else:
                if (manifest.chain, manifest.delta_sequence) > (self.manifest.chain, self.next_sequence):
                    try:
                        self.load(path)
                        return
                    except Exception as error:  # removed meanwhile, or not a base: keep serving, look again
                        self._refuse("base", f"base {path} cannot be loaded: {error}")
        if time.monotonic() >= self._gap_deadline:
            chain, sequence = self._gap
            log.error(
                "delta %d of chain %d: no base past the gap appeared within %.0fs; serving what is loaded",
                sequence,
                chain,
                self.base_wait_seconds,
            )
            self.metrics.deltas_failed.inc()
            self._gap = None
            self.behind = f"a gap before delta {sequence} of chain {chain}: no newer base yet"

    def _newest_readable_base(self) -> Path | None:
        try:
            return self.newest_base()
        except FormatError as error:  # a current.json naming no base folder: as if none were published
            self._refuse(error.reason, str(error))
            return None


@dataclass
class ScoreOutcome:
    results: list[dict[str, Any]]
    tasks: list[str]
    base_version: int
    step: int
    delta_sequence: int


@dataclass(frozen=True)
class ServeLimits:
    """What one client may ask of the server (``streamtrain serve``'s flags of the same names)."""

    max_request_bytes: int = 8 * 2**20
    max_events: int = 10_000
    max_in_flight: int = 8
    token_file: Path | None = None


class Scorer:
    """Turns a score request's events into batches with the worker's own decoder, for one base."""

    def __init__(self, model: ServableModel):
        features = model.features
        # Serving events carry no outcome yet: a missing label must not reject them.
        self.tasks = [t.model_copy(update={"required": False}) for t in model.tasks]
        self.avro = AvroBatchDecoder(features, schema_source(features), self.tasks)
        raw = features.model_copy(update={"wire_format": "raw", "schema_registry": None, "writer_schemas_dir": None})
        self.json = AvroBatchDecoder(raw, None, self.tasks)
        # The decoders build a program per writer schema on first sight: one decode at a time.
        self.decoding = threading.Lock()
        reader = model.manifest.reader_schema
        self.schema = fastavro.parse_schema(reader)
        # A JSON event names the fields the features read; the others (labels not known yet, the
        # event time, fields no feature uses) may be left out, and are written as placeholders.
        read = {t.field.split(".")[0] for t in features.tables} | {d.field.split(".")[0] for d in features.dense}
        self.placeholders = {f["name"]: _placeholder(f["type"]) for f in reader["fields"] if f["name"] not in read}

    def encode_json(self, event: dict[str, Any]) -> bytes:
        out = io.BytesIO()
        fastavro.schemaless_writer(out, self.schema, {**self.placeholders, **event})
        return out.getvalue()

    def decode(self, events: list[Any]) -> tuple[list[dict[str, Any]], list[tuple[list[int], ClickBatch]]]:
        """Each event's error (an empty dict where it decoded), and the batches with the indices of
        the events they hold."""
        results: list[dict[str, Any]] = [{} for _ in events]
        avro: list[RawEvent] = []
        plain: list[RawEvent] = []
        for index, event in enumerate(events):
            if isinstance(event, str):
                try:
                    avro.append(RawEvent(0, index, base64.b64decode(event, validate=True), -1))
                except ValueError as error:
                    results[index] = {"error": f"not base64: {error}"}
            elif isinstance(event, dict):
                try:
                    plain.append(RawEvent(0, index, self.encode_json(event), -1))
                except (ValueError, TypeError, KeyError, AttributeError) as error:  # fastavro's, by field
                    results[index] = {"error": f"not an event of the reader schema: {error}"}
            else:
                results[index] = {"error": "an event is a base64 string (Avro) or a JSON object"}
        batches = []
        for decoder, raw in ((self.avro, avro), (self.json, plain)):
            if not raw:
                continue
            with self.decoding:
                decoded = decoder.decode(raw)
            bad = {event.offset: reason for event, reason in decoded.rejected}
            for event, reason in bad.items():
                results[event] = {"error": reason}
            batches.append(([e.offset for e in raw if e.offset not in bad], decoded.batch))
        return results, batches


_ZEROS: dict[str, Any] = {
    "boolean": False,
    "int": 0,
    "long": 0,
    "float": 0.0,
    "double": 0.0,
    "bytes": b"",
    "string": "",
}


def _placeholder(avro_type: Any) -> Any:
    """A value of ``avro_type`` for a field a score request left out: null where allowed, else zero."""
    if isinstance(avro_type, list):
        return None if "null" in avro_type else _placeholder(avro_type[0])
    if isinstance(avro_type, dict):
        kind = avro_type["type"]
        if kind == "record":
            return {f["name"]: _placeholder(f["type"]) for f in avro_type["fields"]}
        if kind == "enum":
            return avro_type["symbols"][0]
        if kind == "fixed":
            return bytes(avro_type["size"])
        return {"array": [], "map": {}}.get(kind, _placeholder(kind))
    return _ZEROS.get(avro_type)


class ScoringServer:
    """The server: a follower thread, and aiohttp on its own thread. ``start()`` returns once the
    first base is loaded and HTTP listens; ``ready`` turns true once the deltas present at start
    are applied.

    Limits, so that it can face clients it does not trust: a body over ``max_request_bytes`` or
    with over ``max_events`` events gets 413; over ``max_in_flight`` requests at once get 503 with
    ``Retry-After`` (before their bodies are read); with ``token_file``, /score wants
    ``Authorization: Bearer <the file's content>`` (401 otherwise). TLS is the mesh's job."""

    def __init__(
        self,
        model_dir: str | Path,
        deltas: DeltaSource | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        base_wait_seconds: float = 60.0,
        start_timeout_seconds: float = 60.0,
        on_delta_applied: Callable[[DeltaId, float], None] | None = None,
        limits: ServeLimits | None = None,
    ):
        """``on_delta_applied(delta, wall time)`` is called on the follower thread once a delta is
        served (``bench delivery`` times the deltas by it)."""
        self.model_dir = Path(model_dir)
        self.host = host
        self.port = port
        self.start_timeout_seconds = start_timeout_seconds
        self.limits = limits or ServeLimits()
        self._token = _read_token(self.limits.token_file) if self.limits.token_file is not None else None
        self.metrics = ServeMetrics()
        self.follower = Follower(self.model_dir, deltas, self.metrics, base_wait_seconds, on_delta_applied)
        self._scorers: dict[Path, Scorer] = {}
        self._in_flight = 0  # touched on the event loop only
        self._pool = ThreadPoolExecutor(self.limits.max_in_flight, thread_name_prefix="streamtrain-score")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._threads: list[threading.Thread] = []

    @property
    def ready(self) -> bool:
        return self.follower.ready.is_set()

    def start(self) -> None:
        deadline = time.monotonic() + self.start_timeout_seconds
        while True:  # a server may start before the first export
            try:
                base = self.follower.newest_base()
                if base is not None:
                    self.follower.load(base, max(deadline - time.monotonic(), 1.0))
                    break
                why = "no base"
            except DeltaSourceUnavailable:
                raise
            except Exception as error:  # removed meanwhile, or not a base: wait for the next
                why = f"the newest base cannot be loaded ({error})"
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"{why} under {self.model_dir} after {self.start_timeout_seconds:.0f}s: run "
                    f"`streamtrain export` (or a worker with delivery on) to publish one there"
                )
            time.sleep(0.2)
        follower = threading.Thread(target=self.follower.run, name="streamtrain-serve-deltas", daemon=True)
        follower.start()
        listening = threading.Event()
        http = threading.Thread(target=self._serve_http, args=(listening,), name="streamtrain-serve-http", daemon=True)
        http.start()
        self._threads = [follower, http]
        if not listening.wait(30):
            raise RuntimeError(f"the HTTP server did not start on {self.host}:{self.port}")

    def stop(self) -> None:
        self.follower.stopping.set()
        if self._loop is not None and self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout=10)
            self._loop.call_soon_threadsafe(self._loop.stop)
        for thread in self._threads:
            thread.join(timeout=10)
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.follower.source is not None:
            self.follower.source.close()

    def wait_ready(self, timeout: float) -> bool:
        return self.follower.ready.wait(timeout)

    def __enter__(self) -> ScoringServer:
        self.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()

    # --- HTTP ----------------------------------------------------------------------------
    def _serve_http(self, listening: threading.Event) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        app = web.Application(client_max_size=self.limits.max_request_bytes)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/score", self._score)
        self._runner = web.AppRunner(app, access_log=None)
        loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, self.host, self.port)
        loop.run_until_complete(site.start())
        server = site._server
        assert server is not None
        self.port = int(server.sockets[0].getsockname()[1])  # type: ignore[attr-defined]
        self._loop = loop
        listening.set()
        loop.run_forever()
        loop.close()

    async def _healthz(self, _request: web.Request) -> web.Response:
        alive = all(thread.is_alive() for thread in self._threads)
        return web.json_response({"ok": alive}, status=200 if alive else 500)

    async def _readyz(self, request: web.Request) -> web.Response:
        """200 while the state served is current: the deltas present at start applied, no gap
        waiting for a base, the delta source readable; else 503 and why. With ``?allow_stale=1``
        only the first matters: a load balancer's probe keeps scoring on while every replica
        waits for the same base."""
        follower = self.follower
        behind = follower.behind if self.ready else "applying the deltas present at start"
        if self.ready and request.query.get("allow_stale") == "1" and behind is not None:
            behind, stale = None, behind
        else:
            stale = None
        body: dict[str, Any] = {
            "ready": behind is None,
            "base_version": follower.manifest.base_version,
            "next_delta_sequence": follower.next_sequence,
        }
        if behind is not None or stale is not None:
            body["reason"] = behind or stale
        return web.json_response(body, status=200 if behind is None else 503)

    async def _metrics(self, _request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    def _refused(self, status: int, outcome: str, reason: str, **headers: str) -> web.Response:
        self.metrics.score_requests.labels(outcome).inc()
        return web.json_response({"error": reason}, status=status, headers=headers)

    async def _score(self, request: web.Request) -> web.Response:
        started = time.perf_counter()
        limits = self.limits
        if self._token is not None and not hmac.compare_digest(
            request.headers.get("Authorization", "").encode(), b"Bearer " + self._token
        ):
            return self._refused(401, "unauthorized", "a bearer token is needed", **{"WWW-Authenticate": "Bearer"})
        if self._in_flight >= limits.max_in_flight:
            return self._refused(
                503, "busy", f"{limits.max_in_flight} requests are being scored; retry", **{"Retry-After": "1"}
            )
        self._in_flight += 1
        try:
            if (request.content_length or 0) > limits.max_request_bytes:
                return self._refused(413, "too_large", f"the body is over {limits.max_request_bytes} bytes")
            try:
                data = await request.read()
            except web.HTTPRequestEntityTooLarge:
                return self._refused(413, "too_large", f"the body is over {limits.max_request_bytes} bytes")
            loop = asyncio.get_running_loop()
            try:
                events = await loop.run_in_executor(self._pool, _events, data)
            except ValueError as error:
                return self._refused(400, "bad_request", f"bad request: {error}")
            if len(events) > limits.max_events:
                return self._refused(413, "too_many_events", f"{len(events)} events; at most {limits.max_events}")
            outcome = await loop.run_in_executor(self._pool, self.score, events)
        finally:
            self._in_flight -= 1
        self.metrics.score_requests.labels("ok").inc()
        self.metrics.score_seconds.observe(time.perf_counter() - started)
        return web.json_response(
            {
                "tasks": outcome.tasks,
                "base_version": outcome.base_version,
                "step": outcome.step,
                "delta_sequence": outcome.delta_sequence,
                "results": outcome.results,
            }
        )

    def _scorer(self, model: ServableModel) -> Scorer:
        scorers = self._scorers
        if model.path not in scorers:
            scorers = {model.path: Scorer(model)}  # the old base's decoders go with it
            self._scorers = scorers
        return scorers[model.path]

    def score(self, events: list[Any]) -> ScoreOutcome:
        """Probabilities for ``events``: each a string (base64 of an Avro payload in the topic's
        wire format) or an object (the event's fields by the reader schema's names). Decoding runs
        without the state lock; only the forward pass holds it (shared), so one request sees one
        whole state and deltas wait for forward passes only."""
        while True:
            served = self.follower.served
            assert served is not None
            results, batches = self._scorer(served.model).decode(events)
            with self.follower.lock.read():
                now = self.follower.served
                assert now is not None
                if now.model is served.model:  # else a new base came meanwhile: decode with its config
                    for kept, batch in batches:
                        for event, row in zip(kept, now.model.score(batch).tolist(), strict=True):
                            results[event] = {"probabilities": row}
                    break
        rejected = sum("error" in r for r in results)
        self.metrics.rejected_events.inc(rejected)
        self.metrics.scored_events.inc(len(results) - rejected)
        manifest = now.model.manifest
        return ScoreOutcome(results, manifest.tasks, manifest.base_version, now.step, now.next_sequence - 1)


def _events(data: bytes) -> list[Any]:
    body = json.loads(data)
    events = body.get("events") if isinstance(body, dict) else None
    if not isinstance(events, list):
        raise ValueError('the body must be a JSON object {"events": [...]}')
    return events


def _read_token(path: Path) -> bytes:
    token = path.read_bytes().strip()
    if not token:
        raise ValueError(f"the token file {path} is empty: write the bearer token clients send into it")
    return token
