"""The scorer: a score request's events made into batches with the worker's own decoder, for one base.

Everything it needs is read when the base loads: the reader schema, and the writer schemas of a
base that carries its own (``writer_schemas/``). With a schema registry, an id the scorer has not
seen is looked up before decoding, outside the decoders' lock, so one client's new id never holds
up the others; a request may make ``MAX_LOOKUPS_PER_REQUEST`` lookups, the scorer keeps at most
``MAX_WRITER_SCHEMAS`` schemas and remembers ``MAX_REFUSED_IDS`` ids it refused, so clients that
make up ids cost a bounded number of lookups and bounded memory.
"""

from __future__ import annotations

import base64
import io
import threading
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import fastavro

from streamtrain.config import FeaturesConfig
from streamtrain.decode import AvroBatchDecoder, ClickBatch
from streamtrain.delivery.artifact import ServableModel
from streamtrain.registry import BadWriterSchema, SchemaDirectory, SchemaRegistry, SchemaSource, SchemaSourceUnavailable
from streamtrain.source import RawEvent

MAX_WRITER_SCHEMAS = 256
MAX_REFUSED_IDS = 1024
MAX_LOOKUPS_PER_REQUEST = 4


class WriterSchemas:
    """The writer schemas a scorer decodes Confluent-framed events with, by id. The decoders ask
    ``writer_schema`` under their lock, and it answers from memory; ``admit`` looks up the ids a
    request brings beforehand, without that lock."""

    def __init__(self, known: dict[int, Any], lookup: SchemaSource | None, refused: dict[int, str] | None = None):
        """``known``: the schemas by id; ``lookup``: where to ask for others (None: nowhere);
        ``refused``: ids whose events are refused, and why."""
        self.known = known
        self.lookup = lookup
        self.refused: OrderedDict[int, str] = OrderedDict(refused or {})
        self._lock = threading.Lock()  # guards the two maps; never held while a lookup waits

    @classmethod
    def of(cls, features: FeaturesConfig) -> WriterSchemas | None:
        """A base's: read whole from its own ``writer_schemas/``, or looked up in its registry;
        None for raw payloads."""
        if features.wire_format == "raw":
            return None
        if features.schema_registry is not None:
            return cls({}, SchemaRegistry(features.schema_registry))
        folder = features.resolved_writer_schemas_dir()
        directory = SchemaDirectory(folder)
        known, refused = {}, {}
        for schema_id in sorted(int(f.stem) for f in folder.glob("*.avsc") if f.stem.isdigit()):
            try:
                known[schema_id] = directory.writer_schema(schema_id)
            except BadWriterSchema as why:
                refused[schema_id] = f"writer schema {schema_id}: {why}"
        return cls(known, None, refused)

    def writer_schema(self, schema_id: int) -> Any:
        return self.known.get(schema_id)

    def admit(self, ids: Iterable[int]) -> dict[int, str]:
        """Why the events of each of ``ids`` cannot be decoded (absent: they can), after looking
        up at most ``MAX_LOOKUPS_PER_REQUEST`` ids not seen before."""
        problems: dict[int, str] = {}
        lookups = 0
        for schema_id in ids:
            with self._lock:
                if schema_id in self.known:
                    continue
                why = self.refused.get(schema_id)
                if why is not None:
                    self.refused.move_to_end(schema_id)
                elif self.lookup is None:
                    why = f"unknown schema id {schema_id}: the base holds no writer schema of that id"
                elif len(self.known) >= MAX_WRITER_SCHEMAS:
                    why = f"schema id {schema_id} refused: this base's server knows {MAX_WRITER_SCHEMAS} writer schemas"
            if why is None and lookups >= MAX_LOOKUPS_PER_REQUEST:
                why = f"schema id {schema_id} not looked up: at most {MAX_LOOKUPS_PER_REQUEST} new ids a request"
            if why is not None:
                problems[schema_id] = why
                continue
            assert self.lookup is not None
            lookups += 1
            try:
                schema = self.lookup.writer_schema(schema_id)
            except SchemaSourceUnavailable as error:  # not remembered: the next request asks again
                problems[schema_id] = f"schema id {schema_id}: the schema registry did not answer: {error}"
                lookups = MAX_LOOKUPS_PER_REQUEST  # nor is it asked again in this request: it waited enough
                continue
            except BadWriterSchema as error:
                schema, why = None, f"writer schema {schema_id}: {error}"
            with self._lock:
                if schema is not None:
                    self.known[schema_id] = schema
                    continue
                self.refused[schema_id] = problems[schema_id] = why or f"unknown schema id {schema_id}"
                while len(self.refused) > MAX_REFUSED_IDS:
                    self.refused.popitem(last=False)
        return problems


class Scorer:
    """Turns a score request's events into batches with the worker's own decoder, for one base."""

    def __init__(self, model: ServableModel):
        features = model.features
        # Serving events carry no outcome yet: a missing label must not reject them.
        self.tasks = [t.model_copy(update={"required": False}) for t in model.tasks]
        self.schemas = WriterSchemas.of(features)
        self.avro = AvroBatchDecoder(features, self.schemas, self.tasks)
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
                except Exception as error:  # fastavro's, by field: a wrong type, a number out of range, ...
                    results[index] = {"error": f"not an event of the reader schema: {error!r:.300}"}
            else:
                results[index] = {"error": "an event is a base64 string (Avro) or a JSON object"}
        if self.schemas is not None and avro:
            avro = self._admitted(avro, results)
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

    def _admitted(self, events: list[RawEvent], results: list[dict[str, Any]]) -> list[RawEvent]:
        """The events whose writer schema is known, after looking up new ids (outside the decoders'
        lock); the others get their error. Unframed ones are the decoder's to refuse."""
        assert self.schemas is not None
        framed = {e.offset: e.value for e in events if e.value is not None and len(e.value) >= 5 and e.value[0] == 0}
        ids = {index: int.from_bytes(value[1:5], "big") for index, value in framed.items()}
        problems = self.schemas.admit(dict.fromkeys(ids.values()))
        for index, schema_id in ids.items():
            if schema_id in problems:
                results[index] = {"error": problems[schema_id]}
        return [e for e in events if ids.get(e.offset) not in problems]


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
