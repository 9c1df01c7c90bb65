"""Stage 2, decode: Avro payloads -> columns -> a KeyedJaggedTensor batch.

``ClickBatch`` is the data currency from here to the trainer: one KJT key per embedding table,
a dense float matrix, the labels, and the Kafka positions the batch covers.

``AvroBatchDecoder`` decodes a whole batch in one call of a numba interpreter running a program
compiled from the writer schema, the reader schema and the feature config (``avro_program``): one
contiguous buffer plus offsets in; per-table rows and lengths, dense features, labels, event times
and a status per event out; no Python object per event. A writer schema the program compiler does
not support is decoded by ``FastavroDecoder`` (fastavro plus a Python loop; also the benchmark's
baseline), with a log line. Both paths give the same columns for the same bytes.

Ids reach their tables by a documented, stable mapping (``map_ids``), identical in both paths:
  - integers, ``modulo``: ``id mod num_embeddings`` with floor semantics, so -1 -> n-1;
  - integers, ``hash``: ``splitmix64(id as two's-complement uint64) mod num_embeddings``;
  - strings and bytes: first ``fnv1a64`` of the bytes (UTF-8 for strings; a string's bytes are
    hashed as they are, valid UTF-8 or not) as an unsigned id, then as above;
  - enums: the reader's symbol index; booleans: 0 or 1.
Dense features, labels: the number as float64, the transform applied, then float32. A null dense
value is 0.0; a null label rejects the event, and so does one outside [0, 1] (NaN included): the
loss is binary cross-entropy, and one such target would turn the model's weights to NaN. Event time: timestamp-millis (or a plain long) as
is, timestamp-micros floor-divided by 1000; null is 0.

Every rejected payload gets one of ``REASONS``. Decode errors come first, then trailing bytes,
then a missing label, a label outside [0, 1], then non-finite dense values. ``features.non_finite_dense: clip`` keeps
such events instead: NaN becomes 0, +-inf (and finite values past float32's range) +-float32 max.
"""

from __future__ import annotations

import io
import logging
import math
from dataclasses import dataclass, field, replace
from typing import Any

import fastavro
import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from torchrec.streamable import Pipelineable

from streamtrain import avro_program as ap
from streamtrain.avro_program import REASONS, fnv1a64
from streamtrain.config import FeaturesConfig, TableConfig
from streamtrain.schema import field_schema, load_schema, without_logical_types
from streamtrain.source import RawEvent

log = logging.getLogger(__name__)


def splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser over uint64 arrays (wrapping arithmetic)."""
    z = x.astype(np.uint64, copy=True)
    with np.errstate(over="ignore"):
        z += np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def map_ids(raw: np.ndarray, table: TableConfig) -> np.ndarray:
    """Table rows for raw ids (int64, or uint64 from string hashes)."""
    n = table.num_embeddings
    if table.id_mapping == "hash":
        return (splitmix64(raw.astype(np.uint64)) % np.uint64(n)).astype(np.int64)
    if raw.dtype == np.uint64:
        return (raw % np.uint64(n)).astype(np.int64)
    return np.mod(raw, n)


@dataclass(frozen=True)
class PartitionSpan:
    """How many events of one partition a batch holds, and the offset after its last one."""
    events: int
    next_offset: int


@dataclass(frozen=True)
class ClickBatch(Pipelineable):
    """A decoded batch, complete when made: the decoder makes it as if trained alone, and the
    lockstep makes the one that trains (``in_global_step``)."""
    dense_features: torch.Tensor  # [B, num_dense] float32
    sparse_features: KeyedJaggedTensor  # one key per table, B lengths per key
    labels: torch.Tensor  # [B] float32
    event_time_ms: torch.Tensor  # [B] int64
    # Multiplies the summed loss: world_size / global batch size, so an empty batch adds zero
    # and gradients match TorchRec's usual per-rank mean when batches are even.
    loss_scale: torch.Tensor
    spans: dict[int, PartitionSpan] = field(default_factory=dict)
    # Events in this batch's step over all ranks.
    global_batch_size: int = 0

    @property
    def size(self) -> int:
        return int(self.labels.shape[0])

    def in_global_step(self, global_batch_size: int, world_size: int) -> "ClickBatch":
        """This batch as one rank's part of a step of ``global_batch_size`` events over ``world_size`` ranks."""
        return replace(self, global_batch_size=global_batch_size,
                       loss_scale=torch.tensor(world_size / max(global_batch_size, 1), dtype=torch.float32))

    def to(self, device: torch.device, non_blocking: bool = False) -> "ClickBatch":
        return replace(
            self,
            dense_features=self.dense_features.to(device, non_blocking=non_blocking),
            sparse_features=self.sparse_features.to(device, non_blocking=non_blocking),
            labels=self.labels.to(device, non_blocking=non_blocking),
            event_time_ms=self.event_time_ms.to(device, non_blocking=non_blocking),
            loss_scale=self.loss_scale.to(device, non_blocking=non_blocking),
        )

    def record_stream(self, stream: torch.Stream) -> None:
        for tensor in (self.dense_features, self.labels, self.event_time_ms, self.loss_scale):
            tensor.record_stream(stream)
        self.sparse_features.record_stream(stream)


@dataclass
class DecodeResult:
    batch: ClickBatch
    # (event, reason) for every payload that could not become a training example
    rejected: list[tuple[RawEvent, str]]


class AvroBatchDecoder:
    """Decodes a batch of Avro payloads into a ``ClickBatch`` with compiled programs.

    ``features.wire_format`` raw: schemaless bodies written with the reader schema.
    confluent: magic byte 0, a 4-byte big-endian schema id, then the body written with the writer
    schema ``schema_source.writer_schema(id)`` returns (None: an unknown id), resolved to the reader
    schema. One program is built per writer schema id, on first sight, and kept.
    """

    def __init__(self, features: FeaturesConfig, schema_source: Any = None):
        self.features = features
        self.confluent = features.wire_format == "confluent"
        self.clip = features.non_finite_dense == "clip"
        self.reader = load_schema(features.resolved_schema_path())
        self.plan = feature_plan(features, self.reader)
        self.fallback = FastavroDecoder(features, schema_source)
        self.keys = [t.name for t in features.tables]
        self.code = np.zeros(0, np.int64)  # every program built so far, one after another
        # schema id (None in raw mode) -> its program's start in self.code, or _FALLBACK, _UNKNOWN
        self.entries: dict[int | None, int] = {}
        self.programs: dict[int | None, ap.Program] = {}
        if not self.confluent:
            self._entry(None)

    def _entry(self, schema_id: int | None) -> int:
        if schema_id in self.entries:
            return self.entries[schema_id]
        writer = self.reader if schema_id is None else self.fallback.writer_schema(schema_id)
        if writer is None:
            log.error("schema id %s is unknown: its events are rejected as unknown_schema_id", schema_id)
            entry = _UNKNOWN
        else:
            try:
                program = ap.compile_program(writer, self.reader, self.plan)
            except ap.Unsupported as why:
                log.warning("writer schema %s cannot be compiled (%s): decoding its events with fastavro, "
                            "which is several times slower", "(raw)" if schema_id is None else schema_id, why)
                entry = _FALLBACK
            else:
                self.programs[schema_id] = program
                entry = len(self.code)
                self.code = np.concatenate((self.code, program.code))
        self.entries[schema_id] = entry
        return entry

    def describe(self, schema_id: int | None = None) -> str:
        """The program that decodes ``schema_id``'s payloads, one instruction a line."""
        self._entry(schema_id)
        return self.programs[schema_id].describe() if schema_id in self.programs else "(decoded with fastavro)"

    def decode(self, events: list[RawEvent]) -> DecodeResult:
        n, tables, dense_count = len(events), len(self.features.tables), len(self.features.dense)
        payloads = [event.value or b"" for event in events]
        sizes = np.fromiter(map(len, payloads), dtype=np.int64, count=n)
        ends = np.cumsum(sizes)
        starts = ends - sizes
        buf = np.frombuffer(b"".join(payloads), dtype=np.uint8)
        status = np.where(sizes == 0, ap.EMPTY_PAYLOAD, ap.OK).astype(np.int8)
        entry = np.full(n, -1, dtype=np.int64)
        schema_ids = np.full(n, -1, dtype=np.int64)
        if self.confluent:
            ap.parse_frames(buf, starts, ends, status, schema_ids)
            framed = status == ap.OK
            for schema_id in np.unique(schema_ids[framed]).tolist():
                self._assign(self._entry(schema_id), framed & (schema_ids == schema_id), entry, status)
        else:
            self._assign(self._entry(None), status == ap.OK, entry, status)
        lengths = np.zeros((tables, n), dtype=np.int32)
        dense = np.zeros((n, dense_count), dtype=np.float32)
        labels = np.zeros(n, dtype=np.float32)
        times = np.zeros(n, dtype=np.int64)
        rows, row_table, first, stop = ap.run_batch(
            buf, starts, ends, entry, self.code, self.clip, status, lengths, dense, labels, times)
        slow = np.flatnonzero(status == ap.NOT_MINE)
        if slow.size:
            rows, row_table, first, stop = self._decode_slowly(
                slow, payloads, schema_ids, (status, lengths, dense, labels, times),
                (rows, row_table, first, stop))
        values = ap.gather_rows(rows, row_table, first, stop, status, lengths)
        return _result(events, self.keys, status, lengths, dense, labels, times, values)

    @staticmethod
    def _assign(program: int, events: np.ndarray, entry: np.ndarray, status: np.ndarray) -> None:
        if program >= 0:
            entry[events] = program
        else:
            status[events] = ap.UNKNOWN_SCHEMA_ID if program == _UNKNOWN else ap.NOT_MINE

    def _decode_slowly(self, slow, payloads, schema_ids, columns, event_rows):
        """fastavro for the events whose schema has no program; their rows join the others'."""
        status, lengths, dense, labels, times = columns
        bodies = [payloads[i][5:] if self.confluent else payloads[i] for i in slow.tolist()]
        writers = [int(schema_ids[i]) if self.confluent else None for i in slow.tolist()]
        part = self.fallback.columns(bodies, writers)
        status[slow], lengths[:, slow], dense[slow], labels[slow], times[slow] = \
            part.status, part.lengths, part.dense, part.labels, part.times
        # Back to event-major rows, the slow events' after the compiled ones.
        rows, row_table, first, stop = event_rows
        owner = np.concatenate([np.repeat(slow, part.lengths[t]) for t in range(len(part.values))])
        tags = np.concatenate([np.full(len(v), t, np.int32) for t, v in enumerate(part.values)])
        order = np.argsort(owner, kind="stable")
        first, stop = first.copy(), stop.copy()
        per_event = np.bincount(owner, minlength=len(status))[slow]
        first[slow] = len(rows) + np.concatenate(([0], np.cumsum(per_event)[:-1]))
        stop[slow] = first[slow] + per_event
        values = np.concatenate(part.values) if part.values else np.zeros(0, np.int64)
        return (np.concatenate((rows, values[order])), np.concatenate((row_table, tags[order])), first, stop)


_FALLBACK, _UNKNOWN = -2, -3


def feature_plan(features: FeaturesConfig, reader: dict) -> ap.FeaturePlan:
    """Which reader fields feed which table, dense column, the label and the event time."""
    plan = ap.FeaturePlan()
    for t, table in enumerate(features.tables):
        plan.add(table.field, ap.Sink(ap.ID, (t, table.num_embeddings, 1 if table.id_mapping == "hash" else 0),
                                      f"-> table {table.name} ({table.id_mapping})"))
    for d, dense in enumerate(features.dense):
        plan.add(dense.field, ap.Sink(ap.DENSE, (d, 1 if dense.transform == "log1p" else 0),
                                      f"-> dense {d} ({dense.transform})"))
    plan.add(features.label, ap.Sink(ap.LABEL, (), "-> label"))
    divisor = _time_divisor(reader, features.event_time)
    plan.add(features.event_time,
             ap.Sink(ap.TIME, (divisor,), "-> event time" + (" (us -> ms)" if divisor > 1 else "")))
    return plan


def _time_divisor(reader: dict, path: str) -> int:
    avro_type = field_schema(reader, path)
    micros = isinstance(avro_type, dict) and avro_type.get("logicalType") == "timestamp-micros"
    return 1000 if micros else 1


@dataclass
class _Columns:
    status: np.ndarray  # int8 [n], 0 = decoded, else REASONS index + 1
    lengths: np.ndarray  # int32 [tables, n]
    dense: np.ndarray  # float32 [n, dense]
    labels: np.ndarray  # float32 [n]
    times: np.ndarray  # int64 [n]
    values: list[np.ndarray]  # per table, the rows of the decoded events in event order


class FastavroDecoder:
    """fastavro's schemaless_reader per payload and a Python loop building the columns: the path
    for writer schemas the compiler does not support, and the benchmark's baseline.

    Strings are read as bytes (the wire format is the same) so that ids hash the bytes exactly as
    the compiled path does, valid UTF-8 or not.
    """

    def __init__(self, features: FeaturesConfig, schema_source: Any = None):
        self.features = features
        self.schema_source = schema_source
        self.confluent = features.wire_format == "confluent"
        self.clip = features.non_finite_dense == "clip"
        reader = load_schema(features.resolved_schema_path())
        self.reader = fastavro.parse_schema(_strings_as_bytes(without_logical_types(reader)))
        self.keys = [t.name for t in features.tables]
        self.paths = {
            "tables": [tuple(t.field.split(".")) for t in features.tables],
            "dense": [tuple(d.field.split(".")) for d in features.dense],
            "label": tuple(features.label.split(".")),
            "time": tuple(features.event_time.split(".")),
        }
        self.divisor = _time_divisor(reader, features.event_time)
        self.symbols = [_enum_index(field_schema(reader, t.field)) for t in features.tables]
        self.sources: dict[int, dict | None] = {}
        self.writers: dict[int | None, Any] = {None: None}

    def writer_schema(self, schema_id: int) -> dict | None:
        """The schema source's answer for ``schema_id``, asked once."""
        if schema_id not in self.sources:
            self.sources[schema_id] = self.schema_source.writer_schema(schema_id)
        return self.sources[schema_id]

    def _writer(self, schema_id: int | None) -> Any:
        """The parsed writer schema (None: the reader's own); raises again for one that is not Avro."""
        if schema_id not in self.writers:
            try:
                self.writers[schema_id] = fastavro.parse_schema(
                    _strings_as_bytes(without_logical_types(self.writer_schema(schema_id))))
            except Exception as error:  # fastavro's SchemaParseException, or a schema of the wrong shape
                log.error("writer schema %s is not valid Avro (%s): its events are undecodable", schema_id, error)
                self.writers[schema_id] = error
        if isinstance(self.writers[schema_id], Exception):
            raise self.writers[schema_id]
        return self.writers[schema_id]

    def decode(self, events: list[RawEvent]) -> DecodeResult:
        bodies, writers, early = [], [], np.zeros(len(events), np.int8)
        for i, event in enumerate(events):
            payload = event.value or b""
            schema_id = None
            if not payload:
                early[i] = ap.EMPTY_PAYLOAD
            elif self.confluent:
                if len(payload) < 5 or payload[0] != 0:
                    early[i] = ap.BAD_MAGIC_BYTE
                else:
                    schema_id = int.from_bytes(payload[1:5], "big")
                    if self.writer_schema(schema_id) is None:
                        early[i] = ap.UNKNOWN_SCHEMA_ID
                    payload = payload[5:]
            bodies.append(payload)
            writers.append(schema_id)
        part = self.columns(bodies, writers, early)
        values = np.concatenate(part.values) if part.values else np.zeros(0, np.int64)
        return _result(events, self.keys, part.status, part.lengths, part.dense, part.labels, part.times, values)

    def columns(self, bodies: list[bytes], writers: list[int | None], early: np.ndarray | None = None) -> _Columns:
        """The columns of Avro ``bodies``, each written with the writer schema of its id (None:
        the reader schema); events with a nonzero ``early`` status are rejected with it."""
        features, paths = self.features, self.paths
        n = len(bodies)
        status = np.zeros(n, np.int8) if early is None else early.copy()
        ids: list[list[Any]] = [[] for _ in features.tables]
        lengths = np.zeros((len(features.tables), n), dtype=np.int32)
        dense = np.zeros((n, len(features.dense)), dtype=np.float32)
        labels = np.zeros(n, dtype=np.float32)
        times = np.zeros(n, dtype=np.int64)
        # A number past float32's range becomes inf, as it does in the compiled path.
        with np.errstate(over="ignore"):
            for i, body in enumerate(bodies):
                if status[i]:
                    continue
                buffer = io.BytesIO(body)
                try:
                    writer = self._writer(writers[i])
                    record = fastavro.schemaless_reader(buffer, writer or self.reader, self.reader if writer else None)
                except EOFError:
                    status[i] = ap.TRUNCATED
                    continue
                except Exception:  # fastavro raises ValueError, IndexError, SchemaResolutionError, ...
                    status[i] = ap.UNDECODABLE
                    continue
                if buffer.tell() != len(body):
                    status[i] = ap.TRAILING_BYTES
                    continue
                label = _get(record, paths["label"])
                if label is None:
                    status[i] = ap.MISSING_LABEL
                    continue
                if not 0.0 <= np.float32(label) <= 1.0:
                    status[i] = ap.BAD_LABEL
                    continue
                row = [_transform(_get(record, path), d.transform) for path, d in zip(paths["dense"], features.dense)]
                if not all(ap.is_finite_float32(v) for v in row):
                    if not self.clip:
                        status[i] = ap.NON_FINITE_DENSE
                        continue
                    row = [_clipped(v) for v in row]
                for t, path in enumerate(paths["tables"]):
                    value = _get(record, path)
                    values = () if value is None else value if isinstance(value, list) else (value,)
                    ids[t].extend(values)
                    lengths[t, i] = len(values)
                dense[i] = row
                labels[i] = float(label)
                time = _get(record, paths["time"])
                times[i] = 0 if time is None else int(time) // self.divisor
        values = [map_ids(_as_id_array(table_ids, symbols), table)
                  for table_ids, table, symbols in zip(ids, features.tables, self.symbols)]
        return _Columns(status, lengths, dense, labels, times, values)


def _result(events: list[RawEvent], keys: list[str], status: np.ndarray, lengths: np.ndarray, dense: np.ndarray,
            labels: np.ndarray, times: np.ndarray, values: np.ndarray) -> DecodeResult:
    kept = status == ap.OK
    count = int(kept.sum())
    everything = count == len(events)
    batch = ClickBatch(
        dense_features=torch.from_numpy(dense if everything else dense[kept]),
        sparse_features=KeyedJaggedTensor(
            keys=keys,
            values=torch.from_numpy(values),
            lengths=torch.from_numpy(np.ascontiguousarray(lengths if everything else lengths[:, kept]).reshape(-1)),
        ),
        labels=torch.from_numpy(labels if everything else labels[kept]),
        event_time_ms=torch.from_numpy(times if everything else times[kept]),
        loss_scale=torch.tensor(1.0 / max(count, 1)),
        spans=_spans(events, kept),
        global_batch_size=count,
    )
    rejected = [(events[i], REASONS[status[i] - 1]) for i in np.flatnonzero(~kept).tolist()]
    return DecodeResult(batch, rejected)


def _spans(events: list[RawEvent], kept: np.ndarray) -> dict[int, PartitionSpan]:
    """Per partition: the events kept for training, and the offset after the last one consumed.

    Rejected events move the position too: they were consumed, and went to the dead-letter path.
    One Python step per partition, not per event."""
    if not events:
        return {}
    partitions = np.fromiter((e.partition for e in events), dtype=np.int64, count=len(events))
    offsets = np.fromiter((e.offset for e in events), dtype=np.int64, count=len(events))
    spans = {}
    for p in np.unique(partitions).tolist():
        mine = partitions == p
        spans[p] = PartitionSpan(int((mine & kept).sum()), int(offsets[mine].max()) + 1)
    return spans


def _get(record: Any, path: tuple[str, ...]) -> Any:
    for name in path:
        if not isinstance(record, dict):
            return None
        record = record.get(name)
    return record


def _transform(value: float | int | bool | None, transform: str) -> float:
    if value is None:
        return 0.0
    value = float(value)
    if transform == "log1p":
        return math.log1p(value) if value > -1.0 else float("nan")
    return value


def _clipped(value: float) -> float:
    if math.isnan(value):
        return 0.0
    return value if ap.is_finite_float32(value) else math.copysign(ap.FLOAT32_MAX, value)


def _enum_index(avro_type: Any) -> dict[str, int] | None:
    """Symbol -> index for an enum (or array of enums) feature, else None."""
    if isinstance(avro_type, dict) and avro_type.get("type") == "array":
        avro_type = avro_type["items"]
    if isinstance(avro_type, dict) and avro_type.get("type") == "enum":
        return {s: i for i, s in enumerate(avro_type["symbols"])}
    return None


def _as_id_array(values: list[Any], symbols: dict[str, int] | None = None) -> np.ndarray:
    if symbols is not None:
        return np.fromiter((symbols[v] for v in values), dtype=np.int64, count=len(values))
    if values and isinstance(values[0], (str, bytes)):
        return np.fromiter((fnv1a64(v) for v in values), dtype=np.uint64, count=len(values))
    return np.asarray(values, dtype=np.int64)


def _strings_as_bytes(schema: Any) -> Any:
    """The same wire format with strings read as bytes, except in a union that already has bytes."""
    if isinstance(schema, list):
        keep = "bytes" in schema
        return [s if keep and s == "string" else _strings_as_bytes(s) for s in schema]
    if isinstance(schema, dict):
        if schema.get("type") == "string":
            return {**schema, "type": "bytes"}
        return {k: (v if k in ("default", "symbols", "name", "namespace", "doc", "aliases") else _strings_as_bytes(v))
                for k, v in schema.items()}
    return "bytes" if schema == "string" else schema
