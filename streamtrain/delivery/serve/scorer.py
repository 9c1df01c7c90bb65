"""The scorer: a score request's events made into batches with the worker's own decoder, for one base."""

from __future__ import annotations

import base64
import io
import threading
from typing import Any

import fastavro

from streamtrain.decode import AvroBatchDecoder, ClickBatch
from streamtrain.delivery.artifact import ServableModel
from streamtrain.registry import schema_source
from streamtrain.source import RawEvent


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
