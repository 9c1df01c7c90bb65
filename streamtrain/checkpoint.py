"""Snapshots of the whole training state with the Kafka positions inside them, through DCP.

A snapshot is a consistent cut: it is taken between two pipeline steps, so the weights hold the
updates of exactly the batches whose positions it records. It is written asynchronously
(``dcp.async_save`` on a gloo group of its own, one save in flight) under
``step-<N>.partial/``; once every rank's writes are done, rank 0 adds ``streamtrain.json`` and
renames the folder to ``step-<N>``, then points ``latest`` at it. Restoring loads the newest
snapshot that verifies, skipping partial or damaged ones with a warning, and the consumer starts
from the positions in it, never from the consumer group's committed offsets.
"""

from __future__ import annotations

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
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from streamtrain.config import CheckpointConfig, WorkerConfig
from streamtrain.schema import load_schema

if TYPE_CHECKING:
    from torch.distributed.checkpoint import FsspecReader, FsspecWriter
    from torch.distributed.checkpoint.metadata import Metadata

    from streamtrain.metrics import WorkerMetrics

log = logging.getLogger(__name__)

MARKER = "streamtrain.json"
_ASYNC_MODES = {"thread": AsyncCheckpointerType.THREAD, "process": AsyncCheckpointerType.PROCESS}
PARTIAL = ".partial"
FORMAT_VERSION = 1


class CheckpointError(RuntimeError):
    pass


@dataclass
class StreamState:
    """Where the stream stood at a snapshot: the next offset and the trained-event count of every
    partition (all ranks' partitions, gathered), the step, and the newest event time trained."""
    step: int = 0
    next_offsets: dict[int, int] = field(default_factory=dict)
    trained: dict[int, int] = field(default_factory=dict)
    event_time_high_water_ms: int = 0

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> StreamState:
        raw = json.loads(text)
        return cls(step=raw["step"], next_offsets={int(p): o for p, o in raw["next_offsets"].items()},
                   trained={int(p): n for p, n in raw["trained"].items()},
                   event_time_high_water_ms=raw["event_time_high_water_ms"])

    def copy(self) -> StreamState:
        return StreamState(self.step, dict(self.next_offsets), dict(self.trained), self.event_time_high_water_ms)

    def merged(self, other: StreamState) -> StreamState:
        return StreamState(max(self.step, other.step), {**self.next_offsets, **other.next_offsets},
                           {**self.trained, **other.trained},
                           max(self.event_time_high_water_ms, other.event_time_high_water_ms))


def compatibility_fingerprint(config: WorkerConfig) -> dict[str, str]:
    """What must match for a snapshot's tensors to mean the same thing in this worker: the
    feature and model config, and the Avro types of the fields the features read."""
    schema = load_schema(config.features.resolved_schema_path())
    used = {t.field for t in config.features.tables} | {d.field for d in config.features.dense}
    used |= {config.features.label}
    types = {f["name"]: f["type"] for f in schema["fields"] if f["name"] in used}

    def digest(value: Any) -> str:
        return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]

    return {
        "features": digest(config.features.model_dump(exclude={"schema_path"})),
        "model": digest(config.model.model_dump(exclude={"sparse_learning_rate", "dense_learning_rate", "seed"})),
        "schema_fields": digest(types),
    }


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


def _step_of(name: str) -> int | None:
    stem = name[:-len(PARTIAL)] if name.endswith(PARTIAL) else name
    if stem.startswith("step-") and stem[5:].isdigit():
        return int(stem[5:])
    return None


def list_snapshots(root: str) -> list[SnapshotInfo]:
    """Every snapshot under ``root``, newest first, each verified: its marker parses and every
    file DCP's metadata refers to exists and is long enough."""
    fs, base = _fs(root)
    if not fs.exists(base):
        return []
    found = []
    for entry in fs.ls(base, detail=False):
        name = entry.rstrip("/").rsplit("/", 1)[-1]
        step = _step_of(name)
        if step is not None:
            found.append(verify_snapshot(_join(root, name), step))
    return sorted(found, key=lambda s: (s.step, s.complete), reverse=True)


def verify_snapshot(path: str, step: int | None = None) -> SnapshotInfo:
    fs, local = _fs(path)
    name = local.rstrip("/").rsplit("/", 1)[-1]
    step = _step_of(name) if step is None else step
    if step is None:
        raise ValueError(f"{path} is not a snapshot: its name is not step-<N>")
    size = sum(fs.du(local, total=False).values()) if fs.exists(local) else 0
    if name.endswith(PARTIAL):
        return SnapshotInfo(path, step, False, "never finished (no commit by rank 0)", None, size)
    try:
        metadata = json.loads(fs.cat_file(_join(local, MARKER)))
        if metadata.get("format") != FORMAT_VERSION or "stream" not in metadata:
            raise ValueError(f"unknown format {metadata.get('format')!r}")
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
    ):
        self.config = config
        self.root = str(config.path)
        self.model = model
        self.optimizer = optimizer
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self.metrics = metrics
        self.fingerprint = compatibility_fingerprint(worker_config)
        self.in_flight: tuple[Future, str, StreamState, float] | None = None
        self.last_saved_at = time.monotonic()
        self.last_saved_step = 0
        if rank == 0:
            fs, base = _fs(self.root)
            fs.makedirs(base, exist_ok=True)


    # --- what goes in ---------------------------------------------------------------------
    def _state_dict(self, stream_json: str) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(), "stream": stream_json}

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
        started = time.monotonic()
        # async_save stages (copies) the state before it returns: training may go on at once.
        future = dcp.async_save(self._state_dict(stream.to_json()), storage_writer=writer,
                                process_group=self.group, async_checkpointer_type=_ASYNC_MODES[self.config.async_mode])
        self.in_flight = (future, path, stream, started)

    def finish_save(self) -> StreamState:
        """Wait for this rank's writes, then (rank 0) commit the snapshot. Call on all ranks once
        every rank's ``save_done()`` is true, or at shutdown."""
        assert self.in_flight is not None
        future, partial_path, stream, started = self.in_flight
        self.in_flight = None
        try:
            future.result()
        except Exception:
            if self.metrics:
                self.metrics.checkpoint_failures.inc()
            raise
        if self.world_size > 1:
            dist.barrier(group=self.group)  # every rank's files are written
        final_path = partial_path[: -len(PARTIAL)]
        if self.rank == 0:
            self._commit(partial_path, final_path, stream, time.monotonic() - started)
        if self.world_size > 1:
            dist.barrier(group=self.group)  # the snapshot is committed before anyone relies on it
        duration = time.monotonic() - started
        self.last_saved_at = time.monotonic()
        self.last_saved_step = stream.step
        if self.metrics:
            fs, local = _fs(final_path)
            self.metrics.checkpoint_seconds.observe(duration)
            self.metrics.checkpoint_bytes.set(sum(fs.du(local, total=False).values()))
            self.metrics.checkpoint_last_success.set(time.time())
        log.info("rank %d: snapshot %s committed (step %d, %.2fs)", self.rank, final_path, stream.step, duration)
        return stream

    def save(self, local: StreamState) -> StreamState:
        self.start_save(local)
        return self.finish_save()

    def _commit(self, partial_path: str, final_path: str, stream: StreamState, seconds: float) -> None:
        fs, partial = _fs(partial_path)
        _, final = _fs(final_path)
        marker = {
            "format": FORMAT_VERSION,
            "stream": json.loads(stream.to_json()),
            "world_size": self.world_size,
            "fingerprint": self.fingerprint,
            "versions": {"torch": torch.__version__, "torchrec": _version("torchrec"),
                         "fbgemm_gpu": _version("fbgemm_gpu")},
            "wall_time": time.time(),
            "save_seconds": round(seconds, 3),
        }
        fs.pipe_file(_join(partial, MARKER), json.dumps(marker, indent=2).encode())
        if fs.exists(final):  # a replay of the same step after a crash: the new cut replaces it
            fs.rm(final, recursive=True)
        fs.mv(partial, final, recursive=True)
        _, base = _fs(self.root)
        fs.pipe_file(_join(base, "latest.tmp"), final.rstrip("/").rsplit("/", 1)[-1].encode())
        fs.mv(_join(base, "latest.tmp"), _join(base, "latest"))
        self._retain()

    def _retain(self) -> None:
        snapshots = list_snapshots(self.root)
        complete = [s for s in snapshots if s.complete]
        keep = {s.path for s in complete[: self.config.keep_last]}
        newest = complete[0].step if complete else 0
        fs, _ = _fs(self.root)
        for snapshot in snapshots:
            # keep the newest K complete ones; drop older ones, and leftovers of crashed saves
            if snapshot.path not in keep and (snapshot.complete or snapshot.step < newest):
                fs.rm(_fs(snapshot.path)[1], recursive=True)

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
        """Load the newest snapshot that verifies and loads; None if there is none."""
        for snapshot in list_snapshots(self.root):
            if not snapshot.complete:
                log.warning("skipping snapshot %s: %s", snapshot.path, snapshot.problem)
                continue
            assert snapshot.metadata is not None  # a complete snapshot has its marker
            theirs = snapshot.metadata.get("fingerprint", {})
            mismatched = sorted(k for k, v in self.fingerprint.items() if theirs.get(k) != v)
            if mismatched and not allow_partial:
                raise CheckpointError(
                    f"snapshot {snapshot.path} was written for a different {' and '.join(mismatched)} "
                    f"configuration than this worker's; its tensors would not mean the same thing. Restore "
                    f"it with the matching config, point checkpoint.path elsewhere to start fresh, or pass "
                    f"--allow-partial-restore to load only the tensors whose names and shapes still match.")
            try:
                stream = self._load(snapshot.path, partial=bool(mismatched))
            except Exception as error:
                log.warning("skipping snapshot %s: loading it failed: %s", snapshot.path,
                            str(error).splitlines()[0] if str(error) else type(error).__name__)
                continue
            log.info("restored %s: step %d, written by %d rank(s); positions %s", snapshot.path, stream.step,
                     snapshot.metadata.get("world_size"), dict(sorted(stream.next_offsets.items())))
            self.last_saved_step = stream.step
            if self.metrics:
                self.metrics.checkpoint_last_success.set(snapshot.metadata.get("wall_time", time.time()))
            return stream
        return None

    def _load(self, path: str, partial: bool) -> StreamState:
        self.optimizer.init_state()  # fused optimizer state is lazy: create it so DCP can fill it in place
        state = self._state_dict("")
        reader = _fsspec_reader(path) if _is_url(path) else FileSystemReader(_fs(path)[1])
        if partial:
            state = _matching_only(state, reader.read_metadata())
        dcp.load(state, storage_reader=reader, process_group=self.group,
                 planner=DefaultLoadPlanner(allow_partial_load=partial))
        self.model.load_state_dict(state["model"], strict=not partial)
        if not partial:
            # DCP filled the optimizer's state tensors in place; this restores the rest (steps,
            # param groups). A partial restore keeps the loaded tensors and fresh counters.
            self.optimizer.load_state_dict(state["optimizer"])
        return StreamState.from_json(state["stream"])


def _matching_only(state: dict[str, Any], metadata: Metadata) -> dict[str, Any]:
    """Keep the tensors the snapshot has under the same name and shape (for a partial restore)."""
    saved = metadata.state_dict_metadata

    def keep(prefix: str, value: Any) -> bool:
        entry = saved.get(prefix)
        return entry is not None and (not hasattr(value, "shape") or not hasattr(entry, "size")
                                      or tuple(entry.size) == tuple(value.shape))

    def walk(prefix: str, node: Any) -> Any:
        if isinstance(node, dict):
            return {k: v for k, v in ((k, walk(f"{prefix}.{k}" if prefix else k, v)) for k, v in node.items())
                    if v is not _DROP}
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
