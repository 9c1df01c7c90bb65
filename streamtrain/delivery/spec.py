"""The delivery format in code: what docs/delivery-format.md specifies, in one module that the
exporter, the publisher and the server all read.

- names: ``base-<version>`` folders and ``delta-<chain>-<sequence>`` folders, one parser each;
- a delta chunk's header, one typed model per ``kind`` (strict: a wrong type is an error, never
  coerced), and the format version every chunk and manifest carries;
- a base's ``manifest.json``, one typed model, read in one place (``parse_manifest``), and the
  files it names, confined to the base's folder (``base_file``).

Every integer of a header or a manifest is an int64, as the bodies' are: a number past that range
is refused where it is parsed, so nothing downstream (a metric, numpy) meets one it cannot hold.

``chunk_header_schema()`` and ``manifest_schema()`` are the JSON Schemas the spec prints; a test
keeps the two equal.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator

FORMAT_VERSION = 1
MAGIC = b"STD1"
CURRENT = "current.json"
MANIFEST = "manifest.json"
PROGRAM = "model.pt2"
ID_MAPS = "id_maps.npz"
COMPLETE = "COMPLETE"
PARTIAL = ".partial"

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

_BASE = re.compile(r"^base-(\d+)(\.partial)?$")
_DELTA = re.compile(r"^delta-(\d+)-(\d+)$")
_PART = re.compile(r"^part-(\d+)$")


class FormatError(ValueError):
    """Data that is not in this format; ``reason`` is a short label for metrics, the message says
    what is wrong."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


# --- names -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class BaseName:
    version: int
    partial: bool


def base_name(version: int) -> str:
    return f"base-{version:06d}"


def parse_base(name: str) -> BaseName | None:
    """``base-<version>`` (or ``.partial``, still being written); None for any other name."""
    match = _BASE.match(name)
    return None if match is None else BaseName(int(match[1]), bool(match[2]))


def delta_name(chain: int, sequence: int) -> str:
    return f"delta-{chain:06d}-{sequence:09d}"


def parse_delta(name: str) -> tuple[int, int] | None:
    """(chain, sequence) of ``delta-<chain>-<sequence>``; None for any other name (``.bak``, ``.tmp``)."""
    match = _DELTA.match(name)
    return None if match is None else (int(match[1]), int(match[2]))


def part_name(part: int) -> str:
    return f"part-{part:05d}"


def parse_part(name: str) -> int | None:
    match = _PART.match(name)
    return None if match is None else int(match[1])


def check_format(found: object, what: str) -> None:
    """Refuses a format version this reader does not know (absent: 1, written before the field)."""
    if found is not None and found != FORMAT_VERSION:
        raise FormatError(
            "format_version",
            f"{what} is in delivery format {found!r}; this reader knows format {FORMAT_VERSION} only: "
            f"upgrade streamtrain serve to one that reads it (docs/delivery-format.md)",
        )


# --- delta chunks ----------------------------------------------------------------------------

_Count = Annotated[int, Field(ge=0, le=INT64_MAX)]
_Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]


class _ChunkHeader(BaseModel):
    model_config = ConfigDict(strict=True, frozen=True, extra="ignore")

    format: Literal[1] = Field(1, description="the delivery format version; absent means 1")
    model_id: str = Field(description="the model's id: the worker's delivery.model_id, else its topic")
    base_version: _Count = Field(description="the version of the base this delta's chain started from")
    sequence: _Count = Field(description="the delta's number in its chain, contiguous from the base's delta_sequence")
    step: _Count = Field(description="the training step the delta's state is at")
    event_time_high_water_ms: _Int64 = Field(description="the newest event time the delta's state has trained")
    published_at_ms: _Int64 = Field(
        description="wall time the delta was first published, milliseconds since the epoch; its retries carry the same"
    )
    section: str = Field(min_length=1, description="a table's name, or a dense parameter's state-dict name")
    part: _Count = Field(description="this chunk's number, 0-based over the whole delta")
    parts: int = Field(ge=1, le=INT64_MAX, description="how many chunks the delta has")
    count: _Count = Field(description="how many rows (rows, ids, evicted) or elements (dense) the body holds")

    @model_validator(mode="after")
    def _part_in_range(self) -> _ChunkHeader:
        if self.part >= self.parts:
            raise ValueError(f"part {self.part} of {self.parts}: parts are numbered from 0")
        return self


class RowsHeader(_ChunkHeader):
    kind: Literal["rows"]
    column: _Count = Field(description="the first column of the table the values hold")
    width: _Count = Field(description="how many columns each row's values hold")


class DenseHeader(_ChunkHeader):
    kind: Literal["dense"]
    shape: list[_Count] = Field(max_length=32, description="the dense parameter's shape")
    offset: _Count = Field(description="the first element, in the parameter flattened row-major (C order)")

    @model_validator(mode="after")
    def _inside(self) -> DenseHeader:
        if self.offset + self.count > prod(self.shape):
            raise ValueError(f"elements [{self.offset}, {self.offset + self.count}) outside shape {self.shape}")
        return self


class IdsHeader(_ChunkHeader):
    kind: Literal["ids", "evicted"]
    full: bool = Field(False, description="ids only: this chunk is part of the table's whole map")


ChunkHeader = RowsHeader | DenseHeader | IdsHeader
_HEADER = TypeAdapter(Annotated[ChunkHeader, Field(discriminator="kind")])


def parse_chunk_header(data: bytes) -> ChunkHeader:
    """The header of a chunk, from its JSON bytes; FormatError says what is wrong."""
    try:
        raw = json.loads(data)
    except (ValueError, RecursionError) as error:  # UnicodeDecodeError is a ValueError; nesting too deep
        raise FormatError("header_json", f"the chunk's header is not UTF-8 JSON: {error!r:.200}") from None
    if not isinstance(raw, dict):
        raise FormatError("header_type", f"the chunk's header is a JSON {type(raw).__name__}, not an object")
    check_format(raw.get("format"), "a delta chunk")
    try:
        return _HEADER.validate_python(raw)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        message = f"the chunk's header is invalid at {where or 'top'}: {first['msg']}"
        raise FormatError("header_field", message) from None


def chunk_header_schema() -> dict[str, Any]:
    return _HEADER.json_schema()


# --- the base's manifest ---------------------------------------------------------------------


class IdMap(BaseModel):
    unknown_row: _Count = Field(description="the row an id without a row reads (the table's last)")
    file: str = Field(description=f"the .npz file in the base holding <table>.rows and <table>.ids ({ID_MAPS})")


class Parameters(BaseModel):
    tables: dict[str, str] = Field(
        description="each table that owns a weight -> its [rows, dim] float32 parameter's name in the program"
    )
    dense: dict[str, str] = Field(
        description="each dense parameter's state-dict name (as deltas name it) -> its name in the program"
    )


class Manifest(BaseModel):
    """A base's ``manifest.json``."""

    model_config = ConfigDict(extra="allow", frozen=True)

    format: Literal[1] = Field(description="the delivery format version")
    model_id: str = Field(description="deltas must carry the same model_id")
    base_version: _Count = Field(description="this base's own version (its folder's number)")
    chain: _Count = Field(description="the version of the base the delta chain started from")
    delta_sequence: _Count = Field(description="the first delta sequence of the chain that applies on top")
    step: _Count = Field(description="the training step of the snapshot")
    next_offsets: dict[str, int] = Field(description="partition -> the next offset to train")
    trained: dict[str, int] = Field(description="partition -> events trained")
    event_time_high_water_ms: _Int64 = Field(description="the newest event time the snapshot has trained")
    cut_wall_time_ms: _Int64 = Field(description="about when the snapshot's cut was taken: replay deltas from here")
    created_at: float = Field(description="when the base was exported, seconds since the epoch")
    source_snapshot: str = Field(description="the snapshot it was exported from")
    world_size: int | None = Field(description="the ranks that wrote the snapshot")
    config: dict[str, Any] = Field(description="the worker's features and model sections, and kafka.topic")
    tables: list[dict[str, Any]] = Field(description="each table: name, field, num_embeddings, embedding_dim, ...")
    dense: list[dict[str, Any]] = Field(description="each dense feature with its transform")
    tasks: list[str] = Field(description="the output columns' task names, in order")
    reader_schema: dict[str, Any] = Field(description="the Avro reader schema events are decoded with")
    versions: dict[str, str] = Field(description="package versions that trained and exported it")
    id_maps: dict[str, IdMap] = Field(default_factory=dict, description="each managed table's id map")
    parameters: Parameters


def parse_manifest(data: bytes | str, where: str) -> Manifest:
    """The manifest from its JSON; FormatError names ``where`` and what is wrong."""
    try:
        raw = json.loads(data)
    except (ValueError, RecursionError) as error:
        raise FormatError("manifest", f"{where} is not JSON: {error!r:.200}") from None
    if not isinstance(raw, dict):
        raise FormatError("manifest", f"{where} is a JSON {type(raw).__name__}, not an object")
    check_format(raw.get("format"), where)
    try:
        return Manifest.model_validate(raw)
    except ValidationError as error:
        raise FormatError("manifest", f"{where} is not a valid manifest: {error}") from None


def read_manifest(base_dir: Path) -> Manifest:
    return parse_manifest((base_dir / MANIFEST).read_bytes(), str(base_dir / MANIFEST))


def manifest_schema() -> dict[str, Any]:
    return Manifest.model_json_schema()


def base_file(base_dir: Path, name: str, what: str) -> Path:
    """``base_dir / name`` for a file a manifest names (``what``, for the error): a relative path
    that stays inside the base, since whoever writes a manifest could otherwise make a server read
    any file it can."""
    parts = Path(name).parts
    if not name or Path(name).is_absolute() or ".." in parts or "\\" in name:
        raise FormatError("manifest", f"{base_dir / MANIFEST}: {what} {name!r} must be a relative path inside the base")
    return base_dir / name


def current_pointer(version: int, name: str) -> bytes:
    """``current.json``'s content naming base ``name`` of ``version``, with the format it is in."""
    return json.dumps({"format": FORMAT_VERSION, "version": version, "path": name}).encode()


def read_current(model_dir: Path) -> dict[str, Any] | None:
    """``current.json``'s content (``{"version", "path"}``), or None when no base is published.
    Its ``path`` must be a base folder's name, so it cannot point outside ``model_dir``. One
    written without ``format`` (before the field) is format 1."""
    try:
        raw = json.loads((model_dir / CURRENT).read_bytes())
    except FileNotFoundError:
        return None
    except (ValueError, RecursionError) as error:  # a pointer a writer broke: as if it named no base
        raise FormatError("current", f"{model_dir / CURRENT} is not JSON: {error!r:.200}") from None
    if isinstance(raw, dict):
        check_format(raw.get("format"), str(model_dir / CURRENT))
    name = raw.get("path") if isinstance(raw, dict) else None
    parsed = parse_base(name) if isinstance(name, str) else None
    if parsed is None or parsed.partial:
        raise FormatError(
            "current",
            f"{model_dir / CURRENT} names {name!r}; it must name a base folder (base-<version>) inside {model_dir}",
        )
    return {"version": parsed.version, "path": name}
