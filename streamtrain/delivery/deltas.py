"""The delta wire format: one Kafka message (or one file) per chunk of a delta.

A delta is one consistent cut of the model at step ``step``: the embedding rows touched since the
previous delta, from every table and every shard, and all dense parameters. It is split into
``parts`` chunks, each below the target's message size; a reader applies a delta only once it
holds all of its parts.

A chunk is ``MAGIC`` (4 bytes), the header's length (uint32, little-endian), the header (UTF-8
JSON), then the body, little-endian:

- ``kind: "rows"``: ``count`` int64 row ids, then ``count`` x ``width`` float32 values, row-major:
  columns ``[column, column + width)`` of those rows of table ``section``. A column-wise shard sends
  its own columns; a table-wise one, all of them.
- ``kind: "dense"``: ``count`` float32 values, elements ``[offset, offset + count)`` of the
  flattened dense parameter ``section`` (its ``shape`` in the header), named as in the model's
  state dict.
- ``kind: "ids"`` and ``kind: "evicted"``, for a managed table (``id_mapping: managed``) ``section``:
  ``count`` int64 rows, then ``count`` int64 raw ids. ``ids``: at the delta's step raw id i is
  looked up at row i (for the rows this delta carries that hold a live id). ``evicted``: raw id i
  left row i since the previous delta. A reader applies evictions first, then ``ids``; with
  ``full: true`` in an ``ids`` chunk's header the delta carries the table's whole map, which
  replaces the reader's (the worker's eviction log did not reach back to the previous delta).
  Readers that predate these kinds never meet them: only managed tables produce them.

Header fields, in every chunk: ``model_id``, ``base_version`` (the version of the base this
delta's chain started from: a delta applies only on a base of that chain), ``sequence`` (the
delta's number in its chain, contiguous from the base's ``delta_sequence``), ``step``,
``event_time_high_water_ms`` (the newest event time the delta's state has trained),
``published_at_ms``, ``section`` (a table name, or a dense parameter's name), ``kind``,
``part`` and ``parts`` (this chunk is part ``part`` of ``parts``, counted over the whole delta),
and per kind: ``column``, ``width``, ``count`` (rows); ``shape``, ``offset``, ``count`` (dense);
``count``, ``full`` (ids, evicted).
"""

from __future__ import annotations

import json
import struct
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

MAGIC = b"STD1"
_LENGTH = struct.Struct("<I")
# Room left in each chunk for the header and the Kafka record's own framing.
HEADER_ALLOWANCE = 4096


class DeltaFormatError(ValueError):
    """A chunk that is not in this format; the message says what is wrong with it."""


@dataclass(frozen=True)
class DeltaId:
    model_id: str
    base_version: int
    sequence: int
    step: int
    event_time_high_water_ms: int
    published_at_ms: int


@dataclass(frozen=True)
class RowPiece:
    """Columns ``[column, column + values.shape[1])`` of rows ``ids`` of table ``table``."""

    table: str
    ids: np.ndarray  # int64 [n]
    column: int
    values: np.ndarray  # float32 [n, width]


@dataclass(frozen=True)
class DensePiece:
    """Elements ``[offset, offset + values.size)`` of the flattened dense parameter ``name``."""

    name: str
    shape: tuple[int, ...]
    offset: int
    values: np.ndarray  # float32 [count]


@dataclass(frozen=True)
class IdPiece:
    """A managed table's map at rows ``rows``: raw id ``ids[i]`` is looked up at ``rows[i]``
    (``evicted``: it no longer is). ``full``: a part of the table's whole map, which replaces the
    reader's."""

    table: str
    rows: np.ndarray  # int64 [n]
    ids: np.ndarray  # int64 [n], raw ids
    evicted: bool = False
    full: bool = False


@dataclass
class Delta:
    id: DeltaId
    rows: list[RowPiece] = field(default_factory=list)
    dense: list[DensePiece] = field(default_factory=list)
    ids: list[IdPiece] = field(default_factory=list)


def encode(delta: Delta, max_bytes: int) -> list[bytes]:
    """The chunks of ``delta``, each at most ``max_bytes`` long, in order."""
    budget = max_bytes - HEADER_ALLOWANCE
    if budget < 64:
        raise ValueError(
            f"max_bytes {max_bytes} leaves no room for a chunk's body; use at least {HEADER_ALLOWANCE + 64}"
        )
    bodies: list[tuple[dict[str, object], bytes]] = []
    for piece in delta.rows:
        width = piece.values.shape[1] if piece.values.ndim == 2 else 0
        per_row = 8 + 4 * width
        step = max(budget // per_row, 1)
        for start in range(0, len(piece.ids), step):
            ids = np.ascontiguousarray(piece.ids[start : start + step], dtype="<i8")
            values = np.ascontiguousarray(piece.values[start : start + step], dtype="<f4")
            meta = {"section": piece.table, "kind": "rows", "column": piece.column, "width": width, "count": len(ids)}
            bodies.append((meta, ids.tobytes() + values.tobytes()))
    for dense in delta.dense:
        flat = np.ascontiguousarray(dense.values, dtype="<f4").reshape(-1)
        step = max(budget // 4, 1)
        for start in range(0, max(flat.size, 1), step):
            chunk = flat[start : start + step]
            meta = {"section": dense.name, "kind": "dense", "shape": list(dense.shape), "offset": dense.offset + start}
            meta["count"] = int(chunk.size)
            bodies.append((meta, chunk.tobytes()))
    for mapped in delta.ids:
        step = max(budget // 16, 1)
        for start in range(0, max(len(mapped.rows), 1) if mapped.full else len(mapped.rows), step):
            rows = np.ascontiguousarray(mapped.rows[start : start + step], dtype="<i8")
            raw = np.ascontiguousarray(mapped.ids[start : start + step], dtype="<i8")
            kind = "evicted" if mapped.evicted else "ids"
            meta = {"section": mapped.table, "kind": kind, "count": len(rows), "full": mapped.full}
            bodies.append((meta, rows.tobytes() + raw.tobytes()))
    chunks = []
    for part, (meta, body) in enumerate(bodies):
        header = json.dumps({**asdict(delta.id), **meta, "part": part, "parts": len(bodies)}).encode()
        chunks.append(MAGIC + _LENGTH.pack(len(header)) + header + body)
    return chunks


def decode_chunk(data: bytes) -> tuple[dict[str, Any], RowPiece | DensePiece | IdPiece]:
    """One chunk's header and its piece."""
    if data[:4] != MAGIC:
        raise DeltaFormatError(f"not a streamtrain delta chunk: it starts with {data[:4]!r}, not {MAGIC!r}")
    (length,) = _LENGTH.unpack_from(data, 4)
    try:
        header = json.loads(data[8 : 8 + length])
    except ValueError as error:
        raise DeltaFormatError(f"the chunk's header is not JSON: {error}") from None
    body = memoryview(data)[8 + length :]
    count = int(header["count"])
    if header["kind"] == "rows":
        width = int(header["width"])
        if len(body) != count * (8 + 4 * width):
            raise DeltaFormatError(f"a rows chunk of {count} x {width} has {len(body)} body bytes")
        ids = np.frombuffer(body, dtype="<i8", count=count)
        values = np.frombuffer(body, dtype="<f4", offset=8 * count).reshape(count, width)
        return header, RowPiece(header["section"], ids, int(header["column"]), values)
    if header["kind"] == "dense":
        if len(body) != 4 * count:
            raise DeltaFormatError(f"a dense chunk of {count} values has {len(body)} body bytes")
        values = np.frombuffer(body, dtype="<f4", count=count)
        return header, DensePiece(header["section"], tuple(header["shape"]), int(header["offset"]), values)
    if header["kind"] in ("ids", "evicted"):
        if len(body) != 16 * count:
            raise DeltaFormatError(f"an {header['kind']} chunk of {count} rows has {len(body)} body bytes")
        rows = np.frombuffer(body, dtype="<i8", count=count)
        raw = np.frombuffer(body, dtype="<i8", offset=8 * count, count=count)
        evicted = header["kind"] == "evicted"
        return header, IdPiece(header["section"], rows, raw, evicted, bool(header.get("full", False)))
    raise DeltaFormatError(f"unknown chunk kind {header['kind']!r}")


class Assembler:
    """Collects chunks, in any order and with repeats, into whole deltas."""

    def __init__(self) -> None:
        self._pending: dict[tuple[str, int, int], tuple[Delta, set[int], int]] = {}

    def add(self, data: bytes) -> Delta | None:
        """Takes one chunk; returns its delta once every part of it is here."""
        header, piece = decode_chunk(data)
        key = (str(header["model_id"]), int(header["base_version"]), int(header["sequence"]))
        if key not in self._pending:
            fields = {name: header[name] for name in DeltaId.__dataclass_fields__}
            self._pending[key] = (Delta(DeltaId(**fields)), set(), int(header["parts"]))
        delta, seen, parts = self._pending[key]
        part = int(header["part"])
        if part not in seen:
            seen.add(part)
            if isinstance(piece, RowPiece):
                delta.rows.append(piece)
            elif isinstance(piece, DensePiece):
                delta.dense.append(piece)
            else:
                delta.ids.append(piece)
        if len(seen) < parts:
            return None
        del self._pending[key]
        return delta

    def forget_before(self, base_version: int, sequence: int) -> None:
        """Drops incomplete deltas older than (``base_version``, ``sequence``), e.g. after a reload."""
        self._pending = {k: v for k, v in self._pending.items() if (k[1], k[2]) >= (base_version, sequence)}
