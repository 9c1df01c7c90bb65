"""Stage 2, decode: Avro payloads -> columns -> a KeyedJaggedTensor batch.

``ClickBatch`` is the data currency from here to the trainer: one KJT key per embedding table,
a dense float matrix, the labels, and the Kafka positions the batch covers.

``AvroBatchDecoder`` decodes a whole batch in one call of a numba interpreter running a program
compiled from the writer schema, the reader schema and the feature config (``avro_program``): one
contiguous buffer plus offsets in; per-table rows and lengths, dense features, labels, event times
and a status per event out; no Python object per event. A writer schema the program compiler does
not support is decoded by ``FastavroDecoder`` (fastavro plus a Python loop; also the benchmark's
baseline), with a log line. Both paths give the same columns, and the same reasons, for the same bytes.

``threads`` (batching.decode_threads; docs/datapath.md) decodes a batch on several threads: it is
cut into slices of consecutive events, each slice's program runs on its own thread without the GIL
and writes into the batch's columns, and each slice then scatters its rows into its own place in
the KJT's values. Why slices of one batch, not whole batches decoded side by side: a batch keeps
its place, its spans and the moment its rejections are dead-lettered, with nothing to reorder, and
a large batch's delay shrinks with the threads instead of growing with batches in flight. Why a
small pool of our own threads, not numba's ``parallel=True``/``prange``: the interpreter already
releases the GIL, and ``prange`` would bring a threading layer (OpenMP or TBB) with a pool of its
own beside torch's and librdkafka's, sized apart from the config, unnamed for ``top -H`` and
``bench e2e``'s CPU split, and not under SCHED_BATCH. On one thread the stage's work outside the
slices (framing, the columns' set-up, the spans, the KJT) is about 5% of its CPU. What the slices
share they must not write side by side: each scatter moves its own copy of its cursors (two
threads moving cursors that shared a cache line cost the stage a fifth of its speed).

Ids reach their tables by a documented, stable mapping (``map_ids``), identical in both paths:
  - integers, ``modulo``: ``id mod num_embeddings`` with floor semantics, so -1 -> n-1;
  - integers, ``hash``: ``splitmix64(id as two's-complement uint64) mod num_embeddings``;
  - strings and bytes: first ``fnv1a64`` of the bytes (UTF-8 for strings; a string's bytes are
    hashed as they are, valid UTF-8 or not) as an unsigned id, then as above;
  - enums: the reader's symbol index; booleans: 0 or 1;
  - ``managed``: the 64-bit id itself (a string's hash as int64), which ``streamtrain.idspace``
    turns into a row just before training.
Dense features, labels: the number as float64, the transform applied, then float32. A null dense
value is 0.0. There is a label per task (``model.tasks``; one, ``features.label``, by default). A
null label rejects the event when its task is required; otherwise it is NaN, which masks the
event's loss for that task. A label outside [0, 1] (NaN included) rejects the event: the loss is
binary cross-entropy, and one such target would turn the model's weights to NaN. Event
time: timestamp-millis (or a plain long) as is, timestamp-micros floor-divided by 1000; null is 0.
A writer's null where the reader's type has none (e.g. a nullable label the reader declares an
int) is such a null too.

With ``delayed_labels`` (docs/delayed-labels.md) each event's sample kind, impression id and
impression time are read too (``SampleColumns``). A late label's null labels are masked whatever
``required`` says, and so are its labels other than 1: it carries positives only. Its positive is
masked too (and counted) when its delay, event time less impression time, is past its task's
attribution window.

Every rejected payload gets one of ``REASONS``. Decode errors come first, then trailing bytes, an
unknown sample kind, then a missing label, a label outside [0, 1], a sample without its impression's
id and time, a late label without a positive, then non-finite dense values. ``features.non_finite_dense: clip`` keeps
such events instead: NaN becomes 0, +-inf (and finite values past float32's range) +-float32 max.
Whole writer schemas fail too: an id the source does not know is ``unknown_schema_id``; a schema
that is not valid Avro (not JSON, not a schema) is ``bad_writer_schema``; one Avro's rules cannot
resolve to the reader makes its events ``undecodable``. Each is logged once per id, as an ERROR.
A reason that says more than its code is ``"code: detail"`` (the detail names the schema id and
why, or fastavro's error), and the dead letter carries it.
"""

from __future__ import annotations

import io
import itertools
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import fastavro
import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from torchrec.streamable import Pipelineable

from streamtrain import avro_program as ap
from streamtrain.avro_program import REASONS, fnv1a64
from streamtrain.config import SAMPLE_KINDS, DelayedLabelsConfig, FeaturesConfig, TableConfig, TaskConfig, default_tasks
from streamtrain.registry import BadWriterSchema
from streamtrain.schema import field_schema, load_schema, without_logical_types
from streamtrain.source import EventBatch, RawEvent
from streamtrain.threads import DECODE, Slices

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
    if table.id_mapping == "managed":  # the raw id; streamtrain/idspace.py gives it a row
        return raw.view(np.int64) if raw.dtype == np.uint64 else raw.astype(np.int64, copy=False)
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
class SampleColumns:
    """A batch's late-label columns (``delayed_labels``; docs/delayed-labels.md). What the loss reads
    (``kind``, ``late_share``) goes to the trainer's device with the batch; the rest stays on the host,
    for the metrics and the snapshot."""

    kind: torch.Tensor  # [B] int8: ap.PLAIN, ap.IMPRESSION or ap.LATE_LABEL
    delay_ms: torch.Tensor  # [B] int64: event time less impression time; 0 for a plain event
    impression_id: torch.Tensor  # [B] int64; 0 for a plain event
    # Per partition, [2, tasks]: positives known when their impression was emitted, and late labels'
    # positives within the window: what the share of late positives is estimated from.
    positives: dict[int, np.ndarray]
    past_window: np.ndarray  # [tasks] int64: late labels past their task's window, masked
    partition: np.ndarray  # [B] int64: each event's partition
    # [tasks]: the share of positives that arrive late, as the trainer estimated it before this batch
    late_share: torch.Tensor | None = None

    def to(self, device: torch.device, non_blocking: bool = False) -> SampleColumns:
        return replace(
            self,
            kind=self.kind.to(device, non_blocking=non_blocking),
            late_share=None if self.late_share is None else self.late_share.to(device, non_blocking=non_blocking),
        )

    def pin_memory(self) -> SampleColumns:
        return replace(
            self,
            kind=self.kind.pin_memory(),
            late_share=None if self.late_share is None else self.late_share.pin_memory(),
        )

    def record_stream(self, stream: torch.Stream) -> None:
        for tensor in (self.kind, self.late_share):
            if tensor is not None:
                tensor.record_stream(stream)


@dataclass(frozen=True)
class ClickBatch(Pipelineable):
    """A decoded batch, complete when made: the decoder makes it as if trained alone, and the
    lockstep makes the one that trains (``in_global_step``)."""

    dense_features: torch.Tensor  # [B, num_dense] float32
    sparse_features: KeyedJaggedTensor  # one key per table, B lengths per key
    # float32, [B] with one task, [B, tasks] with several; NaN: a masked label
    labels: torch.Tensor
    event_time_ms: torch.Tensor  # [B] int64
    # Multiplies the summed loss: world_size / global batch size, so an empty batch adds zero
    # and gradients match TorchRec's usual per-rank mean when batches are even.
    loss_scale: torch.Tensor
    spans: dict[int, PartitionSpan] = field(default_factory=dict)
    # Events in this batch's step over all ranks.
    global_batch_size: int = 0
    samples: SampleColumns | None = None  # with delayed_labels

    @property
    def size(self) -> int:
        return int(self.labels.shape[0])

    def in_global_step(self, global_batch_size: int, world_size: int) -> ClickBatch:
        """This batch as one rank's part of a step of ``global_batch_size`` events over ``world_size`` ranks."""
        return replace(
            self,
            global_batch_size=global_batch_size,
            # Pinned like the rest of the batch when it was pinned, so its copy is asynchronous too.
            loss_scale=torch.tensor(
                world_size / max(global_batch_size, 1), dtype=torch.float32, pin_memory=self.loss_scale.is_pinned()
            ),
        )

    def to(self, device: torch.device, non_blocking: bool = False) -> ClickBatch:
        return replace(
            self,
            dense_features=self.dense_features.to(device, non_blocking=non_blocking),
            sparse_features=self.sparse_features.to(device, non_blocking=non_blocking),
            labels=self.labels.to(device, non_blocking=non_blocking),
            event_time_ms=self.event_time_ms.to(device, non_blocking=non_blocking),
            loss_scale=self.loss_scale.to(device, non_blocking=non_blocking),
            samples=None if self.samples is None else self.samples.to(device, non_blocking=non_blocking),
        )

    def pin_memory(self) -> ClickBatch:
        """This batch in page-locked host memory, from which the pipeline's copies to the GPU do
        not block the host (needs CUDA)."""
        return replace(
            self,
            dense_features=self.dense_features.pin_memory(),
            sparse_features=self.sparse_features.pin_memory(),
            labels=self.labels.pin_memory(),
            event_time_ms=self.event_time_ms.pin_memory(),
            loss_scale=self.loss_scale.pin_memory(),
            samples=None if self.samples is None else self.samples.pin_memory(),
        )

    def record_stream(self, stream: torch.Stream) -> None:
        for tensor in (self.dense_features, self.labels, self.event_time_ms, self.loss_scale):
            tensor.record_stream(stream)
        self.sparse_features.record_stream(stream)
        if self.samples is not None:
            self.samples.record_stream(stream)


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

    def __init__(
        self,
        features: FeaturesConfig,
        schema_source: Any = None,
        tasks: list[TaskConfig] | None = None,
        threads: int = 1,
        delayed: DelayedLabelsConfig | None = None,
    ):
        self.features = features
        self.slices = Slices(threads, MIN_SLICE_EVENTS, DECODE)
        self.tasks = tasks or default_tasks(features)
        self.required = np.array([t.required for t in self.tasks], dtype=np.bool_)
        self.confluent = features.wire_format == "confluent"
        self.clip = features.non_finite_dense == "clip"
        self.reader = load_schema(features.resolved_schema_path())
        self.late = None if delayed is None else LateLabels(delayed, self.reader, self.tasks)
        self.plan = feature_plan(features, self.reader, self.tasks, self.late)
        self.fallback = FastavroDecoder(features, schema_source, tasks=self.tasks, late=self.late)
        self.keys = [t.name for t in features.tables]
        self.code = np.zeros(0, np.int64)  # every program built so far, one after another
        # schema id (None in raw mode) -> its program's start in self.code, or one of _STATUS
        self.entries: dict[int | None, int] = {}
        self.failures: dict[int | None, str] = {}  # schema id -> why its events are rejected, for the detail
        self.programs: dict[int | None, ap.Program] = {}
        if not self.confluent:
            self._entry(None)

    def _entry(self, schema_id: int | None) -> int:
        if schema_id not in self.entries:
            self.entries[schema_id] = self._build(schema_id)
        return self.entries[schema_id]

    def _build(self, schema_id: int | None) -> int:
        name = "(raw)" if schema_id is None else schema_id
        try:
            writer = self.reader if schema_id is None else self.fallback.writer_schema(schema_id)
            if writer is None:
                log.error("schema id %s is unknown: its events are rejected as unknown_schema_id", schema_id)
                return _UNKNOWN
            program = ap.compile_program(writer, self.reader, self.plan)
        except BadWriterSchema as why:  # the fallback, which asked the source, logged it
            self.failures[schema_id] = str(why)
            return _BAD
        except ap.Unresolvable as why:
            log.error("events of writer schema %s will be dead-lettered: %s", name, why)
            self.failures[schema_id] = f"writer schema {name} cannot be resolved to the reader: {why}"
            return _UNRESOLVABLE
        except ap.Unsupported as why:
            log.warning(
                "writer schema %s cannot be compiled (%s): decoding its events with fastavro, "
                "which is several times slower",
                name,
                why,
            )
            return _FALLBACK
        self.programs[schema_id] = program
        entry = len(self.code)
        self.code = np.concatenate((self.code, program.code))
        return entry

    def describe(self, schema_id: int | None = None) -> str:
        """The program that decodes ``schema_id``'s payloads, one instruction a line."""
        self._entry(schema_id)
        return self.programs[schema_id].describe() if schema_id in self.programs else "(decoded with fastavro)"

    def decode(self, events: EventBatch | Sequence[RawEvent]) -> DecodeResult:
        if not isinstance(events, EventBatch):
            events = EventBatch.of_events(events)
        n, tables, dense_count = len(events), len(self.features.tables), len(self.features.dense)
        buf, sizes, ends = events.data, events.sizes, events.bounds[1:]
        starts = events.bounds[:-1].copy()  # the framing moves each start past its header
        status = np.where(sizes == 0, ap.EMPTY_PAYLOAD, ap.OK).astype(np.int8)
        entry = np.full(n, -1, dtype=np.int64)
        schema_ids = np.full(n, -1, dtype=np.int64)
        details: dict[int, str] = {}  # event -> the detail of its reason
        if self.confluent:
            ap.parse_frames(buf, starts, ends, status, schema_ids)
            framed = status == ap.OK
            for schema_id in _distinct(schema_ids[framed]):
                mine = framed & (schema_ids == schema_id)
                self._assign(self._entry(schema_id), mine, entry, status)
                if schema_id in self.failures:
                    details.update(dict.fromkeys(np.flatnonzero(mine).tolist(), self.failures[schema_id]))
        else:
            self._assign(self._entry(None), status == ap.OK, entry, status)
        # Left unset here: the program sets a decoded event's columns, the fastavro path its own,
        # and a rejected event's are never read. Only the lengths, which the program counts up,
        # are zeroed, by each slice's thread: on one thread that was a tenth of a batch's time.
        lengths = np.empty((tables, n), dtype=np.int32)
        dense = np.empty((n, dense_count), dtype=np.float32)
        labels = np.empty((n, len(self.tasks)), dtype=np.float32)
        times = np.empty(n, dtype=np.int64)
        samples = np.empty((n, 4), dtype=np.int64)

        def run(part: slice) -> _Rows:
            lengths[:, part] = 0
            rows = ap.run_batch(
                buf,
                starts[part],
                ends[part],
                entry[part],
                self.code,
                self.clip,
                status[part],
                lengths[:, part],
                dense[part],
                labels[part],
                self.required,
                times[part],
                samples[part],
            )
            return _Rows(part, *rows, ap.kept_rows(lengths[:, part], status[part]))

        decoded = self.slices.map(run, self.slices.cut(n))
        slow = np.flatnonzero(status == ap.NOT_MINE)
        if slow.size:
            rows = self._decode_slowly(
                slow,
                events.payloads,
                schema_ids,
                (status, lengths, dense, labels, times, samples),
                _Rows.joined(decoded),
                details,
            )
            decoded = [_Rows(slice(0, n), *rows, ap.kept_rows(lengths, status))]
        # Each slice's rows of table t follow the earlier slices' in the KJT's values.
        counts = np.array([part.counts for part in decoded], np.int64).reshape(len(decoded), tables)
        per_key = counts.sum(axis=0)
        cursors = np.cumsum(counts, axis=0) - counts + (np.cumsum(per_key) - per_key)
        values = np.empty(int(per_key.sum()), np.int64)
        self.slices.map(
            lambda part: ap.scatter_rows(
                part.rows, part.row_table, part.first, part.stop, status[part.events], values, part.cursor
            ),
            [replace(part, cursor=cursor) for part, cursor in zip(decoded, cursors, strict=True)],
        )
        columns = _Columns(status, lengths, dense, labels, times, [], details, samples)
        return _result(events, self.keys, columns, values, per_key.tolist(), self.late)

    @staticmethod
    def _assign(program: int, events: np.ndarray, entry: np.ndarray, status: np.ndarray) -> None:
        if program >= 0:
            entry[events] = program
        else:
            status[events] = _STATUS[program]

    def _decode_slowly(
        self,
        slow: np.ndarray,
        payloads: list[bytes],
        schema_ids: np.ndarray,
        columns: tuple[np.ndarray, ...],
        event_rows: tuple[np.ndarray, ...],
        details: dict[int, str],
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """fastavro for the events whose schema has no program; their rows join the others'."""
        status, lengths, dense, labels, times, samples = columns
        bodies = [payloads[i][5:] if self.confluent else payloads[i] for i in slow.tolist()]
        writers = [int(schema_ids[i]) if self.confluent else None for i in slow.tolist()]
        part = self.fallback.columns(bodies, writers)
        status[slow], lengths[:, slow], dense[slow], labels[slow], times[slow], samples[slow] = (
            part.status,
            part.lengths,
            part.dense,
            part.labels,
            part.times,
            part.samples,
        )
        details.update({int(slow[i]): detail for i, detail in part.details.items()})
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


def _distinct(ids: np.ndarray) -> list[int]:
    """The distinct ids, ascending. A stream is written with one schema most of the time, and
    ``np.unique`` sorts a batch's ids to find that out: 0.95 ms for 32,768 events, on the prefetch
    thread alone, against 0.08 ms for checking they all equal the first."""
    if len(ids) and (ids == ids[0]).all():
        return [int(ids[0])]
    return np.unique(ids).tolist()


# Below this many events a slice costs more in handing over than its thread gains.
MIN_SLICE_EVENTS = 1024


@dataclass(frozen=True)
class _Rows:
    """A slice's decoded rows, event by event: its event e's (counted from the slice's first) are
    rows[first[e]:stop[e]], of tables row_table[...]."""

    events: slice
    rows: np.ndarray
    row_table: np.ndarray
    first: np.ndarray
    stop: np.ndarray
    counts: np.ndarray  # per table, the rows of the slice's kept events
    cursor: np.ndarray | None = None  # per table, where the slice's rows go in the KJT's values

    @staticmethod
    def joined(parts: list[_Rows]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The slices' rows as one batch's: (rows, row_table, first, stop)."""
        shifts = np.cumsum([0] + [len(part.rows) for part in parts[:-1]])
        return (
            np.concatenate([part.rows for part in parts]),
            np.concatenate([part.row_table for part in parts]),
            np.concatenate([part.first + shift for part, shift in zip(parts, shifts, strict=True)]),
            np.concatenate([part.stop + shift for part, shift in zip(parts, shifts, strict=True)]),
        )


_FALLBACK, _UNKNOWN, _BAD, _UNRESOLVABLE = -2, -3, -4, -5
# What the events of a writer schema without a program get: NOT_MINE leaves them to fastavro.
_STATUS = {
    _FALLBACK: ap.NOT_MINE,
    _UNKNOWN: ap.UNKNOWN_SCHEMA_ID,
    _BAD: ap.BAD_WRITER_SCHEMA,
    _UNRESOLVABLE: ap.UNDECODABLE,
}


_ID_MODES = {"modulo": 0, "hash": 1, "managed": 2}


def feature_plan(
    features: FeaturesConfig, reader: dict, tasks: list[TaskConfig] | None = None, late: LateLabels | None = None
) -> ap.FeaturePlan:
    """Which reader fields feed which table, dense column, task label, the event time, and with
    ``late`` the sample's kind and impression."""
    plan = ap.FeaturePlan()
    for t, table in enumerate(features.tables):
        plan.add(
            table.field,
            ap.Sink(
                ap.ID,
                (t, table.num_embeddings, _ID_MODES[table.id_mapping]),
                f"-> table {table.name} ({table.id_mapping})",
            ),
        )
    for d, dense in enumerate(features.dense):
        plan.add(
            dense.field,
            ap.Sink(ap.DENSE, (d, 1 if dense.transform == "log1p" else 0), f"-> dense {d} ({dense.transform})"),
        )
    for t, task in enumerate(tasks or default_tasks(features)):
        plan.add(task.label, ap.Sink(ap.LABEL, (t,), f"-> label of task {task.name}"))
    divisor = _time_divisor(reader, features.event_time)
    plan.add(
        features.event_time, ap.Sink(ap.TIME, (divisor,), "-> event time" + (" (us -> ms)" if divisor > 1 else ""))
    )
    if late is not None:
        late.add_sinks(plan)
    return plan


def _signed(h: int) -> int:
    """An unsigned 64-bit hash as the interpreter's int64 register holds it."""
    return h - (1 << 64) if h >= 1 << 63 else h


class LateLabels:
    """How the decoders read ``delayed_labels``' fields, and what they make of them (the module
    docstring says what)."""

    def __init__(self, delayed: DelayedLabelsConfig, reader: dict, tasks: list[TaskConfig]):
        self.paths = {
            ap.SAMPLE_KIND: delayed.kind_field,
            ap.SAMPLE_IMPRESSION_ID: delayed.impression_id_field,
            ap.SAMPLE_IMPRESSION_TIME: delayed.impression_time_field,
        }
        kind = field_schema(reader, delayed.kind_field)
        if isinstance(kind, dict) and kind.get("type") == "enum":
            # the symbols' indexes, as the interpreter reads them and as fastavro names them
            self.kind_codes = tuple(kind["symbols"].index(symbol) for symbol in SAMPLE_KINDS)
        else:
            self.kind_codes = tuple(_signed(fnv1a64(symbol)) for symbol in SAMPLE_KINDS)
        self.divisor = _time_divisor(reader, delayed.impression_time_field)
        # A window is at most some days: milliseconds in float64 are exact.
        self.windows_ms = np.array([float(t.attribution_window_seconds or math.inf) * 1000 for t in tasks])

    def add_sinks(self, plan: ap.FeaturePlan) -> None:
        impression, label = self.kind_codes
        plan.add(self.paths[ap.SAMPLE_KIND], ap.Sink(ap.SAMPLE, (ap.SAMPLE_KIND, impression, label), "-> sample kind"))
        plan.add(
            self.paths[ap.SAMPLE_IMPRESSION_ID], ap.Sink(ap.SAMPLE, (ap.SAMPLE_IMPRESSION_ID, 0, 0), "-> impression id")
        )
        plan.add(
            self.paths[ap.SAMPLE_IMPRESSION_TIME],
            ap.Sink(ap.SAMPLE, (ap.SAMPLE_IMPRESSION_TIME, self.divisor, 0), "-> impression time"),
        )

    def kind_of(self, value: Any) -> int | None:
        """A kind as fastavro reads it (a symbol, or a string read as bytes) -> ap.IMPRESSION or
        ap.LATE_LABEL; ap.PLAIN for null; None for another value."""
        if value is None:
            return ap.PLAIN
        text = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
        return {SAMPLE_KINDS[0]: ap.IMPRESSION, SAMPLE_KINDS[1]: ap.LATE_LABEL}.get(text)

    def columns(
        self, samples: np.ndarray, labels: np.ndarray, times: np.ndarray, partitions: np.ndarray
    ) -> SampleColumns:
        """The kept events' columns, their late labels' labels masked (in place) as the module
        docstring says."""
        kind = samples[:, ap.SAMPLE_KIND]
        sample = kind != ap.PLAIN
        delay = np.where(sample, times - samples[:, ap.SAMPLE_IMPRESSION_TIME], 0)
        late = (kind == ap.LATE_LABEL)[:, None]
        positive = labels == 1.0
        past = late & positive & (delay[:, None] > self.windows_ms)
        labels[late & ~(positive & ~past)] = np.nan  # a late label carries its positives only
        counted = np.stack(((kind == ap.IMPRESSION)[:, None] & positive, late & positive & ~past))  # [2, n, tasks]
        positives = {}
        for p in np.unique(partitions).tolist():
            positives[p] = counted[:, partitions == p].sum(axis=1)
        return SampleColumns(
            kind=torch.from_numpy(kind.astype(np.int8)),
            delay_ms=torch.from_numpy(delay),
            impression_id=torch.from_numpy(np.where(sample, samples[:, ap.SAMPLE_IMPRESSION_ID], 0)),
            positives=positives,
            past_window=past.sum(axis=0),
            partition=partitions,
        )


def _time_divisor(reader: dict, path: str) -> int:
    avro_type = field_schema(reader, path)
    micros = isinstance(avro_type, dict) and avro_type.get("logicalType") == "timestamp-micros"
    return 1000 if micros else 1


@dataclass
class _Columns:
    status: np.ndarray  # int8 [n], 0 = decoded, else REASONS index + 1
    lengths: np.ndarray  # int32 [tables, n]
    dense: np.ndarray  # float32 [n, dense]
    labels: np.ndarray  # float32 [n, tasks]
    times: np.ndarray  # int64 [n]
    values: list[np.ndarray]  # per table, the rows of the decoded events in event order
    details: dict[int, str]  # event -> the detail of its reason, where there is one
    samples: np.ndarray  # int64 [n, 4]: the late-label fields, ap.SAMPLE_* columns


@dataclass(frozen=True)
class _FieldPaths:
    """Where each feature sits in a decoded record: its field's dotted path, split."""

    tables: list[tuple[str, ...]]
    dense: list[tuple[str, ...]]
    labels: list[tuple[str, ...]]
    time: tuple[str, ...]
    samples: dict[int, tuple[str, ...]]  # ap.SAMPLE_* slot -> path, with delayed_labels


class FastavroDecoder:
    """fastavro's schemaless_reader per payload and a Python loop building the columns: the path
    for writer schemas the compiler does not support, and the benchmark's baseline.

    Strings are read as bytes (the wire format is the same) so that ids hash the bytes exactly as
    the compiled path does, valid UTF-8 or not. fastavro is laxer than the compiled path about the
    wire format, so ``_WireCheck`` checks each payload first, as the interpreter does; and the
    reader's feature and label fields are made nullable, so that a writer's null there is no value
    (as in the compiled path) rather than a resolution error. The benchmark's baseline turns the
    wire checks off (``wire_checks=False``): it measures what fastavro alone costs.
    """

    def __init__(
        self,
        features: FeaturesConfig,
        schema_source: Any = None,
        *,
        wire_checks: bool = True,
        tasks: list[TaskConfig] | None = None,
        late: LateLabels | None = None,
    ):
        self.features = features
        self.tasks = tasks or default_tasks(features)
        self.late = late
        self.wire_checks = wire_checks
        self.schema_source = schema_source
        self.confluent = features.wire_format == "confluent"
        self.clip = features.non_finite_dense == "clip"
        reader = load_schema(features.resolved_schema_path())
        self.keys = [t.name for t in features.tables]
        self.paths = _FieldPaths(
            tables=[tuple(t.field.split(".")) for t in features.tables],
            dense=[tuple(d.field.split(".")) for d in features.dense],
            labels=[tuple(t.label.split(".")) for t in self.tasks],
            time=tuple(features.event_time.split(".")),
            samples={} if late is None else {slot: tuple(path.split(".")) for slot, path in late.paths.items()},
        )
        sinks = {
            tuple(path.split("."))
            for path in (
                *(t.field for t in features.tables),
                *(d.field for d in features.dense),
                *(t.label for t in self.tasks),
                features.event_time,
                *([] if late is None else late.paths.values()),
            )
        }
        self.reader = fastavro.parse_schema(_strings_as_bytes(without_logical_types(_nullable_at(reader, sinks))))
        self.divisor = _time_divisor(reader, features.event_time)
        self.symbols = [_enum_index(field_schema(reader, t.field)) for t in features.tables]
        self.sources: dict[int, dict | BadWriterSchema | None] = {}
        # schema id (None: raw bodies, written with the reader schema) -> (writer, reader for fastavro, its checks)
        self.writers: dict[int | None, tuple[Any, Any, _WireCheck]] = {
            None: (fastavro.parse_schema(_strings_as_bytes(without_logical_types(reader))), None, _WireCheck(reader))
        }

    def writer_schema(self, schema_id: int) -> dict | None:
        """The schema source's answer for ``schema_id``, asked once (None: an unknown id). Raises
        ``BadWriterSchema``, each time, if it is not a valid Avro schema; logs that once."""
        if schema_id not in self.sources:
            answer: dict | BadWriterSchema | None
            try:
                answer = self.schema_source.writer_schema(schema_id)
                if answer is not None:
                    self.writers[schema_id] = self._parsed(answer)
            except BadWriterSchema as why:
                log.error(
                    "writer schema %s is broken: %s; its events are dead-lettered as bad_writer_schema", schema_id, why
                )
                answer = BadWriterSchema(f"writer schema {schema_id}: {why}")
            self.sources[schema_id] = answer
        answer = self.sources[schema_id]
        if isinstance(answer, BadWriterSchema):
            raise answer
        return answer

    def _parsed(self, writer: Any) -> tuple[Any, Any, _WireCheck]:
        try:
            return (
                fastavro.parse_schema(_strings_as_bytes(without_logical_types(writer))),
                self.reader,
                _WireCheck(writer),
            )
        except Exception as error:  # fastavro's SchemaParseException, UnknownType, or JSON of the wrong shape
            raise BadWriterSchema(f"not a valid Avro schema: {type(error).__name__}: {error}") from error

    def decode(self, events: EventBatch | Sequence[RawEvent]) -> DecodeResult:
        if not isinstance(events, EventBatch):
            events = EventBatch.of_events(events)
        bodies, writers, early = [], [], np.zeros(len(events), np.int8)
        details: dict[int, str] = {}
        for i, payload in enumerate(events.payloads):
            schema_id = None
            if not payload:
                early[i] = ap.EMPTY_PAYLOAD
            elif self.confluent:
                if len(payload) < 5 or payload[0] != 0:
                    early[i] = ap.BAD_MAGIC_BYTE
                else:
                    schema_id = int.from_bytes(payload[1:5], "big")
                    try:
                        if self.writer_schema(schema_id) is None:
                            early[i] = ap.UNKNOWN_SCHEMA_ID
                    except BadWriterSchema as why:
                        early[i] = ap.BAD_WRITER_SCHEMA
                        details[i] = str(why)
                    payload = payload[5:]
            bodies.append(payload)
            writers.append(schema_id)
        part = self.columns(bodies, writers, early)
        part.details = {**details, **part.details}
        values = np.concatenate(part.values) if part.values else np.zeros(0, np.int64)
        return _result(events, self.keys, part, values, [len(v) for v in part.values], self.late)

    def columns(self, bodies: list[bytes], writers: list[int | None], early: np.ndarray | None = None) -> _Columns:
        """The columns of Avro ``bodies``, each written with the writer schema of its id (None:
        the reader schema); events with a nonzero ``early`` status are rejected with it."""
        features, paths = self.features, self.paths
        n = len(bodies)
        status = np.zeros(n, np.int8) if early is None else early.copy()
        details: dict[int, str] = {}
        ids: list[list[Any]] = [[] for _ in features.tables]
        lengths = np.zeros((len(features.tables), n), dtype=np.int32)
        dense = np.zeros((n, len(features.dense)), dtype=np.float32)
        labels = np.zeros((n, len(self.tasks)), dtype=np.float32)
        times = np.zeros(n, dtype=np.int64)
        samples = np.zeros((n, 4), dtype=np.int64)
        # A number past float32's range becomes inf, as it does in the compiled path.
        with np.errstate(over="ignore"):
            for i, body in enumerate(bodies):
                if status[i]:
                    continue
                writer_id = writers[i]
                if writer_id is not None:
                    self.writer_schema(writer_id)  # asks the source, once
                writer, reader, check = self.writers[writer_id]
                if self.wire_checks:
                    status[i] = check.status(body)
                    if status[i]:
                        continue
                try:
                    record = fastavro.schemaless_reader(io.BytesIO(body), writer, reader)
                except Exception as error:  # a branch or symbol the reader cannot read: SchemaResolutionError
                    status[i] = ap.UNDECODABLE
                    details[i] = f"{type(error).__name__}: {error}"
                    continue
                kind = ap.PLAIN
                if self.late is not None:
                    found = self.late.kind_of(_get(record, paths.samples[ap.SAMPLE_KIND]))
                    if found is None:
                        status[i] = ap.UNKNOWN_SAMPLE_KIND
                        continue
                    kind = found
                read = [_get(record, path) for path in paths.labels]
                if kind != ap.LATE_LABEL and any(
                    label is None and task.required for label, task in zip(read, self.tasks, strict=True)
                ):
                    status[i] = ap.MISSING_LABEL
                    continue
                row_labels = [np.nan if label is None else np.float32(label) for label in read]
                if not all(0.0 <= label <= 1.0 for label, raw in zip(row_labels, read, strict=True) if raw is not None):
                    status[i] = ap.BAD_LABEL
                    continue
                if kind != ap.PLAIN:
                    impression = [_get(record, paths.samples[slot]) for slot in (1, 2)]
                    if None in impression:
                        status[i] = ap.MISSING_IMPRESSION
                        continue
                    if kind == ap.LATE_LABEL and 1.0 not in row_labels:
                        status[i] = ap.LABEL_WITHOUT_POSITIVE
                        continue
                    assert self.late is not None
                    samples[i] = (kind, impression[0], int(impression[1]) // self.late.divisor, 3)
                row = [
                    _transform(_get(record, path), d.transform)
                    for path, d in zip(paths.dense, features.dense, strict=True)
                ]
                if not all(ap.is_finite_float32(v) for v in row):
                    if not self.clip:
                        status[i] = ap.NON_FINITE_DENSE
                        continue
                    row = [_clipped(v) for v in row]
                for t, path in enumerate(paths.tables):
                    value = _get(record, path)
                    values = () if value is None else value if isinstance(value, list) else (value,)
                    ids[t].extend(values)
                    lengths[t, i] = len(values)
                dense[i] = row
                labels[i] = row_labels
                time = _get(record, paths.time)
                times[i] = 0 if time is None else int(time) // self.divisor
        values = [
            map_ids(_as_id_array(table_ids, symbols), table)
            for table_ids, table, symbols in zip(ids, features.tables, self.symbols, strict=True)
        ]
        return _Columns(status, lengths, dense, labels, times, values, details, samples)


def _result(
    events: EventBatch,
    keys: list[str],
    columns: _Columns,
    values: np.ndarray,
    length_per_key: list[int],
    late: LateLabels | None,
) -> DecodeResult:
    """The batch of ``columns``' kept events, whose ids are ``values`` (their KJT's)."""
    status = columns.status
    kept = status == ap.OK
    count = int(kept.sum())
    everything = count == len(events)

    def kept_of(column: np.ndarray) -> np.ndarray:
        return column if everything else column[kept]

    labels, times = kept_of(columns.labels), kept_of(columns.times)
    samples = None
    if late is not None:
        # masks late labels' labels in place: a copy of the decoder's, unless every event was kept
        samples = late.columns(kept_of(columns.samples), labels, times, kept_of(events.partitions))
    lengths = columns.lengths if everything else columns.lengths[:, kept]
    batch = ClickBatch(
        dense_features=torch.from_numpy(kept_of(columns.dense)),
        sparse_features=KeyedJaggedTensor(
            keys=keys,
            values=torch.from_numpy(values),
            lengths=torch.from_numpy(np.ascontiguousarray(lengths).reshape(-1)),
            # Given here, from the decoder's counts, rather than summed per step with a .tolist().
            length_per_key=length_per_key,
            offset_per_key=list(itertools.accumulate(length_per_key, initial=0)),
        ),
        # One task keeps the single-label batch's [B] labels, so a one-task model is DLRM exactly.
        labels=torch.from_numpy(labels[:, 0] if labels.shape[1] == 1 else labels),
        event_time_ms=torch.from_numpy(times),
        loss_scale=torch.tensor(1.0 / max(count, 1)),
        spans=_spans(events, kept),
        global_batch_size=count,
        samples=samples,
    )
    details = columns.details
    rejected = [
        (events.event(i), REASONS[status[i] - 1] + (f": {details[i]}" if i in details else ""))
        for i in np.flatnonzero(~kept).tolist()
    ]
    return DecodeResult(batch, rejected)


def _spans(events: EventBatch, kept: np.ndarray) -> dict[int, PartitionSpan]:
    """Per partition: the events kept for training, and the offset after the last one consumed.

    Rejected events move the position too: they were consumed, and went to the dead-letter path.
    One Python step per partition, not per event."""
    kept_events, next_offset = ap.partition_spans(events.partitions, events.offsets, kept)
    return {
        p: PartitionSpan(int(kept_events[p]), int(next_offset[p])) for p in np.flatnonzero(next_offset >= 0).tolist()
    }


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
        return {
            k: (v if k in ("default", "symbols", "name", "namespace", "doc", "aliases") else _strings_as_bytes(v))
            for k, v in schema.items()
        }
    return "bytes" if schema == "string" else schema


def _nullable_at(record: dict, paths: set[tuple[str, ...]], prefix: tuple[str, ...] = ()) -> dict:
    """The record schema with the fields at ``paths`` (and in records on the way) also taking null,
    as the last branch, so that a default stays valid."""
    fields = []
    for f in record["fields"]:
        path, avro_type = prefix + (f["name"],), f["type"]
        if path in paths and not (isinstance(avro_type, list) and "null" in avro_type):
            avro_type = avro_type + ["null"] if isinstance(avro_type, list) else [avro_type, "null"]
        elif isinstance(avro_type, dict) and avro_type.get("type") == "record":
            avro_type = _nullable_at(avro_type, paths, path)
        fields.append({**f, "type": avro_type})
    return {**record, "fields": fields}


class _Fault(Exception):
    def __init__(self, status: int):
        self.status = status


class _Cursor:
    """A body being checked: the interpreter's reads, each raising ``_Fault`` with its status."""

    __slots__ = ("body", "empty_items", "end", "pos")

    def __init__(self, body: bytes):
        self.body, self.pos, self.end, self.empty_items = body, 0, len(body), 0

    def varint(self) -> int:
        body, pos, result, shift = self.body, self.pos, 0, 0
        for _ in range(10):
            if pos >= self.end:
                raise _Fault(ap.TRUNCATED)
            byte = body[pos]
            pos += 1
            result |= (byte & 0x7F) << shift
            if byte < 0x80:
                self.pos = pos
                result &= 0xFFFFFFFFFFFFFFFF
                return (result >> 1) ^ -(result & 1)
            shift += 7
        raise _Fault(ap.BAD_VARINT)

    def length(self) -> int:
        n = self.varint()
        if n < 0:
            raise _Fault(ap.BAD_LENGTH)
        return n

    def too_long(self, n: int) -> _Fault:
        return _Fault(ap.BAD_LENGTH if n > self.end else ap.TRUNCATED)

    def skip(self, size: int) -> None:
        if self.end - self.pos < size:
            raise _Fault(ap.TRUNCATED)
        self.pos += size

    def bytes(self) -> None:
        n = self.length()
        if n > self.end - self.pos:
            raise self.too_long(n)
        self.pos += n

    def index(self, count: int, fault: int) -> int:
        i = self.varint()
        if not 0 <= i < count:
            raise _Fault(fault)
        return i

    def blocks(self, minimum: int, item: Callable[[_Cursor], object], keyed: bool) -> None:
        while True:
            items = self.varint()
            if items < 0:  # then the block's size in bytes
                items = -items
                self.length()
                if items >= 1 << 63:
                    raise _Fault(ap.BAD_LENGTH)
            if items == 0:
                return
            if minimum > 0 and items > (self.end - self.pos) // minimum:
                raise self.too_long(items)
            if minimum == 0:
                self.empty_items += items
                if self.empty_items > ap.MAX_EMPTY_ITEMS:
                    raise _Fault(ap.BAD_LENGTH)
            for _ in range(items):
                if keyed:
                    self.bytes()
                item(self)


class _WireCheck:
    """The interpreter's checks of a writer schema's wire format, for the payloads fastavro decodes:
    fastavro reads varints of any length, negative union and enum indexes (Python's list[-1]) and
    negative lengths, and fails late or on other grounds on huge ones. ``status(body)`` is the
    compiled path's reason for the first fault, with its limits (0: none). What depends on the
    reader (a branch or symbol it cannot read) is left to fastavro."""

    def __init__(self, writer: Any):
        self.names: dict[str, Any] = {}
        self.named: dict[str, Callable[[_Cursor], object]] = {}
        self.check = self._node(fastavro.parse_schema(writer, named_schemas=self.names, _write_hint=False))

    def status(self, body: bytes) -> int:
        cursor = _Cursor(body)
        try:
            self.check(cursor)
        except _Fault as fault:
            return fault.status
        except RecursionError:  # a recursive type nested deeper than Python's stack
            return ap.UNDECODABLE
        return ap.TRAILING_BYTES if cursor.pos != cursor.end else ap.OK

    def _node(self, schema: Any) -> Callable[[_Cursor], object]:
        if isinstance(schema, list):
            branches = [self._node(b) for b in schema]
            return lambda c: branches[c.index(len(branches), ap.BAD_UNION_INDEX)](c)
        if isinstance(schema, str) and schema in self.names:  # a named type, by name, maybe inside itself
            return lambda c: self.named[schema](c)
        kind = schema["type"] if isinstance(schema, dict) else schema
        check: Callable[[_Cursor], object]
        if kind in ("record", "error"):
            fields: list[Callable[[_Cursor], object]] = []

            def check(c: _Cursor) -> None:
                for field_check in fields:
                    field_check(c)

            self.named[schema["name"]] = check
            fields.extend(self._node(f["type"]) for f in schema["fields"])
        elif kind == "enum":
            symbols = len(schema["symbols"])
            check = self.named[schema["name"]] = lambda c: c.index(symbols, ap.BAD_ENUM_INDEX)
        elif kind == "fixed":
            size = schema["size"]
            check = self.named[schema["name"]] = lambda c: c.skip(size)
        elif kind in ("array", "map"):
            item = schema["items"] if kind == "array" else schema["values"]
            minimum, item_check, keyed = self._min_bytes(item, ()) + (kind == "map"), self._node(item), kind == "map"
            check = lambda c: c.blocks(minimum, item_check, keyed)  # noqa: E731
        else:
            check = _PRIMITIVE_CHECKS[kind]
        return check

    def _min_bytes(self, schema: Any, expanding: tuple[str, ...]) -> int:
        """As the compiler counts them; a type inside itself counts 0."""
        if isinstance(schema, str) and schema in self.names:
            if schema in expanding:
                return 0
            expanding, schema = expanding + (schema,), self.names[schema]
        kind = "union" if isinstance(schema, list) else schema["type"] if isinstance(schema, dict) else schema
        if kind in ("record", "error"):
            return sum(self._min_bytes(f["type"], expanding + (schema["name"],)) for f in schema["fields"])
        return {"null": 0, "float": 4, "double": 8}.get(kind, schema["size"] if kind == "fixed" else 1)


_PRIMITIVE_CHECKS: dict[str, Callable[[_Cursor], object]] = {
    "null": lambda c: None,
    "boolean": lambda c: c.skip(1),
    "int": _Cursor.varint,
    "long": _Cursor.varint,
    "float": lambda c: c.skip(4),
    "double": lambda c: c.skip(8),
    "string": _Cursor.bytes,
    "bytes": _Cursor.bytes,
}
