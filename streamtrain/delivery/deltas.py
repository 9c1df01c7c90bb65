"""Delta chunks: ``encode`` a delta into chunks below a message size, ``decode_chunk`` one back,
and ``Assembler`` collects chunks into whole deltas.

docs/delivery-format.md is the format's reference (byte order, header fields, kinds, layouts,
test vectors); ``streamtrain.delivery.spec`` holds its header models and names. In short: a chunk
is ``STD1``, a uint32 little-endian header length, a UTF-8 JSON header, then a little-endian body
(``rows``: int64 ids then float32 values; ``dense``: float32 elements of a flattened parameter;
``ids``/``evicted``: int64 rows then int64 raw ids). ``part`` counts from 0 over the whole delta.
"""

from __future__ import annotations

import json
import struct
from dataclasses import asdict, dataclass, field

import numpy as np

from streamtrain.delivery.spec import (
    FORMAT_VERSION,
    MAGIC,
    ChunkHeader,
    DenseHeader,
    FormatError,
    RowsHeader,
    parse_chunk_header,
)

_LENGTH = struct.Struct("<I")
# Room left in each chunk for the header and the Kafka record's own framing.
HEADER_ALLOWANCE = 4096


class DeltaFormatError(FormatError):
    """A chunk that is not in this format; ``reason`` labels it for metrics, the message says what
    is wrong with it."""


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
        fields = {"format": FORMAT_VERSION, **asdict(delta.id), **meta, "part": part, "parts": len(bodies)}
        header = json.dumps(fields).encode()
        chunks.append(MAGIC + _LENGTH.pack(len(header)) + header + body)
    return chunks


def decode_chunk(data: bytes) -> tuple[ChunkHeader, RowPiece | DensePiece | IdPiece]:
    """One chunk's header and its piece; DeltaFormatError (with a ``reason``) says what is wrong.
    Every field is checked here, so what a chunk claims about itself is consistent; whether it fits
    the served base is ``ServableModel.apply``'s check."""
    if len(data) < 8 or data[:4] != MAGIC:
        what = f"it starts with {bytes(data[:4])!r}, not {MAGIC!r}" if data[:4] != MAGIC else "it ends after 8 bytes"
        raise DeltaFormatError("truncated" if data[:4] == MAGIC else "magic", f"not a streamtrain delta chunk: {what}")
    (length,) = _LENGTH.unpack_from(data, 4)
    if 8 + length > len(data):
        raise DeltaFormatError("truncated", f"a header of {length} bytes in a chunk of {len(data)}")
    try:
        header = parse_chunk_header(data[8 : 8 + length])
    except FormatError as error:
        raise DeltaFormatError(error.reason, str(error)) from None
    try:
        return header, _piece(header, memoryview(data)[8 + length :])
    except ValueError as error:  # numpy's: a shape no array can have, e.g. 0 rows of 2**62 columns
        raise DeltaFormatError("body_size", f"a {header.kind} chunk's body cannot be laid out: {error}") from None


def _piece(header: ChunkHeader, body: memoryview) -> RowPiece | DensePiece | IdPiece:
    count = header.count
    if isinstance(header, RowsHeader):
        if len(body) != count * (8 + 4 * header.width):
            raise DeltaFormatError("body_size", f"a rows chunk of {count} x {header.width} has {len(body)} body bytes")
        ids = np.frombuffer(body, dtype="<i8", count=count)
        values = np.frombuffer(body, dtype="<f4", offset=8 * count).reshape(count, header.width)
        return RowPiece(header.section, ids, header.column, values)
    if isinstance(header, DenseHeader):
        if len(body) != 4 * count:
            raise DeltaFormatError("body_size", f"a dense chunk of {count} values has {len(body)} body bytes")
        values = np.frombuffer(body, dtype="<f4", count=count)
        return DensePiece(header.section, tuple(header.shape), header.offset, values)
    if len(body) != 16 * count:
        raise DeltaFormatError("body_size", f"an {header.kind} chunk of {count} rows has {len(body)} body bytes")
    rows = np.frombuffer(body, dtype="<i8", count=count)
    raw = np.frombuffer(body, dtype="<i8", offset=8 * count, count=count)
    return IdPiece(header.section, rows, raw, header.kind == "evicted", header.full)


@dataclass
class _Pending:
    delta: Delta
    parts: int
    seen: set[int] = field(default_factory=set)
    size: int = 0  # bytes of the chunks held


class Assembler:
    """Collects chunks, in any order and with repeats, into whole deltas.

    Every chunk of one delta (model id, chain, sequence) must agree on ``parts`` and the delta's
    identity (step, high water, publication time). A chunk of a later attempt at the delta (a newer
    ``published_at_ms``) replaces the partial delta it finds: that was an attempt that failed
    partway. Any other chunk that disagrees is refused and leaves the partial delta as it was, its
    place in the eviction order too, so refusals never keep a stale delta alive.

    At most ``max_pending`` incomplete deltas, holding at most ``max_bytes`` of chunks, are kept:
    the one touched longest ago goes first, and a delta that needs more than ``max_bytes`` alone is
    refused (``too_large``)."""

    def __init__(self, max_pending: int = 64, max_bytes: int = 2**30) -> None:
        self.max_pending = max_pending
        self.max_bytes = max_bytes
        self.held = 0  # bytes of chunks held by incomplete deltas
        self._pending: dict[tuple[str, int, int], _Pending] = {}

    def add(self, data: bytes) -> Delta | None:
        """Takes one chunk; returns its delta once every part of it is here."""
        header, piece = decode_chunk(data)
        key = (header.model_id, header.base_version, header.sequence)
        identity = DeltaId(**{name: getattr(header, name) for name in DeltaId.__dataclass_fields__})
        pending = self._pending.get(key)
        if pending is not None and (pending.parts != header.parts or pending.delta.id != identity):
            if identity.published_at_ms <= pending.delta.id.published_at_ms:
                raise DeltaFormatError(
                    "parts_disagree",
                    f"a chunk of delta {header.sequence} of chain {header.base_version} says {header.parts} parts at "
                    f"step {header.step}; its first chunk said {pending.parts} parts at step {pending.delta.id.step}",
                )
            self._drop(key)
            pending = None
        if pending is None:
            pending = _Pending(Delta(identity), header.parts)
        self._pending.pop(key, None)
        self._pending[key] = pending  # last touched goes last
        if header.part not in pending.seen:
            pending.seen.add(header.part)
            pending.size += len(data)
            self.held += len(data)
            if isinstance(piece, RowPiece):
                pending.delta.rows.append(piece)
            elif isinstance(piece, DensePiece):
                pending.delta.dense.append(piece)
            else:
                pending.delta.ids.append(piece)
        if len(pending.seen) == pending.parts:
            self._drop(key)
            return pending.delta
        while len(self._pending) > self.max_pending or self.held > self.max_bytes:
            oldest = next(iter(self._pending))
            self._drop(oldest)
            if oldest == key:
                raise DeltaFormatError(
                    "too_large",
                    f"delta {header.sequence} of chain {header.base_version} needs more than {self.max_bytes} bytes "
                    f"before it is whole ({header.parts} parts)",
                )
        return None

    def _drop(self, key: tuple[str, int, int]) -> None:
        self.held -= self._pending.pop(key).size

    def forget_before(self, base_version: int, sequence: int) -> None:
        """Drops incomplete deltas older than (``base_version``, ``sequence``): once that is applied
        (or a base past them is loaded) they can never be."""
        for key in [k for k in self._pending if (k[1], k[2]) < (base_version, sequence)]:
            self._drop(key)

    def __len__(self) -> int:
        return len(self._pending)
