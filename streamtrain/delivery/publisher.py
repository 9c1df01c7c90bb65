"""Model delivery in the worker: deltas of the touched rows, cut between steps, and servable bases.

A delta is a consistent cut, like a snapshot. Every rank collects the ids its trained batches
looked up (``TouchedIds``). When a delta is due, the ranks agree on the step through the
lockstep's vote; at that step each rank all-gathers the touched ids on a gloo group of its own and
copies the current rows of its own shards for them (``local_rows``), rank 0 also every dense
parameter. That copy is all the training thread does. A background thread on every rank then
gathers the copies to rank 0 on another gloo group, and rank 0 encodes them
(``streamtrain.delivery.deltas``) and delivers them to the delta topic or directory. One delta is
in flight at a time: the next is cut only at a step every rank agrees the last is done.

A delivery that fails is counted and retried with the same chunks, the wait doubling up to
``RETRY_MAX_SECONDS``, while training goes on. Duplicates are harmless: the reader assembles each
part once, and the delta is stamped with its publication time once, at the cut, so the chunks a
failed attempt left on the topic belong to the same delta as the retry's. Meanwhile no new delta
is cut, and the touched ids keep accumulating, compacted, so the backlog is at most one id per
table row plus the one delta in flight; once the target takes the retried delta, the next
carries every row touched meanwhile. A delta still undelivered at a graceful stop is given up
after a bounded wait and counted: its sequence number is then missing, which the server handles
by reloading the newest base (the worker publishes one at the stop).

Bases come from ``streamtrain export``, run by rank 0 as a background process, never on the
training thread: one at start (``--new-chain``: every start begins a chain), one every
``delivery.base_interval_seconds`` from the newest committed snapshot, and one from the final
snapshot at a graceful stop. A failed export is logged and counted, never fatal.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any, Protocol

import fsspec
import numpy as np
import torch
import torch.distributed as dist
from torchrec.distributed.types import ShardingPlan
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from streamtrain import durable
from streamtrain.checkpoint import DeliveryPosition, StreamState
from streamtrain.config import DeliveryConfig, KafkaConfig, WorkerConfig
from streamtrain.delivery.deltas import Delta, DeltaId, DensePiece, IdPiece, RowPiece, encode
from streamtrain.delivery.spec import MANIFEST, delta_name, parse_base, parse_delta, parse_manifest, part_name
from streamtrain.launch import child_environment
from streamtrain.lockstep import Question
from streamtrain.models.base import TABLE_ATTRIBUTES
from streamtrain.source import KAFKA_LOG
from streamtrain.topics import NO_AUTO_CREATE, OutputTopic, ensure_topics

if TYPE_CHECKING:
    from streamtrain.idspace import IdSpace
    from streamtrain.metrics import WorkerMetrics

log = logging.getLogger(__name__)

RETRY_FIRST_SECONDS = 1.0
RETRY_MAX_SECONDS = 30.0
STOP_MARGIN_SECONDS = 5.0
# A directory target has no message limit; chunks of this size keep each file's write short.
DIRECTORY_CHUNK_BYTES = 8 * 2**20
# How often a directory target looks for deltas no kept base needs.
PRUNE_SECONDS = 60.0
# The base exporter (streamtrain/delivery/artifact.py), run as a process of its own.
EXPORT_COMMAND = (sys.executable, "-m", "streamtrain", "export")
EXPORT_NICENESS = 10
# In delivery.path: the newest base version allocated, exported or not.
RESERVED = "reserved-version"


class TouchedIds:
    """The row ids each table was looked up with since the last ``take()``, from the trained
    batches' KJTs (the decoder has already mapped them to rows). Adding a batch only keeps views of
    its values; once ``compact_at`` ids are held they are reduced to the unique ones, so the memory
    is bounded by the tables' rows however long a delta waits.

    ``table_of`` maps a KJT key (a feature) to the table it looks up, where that is not its own:
    a feature sharing another's table (``shares_table_with``) touches the owner's rows."""

    def __init__(self, tables: Sequence[str], table_of: Mapping[str, str] | None = None, compact_at: int = 1 << 22):
        self.tables = list(tables)
        self.table_of = dict(table_of or {})
        self.compact_at = compact_at
        self.pending: dict[str, list[torch.Tensor]] = {t: [] for t in self.tables}
        self.held = 0

    def add(self, features: KeyedJaggedTensor) -> None:
        lengths = features.length_per_key()
        for key, ids in zip(features.keys(), features.values().split(lengths), strict=True):
            if ids.numel():
                self.pending[self.table_of.get(key, key)].append(ids)
        self.held += sum(lengths)
        if self.held >= self.compact_at:
            self.held = 0
            for table, parts in self.pending.items():
                if parts:
                    unique = torch.unique(torch.cat(parts))
                    self.pending[table] = [unique]
                    self.held += unique.numel()

    def __bool__(self) -> bool:
        """Whether any id was added since the last take."""
        return any(self.pending.values())

    def take(self) -> dict[str, np.ndarray]:
        """Each table's unique ids since the last take, sorted, as int64."""
        taken = {
            table: torch.unique(torch.cat(parts)).to(torch.int64).numpy() if parts else np.empty(0, np.int64)
            for table, parts in self.pending.items()
        }
        self.pending = {t: [] for t in self.tables}
        self.held = 0
        return taken


def table_keys(state: dict[str, Any], plan: ShardingPlan) -> dict[str, str]:
    """Each table's weight in ``state`` (the DMP's state dict), whatever collection holds it and
    wherever that sits in the model."""
    keys = {}
    for path, tables in plan.plan.items():
        for table in tables:
            found = [f"{path}.{kind}.{table}.weight" for kind in TABLE_ATTRIBUTES]
            keys[table] = next(key for key in found if key in state)
    return keys


def local_rows(state: dict[str, Any], plan: ShardingPlan, rank: int, ids: dict[str, np.ndarray]) -> list[RowPiece]:
    """Copies of the rows ``ids`` of every table, as far as this rank holds them: the columns of
    its own shards (table-wise: the whole table; column-wise: its column slices), and on rank 0
    every row of the replicated (data-parallel) tables. ``state`` is the DMP's state dict: its sharded tables are
    DTensors over the fused kernel's own weights, so they hold the optimizer's latest update. The
    shards' offsets come from the plan; DTensor's own local offsets are not reliable for these."""
    pieces = []
    # Where each table's collection sits in the model, whatever its architecture.
    collection_of = {table: path for path, tables in plan.plan.items() for table in tables}
    keys = table_keys(state, plan)
    for table, wanted in ids.items():
        weight = state[keys[table]]
        spec = plan.plan[collection_of[table]][table].sharding_spec
        if spec is None:
            # Data parallel: every rank holds all of it, a torch parameter stepped by the dense
            # optimizer, whose momentum moves rows no batch looked up. The planner replicates only
            # small tables, so every delta carries the whole table.
            if rank == 0:
                every = np.arange(weight.shape[0], dtype=np.int64)
                pieces.append(RowPiece(table, every, 0, _rows(weight, torch.from_numpy(every))))
            continue
        if not len(wanted):
            continue
        mine = [shard for shard in spec.shards if shard.placement is not None and shard.placement.rank() == rank]
        if not mine:
            continue
        for meta, local in zip(mine, weight.to_local().local_shards(), strict=True):
            first_row, column = meta.shard_offsets
            inside = wanted[(wanted >= first_row) & (wanted < first_row + meta.shard_sizes[0])]
            if len(inside):
                pieces.append(RowPiece(table, inside, column, _rows(local, torch.from_numpy(inside - first_row))))
    return pieces


def _rows(weight: torch.Tensor, ids: torch.Tensor) -> np.ndarray:
    # index_select copies: the cut stays as it is while training moves the weights on.
    return weight.detach().index_select(0, ids.to(weight.device)).to("cpu", torch.float32).numpy()


def dense_pieces(state: dict[str, Any], plan: ShardingPlan) -> list[DensePiece]:
    """A copy of every dense parameter, named as in the model's state dict (replicated on all ranks)."""
    tables = set(table_keys(state, plan).values())
    return [
        DensePiece(name, tuple(value.shape), 0, value.detach().to("cpu", torch.float32, copy=True).numpy().reshape(-1))
        for name, value in state.items()
        if name not in tables and isinstance(value, torch.Tensor) and value.is_floating_point()
    ]


class DeliveryFailed(RuntimeError):
    """One attempt to deliver a delta failed; the publisher retries it."""


class DeltaTarget(Protocol):
    def send(self, delta: Delta) -> int:
        """Delivers every chunk of ``delta``; returns the bytes sent. Raises DeliveryFailed."""

    def close(self) -> None: ...


def delta_topic(delivery: DeliveryConfig, kafka: KafkaConfig) -> OutputTopic:
    """The delta topic, as the worker creates it: one partition, so deltas stay in order, keeping
    what reaches back to the oldest kept base (older deltas serve nobody), with segments rolled often
    enough for the broker to delete the rest."""
    retention_ms = int(delivery.delta_retention_seconds() * 1000)
    return OutputTopic(
        delivery.resolved_topic(kafka.topic),
        "delta",
        "delivery.topic",
        1,
        delivery.topic_replication_factor,
        {"retention.ms": str(retention_ms), "segment.ms": str(min(retention_ms, 3_600_000))},
    )


class TopicTarget:
    """Chunks to a Kafka topic with an idempotent producer and acks=all, each chunk below the
    topic's ``max.message.bytes``. The worker makes sure of the topic at start
    (``streamtrain.topics``), and once more when the producer connects, at the first delta."""

    def __init__(self, kafka: KafkaConfig, topic: OutputTopic, key: str, timeout_seconds: float):
        self.kafka = kafka
        self.output_topic = topic
        self.topic = topic.name
        self.key = key.encode()
        self.timeout = timeout_seconds
        self.producer: Any = None
        self.max_bytes = 0

    def _connect(self) -> None:
        from confluent_kafka import Producer
        from confluent_kafka.admin import AdminClient, ConfigResource

        ensure_topics(self.kafka, [self.output_topic], self.timeout)
        admin = AdminClient({**self.kafka.librdkafka(), "logger": KAFKA_LOG, **NO_AUTO_CREATE})
        resource = ConfigResource(ConfigResource.Type.TOPIC, self.topic)
        configs = admin.describe_configs([resource])[resource].result(timeout=self.timeout)
        self.max_bytes = int(configs["max.message.bytes"].value)
        self.producer = Producer(
            {
                **self.kafka.librdkafka(),
                "logger": KAFKA_LOG,
                **NO_AUTO_CREATE,
                "enable.idempotence": True,
                "acks": "all",
                "message.timeout.ms": int(self.timeout * 1000),
                # A record batch, not just a record, must fit the topic's limit.
                "batch.size": self.max_bytes,
                "message.max.bytes": max(self.max_bytes, 1000),
                "linger.ms": 5,
            }
        )

    def send(self, delta: Delta) -> int:
        try:
            if self.producer is None:
                self._connect()
        except Exception as error:
            raise DeliveryFailed(f"the delta topic {self.topic} is unreachable: {error}") from None
        chunks = encode(delta, self.max_bytes)
        errors: list[str] = []

        def delivered(error: Any, _message: Any) -> None:
            if error is not None:
                errors.append(str(error))

        deadline = time.monotonic() + self.timeout
        for chunk in chunks:
            while True:
                try:
                    self.producer.produce(self.topic, chunk, key=self.key, on_delivery=delivered)
                    break
                except BufferError:  # the local queue is full: let deliveries drain it, bounded
                    if time.monotonic() > deadline:
                        errors.append("the producer's queue stayed full")
                        break
                    self.producer.poll(0.1)
        unsent = self.producer.flush(max(deadline - time.monotonic(), 1.0))
        if unsent or errors:
            # Drop what is still queued: the retry sends every chunk again, so the backlog never
            # grows past one delta.
            self.producer.purge()
            self.producer.flush(0)
            reason = errors[0] if errors else f"{unsent} chunk(s) not acknowledged within {self.timeout:g}s"
            raise DeliveryFailed(f"delta {delta.id.sequence} to {self.topic}: {reason}")
        return sum(len(c) for c in chunks)

    def close(self) -> None:
        if self.producer is not None:
            self.producer.flush(0)


class DirectoryTarget:
    """``<directory>/delta-<chain>-<sequence>/part-<i>`` files (numbers zero-padded, so names sort),
    then ``COMPLETE``: a reader takes a delta only once its marker is there. With ``bases`` (the
    bases' folder), the deltas no kept base needs are removed, at most every ``PRUNE_SECONDS``."""

    def __init__(self, directory: str, bases: str | None = None, clock: Callable[[], float] = time.monotonic):
        self.directory = directory.rstrip("/")
        self.fs, self.root = fsspec.core.url_to_fs(self.directory)
        self.bases = bases
        self.clock = clock
        self.pruned_at = -float("inf")

    def send(self, delta: Delta) -> int:
        chunks = encode(delta, DIRECTORY_CHUNK_BYTES)
        folder = f"{self.root}/{delta_name(delta.id.base_version, delta.id.sequence)}"
        try:
            durable.make_folder(self.fs, folder)
            for part, chunk in enumerate(chunks):
                self.fs.pipe_file(f"{folder}/{part_name(part)}", chunk)
            durable.sync_folder(self.fs, folder)
            durable.publish_file(self.fs, f"{folder}/COMPLETE", b"")
        except OSError as error:
            raise DeliveryFailed(f"delta {delta.id.sequence} to {self.directory}: {error}") from None
        if self.bases is not None and self.clock() - self.pruned_at >= PRUNE_SECONDS:
            self.pruned_at = self.clock()
            self.prune(self.bases)
        return sum(len(c) for c in chunks)

    def prune(self, bases: str) -> int:
        """Removes the deltas that no finished base in ``bases`` needs: those of older chains than
        the oldest base's, and those of its chain before its ``delta_sequence``; returns how many.
        A server on a base removed since then finds a gap, and loads the newest base."""
        oldest = oldest_base_position(bases)
        if oldest is None:
            return 0
        removed = 0
        for entry in self.fs.ls(self.root, detail=False):
            position = parse_delta(entry.rstrip("/").rsplit("/", 1)[-1])
            if position is not None and position < oldest:
                try:
                    self.fs.rm(entry, recursive=True)
                    removed += 1
                except OSError as error:  # a file system that refuses now may allow it at the next prune
                    log.warning("could not remove the old delta %s: %s", entry, error)
        return removed

    def close(self) -> None:
        pass


def oldest_base_position(bases: str) -> tuple[int, int] | None:
    """(chain, delta_sequence) of the oldest finished base in ``bases``: the first delta any kept
    base needs. None if there is no finished base."""
    fs, root = fsspec.core.url_to_fs(bases)
    positions = []
    if fs.exists(root):
        for entry in fs.ls(root, detail=False):
            base = parse_base(entry.rstrip("/").rsplit("/", 1)[-1])
            if base is not None and not base.partial:
                path = f"{entry.rstrip('/')}/{MANIFEST}"
                with contextlib.suppress(OSError, ValueError):  # removed by retention meanwhile
                    manifest = parse_manifest(fs.cat_file(path), path)
                    positions.append((manifest.chain, manifest.delta_sequence))
    return min(positions, default=None)


def id_pieces(id_space: IdSpace, touched: dict[str, np.ndarray], since_step: int) -> list[IdPiece]:
    """The managed tables' map for a delta: the ids left since id-space step ``since_step`` (the
    previous delta's), and the raw id of each touched row that holds one at the cut; the whole map
    where the eviction log does not reach back to ``since_step``."""
    pieces = []
    for table in (t.name for t in id_space.tables):
        live_rows, raw_ids = (t.numpy() for t in id_space.raw_ids(table))
        evicted = id_space.evicted_since(table, since_step)
        if evicted is None:
            pieces.append(IdPiece(table, live_rows, raw_ids, full=True))
            continue
        if len(evicted):
            pieces.append(IdPiece(table, evicted.rows.numpy(), evicted.ids.numpy(), evicted=True))
        carried = np.isin(live_rows, touched.get(table, np.empty(0, np.int64)))
        if carried.any():
            pieces.append(IdPiece(table, live_rows[carried], raw_ids[carried]))
    return pieces


@dataclass
class _Cut:
    id: DeltaId
    rows: list[RowPiece]
    dense: list[DensePiece]
    ids: list[IdPiece]
    cut_at: float


class BaseExports:
    """Rank 0's base exports: ``streamtrain export`` in a background process, one at a time."""

    def __init__(
        self,
        config: DeliveryConfig,
        checkpoint_path: str,
        metrics: WorkerMetrics | None,
        pinned: set[int] | None = None,
        export_command: Sequence[str] = EXPORT_COMMAND,
    ):
        """``pinned``: the checkpointer's steps kept past its retention; the snapshot being exported
        is in it, so that newer snapshots do not remove it under the export."""
        self.pinned = pinned if pinned is not None else set()
        self.config = config
        self.export_command = list(export_command)
        self.checkpoint_path = checkpoint_path
        self.path = config.resolved_path(checkpoint_path)
        self.metrics = metrics
        self.fs, self.root = fsspec.core.url_to_fs(self.path)
        self.version = 0
        self.running: threading.Thread | None = None
        self.process: subprocess.Popen | None = None
        self.stopped = False  # set when wait() runs out and kills the export
        self.exporting_chain_start = False  # the export running is the chain's first base
        self.last_step = -1
        self.last_started_at = time.monotonic()

    def newest_version(self) -> int:
        """The newest base version in ``delivery.path``, finished or not, or reserved by an
        allocation whose export never got as far; 0 if there is none."""
        newest = self.version
        if self.fs.exists(self.root):
            for entry in self.fs.ls(self.root, detail=False):
                base = parse_base(entry.rstrip("/").rsplit("/", 1)[-1])
                if base is not None:
                    newest = max(newest, base.version)
            with contextlib.suppress(OSError, ValueError):
                newest = max(newest, int(self.fs.cat_file(f"{self.root}/{RESERVED}")))
        return newest

    def allocate(self, at_least: int = 0) -> int:
        """The next base version, above every one in ``delivery.path`` and ``at_least``. It is
        reserved on disk first: deltas carry it at once, and a failed export must not hand it out
        again to the next start."""
        self.version = max(self.newest_version(), at_least) + 1
        self.fs.makedirs(self.root, exist_ok=True)
        durable.publish_file(self.fs, f"{self.root}/{RESERVED}", str(self.version).encode())
        return self.version

    def start(self, step: int, new_chain: bool, version: int | None = None) -> None:
        """Exports the snapshot at ``step`` as the next base version (``version`` when given),
        unless an export is running."""
        if self.running is not None:
            return
        version = version if version is not None else self.allocate()
        command = [
            *self.export_command, "--checkpoint", self.checkpoint_path,
            "--step", str(step), "--out", self.path, "--version", str(version), "--keep", str(self.config.keep_bases),
            *(["--new-chain"] if new_chain else []),
        ]  # fmt: skip
        output = tempfile.TemporaryFile()  # noqa: SIM115 - the watcher reads and closes it
        self.pinned.add(step)
        try:
            process = subprocess.Popen(
                command, stdout=output, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=child_environment()
            )  # it dies with this rank
        except OSError as error:
            output.close()
            self.pinned.discard(step)
            self.failed(version, step, f"could not start it: {error}")
            return
        with contextlib.suppress(OSError):  # where priorities cannot be lowered, it runs as it is
            # When the CPU is short, training goes first; the export takes what is left.
            os.setpriority(os.PRIO_PROCESS, process.pid, EXPORT_NICENESS)
        self.process, self.last_step = process, step
        self.exporting_chain_start = new_chain
        self.last_started_at = time.monotonic()
        log.info("exporting base %d from the snapshot at step %d (pid %d)", version, step, process.pid)
        # A thread per export notes its end when it comes, so the log and metrics do not wait for
        # the next training step (an idle stream takes none).
        self.running = threading.Thread(
            target=self._watch, args=(process, output, version, step), name="streamtrain-base-export", daemon=True
        )
        self.running.start()

    def _watch(self, process: subprocess.Popen, output: IO[bytes], version: int, step: int) -> None:
        process.wait()
        seconds = time.monotonic() - self.last_started_at
        output.seek(0)
        text = output.read().decode(errors="replace")
        output.close()
        self.pinned.discard(step)
        if self.stopped:
            self.failed(version, step, f"stopped unfinished after {seconds:.0f}s, at the worker's stop")
        elif process.returncode != 0:
            tail = " | ".join(text.strip().splitlines()[-5:])
            self.failed(version, step, f"streamtrain export exited with {process.returncode}: {tail}")
        else:
            if self.metrics:
                self.metrics.bases_published.inc()
                self.metrics.base_export_seconds.observe(seconds)
            log.info("base %d published from the snapshot at step %d in %.1fs", version, step, seconds)
        self.exporting_chain_start = False
        self.running = None

    def due(self, newest_snapshot_step: int) -> bool:
        return (
            self.running is None
            and newest_snapshot_step > self.last_step
            and time.monotonic() - self.last_started_at >= self.config.base_interval_seconds
        )

    def wait(self, seconds: float) -> None:
        """Waits up to ``seconds`` for the export running; past that it is stopped and counted."""
        watcher = self.running
        if watcher is None:
            return
        watcher.join(timeout=seconds)
        if watcher.is_alive() and self.process is not None:
            self.stopped = True
            self.process.kill()
            watcher.join(timeout=10)
        self.stopped = False

    def failed(self, version: int, step: int, reason: str) -> None:
        """Counts and logs a base that was not published."""
        if self.metrics:
            self.metrics.bases_failed.inc()
        log.error("base %d from the snapshot at step %d failed (training goes on): %s", version, step, reason)


class Publisher:
    """One rank's part in model delivery. ``questions``, ``record``, ``act`` and ``stop_deltas``
    are called on every rank at the same steps, as the lockstep agrees."""

    def __init__(
        self,
        config: WorkerConfig,
        model: torch.nn.Module,
        plan: ShardingPlan,
        rank: int,
        world_size: int,
        cut_group: dist.ProcessGroup | None,
        send_group: dist.ProcessGroup | None,
        stream: StreamState,
        newest_snapshot_step: Callable[[], int],
        pinned_snapshots: set[int] | None = None,
        metrics: WorkerMetrics | None = None,
        target: DeltaTarget | None = None,
        clock: Callable[[], float] = time.monotonic,
        id_space: IdSpace | None = None,
    ):
        """``stream`` is the snapshot schedule's state: the publisher keeps its ``delivery`` position
        current, so each snapshot records the next delta's sequence. ``id_space``: the trainer's,
        when it has managed tables; their maps travel with the deltas."""
        delivery = config.delivery
        self.config = delivery
        self.model = model
        self.plan = plan
        self.rank = rank
        self.world_size = world_size
        self.cut_group = cut_group
        self.send_group = send_group
        self.stream = stream
        self.newest_snapshot_step = newest_snapshot_step
        self.metrics = metrics
        self.clock = clock
        self.model_id = delivery.resolved_model_id(config.kafka.topic)
        self.id_space = id_space
        # The id-space step of the previous delta's cut (or of the start's base): evictions since it go out.
        self.id_space_step = id_space.step if id_space is not None else 0
        features = config.features
        self.touched = TouchedIds(
            [t.name for t in features.owned_tables()],
            {t.name: t.shares_table_with for t in features.tables if t.shares_table_with is not None},
        )
        self.last_cut_at = clock()
        self.last_cut_step = stream.step
        self.step_mark = stream.step  # delta_interval_steps counts from here
        self.steps_due_at: int | None = None  # the step at which the steps interval fell due
        self.in_flight = False
        self.done = threading.Event()
        self.done.set()
        self.abandon = threading.Event()
        checkpoint_path = config.checkpoint_path_for_delivery()
        self.bases = BaseExports(delivery, checkpoint_path, metrics, pinned_snapshots) if rank == 0 else None
        self.target: DeltaTarget | None = None
        if rank == 0:
            self.target = target or (
                DirectoryTarget(delivery.directory, delivery.resolved_path(checkpoint_path))
                if delivery.directory
                else TopicTarget(
                    config.kafka,
                    delta_topic(delivery, config.kafka),
                    self.model_id,
                    delivery.delivery_timeout_seconds,
                )
            )
        self.cuts: queue.Queue[_Cut | None] = queue.Queue(maxsize=1)
        self.thread = threading.Thread(target=self._send_cuts, name="streamtrain-delta-publisher", daemon=True)
        self.thread.start()

    # --- the chain ------------------------------------------------------------------------
    def begin_chain(self, restored: StreamState | None) -> int:
        """Every start begins a chain: rank 0 allocates the next base version, every rank learns it,
        and the sequence continues from the restored snapshot's. Returns the version."""
        previous = restored.delivery if restored is not None else None
        version = [self.bases.allocate(previous.chain if previous else 0) if self.bases is not None else 0]
        if self.world_size > 1:
            dist.broadcast_object_list(version, src=0, group=self.cut_group)
        self.stream.delivery = DeliveryPosition(version[0], previous.next_sequence if previous else 0)
        log.info(
            "rank %d: delta chain %d starts at sequence %d", self.rank, version[0], self.stream.delivery.next_sequence
        )
        return version[0]

    def publish_start_base(self, snapshot_step: int | None) -> None:
        """Rank 0 exports the snapshot the worker starts from as the chain's base; None: there is
        none (its save failed), which is counted like a failed export."""
        if self.bases is None or self.stream.delivery is None:
            return
        if snapshot_step is None:
            self.bases.failed(self.stream.delivery.chain, self.stream.step, "no snapshot to export it from")
            return
        self.bases.start(snapshot_step, new_chain=True, version=self.stream.delivery.chain)

    # --- every step -----------------------------------------------------------------------
    def questions(self) -> dict[str, Question]:
        return {"delta": (self.due, "any"), "delta_sent": (self.sent, "all")}

    def due(self) -> bool:
        steps = self.config.delta_interval_steps
        steps_due = bool(steps and self.stream.step - self.step_mark >= steps)
        if steps_due and self.steps_due_at is None:
            self.steps_due_at = self.stream.step
        # Only after events trained here: the empty steps of an idle stream (one clears the delta in
        # flight) would otherwise cut a delta, and step again, every interval.
        if self.in_flight or not self.touched:
            return False
        return steps_due or self.clock() - self.last_cut_at >= self.config.delta_interval_seconds

    def sent(self) -> bool:
        return self.in_flight and self.done.is_set()

    def record(self, features: KeyedJaggedTensor) -> None:
        """The trainer applied a batch with these sparse features."""
        self.touched.add(features)

    def act(self, agreed: dict[str, bool]) -> None:
        """After a step, before the snapshot schedule's: a delta cut at the same step as a snapshot
        is in it, and the snapshot records the sequence after it."""
        if agreed.get("delta_sent") and self.in_flight:
            self.in_flight = False
        elif agreed.get("delta") and not self.in_flight:
            self._cut()
        if self.bases is not None:
            newest = self.newest_snapshot_step()
            if self.bases.due(newest):
                self.bases.start(newest, new_chain=False)

    def _cut(self) -> None:
        started = time.perf_counter()
        position = self.stream.delivery
        assert position is not None, "begin_chain() first"
        ids = self.touched.take()
        high_water = self.stream.event_time_high_water_ms
        if self.world_size > 1:
            gathered: list[Any] = [None] * self.world_size
            dist.all_gather_object(gathered, (ids, high_water), group=self.cut_group)
            ids = {table: np.unique(np.concatenate([theirs[table] for theirs, _ in gathered])) for table in ids}
            high_water = max(theirs for _, theirs in gathered)
        state = self.model.state_dict()
        rows = local_rows(state, self.plan, self.rank, ids)
        dense = dense_pieces(state, self.plan) if self.rank == 0 else []
        # Each rank sends the map of the buckets it owns, beside the rows it holds.
        mapped = []
        if self.id_space is not None:
            mapped = id_pieces(self.id_space, ids, self.id_space_step)
            self.id_space_step = self.id_space.step
        published_at_ms = int(time.time() * 1000)  # once: every attempt to deliver it carries the same identity
        delta_id = DeltaId(
            self.model_id, position.chain, position.next_sequence, self.stream.step, high_water, published_at_ms
        )
        self.stream.delivery = DeliveryPosition(position.chain, position.next_sequence + 1)
        self.last_cut_at, self.last_cut_step = self.clock(), self.stream.step
        # A delta cuts the step after the vote that found it due. One held back by the delta in
        # flight counts the next interval from where it would have been cut, so the deltas keep
        # to the steps the snapshots take when both intervals are equal.
        self.step_mark = self.stream.step if self.steps_due_at is None else self.steps_due_at + 1
        self.steps_due_at = None
        self.in_flight = True
        self.done.clear()
        self.cuts.put(_Cut(delta_id, rows, dense, mapped, time.monotonic()))  # room: one delta in flight
        if self.metrics:
            self.metrics.delta_cut_seconds.observe(time.perf_counter() - started)

    # --- in the background ----------------------------------------------------------------
    def _send_cuts(self) -> None:
        while True:
            cut = self.cuts.get()
            if cut is None:
                return
            try:
                delta = self._gathered(cut)
                if delta is not None:
                    self._deliver(delta, cut.cut_at)
            except Exception as error:  # a peer gone is the training loop's to report; this rank goes on
                if self.metrics:
                    self.metrics.delta_failures.inc()
                log.error("rank %d: delta %d was not published: %s", self.rank, cut.id.sequence, error)
            finally:
                self.done.set()

    def _gathered(self, cut: _Cut) -> Delta | None:
        """Rank 0: the whole delta, every rank's rows and id maps in it; other ranks: None."""
        if self.world_size == 1:
            return Delta(cut.id, cut.rows, cut.dense, cut.ids)
        parts: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object((cut.rows, cut.ids), parts, dst=0, group=self.send_group)
        if parts is None:
            return None
        rows = [piece for theirs, _ in parts for piece in theirs]
        return Delta(cut.id, rows, cut.dense, [piece for _, theirs in parts for piece in theirs])

    def _deliver(self, delta: Delta, cut_at: float) -> None:
        assert self.target is not None
        wait = RETRY_FIRST_SECONDS
        while True:
            try:
                sent = self.target.send(delta)
                break
            except DeliveryFailed as error:
                if self.metrics:
                    self.metrics.delta_failures.inc()
                log.warning("%s; retrying in %.0fs (training goes on, no new delta until then)", error, wait)
                if self.abandon.wait(wait):
                    raise DeliveryFailed(f"given up at the worker's stop: {error}") from None
                wait = min(wait * 2, RETRY_MAX_SECONDS)
        if self.metrics:
            self.metrics.deltas_published.inc()
            self.metrics.delta_bytes.inc(sent)
            self.metrics.delta_publish_seconds.observe(time.monotonic() - cut_at)
            self.metrics.delta_last_sequence.set(delta.id.sequence)
            self.metrics.delta_rows.observe(sum(len(piece.ids) for piece in delta.rows))

    # --- the stop -------------------------------------------------------------------------
    def stop_deltas(self, clean: bool, seconds: float) -> None:
        """At the stop, before the final snapshot: with every rank here (``clean``), waits up to
        ``seconds`` for the delta in flight, then cuts a last one of what the last steps trained.
        A delta still undelivered then is given up, on every rank alike."""
        if not clean:
            self.abandon.set()
            return
        delivered = self.done.wait(seconds / 2)
        if self.world_size > 1:
            verdict = torch.tensor([int(delivered)], dtype=torch.int64)
            dist.all_reduce(verdict, op=dist.ReduceOp.MIN, group=self.cut_group)
            delivered = bool(verdict.item())
        if not delivered:
            log.error("rank %d: the delta in flight was not delivered by the stop; no final delta", self.rank)
            self.abandon.set()
            return
        self.in_flight = False
        if self.stream.step > self.last_cut_step:
            self._cut()

    def close(self, clean: bool, seconds: float) -> None:
        """After the final snapshot: waits up to ``seconds`` for the last delta and, after a clean
        stop, (rank 0) for a base of the final snapshot; then stops the background thread."""
        deadline = time.monotonic() + seconds
        if not self.done.wait(max(seconds / 2, 0.0) if clean else 0.0):
            self.abandon.set()
        self.cuts.put(None)
        self.thread.join(timeout=max(deadline - time.monotonic(), 1.0))
        if self.target is not None:
            self.target.close()
        if self.bases is None:
            return
        newest = self.newest_snapshot_step()

        def budget() -> float:
            # Room left for the rest of the stop (the sources' and producers' close) within the grace.
            return max(deadline - time.monotonic() - STOP_MARGIN_SECONDS, 0.0) if clean else 0.0

        if clean and newest > self.bases.last_step:
            # The final snapshot's base supersedes a periodic one still being exported, but not the
            # chain's start base: without it no server can follow this run's deltas from its start.
            self.bases.wait(budget() if self.bases.exporting_chain_start else 0.0)
            self.bases.start(newest, new_chain=False)
        self.bases.wait(budget())
