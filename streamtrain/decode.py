"""Stage 2, decode: Avro payloads -> columns -> a KeyedJaggedTensor batch.

``ClickBatch`` is the data currency from here to the trainer: one KJT key per embedding table,
a dense float matrix, the labels, and the Kafka positions the batch covers.

Ids reach their tables by a documented, stable mapping (``map_ids``):
  - integers, ``modulo``: ``id mod num_embeddings`` with floor semantics, so -1 -> n-1;
  - integers, ``hash``: ``splitmix64(id as uint64) mod num_embeddings``;
  - strings: first ``fnv1a64(utf-8 bytes)`` as an unsigned id, then as above.
"""

from __future__ import annotations

import io
import math
from collections import Counter
from dataclasses import dataclass, field
from functools import lru_cache

import fastavro
import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from torchrec.streamable import Pipelineable

from streamtrain.config import FeaturesConfig, TableConfig
from streamtrain.schema import load_schema, without_logical_types
from streamtrain.source import RawEvent

_MASK64 = (1 << 64) - 1


def splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser over uint64 arrays (wrapping arithmetic)."""
    z = x.astype(np.uint64, copy=True)
    with np.errstate(over="ignore"):
        z += np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


@lru_cache(maxsize=65536)
def fnv1a64(text: str | bytes) -> int:
    h = 0xCBF29CE484222325
    for byte in text.encode("utf-8") if isinstance(text, str) else text:
        h = ((h ^ byte) * 0x100000001B3) & _MASK64
    return h


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


@dataclass
class ClickBatch(Pipelineable):
    dense_features: torch.Tensor  # [B, num_dense] float32
    sparse_features: KeyedJaggedTensor  # one key per table, B lengths per key
    labels: torch.Tensor  # [B] float32
    event_time_ms: torch.Tensor  # [B] int64
    # Multiplies the summed loss: world_size / global batch size, so an empty batch adds zero
    # and gradients match TorchRec's usual per-rank mean when batches are even.
    loss_scale: torch.Tensor
    spans: dict[int, PartitionSpan] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return int(self.labels.shape[0])

    def to(self, device: torch.device, non_blocking: bool = False) -> "ClickBatch":
        return ClickBatch(
            self.dense_features.to(device, non_blocking=non_blocking),
            self.sparse_features.to(device, non_blocking=non_blocking),
            self.labels.to(device, non_blocking=non_blocking),
            self.event_time_ms.to(device, non_blocking=non_blocking),
            self.loss_scale.to(device, non_blocking=non_blocking),
            self.spans,
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
    """Decodes schemaless Avro bodies written with the configured schema into ``ClickBatch``es."""

    def __init__(self, features: FeaturesConfig):
        self.features = features
        self.schema = fastavro.parse_schema(without_logical_types(load_schema(features.resolved_schema_path())))
        self.keys = [t.name for t in features.tables]

    def decode(self, events: list[RawEvent]) -> DecodeResult:
        features = self.features
        ids: list[list[int | str | bytes]] = [[] for _ in features.tables]
        lengths = np.zeros((len(features.tables), len(events)), dtype=np.int32)
        dense, labels, times, accepted, rejected = [], [], [], [], []
        for event in events:
            try:
                record = fastavro.schemaless_reader(io.BytesIO(event.value or b""), self.schema, None)
            except Exception as error:  # fastavro raises EOFError, ValueError, IndexError, ...
                rejected.append((event, f"undecodable: {type(error).__name__}"))
                continue
            label = record.get(features.label)
            if label is None:
                rejected.append((event, "missing_label"))
                continue
            row = [_transform(record.get(d.field), d.transform) for d in features.dense]
            if not all(math.isfinite(v) for v in row):
                rejected.append((event, "non_finite_dense"))
                continue
            column = len(accepted)
            for t, table in enumerate(features.tables):
                value = record.get(table.field)
                values = () if value is None else value if isinstance(value, list) else (value,)
                ids[t].extend(values)
                lengths[t, column] = len(values)
            dense.append(row)
            labels.append(float(label))
            times.append(record.get(features.event_time) or 0)
            accepted.append(event)
        lengths = lengths[:, : len(accepted)]
        values = [map_ids(_as_id_array(table_ids), table) for table_ids, table in zip(ids, features.tables)]
        batch = ClickBatch(
            dense_features=torch.tensor(dense, dtype=torch.float32).reshape(len(accepted), len(features.dense)),
            sparse_features=KeyedJaggedTensor(
                keys=self.keys,
                values=torch.from_numpy(np.concatenate(values) if values else np.zeros(0, np.int64)),
                lengths=torch.from_numpy(lengths.reshape(-1)),
            ),
            labels=torch.tensor(labels, dtype=torch.float32),
            event_time_ms=torch.tensor(times, dtype=torch.int64),
            loss_scale=torch.tensor(1.0 / max(len(accepted), 1)),
            spans=spans_of(events, accepted),
        )
        return DecodeResult(batch, rejected)


def spans_of(consumed: list[RawEvent], trained: list[RawEvent]) -> dict[int, PartitionSpan]:
    """Per partition: the events trained, and the offset after the last one consumed.

    Rejected events move the position too: they were consumed, and go to the dead-letter path.
    """
    counts = Counter(event.partition for event in trained)
    next_offsets: dict[int, int] = {}
    for event in consumed:
        next_offsets[event.partition] = max(next_offsets.get(event.partition, 0), event.offset + 1)
    return {p: PartitionSpan(counts[p], offset) for p, offset in next_offsets.items()}


def _transform(value: float | int | bool | None, transform: str) -> float:
    if value is None:
        return 0.0
    value = float(value)
    if transform == "log1p":
        return math.log1p(value) if value > -1.0 else float("nan")
    return value


def _as_id_array(values: list[int | str | bytes]) -> np.ndarray:
    if values and isinstance(values[0], (str, bytes)):
        return np.fromiter((fnv1a64(v) for v in values), dtype=np.uint64, count=len(values))
    return np.asarray(values, dtype=np.int64)
