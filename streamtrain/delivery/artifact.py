"""A servable base: a training snapshot (any number of ranks) as one program a plain CPU process
loads and scores, without a process group, TorchRec's sharded stack or the training world size.

``export_snapshot`` flattens the snapshot with DCP's ``dcp_to_torch_save`` (no process group),
loads it into an unsharded ``ClickModel`` on the CPU, and ``torch.export``s its scoring path with a
dynamic batch dimension (and a dynamic number of ids). The base is ``model.pt2`` plus
``manifest.json`` (docs/delivery.md lists its fields), with the reader schema and any writer
schemas beside them, so a server decodes events with the worker's own decoder, exactly as training
did. It is written as ``base-<version>.partial/``, renamed, and only then is ``current.json``
pointed at it; the last ``keep`` bases stay.

``ServableModel`` loads a base and scores ``ClickBatch``es; ``apply`` writes a delta's rows and
dense values into the loaded program's parameters in place (the unlifted module's parameters are
the tensors its graph reads, so an in-place write is what the next score sees).
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from fsspec.implementations.local import LocalFileSystem
from torch import nn
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import streamtrain
from streamtrain import durable
from streamtrain.checkpoint import MARKER, SnapshotInfo, list_snapshots, verify_snapshot
from streamtrain.config import FeaturesConfig, ModelConfig, TaskConfig, default_tasks
from streamtrain.decode import ClickBatch
from streamtrain.delivery.deltas import Delta, IdPiece
from streamtrain.delivery.safeload import load_program
from streamtrain.delivery.spec import (
    CURRENT,
    FORMAT_VERSION,
    ID_MAPS,
    MANIFEST,
    PARTIAL,
    PROGRAM,
    FormatError,
    IdMap,
    Manifest,
    Parameters,
    base_file,
    base_name,
    current_pointer,
    parse_base,
    read_current,
    read_manifest,
)
from streamtrain.idspace import whole_map
from streamtrain.model import ClickModel, net_logits
from streamtrain.models.base import ModelInterfaceError, check_logits, table_weights
from streamtrain.schema import load_schema

log = logging.getLogger(__name__)

READER_SCHEMA = "reader.avsc"
WRITER_SCHEMAS = "writer_schemas"
_TABLE_FIELDS = {"name", "field", "num_embeddings", "embedding_dim", "pooling", "id_mapping"}


class ExportError(RuntimeError):
    """A snapshot that cannot become a base; the message says why and what to do."""


class ScoringModule(nn.Module):
    """What is exported: the trained net (and its heads) on plain tensors, returning click
    probabilities [B, tasks]. Plain tensors in, since a KeyedJaggedTensor is no input a serving
    runtime can build; the KJT is made inside, from the table order the decoder keys by."""

    def __init__(self, model: ClickModel, keys: list[str]):
        super().__init__()
        self.net_name = model.net_name
        self.add_module(model.net_name, model.net)  # the model's attribute name: parameter names stay the snapshot's
        self.pairs = model.pairs
        self.keys = keys

    def forward(self, dense: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        sparse = KeyedJaggedTensor(keys=self.keys, values=values, lengths=lengths)
        logits = net_logits(self.get_submodule(self.net_name), self.pairs, dense, sparse)
        return torch.sigmoid(logits).reshape(dense.shape[0], -1)


def servable_config(record: dict[str, Any]) -> tuple[FeaturesConfig, ModelConfig, list[TaskConfig]]:
    """The feature config, model config and tasks of a snapshot marker's (or manifest's) ``config``."""
    features = FeaturesConfig.model_validate(record["features"])
    model = ModelConfig.model_validate(record["model"])
    tasks = list(model.tasks) if model.tasks is not None else default_tasks(features)
    return features, model, tasks


def model_id(record: dict[str, Any]) -> str:
    """The model's id in bases and deltas: ``delivery.model_id`` when the config sets one, else the topic."""
    return str((record.get("delivery") or {}).get("model_id") or record["kafka"]["topic"])


def _find_snapshot(checkpoint_dir: str, step: int | None) -> SnapshotInfo:
    name = checkpoint_dir.rstrip("/").rsplit("/", 1)[-1]
    candidates = [verify_snapshot(checkpoint_dir)] if name.startswith("step-") else list_snapshots(checkpoint_dir)
    complete = [s for s in candidates if s.complete and (step is None or s.step == step)]
    if not complete:
        found = ", ".join(f"step {s.step} ({'complete' if s.complete else s.problem})" for s in candidates) or "none"
        wanted = f" at step {step}" if step is not None else ""
        raise ExportError(
            f"{checkpoint_dir} holds no complete snapshot{wanted} (found: {found}); pass a checkpoint.path or a "
            f"step-<N> folder, and --step only for a step it holds"
        )
    return complete[0]


def _next_version(out_dir: Path) -> int:
    versions = [parsed.version for p in out_dir.glob("base-*") if (parsed := parse_base(p.name)) and not parsed.partial]
    current = read_current(out_dir)
    if current is not None:
        versions.append(int(current["version"]))
    return max(versions, default=0) + 1


def _flatten(snapshot: SnapshotInfo) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="streamtrain-export-") as scratch:
        flat = Path(scratch) / "snapshot.pt"
        dcp_to_torch_save(snapshot.path, flat)
        return dict(torch.load(flat, map_location="cpu", weights_only=True))


def unsharded_model(features: FeaturesConfig, model: ModelConfig, tasks: list[TaskConfig]) -> ClickModel:
    """A ``ClickModel`` wholly on the CPU (tables included, where training builds them on the meta
    device for sharding), to be filled by ``load_state_dict``."""
    return ClickModel(features, model, tasks, torch.device("cpu"), table_device=torch.device("cpu")).eval()


def _example(features: FeaturesConfig, batch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inputs in the decoder's dtypes: float32 dense, int64 ids, int32 lengths (one id per event and table)."""
    tables = len(features.tables)
    return (
        torch.zeros(batch, len(features.dense), dtype=torch.float32),
        torch.zeros(batch * tables, dtype=torch.int64),
        torch.ones(batch * tables, dtype=torch.int32),
    )


def export_program(module: ScoringModule, features: FeaturesConfig) -> torch.export.ExportedProgram:
    batch = torch.export.Dim("batch", min=2, max=1 << 20)
    ids = torch.export.Dim("ids", min=1, max=1 << 30)
    tables = len(features.tables)
    # lengths hold one entry per (table, event): their size is tables x batch, not a free dimension.
    shapes = {"dense": {0: batch}, "values": {0: ids}, "lengths": {0: tables * batch}}
    with torch.no_grad():
        return torch.export.export(module, _example(features, 3), dynamic_shapes=shapes, strict=False)


_PROBE_ROWS = 8
_PROBE_BATCH = 3


def check_exportable(features: FeaturesConfig, model: ModelConfig, tasks: list[TaskConfig]) -> None:
    """Refuses a model that does not fit the interface, naming what is missing: its tables, logits
    of the wrong shape, a forward that does not ``torch.export``. It
    builds the model on the CPU with tables of a few rows and exports it as delivery does: seconds,
    so the worker runs it at start-up for a user's model only (each built-in's tests export it)."""
    where = f"model.module {model.module}"
    probe = features.model_copy(
        update={"tables": [t.model_copy(update={"num_embeddings": _PROBE_ROWS}) for t in features.tables]}
    )
    click = unsharded_model(probe, model, tasks)
    keys = [t.name for t in features.tables]
    dense = torch.zeros(_PROBE_BATCH, len(features.dense))
    ids = torch.zeros(_PROBE_BATCH * len(keys), dtype=torch.int64)
    kjt = KeyedJaggedTensor(keys=keys, values=ids, lengths=torch.ones(_PROBE_BATCH * len(keys), dtype=torch.int32))
    try:
        with torch.no_grad():
            logits = net_logits(click.net, click.pairs, dense, kjt)
    except Exception as error:
        raise ModelInterfaceError(
            f"{where}: forward fails on a batch of {_PROBE_BATCH} events: {type(error).__name__}: {error}"
        ) from error
    check_logits(logits, _PROBE_BATCH, len(tasks), where)
    try:
        export_program(ScoringModule(click, keys), probe)
    except Exception as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise ModelInterfaceError(
            f"{where}: the model is not exportable: torch.export fails on its forward ({type(error).__name__}: "
            f"{first}); served bases are that program, so its forward must trace without data-dependent Python "
            f"control flow on tensor values"
        ) from error


def export_snapshot(
    checkpoint_dir: str | Path,
    step: int | None,
    out_dir: str | Path,
    version: int | None = None,
    new_chain: bool = False,
    keep: int = 3,
    config_record: dict[str, Any] | None = None,
) -> Path:
    """Publish the snapshot at ``step`` (the newest complete one when None) under ``out_dir`` as
    base ``version`` (one past the newest there when None); returns the base's folder.

    ``config_record``: the config sections (``features``, ``model``) to use when the snapshot's
    marker carries none (snapshots written before markers held the config)."""
    started = time.monotonic()
    snapshot = _find_snapshot(str(checkpoint_dir), step)
    marker = snapshot.metadata or {}
    record = marker.get("config") or config_record
    if record is None:
        raise ExportError(
            f"{snapshot.path}/{MARKER} holds no config (written before snapshots carried it): pass the "
            f"worker's config with --config"
        )
    features, model_config, tasks = servable_config(record)
    flat = _flatten(snapshot)
    click = unsharded_model(features, model_config, tasks)
    missing, unexpected = click.load_state_dict(flat["model"], strict=False)
    if missing or unexpected:
        raise ExportError(
            f"{snapshot.path} does not fit its own config: missing {sorted(missing)}, unexpected {sorted(unexpected)}"
        )
    module = ScoringModule(click, [t.name for t in features.tables])
    program = export_program(module, features)

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    version = _next_version(out) if version is None else version
    stream = marker["stream"]
    delivery = stream.get("delivery") or {}
    # A snapshot without a delivery entry predates delivery (or the worker's first delta): a new chain.
    chain = version if new_chain or "chain" not in delivery else int(delivery["chain"])
    sequence = int(delivery.get("next_sequence", 0))
    name = base_name(version)
    partial = out / (name + PARTIAL)
    if partial.exists():  # left by an export that crashed
        shutil.rmtree(partial)
    partial.mkdir()
    torch.export.save(program, partial / PROGRAM)
    id_maps = _id_maps(features, flat)
    if id_maps:
        arrays = {f"{t}.rows": rows for t, (rows, _ids) in id_maps.items()}
        arrays |= {f"{t}.ids": ids for t, (_rows, ids) in id_maps.items()}
        with (partial / ID_MAPS).open("wb") as file:
            np.savez(file, allow_pickle=False, **arrays)
    reader = load_schema(features.resolved_schema_path())
    (partial / READER_SCHEMA).write_text(json.dumps(reader))
    features_record = dict(record["features"])
    features_record["schema_path"] = READER_SCHEMA
    if features.wire_format == "confluent" and features.writer_schemas_dir is not None:
        shutil.copytree(features.resolved_writer_schemas_dir(), partial / WRITER_SCHEMAS)
        features_record["writer_schemas_dir"] = WRITER_SCHEMAS
    signature = program.graph_signature
    weights = table_weights(module)
    tables = {t.name: weights[t.name] for t in features.owned_tables()}
    manifest = Manifest.model_validate(
        {
            "format": FORMAT_VERSION,
            "model_id": model_id(record),
            "base_version": version,
            "chain": chain,
            "delta_sequence": sequence,
            "step": int(stream["step"]),
            "next_offsets": stream["next_offsets"],
            "trained": stream["trained"],
            "event_time_high_water_ms": int(stream["event_time_high_water_ms"]),
            # When the snapshot's cut was taken (its commit less the save): deltas after it were
            # published later, so a server replaying a delta topic from this base seeks there.
            "cut_wall_time_ms": int((float(marker["wall_time"]) - float(marker.get("save_seconds", 0))) * 1000),
            "created_at": time.time(),
            "source_snapshot": snapshot.path,
            "world_size": marker.get("world_size"),
            "config": {**record, "features": features_record},
            "tables": [t.model_dump(mode="json", include=_TABLE_FIELDS) for t in features.tables],
            "dense": [d.model_dump(mode="json") for d in features.dense],
            "tasks": [t.name for t in tasks],
            "reader_schema": reader,
            "versions": {
                **marker.get("versions", {}),
                "streamtrain": getattr(streamtrain, "__version__", _own_version()),
                "export_torch": torch.__version__,
            },
            # Managed tables: ID_MAPS holds each one's map (raw id -> row) at the snapshot's cut; ids
            # not in it read the unknown row, as in training.
            "id_maps": {
                t.name: IdMap(unknown_row=t.live_rows(), file=ID_MAPS)
                for t in features.tables
                if t.id_mapping == "managed"
            },
            "parameters": Parameters(
                # One per embedding table: a feature sharing another's table (shares_table_with) has none.
                tables=tables,
                dense={name: name for name in signature.parameters if name not in tables.values()},
            ),
        }
    )
    (partial / MANIFEST).write_text(manifest.model_dump_json(indent=2))
    final = out / name
    # a re-export of the same version replaces it, before the pointer names it
    durable.publish_folder(LocalFileSystem(), str(partial), str(final))
    _point_current(out, version, name)
    _retain(out, keep)
    log.info(
        "exported %s (step %d, chain %d, deltas from %d) to %s in %.1fs",
        snapshot.path,
        manifest.step,
        chain,
        sequence,
        final,
        time.monotonic() - started,
    )
    return final


def _id_maps(features: FeaturesConfig, flat: dict[str, Any]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Each managed table's live rows and their raw ids, from the snapshot's id space."""
    managed = [t.name for t in features.tables if t.id_mapping == "managed"]
    if managed and "id_space" not in flat:
        raise ExportError(
            "the snapshot has managed tables but no id_space: it cannot map their ids; export a newer one"
        )
    maps = {}
    for name in managed:
        ids, in_use = whole_map(flat["id_space"][name])
        rows = in_use.nonzero().squeeze(1)
        maps[name] = (rows.to(torch.int64).numpy(), ids[rows].to(torch.int64).numpy())
    return maps


def _own_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("streamtrain")
    except PackageNotFoundError:
        return "unknown"


def _point_current(out: Path, version: int, name: str) -> None:
    durable.publish_file(LocalFileSystem(), str(out / CURRENT), current_pointer(version, name))


def _retain(out: Path, keep: int) -> None:
    current = read_current(out)
    bases = sorted(p for p in out.glob("base-*") if p.is_dir() and (name := parse_base(p.name)) and not name.partial)
    kept = {p.name for p in bases[-keep:]} | ({current["path"]} if current else set())
    for base in bases:
        if base.name not in kept:
            shutil.rmtree(base, ignore_errors=True)


def base_features(manifest: Manifest, base_dir: Path) -> tuple[FeaturesConfig, list[TaskConfig]]:
    """The feature config and tasks a base's events are decoded with, its schemas resolved inside it."""
    record = manifest.config
    features_record = dict(record["features"])
    # The schemas travel inside the base: resolve them there, wherever the server runs, and nowhere else.
    schema_path = features_record.get("schema_path")
    features_record["schema_path"] = str(base_file(base_dir, str(schema_path or ""), "features.schema_path"))
    writer_schemas = features_record.get("writer_schemas_dir")
    if writer_schemas is not None:
        features_record["writer_schemas_dir"] = str(base_file(base_dir, str(writer_schemas), "writer_schemas_dir"))
    features, _model, tasks = servable_config({**record, "features": features_record})
    return features, tasks


def _twice(
    dense: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A one-event batch as two copies of its event (lengths are table-major: one per table)."""
    segments = torch.split(values, lengths.tolist())
    return (
        dense.repeat(2, 1),
        torch.cat([part for segment in segments for part in (segment, segment)]),
        lengths.repeat_interleave(2),
    )


class DeltaMismatch(ValueError):
    """A delta that names a table, parameter or shape this base does not have."""


class ServedIds:
    """A managed table's map from raw ids to rows in a server, as the trainer's at the base or the
    newest applied delta; ids without a row read the unknown row, as in training."""

    def __init__(self, rows: np.ndarray, ids: np.ndarray, unknown_row: int):
        self.unknown_row = unknown_row
        self.row_of: dict[int, int] = {}
        self.id_at: dict[int, int] = {}
        # While an ``undoable`` block runs: (map, key, the value before) for each change, in order;
        # None once a clear() has noted the whole maps (nothing after it needs noting).
        self._journal: list[tuple[dict[int, int], int, int | None]] | None = None
        self._before_clear: tuple[dict[int, int], dict[int, int]] | None = None
        self.assign(rows, ids)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        unknown = self.unknown_row
        return torch.tensor([self.row_of.get(i, unknown) for i in ids.tolist()], dtype=ids.dtype)

    def assign(self, rows: np.ndarray, ids: np.ndarray) -> None:
        for row, raw in zip(rows.tolist(), ids.tolist(), strict=True):
            previous = self.id_at.get(row)
            if previous is not None and self.row_of.get(previous) == row:
                self._set(self.row_of, previous, None)
            moved_from = self.row_of.get(raw)
            if moved_from is not None and self.id_at.get(moved_from) == raw:
                self._set(self.id_at, moved_from, None)
            self._set(self.row_of, raw, row)
            self._set(self.id_at, row, raw)

    def evict(self, rows: np.ndarray, ids: np.ndarray) -> None:
        for row, raw in zip(rows.tolist(), ids.tolist(), strict=True):
            if self.row_of.get(raw) == row:
                self._set(self.row_of, raw, None)
            if self.id_at.get(row) == raw:
                self._set(self.id_at, row, None)

    def clear(self) -> None:
        if self._journal is not None and self._before_clear is None:
            self._before_clear = (self.row_of, self.id_at)
        self.row_of, self.id_at = {}, {}

    def _set(self, mapping: dict[int, int], key: int, value: int | None) -> None:
        """``mapping[key] = value`` (None: removes it), noted in the journal."""
        if self._journal is not None and self._before_clear is None:
            self._journal.append((mapping, key, mapping.get(key)))
        if value is None:
            del mapping[key]
        else:
            mapping[key] = value

    @contextmanager
    def undoable(self) -> Iterator[None]:
        """The changes made inside are taken back if it raises."""
        self._journal, self._before_clear = [], None
        try:
            yield
        except BaseException:
            for mapping, key, before in reversed(self._journal):
                if before is None:
                    mapping.pop(key, None)
                else:
                    mapping[key] = before
            if self._before_clear is not None:
                self.row_of, self.id_at = self._before_clear
            raise
        finally:
            self._journal, self._before_clear = None, None


class ServableModel:
    """A base loaded for scoring in this process: no process group, no DMP. Everything a score
    needs is read when it loads (program, manifest, id maps; a ``Scorer`` reads the schemas), so
    the base's folder may be removed by retention while it is served."""

    def __init__(self, base_dir: str | Path):
        self.path = Path(base_dir)
        self.manifest = read_manifest(self.path)
        self.features, self.tasks = base_features(self.manifest, self.path)
        self.program = load_program(self.path / PROGRAM)
        self.module = self.program.module()
        parameters = dict(self.module.named_parameters())
        names = self.manifest.parameters
        missing = sorted({*names.tables.values(), *names.dense.values()} - set(parameters))
        if missing:
            raise FormatError("manifest", f"{self.path}: the manifest names {missing}, not in its program")
        self.tables = {table: parameters[name] for table, name in names.tables.items()}
        self.dense = {state_name: parameters[name] for state_name, name in names.dense.items()}
        self.id_maps: dict[str, ServedIds] = {}
        for table, entry in self.manifest.id_maps.items():
            with np.load(base_file(self.path, entry.file, f"id_maps.{table}.file"), allow_pickle=False) as arrays:
                self.id_maps[table] = ServedIds(arrays[f"{table}.rows"], arrays[f"{table}.ids"], entry.unknown_row)
        try:  # a base that loads but cannot score is refused here, not at its first request
            with torch.no_grad():
                self.module(*_example(self.features, 2))
        except Exception as error:
            raise FormatError("base", f"{self.path}: its program fails on two events: {error!r:.300}") from error

    @property
    def nbytes(self) -> int:
        """The bytes of every table and dense parameter: about what a delta carrying all of them holds."""
        return sum(p.numel() * p.element_size() for p in (*self.tables.values(), *self.dense.values()))

    def score(self, batch: ClickBatch) -> np.ndarray:
        """Click probabilities [B, tasks], in the manifest's task order."""
        if batch.size == 0:
            return np.zeros((0, len(self.manifest.tasks)), dtype=np.float32)
        sparse = batch.sparse_features
        dense, values, lengths = batch.dense_features, self._rows(sparse), sparse.lengths().to(torch.int32)
        if batch.size == 1:
            # The exported program guards its batch dimension at 2 and more (export specialises a
            # size of 1); one event is scored as two copies of itself, each row on its own.
            dense, values, lengths = _twice(dense, values, lengths)
        with torch.no_grad():
            probabilities = self.module(dense, values, lengths)
        return probabilities[: batch.size].numpy()

    def _rows(self, sparse: KeyedJaggedTensor) -> torch.Tensor:
        """The KJT's values as rows: managed tables' raw ids mapped as the trainer maps them."""
        if not self.id_maps:
            return sparse.values()
        parts = sparse.values().split(sparse.length_per_key())
        mapped = [
            self.id_maps[k].rows(v) if k in self.id_maps else v for k, v in zip(sparse.keys(), parts, strict=True)
        ]
        return torch.cat(mapped)

    def apply(self, delta: Delta) -> None:
        """Writes the delta into the served state, all or nothing: every piece is checked and staged
        before anything is written (a delta that does not fit raises ``DeltaMismatch``), and if a
        write still fails, what was written is put back before the error goes on."""
        writes = self._staged(delta)
        written: list[tuple[torch.Tensor, Any, torch.Tensor]] = []
        try:
            with torch.no_grad(), ExitStack() as maps:
                for target, index, values in writes:
                    written.append((target, index, target[index].clone()))
                    target[index] = values
                for served in self.id_maps.values():
                    maps.enter_context(served.undoable())
                self._apply_ids(delta.ids)
        except BaseException:
            with torch.no_grad():
                for target, index, before in reversed(written):
                    target[index] = before
            raise

    def _staged(self, delta: Delta) -> list[tuple[torch.Tensor, Any, torch.Tensor]]:
        """Each write the delta makes, as (parameter, index, values); DeltaMismatch for a piece that
        does not fit this base."""
        writes: list[tuple[torch.Tensor, Any, torch.Tensor]] = []
        for row in delta.rows:
            table = self.tables.get(row.table)
            if table is None:
                raise DeltaMismatch(f"delta {delta.id.sequence} names table {row.table!r}, not in this base")
            rows, dim = table.shape
            width = row.values.shape[1] if row.values.ndim == 2 else -1
            if row.values.shape != (len(row.ids), width) or row.column < 0 or row.column + width > dim:
                raise DeltaMismatch(
                    f"delta {delta.id.sequence}: columns [{row.column}, {row.column + width}) of {row.table} "
                    f"outside its {rows} x {dim} weight"
                )
            if len(row.ids) and (row.ids.min() < 0 or row.ids.max() >= rows):
                raise DeltaMismatch(f"delta {delta.id.sequence}: rows of {row.table} outside its {rows} x {dim} weight")
            ids = torch.from_numpy(np.array(row.ids, dtype=np.int64))  # a chunk's arrays are read-only
            values = torch.from_numpy(np.array(row.values, dtype=np.float32))
            writes.append((table, (ids, slice(row.column, row.column + width)), values))
        for mapped in delta.ids:
            table = self.tables.get(mapped.table)
            if mapped.table not in self.id_maps or table is None:
                raise DeltaMismatch(f"delta {delta.id.sequence} maps ids of {mapped.table!r}, no managed table here")
            if len(mapped.rows) != len(mapped.ids) or (
                len(mapped.rows) and (mapped.rows.min() < 0 or mapped.rows.max() >= table.shape[0])
            ):
                raise DeltaMismatch(f"delta {delta.id.sequence}: id map rows of {mapped.table} outside its table")
        for piece in delta.dense:
            parameter = self.dense.get(piece.name)
            if parameter is None:
                raise DeltaMismatch(f"delta {delta.id.sequence} names dense parameter {piece.name!r}, not in this base")
            if (
                tuple(parameter.shape) != tuple(piece.shape)
                or piece.offset < 0
                or piece.offset + piece.values.size > parameter.numel()
                or not parameter.is_contiguous()
            ):
                raise DeltaMismatch(
                    f"delta {delta.id.sequence}: elements [{piece.offset}, {piece.offset + piece.values.size}) of "
                    f"{piece.name}, {tuple(piece.shape)} in the delta, {tuple(parameter.shape)} here"
                )
            values = torch.from_numpy(np.array(piece.values, dtype=np.float32).reshape(-1))
            writes.append((parameter.view(-1), slice(piece.offset, piece.offset + values.numel()), values))
        return writes

    def _apply_ids(self, pieces: list[IdPiece]) -> None:
        """Evictions first, then the rows' ids at the delta's step; a whole map replaces the table's."""
        for table in {piece.table for piece in pieces if piece.full}:
            self.id_maps[table].clear()
        for piece in pieces:
            if piece.evicted:
                self.id_maps[piece.table].evict(piece.rows, piece.ids)
        for piece in pieces:
            if not piece.evicted:
                self.id_maps[piece.table].assign(piece.rows, piece.ids)
