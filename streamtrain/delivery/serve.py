"""``streamtrain serve``: a reference scoring server that follows the newest base and its deltas.

It loads the base ``current.json`` points to (``artifact.ServableModel``), then applies the deltas
of that base's chain in order from its ``delta_sequence`` (docs/delivery.md):

- a delta of an older chain, or one already applied, is skipped;
- a gap in the sequence, or a delta of a newer chain, makes it wait (``base_wait_seconds`` at
  most) for a base that covers it (a newer chain, or this chain past the missing number), load
  it, and replay the delta source from that base on. Without one in time, the delta is counted
  failed and the server keeps what it serves, until a later delta tries again.

Replaying a Kafka delta topic (one partition) starts at the first message whose timestamp is at
or after the base's cut (the snapshot's wall time less its save time, ``cut_wall_time_ms``) less
``REPLAY_MARGIN_MS``, found with ``offsets_for_times``: a delta cut after the snapshot was produced
after it, and what the margin adds is skipped as already applied. Chunks may come in any order
and repeat (the producer's retries); ``Assembler`` makes whole deltas of them.

A score sees one whole delta or none: applying a delta and scoring hold the same lock.

HTTP is aiohttp's server rather than ``http.server``: HTTP/1.1 keep-alive for clients that send
many small score requests, a bounded request size, and requests handled concurrently on one event
loop while the scoring itself runs in a thread (torch releases the GIL); its runner also starts
and stops cleanly inside a test process, on a port the OS picks.
"""

from __future__ import annotations

import asyncio
import base64
import io
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import fastavro
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from streamtrain.decode import AvroBatchDecoder
from streamtrain.delivery.artifact import Manifest, ServableModel, read_current, read_manifest
from streamtrain.delivery.deltas import Assembler, Delta, DeltaFormatError, DeltaId
from streamtrain.registry import schema_source
from streamtrain.source import KAFKA_LOG, RawEvent

log = logging.getLogger(__name__)

REPLAY_MARGIN_MS = 60_000
# A score request's body; an Avro click event is about 60 bytes, a JSON one a few hundred.
MAX_REQUEST_BYTES = 64 * 2**20


class DeltaSource(Protocol):
    def rewind(self, since_ms: int) -> None:
        """Read again from the deltas published at or after ``since_ms``; what was present at this
        moment is what ``caught_up`` waits for."""

    def poll(self, timeout: float) -> list[bytes]:
        """The chunks that arrived, waiting at most ``timeout`` seconds for one."""

    def caught_up(self) -> bool:
        """Whether everything present at the last ``rewind`` has been returned."""

    def close(self) -> None: ...


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
        from confluent_kafka import TopicPartition

        low, high = self._consumer.get_watermark_offsets(self._partition, timeout=10)
        found = self._consumer.offsets_for_times([TopicPartition(self.topic, 0, max(since_ms, 0))], timeout=10)[0]
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
    marker is there, in (chain, sequence) order."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._seen: set[str] = set()
        self._present: set[str] = set()

    def _complete(self) -> list[Path]:
        found = [d for d in self.path.glob("delta-*-*") if (d / "COMPLETE").exists()]

        def order(d: Path) -> tuple[int, int]:
            _, chain, sequence = d.name.split("-")
            return int(chain), int(sequence)

        return sorted(found, key=order)

    def rewind(self, since_ms: int) -> None:
        self._seen = set()
        self._present = {d.name for d in self._complete()}

    def poll(self, timeout: float) -> list[bytes]:
        deadline = time.monotonic() + timeout
        while True:
            fresh = [d for d in self._complete() if d.name not in self._seen]
            if fresh:
                self._seen.add(fresh[0].name)
                return [p.read_bytes() for p in sorted(fresh[0].glob("part-*"))]
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
            "Deltas that could not be applied: unreadable, not fitting the base, or a gap no base covered in time",
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
            "Time to write one delta into the served model",
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5),
            registry=r,
        )
        self.freshness = Gauge(
            "streamtrain_serve_freshness_seconds",
            "Now minus the event-time high-water of the state served (its newest delta's, else its base's)",
            registry=r,
        )
        self.score_requests = Counter(
            "streamtrain_serve_score_requests_total", "Score requests", ["outcome"], registry=r
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


class Follower:
    """Keeps ``model`` at the newest base plus the deltas of its chain, in order."""

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
        self.lock = threading.Lock()  # held by apply and by score: a score sees a whole delta or none
        self.model: ServableModel | None = None
        self.next_sequence = 0
        self.step = 0
        self.loads = 0
        self.assembler = Assembler()
        self.ready = threading.Event()
        self.stopping = threading.Event()
        self.failure: str | None = None

    @property
    def manifest(self) -> Manifest:
        assert self.model is not None
        return self.model.manifest

    def load(self, base_dir: Path) -> None:
        model = ServableModel(base_dir)  # outside the lock: scores go on from the old base meanwhile
        with self.lock:
            self.model = model
            self.next_sequence = model.manifest.delta_sequence
            self.step = int(model.manifest.raw["step"])
            self.loads += 1
        manifest = model.manifest.raw
        self.metrics.base_loads.inc()
        self.metrics.base_version.set(manifest["base_version"])
        self.metrics.chain.set(manifest["chain"])
        self.metrics.step.set(manifest["step"])
        self.metrics.delta_sequence.set(self.next_sequence - 1)
        self.metrics.high_water_ms = int(manifest["event_time_high_water_ms"])
        self.assembler = Assembler()
        if self.source is not None:
            self.source.rewind(int(manifest.get("cut_wall_time_ms", 0)) - REPLAY_MARGIN_MS)
        log.info(
            "serving base %s (step %d, chain %d, deltas from %d)",
            base_dir.name,
            manifest["step"],
            manifest["chain"],
            self.next_sequence,
        )

    def newest_base(self) -> Path | None:
        current = read_current(self.model_dir)
        return None if current is None else self.model_dir / current["path"]

    def run(self) -> None:
        """The follower thread: until ``stopping``, read chunks and apply whole deltas."""
        try:
            while not self.stopping.is_set():
                if self.source is None:
                    self.ready.set()
                    self.stopping.wait(1.0)
                    continue
                loads = self.loads
                for chunk in self.source.poll(0.2):
                    if self.loads != loads:  # a base was loaded and the source rewound: the rest is read again
                        break
                    self._take(chunk)
                if not self.ready.is_set() and self.source.caught_up():
                    self.ready.set()
                    log.info("ready: the deltas present at start are applied (sequence %d next)", self.next_sequence)
        except Exception as error:  # the server stays up and says why in /healthz
            self.failure = f"the delta follower stopped: {error!r}"
            log.exception("the delta follower stopped")

    def _take(self, chunk: bytes) -> None:
        try:
            delta = self.assembler.add(chunk)
        except (DeltaFormatError, KeyError, ValueError) as error:
            self.metrics.deltas_failed.inc()
            log.error("skipping an unreadable delta chunk: %s", error)
            return
        if delta is not None:
            self.offer(delta)

    def offer(self, delta: Delta) -> None:
        manifest = self.manifest
        chain, sequence = delta.id.base_version, delta.id.sequence
        if delta.id.model_id != manifest.raw["model_id"]:
            self.metrics.deltas_skipped.inc()
            log.warning("skipping a delta of model %r; this base is %r", delta.id.model_id, manifest.raw["model_id"])
            return
        if (chain, sequence) < (manifest.chain, self.next_sequence):
            self.metrics.deltas_skipped.inc()
            return
        if chain == manifest.chain and sequence == self.next_sequence:
            self._apply(delta)
            return
        why = f"delta {sequence} of chain {chain} while {self.next_sequence} of chain {manifest.chain} is next"
        if not self._reload_past(chain, sequence, why):
            self.metrics.deltas_failed.inc()

    def _apply(self, delta: Delta) -> None:
        assert self.model is not None
        started = time.perf_counter()
        try:
            with self.lock:
                self.model.apply(delta)
                self.next_sequence = delta.id.sequence + 1
                self.step = delta.id.step
        except ValueError as error:
            self.metrics.deltas_failed.inc()
            log.error("delta %d of chain %d does not fit: %s", delta.id.sequence, delta.id.base_version, error)
            return
        self.metrics.apply_seconds.observe(time.perf_counter() - started)
        self.metrics.deltas_applied.inc()
        self.metrics.step.set(delta.id.step)
        self.metrics.delta_sequence.set(delta.id.sequence)
        self.metrics.high_water_ms = delta.id.event_time_high_water_ms
        if self.on_delta_applied is not None:
            self.on_delta_applied(delta.id, time.time())

    def _reload_past(self, chain: int, sequence: int, why: str) -> bool:
        """Waits for a base that a delta of ``chain`` at ``sequence`` can follow, loads it; False if
        none came within ``base_wait_seconds``."""
        log.warning("%s: waiting up to %.0fs for a newer base", why, self.base_wait_seconds)
        deadline = time.monotonic() + self.base_wait_seconds
        while not self.stopping.is_set():
            path = self.newest_base()
            if path is not None and path != self.model_path:
                try:
                    manifest = read_manifest(path)
                except (OSError, ValueError, KeyError) as error:
                    log.warning("base %s is not readable yet: %s", path, error)
                else:
                    if (manifest.chain, manifest.delta_sequence) > (self.manifest.chain, self.next_sequence) and (
                        manifest.chain,
                        manifest.delta_sequence,
                    ) <= (chain, sequence):
                        self.load(path)
                        return True
            if time.monotonic() >= deadline:
                log.error("%s, and no base covering it appeared within %.0fs", why, self.base_wait_seconds)
                return False
            self.stopping.wait(0.2)
        return False

    @property
    def model_path(self) -> Path:
        assert self.model is not None
        return self.model.path


@dataclass
class ScoreOutcome:
    results: list[dict[str, Any]]
    base_version: int
    step: int
    delta_sequence: int


class Scorer:
    """Turns a score request's events into probabilities with the worker's own decoder."""

    def __init__(self, manifest: Manifest):
        features = manifest.features
        # Serving events carry no outcome yet: a missing label must not reject them.
        self.tasks = [t.model_copy(update={"required": False}) for t in manifest.tasks]
        self.avro = AvroBatchDecoder(features, schema_source(features), self.tasks)
        raw = features.model_copy(update={"wire_format": "raw", "schema_registry": None, "writer_schemas_dir": None})
        self.json = AvroBatchDecoder(raw, None, self.tasks)
        reader = manifest.raw["reader_schema"]
        self.schema = fastavro.parse_schema(reader)
        # A JSON event names the fields the features read; the others (labels not known yet, the
        # event time, fields no feature uses) may be left out, and are written as placeholders.
        read = {t.field.split(".")[0] for t in features.tables} | {d.field.split(".")[0] for d in features.dense}
        self.placeholders = {f["name"]: _placeholder(f["type"]) for f in reader["fields"] if f["name"] not in read}

    def encode_json(self, event: dict[str, Any]) -> bytes:
        out = io.BytesIO()
        fastavro.schemaless_writer(out, self.schema, {**self.placeholders, **event})
        return out.getvalue()


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
    are applied."""

    def __init__(
        self,
        model_dir: str | Path,
        deltas: DeltaSource | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        base_wait_seconds: float = 60.0,
        start_timeout_seconds: float = 60.0,
        on_delta_applied: Callable[[DeltaId, float], None] | None = None,
    ):
        """``on_delta_applied(delta, wall time)`` is called on the follower thread once a delta is
        served (``bench delivery`` times the deltas by it)."""
        self.model_dir = Path(model_dir)
        self.host = host
        self.port = port
        self.start_timeout_seconds = start_timeout_seconds
        self.metrics = ServeMetrics()
        self.follower = Follower(self.model_dir, deltas, self.metrics, base_wait_seconds, on_delta_applied)
        self._scorers: dict[Path, Scorer] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._threads: list[threading.Thread] = []

    @property
    def ready(self) -> bool:
        return self.follower.ready.is_set()

    def start(self) -> None:
        deadline = time.monotonic() + self.start_timeout_seconds
        while (base := self.follower.newest_base()) is None:  # a server may start before the first export
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"no base under {self.model_dir} after {self.start_timeout_seconds:.0f}s: run "
                    f"`streamtrain export` (or a worker with delivery on) to publish one there"
                )
            time.sleep(0.2)
        self.follower.load(base)
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
        app = web.Application(client_max_size=MAX_REQUEST_BYTES)
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
        if self.follower.failure:
            return web.json_response({"ok": False, "error": self.follower.failure}, status=500)
        return web.json_response({"ok": True})

    async def _readyz(self, _request: web.Request) -> web.Response:
        ready = self.ready and self.follower.failure is None
        body = {
            "ready": ready,
            "base_version": self.follower.manifest.base_version,
            "next_delta_sequence": self.follower.next_sequence,
        }
        return web.json_response(body, status=200 if ready else 503)

    async def _metrics(self, _request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _score(self, request: web.Request) -> web.Response:
        started = time.perf_counter()
        try:
            body = await request.json()
            events = body["events"] if isinstance(body, dict) else None
            if not isinstance(events, list):
                raise ValueError('the body must be a JSON object {"events": [...]}')
        except (ValueError, KeyError) as error:
            self.metrics.score_requests.labels("bad_request").inc()
            return web.json_response({"error": f"bad request: {error}"}, status=400)
        outcome = await asyncio.get_running_loop().run_in_executor(None, self.score, events)
        self.metrics.score_requests.labels("ok").inc()
        self.metrics.score_seconds.observe(time.perf_counter() - started)
        return web.json_response(
            {
                "tasks": [t.name for t in self.follower.manifest.tasks],
                "base_version": outcome.base_version,
                "step": outcome.step,
                "delta_sequence": outcome.delta_sequence,
                "results": outcome.results,
            }
        )

    def _scorer(self, model: ServableModel) -> Scorer:
        if model.path not in self._scorers:
            self._scorers = {model.path: Scorer(model.manifest)}  # the old base's decoders go with it
        return self._scorers[model.path]

    def score(self, events: list[Any]) -> ScoreOutcome:
        """Probabilities for ``events``: each a string (base64 of an Avro payload in the topic's
        wire format) or an object (the event's fields by the reader schema's names)."""
        results: list[dict[str, Any]] = [{} for _ in events]
        with self.follower.lock:  # one state for the whole request: no delta lands halfway
            model = self.follower.model
            assert model is not None
            scorer = self._scorer(model)
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
                        plain.append(RawEvent(0, index, scorer.encode_json(event), -1))
                    except (ValueError, TypeError, KeyError, AttributeError) as error:  # fastavro's, by field
                        results[index] = {"error": f"not an event of the reader schema: {error}"}
                else:
                    results[index] = {"error": "an event is a base64 string (Avro) or a JSON object"}
            for decoder, raw in ((scorer.avro, avro), (scorer.json, plain)):
                if not raw:
                    continue
                decoded = decoder.decode(raw)
                bad = {event.offset: reason for event, reason in decoded.rejected}
                for event, reason in bad.items():
                    results[event] = {"error": reason}
                probabilities = model.score(decoded.batch)
                kept = [e.offset for e in raw if e.offset not in bad]
                for event, row in zip(kept, probabilities.tolist(), strict=True):
                    results[event] = {"probabilities": row}
            outcome = ScoreOutcome(
                results, model.manifest.base_version, self.follower.step, self.follower.next_sequence - 1
            )
        rejected = sum("error" in r for r in results)
        self.metrics.rejected_events.inc(rejected)
        self.metrics.scored_events.inc(len(results) - rejected)
        return outcome
