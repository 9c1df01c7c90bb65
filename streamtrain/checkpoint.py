"""Snapshots of the whole training state with the Kafka positions inside them, through DCP.

A snapshot is a consistent cut: it is taken between two pipeline steps, so the weights hold the
updates of exactly the batches whose positions it records. It is written asynchronously
(``dcp.async_save`` on a gloo group of its own, one save in flight) under
``step-<N>.partial/``; once every rank's writes are done, rank 0 adds ``streamtrain.json`` and
renames the folder to ``step-<N>``, then points ``latest`` at it. Restoring loads the snapshot
committed last that every rank verifies and loads, skipping partial or damaged ones with a
warning, and the consumer starts from the positions in it, never from the consumer group's
committed offsets.
If snapshots exist and none loads, the worker refuses to start (``RestoreRefused``) rather than
train from scratch beside them; ``--fresh-start`` moves them aside first. A snapshot that fails to
write is counted and removed, and the next trigger tries again. Commits go through
``streamtrain.durable`` (fsync, then rename); retention keeps the snapshots committed last.
docs/durability.md says what survives what.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import time
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, cast

import fsspec
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.staging import AsyncStager, DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from streamtrain import durable
from streamtrain.config import CheckpointConfig, WorkerConfig
from streamtrain.exitcodes import ExitCode
from streamtrain.heads import architecture
from streamtrain.launch import exit_if_orphaned
from streamtrain.schema import field_kind, load_schema

if TYPE_CHECKING:
    from torch.distributed.checkpoint import FsspecReader, FsspecWriter
    from torch.distributed.checkpoint.metadata import Metadata

    from streamtrain.idspace import IdSpace
    from streamtrain.metrics import WorkerMetrics

log = logging.getLogger(__name__)

MARKER = "streamtrain.json"
_ASYNC_MODES = {"thread": AsyncCheckpointerType.THREAD, "process": AsyncCheckpointerType.PROCESS}
PARTIAL = ".partial"
FORMAT_VERSION = 1
# Version 1 hashed whole config sections; version 2 lists what shapes the tensors (see below).
FINGERPRINT_VERSION = 2
ASIDE = "aside-"


class CheckpointError(RuntimeError):
    pass


class SnapshotsFailing(CheckpointError):
    """Too many snapshots in a row failed: every rank raises it at the same step, and exits."""


class RestoreRefused(CheckpointError):
    """Snapshots exist and none can be restored: every rank raises it, and the worker exits with
    ``ExitCode.RESTORE_REFUSED``, leaving them where they are."""


@dataclass(frozen=True)
class DeliveryPosition:
    """Where model delivery stood at a snapshot (docs/delivery.md): the base version the current
    delta chain started from, and the sequence number of the next delta, which a restored worker
    continues from."""

    chain: int
    next_sequence: int


@dataclass
class StreamState:
    """Where the stream stood at a snapshot: the next offset and the trained-event count of every
    partition (all ranks' partitions, gathered), the step, the newest event time trained, with
    delivery on the delta chain's position (the same on every rank), and with delayed_labels each
    partition's positives counted for the late share (``delayed.LateShare``: known at emission per
    task, then late per task)."""

    step: int = 0
    next_offsets: dict[int, int] = field(default_factory=dict)
    trained: dict[int, int] = field(default_factory=dict)
    event_time_high_water_ms: int = 0
    delivery: DeliveryPosition | None = None
    positives: dict[int, list[int]] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> StreamState:
        raw = json.loads(text)
        delivery = raw.get("delivery")  # absent in snapshots from before delivery, or without it
        return cls(
            step=raw["step"],
            next_offsets={int(p): o for p, o in raw["next_offsets"].items()},
            trained={int(p): n for p, n in raw["trained"].items()},
            event_time_high_water_ms=raw["event_time_high_water_ms"],
            delivery=DeliveryPosition(int(delivery["chain"]), int(delivery["next_sequence"])) if delivery else None,
            # absent in snapshots from before delayed labels, or without them
            positives={int(p): [int(n) for n in counts] for p, counts in raw.get("positives", {}).items()},
        )

    def copy(self) -> StreamState:
        return StreamState(
            self.step,
            dict(self.next_offsets),
            dict(self.trained),
            self.event_time_high_water_ms,
            self.delivery,
            {p: list(counts) for p, counts in self.positives.items()},
        )

    def merged(self, other: StreamState) -> StreamState:
        return StreamState(
            max(self.step, other.step),
            {**self.next_offsets, **other.next_offsets},
            {**self.trained, **other.trained},
            max(self.event_time_high_water_ms, other.event_time_high_water_ms),
            self.delivery or other.delivery,
            {**self.positives, **other.positives},
        )


def compatibility_fingerprint(config: WorkerConfig) -> dict[str, Any]:
    """What must match for a snapshot's tensors to fit this worker and mean the same thing here.

    The shapes: each table's rows, dim and pooling, the number of dense features, the layer
    sizes, and the sparse optimizer (its state's shape). Beyond shape, which id each table row
    holds: the table's field, that field's Avro kind (strings are always hashed) and the id
    mapping. A table restored under another mapping has the right shape and silently wrong rows,
    so a changed mapping is refused like a changed shape (``--allow-partial-restore`` overrides).
    The table order is kept too: it orders the interaction features the over arch reads. The target
    matches (each a dense input). The heads:
    the architecture above the interaction, the tasks (their towers are named after them), and
    mmoe's experts; not the labels, loss weights or which labels are required.

    Left out, because a snapshot stays right across them: the wire format, the registry and
    credentials, sharding constraints (DCP reshards), batch size, learning rates, metrics. For a
    user's model (model.module), also what only the built-ins read (``_BUILT_IN_ONLY``): its
    factory builds from the tables, the dense inputs, the tasks and model.options (docs/models.md).
    """
    schema = load_schema(config.features.resolved_schema_path())
    fingerprint = {
        "version": FINGERPRINT_VERSION,
        "tables": {
            t.name: {
                "rows": t.num_embeddings,
                "dim": t.embedding_dim,
                "pooling": t.pooling,
                "field": t.field,
                "field_kind": field_kind(schema, t.field),
                "id_mapping": t.id_mapping,
                # the id map's layout in the snapshot: a managed table restores only with the same buckets
                **({"buckets": t.id_buckets()} if t.id_mapping == "managed" else {}),
                # only when set, so that fingerprints written before sharing existed still match
                **({"shares_table_with": t.shares_table_with} if t.shares_table_with else {}),
            }
            for t in config.features.tables
        },
        "table_order": [t.name for t in config.features.tables],
        "dense_features": len(config.features.dense),
        "dense_arch_layer_sizes": list(config.model.dense_arch_layer_sizes),
        "over_arch_layer_sizes": list(config.model.over_arch_layer_sizes),
        "sparse_optimizer": config.model.sparse_optimizer,
        "heads": _heads(config),
        **_architecture(config),
        # each match adds a dense input, widening the dense arch's first layer; only when set, so
        # that fingerprints written before matches existed still match
        **(
            {"target_matches": [[m.candidate, m.history] for m in config.model.target_matches]}
            if config.model.target_matches
            else {}
        ),
    }
    if config.model.module is None:
        return fingerprint
    # the tasks' names and count: the module's output has a logit per task, and may name a tower after each
    return {**_without_built_in_only(fingerprint), "tasks": [t.name for t in config.tasks()]}


# What only the built-in architectures read: their dense and over arches and model.multitask's heads.
_BUILT_IN_ONLY = ("dense_arch_layer_sizes", "over_arch_layer_sizes", "heads")


def _without_built_in_only(fingerprint: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in fingerprint.items() if k not in _BUILT_IN_ONLY}


def _as_user_model_fingerprint(theirs: dict[str, Any]) -> dict[str, Any]:
    """A user's model's fingerprint as this version writes it, from one written before, which held
    the built-ins' settings too, and the tasks only in its heads (which named a single task not at
    all: None then, and the task count is left to the load's shape check)."""
    if "tasks" in theirs:
        return theirs
    return {**_without_built_in_only(theirs), "tasks": theirs.get("heads", _DLRM_HEADS).get("tasks")}


def _architecture(config: WorkerConfig) -> dict[str, Any]:
    """The net's kind and the settings that shape it; nothing for DLRM, so that fingerprints
    written before other architectures existed still match. A user's module is fingerprinted by
    its factory's name and options: what it builds from them is its own."""
    model = config.model
    if model.module is not None:
        return {"net": {"module": model.module, "options": dict(model.options)}}
    settings = {"dcn_v2": model.dcn_v2, "deepfm": model.deepfm, "din": model.din}.get(model.architecture)
    if settings is None:
        return {}
    return {"net": {"architecture": model.architecture, **settings.model_dump(mode="json")}}


# What the heads of every snapshot written before multi-task were: one task, DLRM's own over arch.
_DLRM_HEADS = {"architecture": "dlrm"}


def _heads(config: WorkerConfig) -> dict[str, Any]:
    kind = architecture(config.tasks(), config.model)
    if kind == "dlrm":
        return dict(_DLRM_HEADS)
    heads: dict[str, Any] = {"architecture": kind, "tasks": [t.name for t in config.tasks()]}
    if kind == "mmoe":
        heads |= {"num_experts": config.model.num_experts, "expert_layer_sizes": list(config.model.expert_layer_sizes)}
    if kind == "dbmtl":  # a dependency widens its task's logit layer
        heads["depends_on"] = {t.name: t.depends_on for t in config.tasks() if t.depends_on is not None}
    return heads


def fingerprint_differences(ours: dict[str, Any], theirs: dict[str, Any], config: WorkerConfig) -> list[str]:
    """Why a snapshot's fingerprint (``theirs``) does not fit this worker's; empty if it does."""
    if theirs.get("version") != FINGERPRINT_VERSION:
        # A version-1 fingerprint hashed whole sections: equal to this config's means nothing
        # changed; unequal cannot tell a changed shape from a changed learning rate.
        old = _fingerprint_v1(config)
        changed = sorted(k for k in old if theirs.get(k) != old[k])
        if ours["heads"] != _DLRM_HEADS:  # version 1 predates multi-task heads
            changed.append("model.multitask")
        return (
            [
                f"the {' and '.join(changed)} configuration (the snapshot carries a version-1 fingerprint, which "
                f"cannot tell whether the change shapes any tensor; restore it once with the config it was "
                f"written with, and the snapshots after carry version {FINGERPRINT_VERSION})"
            ]
            if changed
            else []
        )
    if "module" in ours.get("net", {}) and "module" in theirs.get("net", {}):
        theirs = _as_user_model_fingerprint(theirs)
        if theirs["tasks"] is None:
            ours = {k: v for k, v in ours.items() if k != "tasks"}
            theirs = {k: v for k, v in theirs.items() if k != "tasks"}
    else:
        theirs = {"heads": _DLRM_HEADS, **theirs}
    return [
        _before_buckets(name) if name is not None else difference
        for difference in _differences(ours, theirs, "")
        for name in [_table_without_buckets(difference, theirs)]
    ]


def _table_without_buckets(difference: str, theirs: dict[str, Any]) -> str | None:
    """The managed table a difference is about if the snapshot predates id buckets, else None."""
    parts = difference.split(":", 1)[0].split(".")
    if len(parts) == 3 and parts[0] == "tables" and parts[2] == "buckets":
        table = theirs.get("tables", {}).get(parts[1], {})
        if table.get("id_mapping") == "managed" and "buckets" not in table:
            return parts[1]
    return None


def _before_buckets(table: str) -> str:
    # No config reproduces the replicated map's layout: its rows are not where the buckets put them.
    return (
        f"tables.{table}: the snapshot was written before managed id maps had buckets, and its map does not fit "
        f"them; --allow-partial-restore loads everything else and starts {table}'s id map empty (its rows "
        f"re-initialise as ids are admitted again)"
    )


def _differences(ours: Any, theirs: Any, where: str) -> list[str]:
    if isinstance(ours, dict) and isinstance(theirs, dict):
        return [
            d
            for k in sorted(set(ours) | set(theirs), key=str)
            for d in _differences(ours.get(k), theirs.get(k), f"{where}.{k}" if where else str(k))
        ]
    return [] if ours == theirs else [f"{where}: {theirs!r} in the snapshot, {ours!r} here"]


_MULTITASK_FIELDS = {"tasks", "multitask", "num_experts", "expert_layer_sizes"}


def _fingerprint_v1(config: WorkerConfig) -> dict[str, str]:
    """The fingerprint snapshots carried before version 2: digests of the feature and model
    config and of the Avro types of the fields the features read."""
    schema = load_schema(config.features.resolved_schema_path())
    used = {t.field for t in config.features.tables} | {d.field for d in config.features.dense}
    used |= {config.features.label}
    types = {f["name"]: f["type"] for f in schema["fields"] if f["name"] in used}

    def digest(value: Any) -> str:
        return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]

    return {
        "features": digest(config.features.model_dump(exclude={"schema_path", "max_event_time_skew_seconds"})),
        "model": digest(
            config.model.model_dump(
                # the learning rates and seed never counted; the multi-task fields came after version 1
                exclude={"sparse_learning_rate", "dense_learning_rate", "seed", *_MULTITASK_FIELDS}
            )
        ),
        "schema_fields": digest(types),
    }


def staging_options(device: torch.device, async_mode: str) -> StagingOptions | None:
    """How DCP's ``DefaultStager`` stages (copies) a snapshot's state on a CUDA trainer, before the
    write goes on in the background: into pinned host buffers kept from one snapshot to the next,
    filled by non-blocking copies, synchronously: ``dcp.async_save`` returns only once every copy
    is done, so the next step cannot change the weights of the cut. ``process`` mode is refused
    there. None off CUDA, where ``snapshot_stager`` chooses."""
    if device.type != "cuda":
        return None
    if async_mode == "process":
        raise CheckpointError(
            "checkpoint.async_mode: process does not support a CUDA trainer: the helper process would be "
            "handed DTensors whose device mesh is on CUDA (and pinned host memory shared with it, which "
            "DCP registers slowly); this has never been run. Use checkpoint.async_mode: thread, which "
            "stages to pinned host memory and writes in a thread (STREAMTRAIN_CHECKPOINT__ASYNC_MODE=thread)."
        )
    return StagingOptions(
        use_pinned_memory=True, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=True
    )


class KeptBuffersStager(AsyncStager):
    """Stages a snapshot on a CPU trainer into host buffers made at the first snapshot and
    refilled by each later one: one copy of the state on the training thread per snapshot.

    DCP's own staging allocates fresh pageable memory every time and copies each sharded table
    three times on the way (a deep copy, a zeroed shard, then the copy): on the reference model
    (205 MiB) about 2 CPU-s of the training thread per snapshot, against 0.05-0.1 s for the one
    copy. ``DefaultStager`` keeps its buffers too, but as copies of whole storages: a table is a
    view into its kernel's storage, so the writer then clones every table before it saves it
    (0.4-0.5 CPU-s per write, against 0.17-0.19 s from buffers of their own). Here each tensor gets
    a buffer of its own, which the writer saves as it is. One save is in flight at a time, so a
    staging never refills buffers a write is still reading. The staging is synchronous:
    ``dcp.async_save`` returns once the copy is done, so the next step cannot change the cut."""

    _synchronize_after_execute = False

    def __init__(self) -> None:
        self._buffers: dict[str, Any] | None = None
        self._layout: Any = None

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        # DCP's own similarity check copies every tensor as it compares; this compares shapes only
        layout = _layout(state_dict)
        if self._buffers is None or layout != self._layout:
            # the first snapshot, or state that changed shape since (optimizer state appears lazily)
            self._buffers, self._layout = _create_cpu_state_dict(state_dict), layout
        return cast(dict[str, Any], _copy_state_dict(state_dict, self._buffers, type_check=False))

    def synchronize_staging(self) -> None:
        """Nothing to wait for: ``stage`` returns once the copy is done."""

    def close(self) -> None:
        self._buffers = None


def _layout(state: Any) -> Any:
    """What kept staging buffers must match: the nesting, and each tensor's kind, shape and dtype."""
    if isinstance(state, dict):
        return tuple((key, _layout(value)) for key, value in state.items())
    if isinstance(state, (list, tuple)):
        return tuple(_layout(value) for value in state)
    if isinstance(state, torch.Tensor):
        return type(state).__name__, tuple(state.shape), state.dtype
    return None


class StagerPerSnapshot(AsyncStager):
    """A ``DefaultStager`` made for each snapshot and closed after it, for a torch whose
    ``DefaultStager`` closes itself after every stage: torch 2.11's empties its copier table
    there, so a stager kept for the worker's life fails at the second snapshot
    (``KeyError: <class 'type'>``). That torch keeps no buffers between snapshots either, so this
    costs nothing more there."""

    _synchronize_after_execute = False

    def __init__(self, options: StagingOptions):
        self._options = options

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        stager = DefaultStager(self._options)
        try:
            return cast(dict[str, Any], stager.stage(state_dict))
        finally:
            stager.close()

    def synchronize_staging(self) -> None:
        """Nothing to wait for: the staging is synchronous (``use_async_staging`` is off)."""


@functools.cache
def _default_stager_stages_twice() -> bool:
    """Whether the installed torch's ``DefaultStager`` can stage a second time (2.13's keeps its
    buffers for the next snapshot; 2.11's has closed itself), tried on a one-tensor state."""
    stager = DefaultStager(StagingOptions(False, False, False, False))
    try:
        for _ in range(2):
            stager.stage({"probe": torch.zeros(1)})
        return True
    except KeyError:
        return False
    finally:
        stager.close()


def kept_default_stager(options: StagingOptions) -> AsyncStager:
    """DCP's ``DefaultStager`` kept for the worker's life, where the installed torch allows it."""
    return DefaultStager(options) if _default_stager_stages_twice() else StagerPerSnapshot(options)


def snapshot_stager(device: torch.device, async_mode: str) -> AsyncStager | None:
    """What stages a snapshot on a trainer on ``device``. None: DCP's own staging, kept for the
    helper process of ``process`` mode on CPU, which is handed the staged state (not measured with
    kept buffers)."""
    if device.type == "cuda":
        options = staging_options(device, async_mode)
        return kept_default_stager(options) if options is not None else None
    return KeptBuffersStager() if async_mode == "thread" else None


def _device_of(model: torch.nn.Module) -> torch.device:
    """Where the trainer runs: DMP puts the dense parameters on its device."""
    return next((p.device for p in model.parameters() if p.device.type != "meta"), torch.device("cpu"))


def _fs(root: str) -> tuple[fsspec.AbstractFileSystem, str]:
    return fsspec.core.url_to_fs(str(root))


def _is_url(path: str) -> bool:
    return "://" in str(path)


def _join(base: str, name: str) -> str:
    return f"{str(base).rstrip('/')}/{name}"


@dataclass
class SnapshotInfo:
    path: str
    step: int
    complete: bool
    problem: str | None
    metadata: dict[str, Any] | None
    bytes: int

    @property
    def committed(self) -> bool:
        """Whether rank 0 renamed it into place: a ``step-<N>`` folder, loadable or not."""
        return not self.path.rstrip("/").endswith(PARTIAL)

    @property
    def commit_order(self) -> tuple[int, float, int]:
        """When it was committed: the marker's commit sequence (0 in markers written before it), then
        its wall time, then its step. A run restarted at a lower step commits later, not lower."""
        meta = self.metadata or {}
        return int(meta.get("commit", 0)), float(meta.get("wall_time", 0.0)), self.step


def _step_of(name: str) -> int | None:
    stem = name[: -len(PARTIAL)] if name.endswith(PARTIAL) else name
    if stem.startswith("step-") and stem[5:].isdigit():
        return int(stem[5:])
    return None


def list_snapshots(root: str) -> list[SnapshotInfo]:
    """Every snapshot under ``root``, the one committed last first (``commit_order``: the order
    restore, retention and export all read), each verified: its marker parses and every file DCP's
    metadata refers to exists and is long enough. Those whose marker is unreadable come last."""
    fs, base = _fs(root)
    if not fs.exists(base):
        return []
    found = []
    for entry in fs.ls(base, detail=False):
        name = entry.rstrip("/").rsplit("/", 1)[-1]
        step = _step_of(name)
        if step is not None:
            found.append(verify_snapshot(_join(root, name), step))
    return sorted(found, key=lambda s: s.commit_order, reverse=True)


def verify_snapshot(path: str, step: int | None = None) -> SnapshotInfo:
    fs, local = _fs(path)
    name = local.rstrip("/").rsplit("/", 1)[-1]
    step = _step_of(name) if step is None else step
    if step is None:
        raise ValueError(f"{path} is not a snapshot: its name is not step-<N>")
    size = _size_of(fs, local)
    if name.endswith(PARTIAL):
        return SnapshotInfo(path, step, False, "never finished (no commit by rank 0)", None, size)
    try:
        metadata = json.loads(fs.cat_file(_join(local, MARKER)))
        written = metadata.get("format")
        if isinstance(written, int) and written > FORMAT_VERSION:
            raise ValueError(
                f"written in snapshot format {written} by a newer streamtrain; this one reads format "
                f"{FORMAT_VERSION}: restore it with a version that reads it (docs/upgrading.md)"
            )
        if written != FORMAT_VERSION or "stream" not in metadata:
            raise ValueError(f"unknown format {written!r}")
    except FileNotFoundError:
        return SnapshotInfo(path, step, False, f"no {MARKER} marker", None, size)
    except (ValueError, KeyError) as error:
        return SnapshotInfo(path, step, False, f"bad {MARKER}: {error}", None, size)
    try:
        reader = FileSystemReader(local) if not _is_url(path) else _fsspec_reader(path)
        dcp_metadata = reader.read_metadata()
        needed: dict[str, int] = {}
        for info in (dcp_metadata.storage_data or {}).values():
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
        for relative, length in needed.items():
            actual = fs.size(_join(local, relative)) if fs.exists(_join(local, relative)) else -1
            if actual < length:
                problem = "missing" if actual < 0 else f"truncated to {actual} of {length} bytes"
                return SnapshotInfo(path, step, False, f"data file {relative} {problem}", metadata, size)
    except Exception as error:  # a damaged .metadata file fails to unpickle in many ways
        return SnapshotInfo(path, step, False, f"unreadable DCP metadata: {error}", metadata, size)
    return SnapshotInfo(path, step, True, None, metadata, size)


def _size_of(fs: Any, local: str) -> int:
    """A snapshot folder's bytes; 0 if it is gone. A save in flight renames its ``.partial`` folder
    as it commits, and retention removes folders: a reader listing beside the worker (retention,
    ``streamtrain checkpoints``, a test waiting for a snapshot) may find one gone half-way."""
    try:
        return sum(fs.du(local, total=False).values()) if fs.exists(local) else 0
    except FileNotFoundError:
        return 0


def _fsspec_reader(path: str) -> FsspecReader:
    from torch.distributed.checkpoint import FsspecReader

    return FsspecReader(path)


def _fsspec_writer(path: str) -> FsspecWriter:
    from torch.distributed.checkpoint import FsspecWriter

    return FsspecWriter(path)


class Checkpointer:
    """Saves and restores one worker's full training state; every method is called on all ranks
    at the same step (the lockstep agrees when)."""

    def __init__(
        self,
        config: CheckpointConfig,
        worker_config: WorkerConfig,
        model: torch.nn.Module,
        optimizer: Any,
        rank: int,
        world_size: int,
        group: dist.ProcessGroup | None,
        metrics: WorkerMetrics | None = None,
        id_space: IdSpace | None = None,
    ):
        self.config = config
        # The managed tables' id map at the cut: their rows mean nothing without it, so it travels
        # with the model, in restores and warm starts alike.
        self.id_space = id_space
        self.root = str(config.path)
        self.model = model
        self.optimizer = optimizer
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self.metrics = metrics
        if metrics is not None:
            metrics.checkpoint_interval.set(config.interval_seconds)
        self.worker_config = worker_config
        self.fingerprint = compatibility_fingerprint(worker_config)
        self.in_flight: tuple[Future, str, StreamState, float] | None = None
        self.last_saved_at = time.monotonic()
        self.last_saved_step = 0
        # The interval triggers count from the last attempt: a failed one is retried at the
        # next trigger, not at every step.
        self.last_attempt_at = self.last_saved_at
        self.last_attempt_step = 0
        self.consecutive_failures = 0
        self.last_failure = ""
        self.commits = 0  # by this process; see _next_commit
        self.commit_base = 0
        # Steps whose snapshots a reader outside this class is still using (a base export): kept
        # past keep_last until it lets go.
        self.pinned: set[int] = set()
        self.unreadable_kept: set[str] = set()  # committed snapshots retention could not read, warned of
        # One stager for the worker's life: it keeps its host buffers. One save is in flight at
        # a time, so a staging never overwrites the buffers a write is still reading.
        self.stager = snapshot_stager(_device_of(model), config.async_mode)
        if rank == 0:
            fs, base = _fs(self.root)
            fs.makedirs(base, exist_ok=True)

    # --- what goes in ---------------------------------------------------------------------
    def _state_dict(self, stream_json: str) -> dict[str, Any]:
        state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(), "stream": stream_json}
        if self.id_space is not None:
            state["id_space"] = self.id_space.state_dict()
        return state

    def _with_id_space(self, parts: tuple[str, ...]) -> tuple[str, ...]:
        return (*parts, "id_space") if self.id_space is not None and "model" in parts else parts

    # --- saving ---------------------------------------------------------------------------
    @property
    def save_in_flight(self) -> bool:
        return self.in_flight is not None

    def save_done(self) -> bool:
        return self.in_flight is not None and self.in_flight[0].done()

    def start_save(self, local: StreamState) -> None:
        """Gather every rank's stream state and start an async save of the current weights."""
        if self.in_flight is not None:
            raise CheckpointError("a save is already in flight")
        stream = self._gather(local)
        path = _join(self.root, f"step-{stream.step:09d}{PARTIAL}")
        writer = _fsspec_writer(path) if _is_url(path) else FileSystemWriter(path)
        started = self.last_attempt_at = time.monotonic()
        self.last_attempt_step = stream.step
        try:
            # async_save stages (copies) the state before it returns: training may go on at once.
            future = dcp.async_save(
                self._state_dict(stream.to_json()),
                storage_writer=writer,
                process_group=self.group,
                async_checkpointer_type=_ASYNC_MODES[self.config.async_mode],
                async_stager=self.stager,
            )
        except Exception as error:  # failed here on this rank only: finish_save makes every rank agree
            future = Future()
            future.set_exception(error)
        self.in_flight = (future, path, stream, started)

    @property
    def failing(self) -> bool:
        return self.consecutive_failures >= self.config.max_consecutive_failures

    def finish_save(self) -> StreamState | None:
        """Wait for this rank's writes, then (rank 0) commit the snapshot. Call on all ranks once
        every rank's ``save_done()`` is true, or at shutdown.

        Returns the committed stream state, or None if the save failed on any rank: then every
        rank counts it, rank 0 removes the folder, and the next trigger tries again."""
        assert self.in_flight is not None
        future, partial_path, stream, started = self.in_flight
        self.in_flight = None
        error = future.exception()
        # A write can fail on some ranks only; all agree before rank 0 commits, so no rank waits
        # at a collective the others skipped, and no partial snapshot is committed.
        if not self._all_ok(error is None):
            self._failed(partial_path, stream.step, error)
            return None
        final_path = partial_path[: -len(PARTIAL)]
        if self.rank == 0:
            try:
                self._commit(partial_path, final_path, stream, time.monotonic() - started)
            except Exception as commit_error:
                error = commit_error
        if not self._all_ok(error is None):  # committed before anyone relies on it
            self._failed(partial_path, stream.step, error)
            return None
        if self.rank == 0:  # after the commit: removing old snapshots can fail, the commit stands
            self._retain()
        self.consecutive_failures = 0
        duration = time.monotonic() - started
        self.last_saved_at = time.monotonic()
        self.last_saved_step = stream.step
        if self.metrics:
            self.metrics.checkpoint_seconds.observe(duration)
            self.metrics.checkpoint_last_success.set(time.time())
            self._measure(final_path)
        log.info("rank %d: snapshot %s committed (step %d, %.2fs)", self.rank, final_path, stream.step, duration)
        return stream

    def _measure(self, path: str) -> None:
        """The committed snapshot's size, for its gauge. Read on each rank by itself after every rank
        agreed on the commit, so a failure here (a file system that fails one rank's listing) is
        logged and counted, never raised: a rank that raised would leave its peers at the next
        collective."""
        assert self.metrics is not None
        try:
            fs, local = _fs(path)
            self.metrics.checkpoint_bytes.set(sum(fs.du(local, total=False).values()))
        except Exception as error:
            log.warning("rank %d: could not read the size of %s: %s", self.rank, path, _first_line(error))
            self.metrics.checkpoint_size_failures.inc()

    def save(self, local: StreamState) -> StreamState | None:
        self.start_save(local)
        return self.finish_save()

    def _all_ok(self, ok: bool) -> bool:
        return self._agree(int(ok), dist.ReduceOp.MIN) == 1

    def _agree(self, value: int, op: dist.ReduceOp.RedOpType) -> int:
        if self.world_size == 1:
            return value
        agreed = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(agreed, op=op, group=self.group)
        return int(agreed.item())

    def _failed(self, partial_path: str, step: int, error: BaseException | None) -> None:
        self.consecutive_failures += 1
        reason = _first_line(error) if error is not None else "another rank's part failed (see its log)"
        self.last_failure = f"step {step}: {reason}"
        if self.metrics:
            self.metrics.checkpoint_failures.inc()
        log.error(
            "rank %d: snapshot at step %d failed (%d in a row; the worker exits at %d): %s",
            self.rank,
            step,
            self.consecutive_failures,
            self.config.max_consecutive_failures,
            reason,
        )
        if self.rank == 0:
            fs, partial = _fs(partial_path)
            try:
                if fs.exists(partial):
                    fs.rm(partial, recursive=True)
            except OSError as cleanup_error:  # the next committed snapshot's retention removes it
                log.warning("could not remove %s: %s", partial_path, cleanup_error)

    def failing_message(self) -> str:
        return (
            f"{self.consecutive_failures} snapshots in a row failed (checkpoint.max_consecutive_failures is "
            f"{self.config.max_consecutive_failures}); the last at {self.last_failure}. Training on would pile "
            f"up work that a crash loses. Check free space and permissions of {self.root}; a restart resumes "
            f"from the last committed snapshot. Exiting with code {ExitCode.SNAPSHOTS_FAILING:d}."
        )

    def _commit(self, partial_path: str, final_path: str, stream: StreamState, seconds: float) -> None:
        fs, partial = _fs(partial_path)
        _, final = _fs(final_path)
        marker = {
            "format": FORMAT_VERSION,
            "stream": json.loads(stream.to_json()),
            "world_size": self.world_size,
            "fingerprint": self.fingerprint,
            # what `streamtrain export` rebuilds the model and its decoder from
            "config": self.worker_config.model_record(),
            "versions": {
                "torch": torch.__version__,
                "torchrec": _version("torchrec"),
                "fbgemm_gpu": _version("fbgemm_gpu"),
            },
            "wall_time": time.time(),
            "save_seconds": round(seconds, 3),
            # the order retention keeps by: one past every commit under checkpoint.path
            "commit": self._next_commit(),
        }
        fs.pipe_file(_join(partial, MARKER), json.dumps(marker, indent=2).encode())
        exit_if_orphaned("committing a snapshot")  # a replacement worker may be committing by now
        # a replay of the same step after a crash: the new cut replaces it
        durable.publish_folder(fs, partial, final)
        _, base = _fs(self.root)
        durable.publish_file(fs, _join(base, "latest"), final.rstrip("/").rsplit("/", 1)[-1].encode())
        self.commits += 1

    def _next_commit(self) -> int:
        if self.commits == 0:  # the first commit of this process: continue after what is there
            self.commit_base = max((s.commit_order[0] for s in list_snapshots(self.root)), default=0)
        return self.commit_base + self.commits + 1

    def _retain(self) -> None:
        """Keep the ``keep_last`` snapshots committed last (and the pinned ones); remove the older
        ones, and leftovers of crashed saves older than the newest. By commit order, not step: a run
        restarted at a lower step keeps its own snapshots. A committed snapshot that could not be
        read (a damaged one, or a read that failed this once) is never removed: refuse rather than
        forget; nor is a pinned one, whatever its state. A removal that fails is logged and
        counted, and retried at the next commit; the commit it followed stands."""
        try:
            snapshots = list_snapshots(self.root)
        except Exception as error:
            self._retention_failed(self.root, error)
            return
        complete = [s for s in snapshots if s.complete]  # committed last first
        pinned = {s.path for s in snapshots if s.step in self.pinned}
        keep = {s.path for s in complete[: self.config.keep_last]} | pinned
        newest = complete[0].step if complete else 0
        fs, _ = _fs(self.root)
        for snapshot in snapshots:
            if snapshot.committed and not snapshot.complete and snapshot.path not in self.unreadable_kept:
                self.unreadable_kept.add(snapshot.path)
                log.warning("retention: keeping %s, which could not be read (%s)", snapshot.path, snapshot.problem)
            removable = snapshot.complete or (not snapshot.committed and snapshot.step < newest)
            if snapshot.path not in keep and removable:
                try:
                    fs.rm(_fs(snapshot.path)[1], recursive=True)
                except Exception as error:
                    self._retention_failed(snapshot.path, error)

    def _retention_failed(self, path: str, error: Exception) -> None:
        log.warning("retention: could not remove %s (tried again at the next commit): %s", path, _first_line(error))
        if self.metrics:
            self.metrics.checkpoint_retention_failures.inc()

    def set_aside(self) -> str | None:
        """``--fresh-start``: move this path's snapshots and ``latest`` into ``aside-<UTC time>/``
        beside them (never deleted), so that this run starts at the configured position. Returns
        that folder, or None when there was nothing to move. Call on every rank before ``restore``."""
        aside = None
        if self.rank == 0:
            fs, base = _fs(self.root)
            names = [e.rstrip("/").rsplit("/", 1)[-1] for e in fs.ls(base, detail=False)]
            moving = [n for n in names if _step_of(n) is not None or n == "latest"]
            if moving:
                aside = _join(self.root, ASIDE + time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()))
                fs.makedirs(_fs(aside)[1], exist_ok=True)
                for name in moving:
                    fs.mv(_join(base, name), _join(_fs(aside)[1], name), recursive=True)
                log.warning("--fresh-start: moved %s of %s aside to %s", ", ".join(sorted(moving)), self.root, aside)
        self._agree(0, dist.ReduceOp.SUM)  # no rank lists snapshots before they are aside
        return aside

    def _gather(self, local: StreamState) -> StreamState:
        if self.world_size == 1:
            return local
        states: list[str | None] = [None] * self.world_size
        dist.all_gather_object(states, local.to_json(), group=self.group)
        merged = StreamState()
        for text in cast(list[str], states):  # all_gather_object filled every slot
            merged = merged.merged(StreamState.from_json(text))
        return merged

    # --- restoring ------------------------------------------------------------------------
    def restore(self, allow_partial: bool = False) -> StreamState | None:
        """Load the newest snapshot that every rank verifies and loads; None if there is none.
        Raises ``RestoreRefused`` if snapshots were committed here and none of them loads."""
        snapshots = list_snapshots(self.root)
        reasons: list[str] = []
        loaded = self._load_agreed(snapshots, allow_partial, ("model", "optimizer", "stream"), reasons)
        if loaded is None:
            if not self._agree(int(any(s.committed for s in snapshots)), dist.ReduceOp.MAX):
                return None  # nothing ever committed here (at most the leftovers of a first save)
            raise RestoreRefused(
                f"{self.root} holds snapshots and none of them loads: {'; '.join(reasons)}. Nothing was removed. "
                f"Fix what the reasons name and restart; or pass --allow-partial-restore if the config changed; "
                f"or pass --fresh-start to move them aside (into {ASIDE}<time>/ there) and start at the configured "
                f"position. Exiting with code {ExitCode.RESTORE_REFUSED:d}."
            )
        snapshot, stream = loaded
        assert stream is not None and snapshot.metadata is not None
        log.info(
            "restored %s: step %d, written by %d rank(s); positions %s",
            snapshot.path,
            stream.step,
            snapshot.metadata.get("world_size"),
            dict(sorted(stream.next_offsets.items())),
        )
        self.last_saved_step = self.last_attempt_step = stream.step
        if self.metrics:
            self.metrics.checkpoint_last_success.set(snapshot.metadata.get("wall_time", time.time()))
        return stream

    def warm_start(self, source: str, with_optimizer: bool, allow_partial: bool = False) -> None:
        """Load the weights (and ``with_optimizer``, the optimizer state) of another run's snapshot:
        ``source`` is a ``step-<N>`` folder, or a checkpoint.path whose newest complete snapshot is
        taken. Its positions are not: the stream starts as in a fresh run."""
        candidates = (
            [verify_snapshot(source)]
            if _step_of(source.rstrip("/").rsplit("/", 1)[-1]) is not None
            else list_snapshots(source)
        )
        parts = ("model", "optimizer") if with_optimizer else ("model",)
        reasons: list[str] = []
        loaded = self._load_agreed(candidates, allow_partial, parts, reasons)
        if loaded is None:
            raise CheckpointError(
                f"checkpoint.init_from {source} holds no snapshot that every rank can load ({'; '.join(reasons)}); "
                f"fix or remove checkpoint.init_from to start from scratch"
            )
        snapshot = loaded[0]
        log.info(
            "warm start: weights%s from %s (step %d, written by %s rank(s)); positions not taken from it",
            " and optimizer state" if with_optimizer else "",
            snapshot.path,
            snapshot.step,
            (snapshot.metadata or {}).get("world_size"),
        )

    def _load_agreed(
        self, snapshots: list[SnapshotInfo], allow_partial: bool, parts: tuple[str, ...], reasons: list[str]
    ) -> tuple[SnapshotInfo, StreamState | None] | None:
        """Every rank loads ``parts`` of the same snapshot: the one committed last (``snapshots``'
        order, which retention keeps by) that every rank verifies and loads. Rank 0 names each
        candidate in turn; if any rank cannot verify or load it, all fall back to the next one
        together. Ranks that restored different cuts would train from mixed positions. By commit,
        not step: a run that fell back to an older snapshot commits lower steps after the higher
        one it abandoned, and those are its newest. Why each skipped one was skipped is appended
        to ``reasons``."""
        for unusable in (s for s in snapshots if not s.complete):
            log.warning("skipping snapshot %s: %s", unusable.path, unusable.problem)
            reasons.append(f"{unusable.path}: {unusable.problem}")
        verified = {s.step: s for s in snapshots if s.complete}  # a step names one folder
        candidates = iter(verified) if self.rank == 0 else iter(())
        while True:  # ends: each turn takes the next of rank 0's candidates, or -1 once none is left
            step = self._agree(next(candidates, -1), dist.ReduceOp.MAX)  # the other ranks offer -1
            if step < 0:
                return None
            snapshot = verified.get(step)
            differences: list[str] = []
            if snapshot is not None:
                assert snapshot.metadata is not None  # a complete snapshot has its marker
                differences = fingerprint_differences(
                    self.fingerprint, snapshot.metadata.get("fingerprint", {}), self.worker_config
                )
            refused = bool(differences) and not allow_partial
            topic = self.worker_config.kafka.topic  # whose offsets a restore may take
            foreign = "stream" in parts and snapshot is not None and _topic_of(snapshot) not in (None, topic)
            # 0: every rank loads it; 1: some rank cannot verify it; 2: some rank refuses it; 3: its
            # positions are in another topic
            verdict = self._agree(1 if snapshot is None else 3 if foreign else 2 if refused else 0, dist.ReduceOp.MAX)
            if verdict == 3:
                where = f"in the topic {_topic_of(snapshot)!r}" if foreign and snapshot else "in another topic"
                raise RestoreRefused(
                    f"the snapshot {snapshot.path if snapshot else f'at step {step}'} holds positions {where}, and "
                    f"this worker reads {topic!r}: those offsets would place this topic's partitions at another "
                    f"topic's positions, skipping or repeating events. Nothing was loaded. To go on training that "
                    f"stream, set kafka.topic back; to train this model on the new topic, give it another "
                    f"checkpoint.path with checkpoint.init_from: {self.root} (weights, not positions), or pass "
                    f"--fresh-start here. Exiting with code {ExitCode.RESTORE_REFUSED:d}."
                )
            if verdict == 2:
                raise RestoreRefused(
                    f"the snapshot {snapshot.path if snapshot else f'at step {step}'} does not fit this worker: "
                    f"{'; '.join(differences) or 'another rank refused it (see its log)'}. "
                    f"Its tensors would not mean the same thing here. Restore it with the config it was written "
                    f"with, point checkpoint.path elsewhere to start fresh, or pass --allow-partial-restore to "
                    f"load only the tensors whose names and shapes still match. Exiting with code "
                    f"{ExitCode.RESTORE_REFUSED:d}."
                )
            if verdict == 1:
                why = "another rank cannot verify it (see its log)" if snapshot else "this rank cannot verify it"
                log.warning("skipping the snapshot at step %d: %s", step, why)
                reasons.append(f"the snapshot at step {step}: {why}")
                continue
            assert snapshot is not None
            stream, error = None, None
            try:
                stream = self._load(snapshot.path, bool(differences), parts)
            except (Exception, CheckpointException) as load_error:  # DCP's is a BaseException
                error = load_error
            if self._all_ok(error is None):
                return snapshot, stream
            why = f"loading it failed {f'here: {_first_line(error)}' if error else 'on another rank (see its log)'}"
            if differences:  # a partial load writes only some tensors: an older one would not overwrite them all
                raise RestoreRefused(
                    f"the partial restore of {snapshot.path} failed after it began loading ({why}); the model may be "
                    f"half-loaded, so the worker does not train it. Exiting with code {ExitCode.RESTORE_REFUSED:d}."
                )
            log.warning("skipping snapshot %s: %s", snapshot.path, why)
            reasons.append(f"{snapshot.path}: {why}")

    def _load(self, path: str, partial: bool, parts: tuple[str, ...]) -> StreamState | None:
        if "optimizer" in parts:
            self.optimizer.init_state()  # fused optimizer state is lazy: create it so DCP can fill it in place
        parts = self._with_id_space(parts)
        state = {k: v for k, v in self._state_dict("").items() if k in parts}
        reader = _fsspec_reader(path) if _is_url(path) else FileSystemReader(_fs(path)[1])
        if "id_space" in state:
            state["id_space"] = _without_other_sketches(state["id_space"], reader.read_metadata())
        if partial:
            matched = _matching_only(state, reader.read_metadata())
            if "id_space" in state:
                # decided before anything is loaded: a managed table added or resized has no usable
                # id map in the snapshot, and its map starts empty
                matched["id_space"] = _whole_id_maps(state["id_space"], matched.get("id_space", {}))
            state = matched
        dcp.load(
            state,
            storage_reader=reader,
            process_group=self.group,
            planner=DefaultLoadPlanner(allow_partial_load=partial),
        )
        self.model.load_state_dict(state["model"], strict=not partial)
        if state.get("id_space") and self.id_space is not None:
            self.id_space.load_state_dict(state["id_space"])
        if "optimizer" in parts and not partial:
            # DCP filled the optimizer's state tensors in place; this restores the rest (steps,
            # param groups). A partial restore keeps the loaded tensors and fresh counters.
            self.optimizer.load_state_dict(state["optimizer"])
        return StreamState.from_json(state["stream"]) if "stream" in parts else None


def _topic_of(snapshot: SnapshotInfo) -> str | None:
    """The topic whose offsets a snapshot holds, from the config its marker records; None for a
    marker that records none."""
    topic = ((snapshot.metadata or {}).get("config") or {}).get("kafka", {}).get("topic")
    return topic if isinstance(topic, str) else None


def _without_other_sketches(id_space: dict[str, Any], metadata: Metadata) -> dict[str, Any]:
    """``id_space`` less the buckets' admission sketches the snapshot holds at another shape (or not
    at all): admission settings may change across a restore, and ids waiting for admission then
    count from zero. A snapshot taken with every id admitted holds empty sketches."""
    saved = metadata.state_dict_metadata
    kept: dict[str, Any] = {}
    for name, buckets in id_space.items():
        if isinstance(buckets, dict):
            differ = [
                bucket
                for bucket, part in buckets.items()
                if tuple(getattr(saved.get(f"id_space.{name}.{bucket}.sketch"), "size", ())) != part["sketch"].shape
            ]
            if differ:
                log.info("table %s: the snapshot's admission sketch differs; waiting ids count from zero", name)
                buckets = {
                    bucket: {k: v for k, v in part.items() if k != "sketch"} if bucket in differ else part
                    for bucket, part in buckets.items()
                }
        kept[name] = buckets
    return kept


def _whole_id_maps(full: dict[str, Any], matched: dict[str, Any]) -> dict[str, Any]:
    """The managed tables' id maps a partial restore can load: those the snapshot holds whole
    (every bucket this rank owns, each with every array at its size), with the id space's step;
    none if it holds none."""
    whole = {
        name: buckets
        for name, buckets in matched.items()
        if name != "step"
        and isinstance(buckets, dict)
        and set(buckets) == set(full[name])
        and all(set(buckets[b]) == set(full[name][b]) for b in buckets)
    }
    for name in sorted(set(full) - {"step"} - set(whole)):
        log.warning("partial restore: the snapshot holds no usable id map for table %s; it starts empty", name)
    return {**whole, "step": matched["step"]} if whole else {}


def _matching_only(state: dict[str, Any], metadata: Metadata) -> dict[str, Any]:
    """Keep the tensors the snapshot has under the same name and shape (for a partial restore)."""
    saved = metadata.state_dict_metadata

    def keep(prefix: str, value: Any) -> bool:
        entry = saved.get(prefix)
        return entry is not None and (
            not hasattr(value, "shape") or not hasattr(entry, "size") or tuple(entry.size) == tuple(value.shape)
        )

    def walk(prefix: str, node: Any) -> Any:
        if isinstance(node, dict):
            return {
                k: v
                for k, v in ((k, walk(f"{prefix}.{k}" if prefix else k, v)) for k, v in node.items())
                if v is not _DROP
            }
        return node if keep(prefix, node) else _DROP

    return walk("", state)


_DROP = object()


def _version(module: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    for name in (module, module.replace("_", "-"), "fbgemm-gpu-cpu" if module == "fbgemm_gpu" else module):
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    return "unknown"


def _first_line(error: BaseException) -> str:
    return str(error).splitlines()[0] if str(error) else type(error).__name__
