"""Managed ids: every live id of a managed table has a row of its own, with admission and eviction.

A table with ``id_mapping: managed`` reaches this stage with raw 64-bit ids (strings hashed to 64
bits by the decoder). Just before the trainer takes a batch, ``IdSpace.translate`` turns them into
rows; the table itself stays a plain sharded table that the planner places as usual.

Why a mapping of our own rather than TorchRec's managed collision (``MCHManagedCollisionModule``),
decided on this stack (torchrec 1.8, fbgemm-gpu-cpu 1.8, CPU, gloo; see NOTES.md):
  - MCH needs row-wise sharding, which CPU does not offer (a hand-made plan only), and a table
    size divisible by the world size. Ours works with whatever sharding the planner picks, at any
    world size, and a snapshot restores at another one, since the mapping is replicated.
  - MCH's eviction resets rows through ``fbgemm::reset_weight_momentum``, which has no CPU kernel
    (row-wise Adagrad crashes; Adagrad and SGD keep the old state). A reset of our own was needed
    either way; ours is ``RowResetter``.
  - MCH has no ttl, its admission is a threshold applied only at eviction intervals (meanwhile
    new ids share the last row), its history buffer is sized by the first batch (later, larger
    batches lose ids silently), and a changed size fails restore with an assertion.
  - Exactly-once needs the mapping of the trained batches at each cut, while the pipeline has
    already mapped up to two batches ahead; a mapping we own can take those steps back (below).

How it stays right:
  - **Rank-consistent.** Every step, the ranks all-gather the raw ids of their batches (and the
    step's newest event time) and each applies the same deterministic update (``IdMapping``) to
    the same global ids, so every rank holds the same map, and an id gets the same row whichever
    rank reads it.
  - **Collision-free.** A row holds one live id. An id not admitted (yet), or one that found no
    row because the step alone held more new ids than the table has rows, reads the table's last
    row, the *unknown row*, which trains like any row: the embedding of "an id we do not know".
  - **Fresh rows.** A row given to a new id is re-initialised (uniform in +-sqrt(1/rows), as
    TorchRec initialises tables) and its optimizer state zeroed, on whichever ranks hold its
    shards. This happens just before the forward pass of the batch that first uses it, not when
    the batch is mapped: the batches already in the pipeline may still train the row's old id.
  - **Exactly-once.** The pipeline maps batches ahead of training, so the map is up to two steps
    ahead of the weights. Each step records what it overwrote (its ``Undo``: the rows it wrote
    and their old values, the low bits a halving dropped), held while its batch is in flight;
    the map at the cut, which snapshots and deltas read, is a copy of the arrays with those
    steps undone, made only when they ask. A restore maps the re-read batches again from it.

Memory: one copy of the map, made at full size. Per row, the raw id (int64) and whether it is in
use (bool), plus only what the policy reads: the step last seen (uint32, as an age modulo 2^32) for
lru and ttl, the event time last seen (int64) for ttl in seconds, a saturating int32 count for lfu;
and an open-addressing index (``streamtrain.idindex``: an int16 or int32 slot per 0.7 rows, the key
read from the ids) in place of a Python dict. lru: 8 + 1 + 4 + 2.9 = 15.9 bytes per row below 2^15
rows, 18.7 beyond. ``min_count`` adds a uint16 sketch of two hash rows at least twice the rows wide
(8 to 16 bytes per row). Per step, the lookup is one numba loop over the step's distinct ids, the
rest vectorised numpy, and a victim search over the rows (``argpartition``) only when the table is
full.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from streamtrain.config import EvictionConfig, FeaturesConfig, TableConfig
from streamtrain.decode import ClickBatch, splitmix64
from streamtrain.idindex import IdIndex
from streamtrain.metrics import IdSpaceMetrics

_INT64_MAX = np.iinfo(np.int64).max
# Two hash rows for the count sketch of ids waiting for admission, with salts that make them
# independent; its width is at least twice the table's rows, so waiting ids rarely share a count.
_SKETCH_SALTS = (np.uint64(0x243F6A8885A308D3), np.uint64(0x13198A2E03707344))
_SKETCH_MIN_WIDTH = 1024
# Sketch cells saturate here (uint16): min_count is at most this (config), and the halving every
# interval keeps counts of live traffic far below it.
_SKETCH_MAX = np.iinfo(np.uint16).max
# lfu counts saturate here (int32): past it an id is popular enough never to be the victim.
_COUNT_MAX = 1 << 30
# Steps are kept modulo 2^32 (uint32) and compared as ages, step - last_step modulo 2^32, which are
# exact while an id's age stays under 2^32 steps (about 50 days at 1,000 steps a second); an older
# id still in a table that never needed its row may then look young. Snapshots hold absolute steps.
_STEP_MASK = (1 << 32) - 1
_MAX_AGE = np.int64(_STEP_MASK)
# Evictions kept for readers of "what was evicted since step X" (deltas); older ones are dropped,
# and a reader asking from before them is told to take everything instead.
_EVICTION_LOG_STEPS = 10_000


def managed_tables(features: FeaturesConfig) -> list[TableConfig]:
    return [t for t in features.tables if t.id_mapping == "managed"]


@dataclass(frozen=True)
class Evictions:
    """Ids that lost their rows, with the rows they held."""

    rows: torch.Tensor  # int64
    ids: torch.Tensor  # int64, the raw ids

    @staticmethod
    def none() -> Evictions:
        return Evictions(torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64))

    def __len__(self) -> int:
        return int(self.rows.numel())


@dataclass
class Undo:
    """What one step overwrote in a table's arrays, to take the step back on a copy of them (the
    map at the cut): per write the array's name, the rows (or sketch cells) and their old values;
    per halving the low bits it dropped, packed. A step's undo is about 8 to 17 bytes per distinct
    id it saw, held while its batch is in flight."""

    # (name, rows, old values) per write; (name, None, packed low bits) per halving
    writes: list[tuple[str, np.ndarray | None, np.ndarray]] = field(default_factory=list)

    def write(self, arrays: TableArrays, name: str, rows: np.ndarray) -> np.ndarray:
        """Record the values at ``rows`` of array ``name`` before they are written; the array."""
        array = arrays.flat(name)
        self.writes.append((name, rows.astype(np.int32), array[rows].copy()))
        return array

    def halve(self, arrays: TableArrays, name: str) -> None:
        array = arrays.flat(name)
        self.writes.append((name, None, np.packbits((array & 1).astype(np.bool_))))
        array >>= 1

    def undo(self, arrays: TableArrays) -> None:
        for name, rows, old in reversed(self.writes):
            array = arrays.flat(name)
            if rows is not None:
                array[rows] = old
            else:
                array <<= 1
                array |= np.unpackbits(old, count=array.size).astype(array.dtype)

    @property
    def nbytes(self) -> int:
        return sum((0 if rows is None else rows.nbytes) + old.nbytes for _name, rows, old in self.writes)


@dataclass(frozen=True)
class TableStep:
    """What one step does to one table: decided once (``TableIds.decide``), then applied
    (``TableIds.apply``), which records how to take it back (``undo``)."""

    step: int
    now_ms: int  # the step's newest event time
    rows: torch.Tensor  # the row of each id given, in order (the unknown row for ids without one)
    unknown: torch.Tensor  # bool per id given: it reads the unknown row
    seen: np.ndarray  # rows of live ids seen this step, and how often
    seen_counts: np.ndarray
    cells: np.ndarray  # [salts, n]: admission sketch cells of the ids counted, and their counts
    cell_counts: np.ndarray
    evicted: Evictions  # ids evicted for lack of room
    assigned: torch.Tensor  # rows given to new ids, which start fresh; the ids, and how often seen
    new_ids: np.ndarray
    new_counts: np.ndarray
    expired: Evictions = field(default_factory=Evictions.none)  # ids evicted by ttl, known once applied
    undo: Undo = field(default_factory=Undo)  # known once applied


def _uniform(hashed: np.ndarray) -> np.ndarray:
    """Hashes as floats in [0, 1): their top 53 bits."""
    return (hashed >> np.uint64(11)).astype(np.float64) / float(1 << 53)


_NO_CELLS = np.zeros((0, 0), dtype=np.int64)
_NO_ROWS = np.zeros(0, dtype=np.int64)


@dataclass
class TableArrays:
    """A table's per-row arrays, only those its policy reads: ``last_step`` for lru and ttl,
    ``last_time_ms`` for ttl in event time, ``counts`` for lfu, ``sketch`` for min_count."""

    ids: np.ndarray  # int64, the raw id a row holds (or held, when not in use)
    in_use: np.ndarray  # bool
    last_step: np.ndarray | None  # uint32, the step (modulo 2^32) an id was last seen
    last_time_ms: np.ndarray | None  # int64
    counts: np.ndarray | None  # int32, saturating at _COUNT_MAX
    sketch: np.ndarray | None  # uint16 [salts, width], saturating at _SKETCH_MAX

    def flat(self, name: str) -> np.ndarray:
        array = getattr(self, name)
        assert array is not None, name
        return array.reshape(-1)  # a view: the sketch's cells are numbered across its hash rows

    def copy(self) -> TableArrays:
        return TableArrays(
            self.ids.copy(),
            self.in_use.copy(),
            *(None if a is None else a.copy() for a in (self.last_step, self.last_time_ms, self.counts, self.sketch)),
        )

    def _all(self) -> tuple[np.ndarray | None, ...]:
        return (self.ids, self.in_use, self.last_step, self.last_time_ms, self.counts, self.sketch)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self._all() if a is not None)


class TableIds:
    """One managed table's map from raw ids to rows; every method is deterministic, so ranks fed
    the same ids hold the same map."""

    def __init__(self, table: TableConfig):
        self.name = table.name
        self.capacity = table.live_rows()
        self.unknown_row = self.capacity
        self.eviction = table.eviction or EvictionConfig()
        self.admission = table.admission
        n, policy = self.capacity, self.eviction.policy
        waiting = self.admission is not None and self.admission.min_count is not None
        width = max(_SKETCH_MIN_WIDTH, 1 << math.ceil(math.log2(2 * n)))
        self.arrays = TableArrays(
            ids=np.zeros(n, dtype=np.int64),
            in_use=np.zeros(n, dtype=np.bool_),
            last_step=np.zeros(n, dtype=np.uint32) if policy in ("lru", "ttl") else None,
            last_time_ms=np.zeros(n, dtype=np.int64) if self.eviction.ttl_seconds is not None else None,
            counts=np.zeros(n, dtype=np.int32) if policy == "lfu" else None,
            sketch=np.zeros((len(_SKETCH_SALTS), width), dtype=np.uint16) if waiting else None,
        )
        self.index = IdIndex(self.arrays.ids)
        self.occupied = 0
        self.sketch_total = 0  # the sum of the sketch's cells, kept as they change

    # --- the update -----------------------------------------------------------------------
    def update(self, ids: torch.Tensor, step: int, now_ms: int) -> TableStep:
        """Map ``ids`` (all ranks' ids of step ``step``, whose newest event is at ``now_ms``),
        admitting and evicting as configured."""
        return self.apply(self.decide(ids, step, now_ms))

    def decide(self, ids: torch.Tensor, step: int, now_ms: int) -> TableStep:
        """What mapping ``ids`` at ``step`` does, without doing it."""
        unique_t, inverse, counts_t = torch.unique(ids, sorted=True, return_inverse=True, return_counts=True)
        unique, counts = unique_t.numpy(), counts_t.numpy()
        rows = self.index.find(unique)
        hit = rows >= 0
        seen = rows[hit]
        waiting = np.flatnonzero(~hit)
        admit, cells = self._admit(unique[waiting], counts[waiting], step)
        admitted = waiting[admit]
        free, evicted = self._rows_for(int(admitted.size), seen, step)
        assigned = np.concatenate((free, evicted.rows.numpy()))
        admitted = admitted[: assigned.size]  # the rest found no row this step: unknown
        rows[admitted] = assigned
        unknown = rows < 0
        rows[unknown] = self.unknown_row
        rows_t, unknown_t = torch.from_numpy(rows), torch.from_numpy(unknown)
        return TableStep(
            step=step,
            now_ms=now_ms,
            rows=rows_t[inverse],
            unknown=unknown_t[inverse],
            seen=seen,
            seen_counts=counts[hit],
            cells=cells,
            cell_counts=counts[waiting] if cells.size else _NO_ROWS,
            evicted=evicted,
            assigned=torch.from_numpy(assigned),
            new_ids=unique[admitted],
            new_counts=counts[admitted],
        )

    def apply(self, decided: TableStep) -> TableStep:
        """Do what ``decide`` decided; ``decided`` with the ids ttl expired and the step's undo."""
        arrays, undo = self.arrays, Undo()
        step, now_ms, seen = decided.step, decided.now_ms, decided.seen
        self._touch(undo, seen, step, now_ms)
        if arrays.counts is not None:
            undo.write(arrays, "counts", seen)[seen] = np.minimum(arrays.counts[seen] + decided.seen_counts, _COUNT_MAX)
        if decided.cells.size:
            self._count_waiting(undo, decided.cells, decided.cell_counts)
        evicted = decided.evicted.rows.numpy()
        self.index.delete(evicted)  # while the rows still hold the evicted ids
        assigned = decided.assigned.numpy()
        undo.write(arrays, "ids", assigned)[assigned] = decided.new_ids
        undo.write(arrays, "in_use", assigned)[assigned] = True
        self._touch(undo, assigned, step, now_ms)
        if arrays.counts is not None:
            undo.write(arrays, "counts", assigned)[assigned] = np.minimum(decided.new_counts, _COUNT_MAX)
        self.index.insert(assigned)
        self.occupied += int(assigned.size) - int(evicted.size)
        expired = self._interval(undo, step, now_ms) if step % self.eviction.interval_steps == 0 else Evictions.none()
        return replace(decided, expired=expired, undo=undo)

    def _touch(self, undo: Undo, rows: np.ndarray, step: int, now_ms: int) -> None:
        """Rows seen at ``step``, whose newest event is at ``now_ms``."""
        if self.arrays.last_step is not None:
            undo.write(self.arrays, "last_step", rows)[rows] = step & _STEP_MASK
        if self.arrays.last_time_ms is not None:
            undo.write(self.arrays, "last_time_ms", rows)[rows] = now_ms

    def _count_waiting(self, undo: Undo, cells: np.ndarray, counts: np.ndarray) -> None:
        sketch = self.arrays.sketch
        assert sketch is not None
        width = sketch.shape[1]
        flat_cells = (cells + (np.arange(cells.shape[0]) * width)[:, None]).reshape(-1)
        shared, where = np.unique(flat_cells, return_inverse=True)
        added = np.zeros(shared.size, dtype=np.int64)
        np.add.at(added, where, np.tile(counts, cells.shape[0]))
        flat = undo.write(self.arrays, "sketch", shared)
        old = flat[shared].astype(np.int64)
        new = np.minimum(old + added, _SKETCH_MAX)
        flat[shared] = new
        self.sketch_total += int(new.sum() - old.sum())
        # TinyLFU's sample: once the cells hold a sighting each on average, halve them, however
        # many steps that took. Halving only every interval_steps lets a stream with many ids seen
        # once fill every cell between halvings, and then every new id looks seen before.
        if self.sketch_total >= sketch.size:
            self._halve_sketch(undo)

    def _halve_sketch(self, undo: Undo) -> None:
        assert self.arrays.sketch is not None
        undo.halve(self.arrays, "sketch")
        self.sketch_total = int(self.arrays.sketch.sum(dtype=np.int64))

    def _admit(self, ids: np.ndarray, counts: np.ndarray, step: int) -> tuple[np.ndarray, np.ndarray]:
        """Which of ``ids`` (without rows, seen ``counts`` times) are admitted, and for min_count
        the sketch cells that count them."""
        rule = self.admission
        if rule is None or ids.size == 0:
            return np.ones(ids.size, dtype=np.bool_), _NO_CELLS
        raw = ids.view(np.uint64)
        if rule.probability is not None:
            draw = _uniform(splitmix64(raw ^ splitmix64(np.array([step], dtype=np.uint64))))
            return draw < rule.probability, _NO_CELLS
        assert rule.min_count is not None and self.arrays.sketch is not None
        sketch = self.arrays.sketch
        width = np.uint64(sketch.shape[1])
        cells = np.stack([(splitmix64(raw ^ salt) % width).astype(np.int64) for salt in _SKETCH_SALTS])
        estimate = np.full(ids.size, _INT64_MAX, dtype=np.int64)
        for row, row_cells in enumerate(cells):
            # the cell's count once this step's sightings are added (ids sharing a cell add up)
            shared, where = np.unique(row_cells, return_inverse=True)
            added = np.zeros(shared.size, dtype=np.int64)
            np.add.at(added, where, counts)
            estimate = np.minimum(estimate, sketch[row][row_cells].astype(np.int64) + added[where])
        return estimate >= rule.min_count, cells

    def _rows_for(self, wanted: int, seen: np.ndarray, step: int) -> tuple[np.ndarray, Evictions]:
        """Up to ``wanted`` rows: free ones first (lowest first), then the policy's victims among
        the rows not ``seen`` this step."""
        if wanted == 0:
            return _NO_ROWS, Evictions.none()
        free = np.flatnonzero(~self.arrays.in_use)[:wanted]
        short = min(wanted - int(free.size), self.capacity - int(free.size) - int(seen.size))
        if short <= 0:
            return free, Evictions.none()
        # Unique keys (the row breaks ties), so every rank picks the same victims.
        if self.arrays.counts is not None:
            rank = self.arrays.counts.astype(np.int64)
        else:
            assert self.arrays.last_step is not None
            rank = _MAX_AGE - (np.uint32(step & _STEP_MASK) - self.arrays.last_step).astype(np.int64)
        key = rank * self.capacity + np.arange(self.capacity)
        key[seen] = _INT64_MAX
        key[free] = _INT64_MAX
        victims = np.argpartition(key, short - 1)[:short]
        victims = victims[np.argsort(key[victims])]
        return free, Evictions(torch.from_numpy(victims), torch.from_numpy(self.arrays.ids[victims].copy()))

    def _interval(self, undo: Undo, step: int, now_ms: int) -> Evictions:
        arrays, eviction = self.arrays, self.eviction
        if arrays.sketch is not None:  # waiting ids' counts fade, so a trickle is never admitted by age alone
            self._halve_sketch(undo)
        if arrays.counts is not None:
            undo.halve(arrays, "counts")
        if eviction.policy != "ttl":
            return Evictions.none()
        if eviction.ttl_steps is not None:
            assert arrays.last_step is not None
            stale = (np.uint32(step & _STEP_MASK) - arrays.last_step).astype(np.int64) > eviction.ttl_steps
        else:
            assert eviction.ttl_seconds is not None and arrays.last_time_ms is not None
            stale = arrays.last_time_ms < now_ms - int(eviction.ttl_seconds * 1000)
        rows = np.flatnonzero(stale & arrays.in_use)
        self.index.delete(rows)
        undo.write(arrays, "in_use", rows)[rows] = False
        self.occupied -= int(rows.size)
        return Evictions(torch.from_numpy(rows), torch.from_numpy(arrays.ids[rows].copy()))

    # --- reading ----------------------------------------------------------------------------
    def find(self, ids: np.ndarray) -> np.ndarray:
        """The rows of ``ids`` (int64), -1 where an id has none."""
        return self.index.find(ids)

    def live(self, arrays: TableArrays | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows holding live ids, ascending, and their raw ids: in this map, or in ``arrays``."""
        arrays = self.arrays if arrays is None else arrays
        rows = np.flatnonzero(arrays.in_use)
        return torch.from_numpy(rows), torch.from_numpy(arrays.ids[rows].copy())

    def memory_bytes(self) -> int:
        """Bytes of the map: its arrays and index, which are made at their full size."""
        return self.arrays.nbytes + self.index.nbytes

    def at(self, undone: Sequence[TableStep]) -> TableArrays:
        """A copy of the arrays as they were before ``undone``, this map's newest steps in order."""
        arrays = self.arrays.copy()
        for taken in reversed(undone):
            taken.undo.undo(arrays)
        return arrays

    # --- snapshots ---------------------------------------------------------------------------
    def state_dict(self, step: int, arrays: TableArrays | None = None) -> dict[str, torch.Tensor]:
        """The map (or ``arrays``, the map at ``step``) in the snapshot's format, unchanged since
        the map kept every array per row at int64: arrays its policy does not keep are zeros."""
        arrays = self.arrays if arrays is None else arrays
        n = self.capacity
        zeros = np.zeros(n, dtype=np.int64)
        if arrays.last_step is not None:
            last_step = step - ((step & _STEP_MASK) - arrays.last_step.astype(np.int64)) % (1 << 32)
        else:
            last_step = zeros
        sketch = arrays.sketch.astype(np.int64) if arrays.sketch is not None else _NO_CELLS
        return {
            name: torch.from_numpy(np.ascontiguousarray(value))
            for name, value in (
                ("ids", arrays.ids.copy()),
                ("in_use", arrays.in_use.copy()),
                ("last_step", last_step),
                ("last_time_ms", arrays.last_time_ms.copy() if arrays.last_time_ms is not None else zeros),
                ("counts", arrays.counts.astype(np.int64) if arrays.counts is not None else zeros),
                ("sketch", sketch),
            )
        }

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        arrays = self.arrays
        arrays.ids[:] = state["ids"].numpy()
        arrays.in_use[:] = state["in_use"].numpy()
        if arrays.last_step is not None:
            arrays.last_step[:] = state["last_step"].numpy() & _STEP_MASK
        if arrays.last_time_ms is not None:
            arrays.last_time_ms[:] = state["last_time_ms"].numpy()
        if arrays.counts is not None:
            arrays.counts[:] = np.minimum(state["counts"].numpy(), _COUNT_MAX)
        if arrays.sketch is not None:  # absent where the snapshot's admission kept no sketch of this size
            arrays.sketch[:] = np.minimum(state["sketch"].numpy(), _SKETCH_MAX) if "sketch" in state else 0
            self.sketch_total = int(arrays.sketch.sum(dtype=np.int64))
        rows = np.flatnonzero(arrays.in_use)
        self.index.clear()
        try:
            self.index.insert(rows)
        except AssertionError as error:
            raise ValueError(f"table {self.name}: the snapshot's id map gives one id several rows") from error
        self.occupied = int(rows.size)


class IdMapping:
    """All managed tables' maps, and the step they have reached."""

    def __init__(self, tables: Sequence[TableConfig]):
        self.tables = {t.name: TableIds(t) for t in tables}
        self.step = 0

    def update(self, ids: dict[str, torch.Tensor], now_ms: int) -> dict[str, TableStep]:
        self.step += 1
        return {name: table.update(ids[name], self.step, now_ms) for name, table in self.tables.items()}

    def state_dict(self, undone: Sequence[dict[str, TableStep]] = ()) -> dict[str, object]:
        """The map, or the map before ``undone``, its newest steps in order."""
        step = self.step - len(undone)
        state: dict[str, object] = {"step": torch.tensor(step)}
        for name, table in self.tables.items():
            state[name] = table.state_dict(step, table.at([s[name] for s in undone]) if undone else None)
        return state

    def load_state_dict(self, state: dict[str, object]) -> None:
        step = state["step"]
        assert isinstance(step, torch.Tensor)
        self.step = int(step)
        for name, table in self.tables.items():
            if name in state:  # absent only in a partial restore's: a table added or resized starts empty
                table.load_state_dict(state[name])  # type: ignore[arg-type]


@dataclass(frozen=True)
class _Mapped:
    """A batch mapped ahead of training: what its step did to each table (with its undo, which the
    cut needs until the batch has trained), and the rows to reset before its forward pass."""

    steps: dict[str, TableStep]
    step: int

    @property
    def fresh(self) -> dict[str, torch.Tensor]:
        return {name: step.assigned for name, step in self.steps.items()}


class IdSpace:
    """The managed tables' id space on one rank: maps each step's batch (``translate``), resets
    the rows it gave away before that batch trains (``before_forward``), and gives the map at the
    cut (the map less the steps of the batches still in flight) to snapshots and deltas. Every rank
    calls each method at the same step."""

    def __init__(
        self,
        features: FeaturesConfig,
        world_size: int,
        group: dist.ProcessGroup | None,
        metrics: IdSpaceMetrics | None = None,
    ):
        self.tables = managed_tables(features)
        self.features = features
        self.world_size = world_size
        self.group = group
        self.metrics = metrics
        self.mapping = IdMapping(self.tables)  # mapped up to the newest batch in flight
        self.in_flight: deque[_Mapped] = deque()  # mapped, not yet trained: the cut undoes them
        self.to_reset: deque[_Mapped] = deque()  # mapped, forward pass not yet started
        self.resetter: RowResetter | None = None
        self.eviction_log: dict[str, deque[tuple[int, Evictions]]] = {t.name: deque() for t in self.tables}
        # The id-space step after which the log holds every eviction: a restore starts it afresh.
        self.eviction_log_from = 0
        if metrics:
            for t in self.tables:
                metrics.rows.labels(t.name).set(t.live_rows())

    # --- the stage -------------------------------------------------------------------------
    def translate(self, batch: ClickBatch) -> ClickBatch:
        """``batch`` with its managed tables' raw ids replaced by rows."""
        features = batch.sparse_features
        device = features.values().device
        per_key = dict(zip(features.keys(), features.values().cpu().split(features.length_per_key()), strict=True))
        own = {t.name: per_key[t.name] for t in self.tables}
        # one far-future event (microseconds in a millisecond field) would make every row stale: the
        # worker counts the clamped events (streamtrain_event_times_clamped_total)
        newest = min(int(batch.event_time_ms.max()), self.features.event_time_bound_ms()) if batch.size else 0
        everyone, now_ms, mine = self._gather(own, newest)
        steps = self.mapping.update(everyone, now_ms)
        mapped = _Mapped(steps, self.mapping.step)
        self.in_flight.append(mapped)
        self.to_reset.append(mapped)
        for name, step in steps.items():
            per_key[name] = step.rows[mine[name]]
            self._count(name, step, mine[name])
        values = torch.cat(list(per_key.values()))  # in the KJT's key order, as split
        if features.values().is_pinned():  # so the pipeline's copy to the GPU stays asynchronous
            values = values.pin_memory()
        translated = KeyedJaggedTensor(keys=features.keys(), values=values.to(device), lengths=features.lengths())
        return replace(batch, sparse_features=translated)

    def before_forward(self) -> None:
        """The next batch's forward pass starts: re-initialise the rows its step gave away."""
        mapped = self.to_reset.popleft()
        if self.resetter is not None:
            for name, rows in mapped.fresh.items():
                self.resetter.reset(name, rows, mapped.step)

    def trained(self) -> None:
        """The oldest batch in flight has trained: its step joins the cut."""
        mapped = self.in_flight.popleft()
        for name, step in mapped.steps.items():
            log_ = self.eviction_log[name]
            for evictions in (step.evicted, step.expired):
                if len(evictions):
                    log_.append((mapped.step, evictions))
            while log_ and log_[0][0] <= mapped.step - _EVICTION_LOG_STEPS:
                log_.popleft()
        self.eviction_log_from = max(self.eviction_log_from, mapped.step - _EVICTION_LOG_STEPS)

    def _gather(
        self, own: dict[str, torch.Tensor], newest: int
    ) -> tuple[dict[str, torch.Tensor], int, dict[str, slice]]:
        """Every rank's ids per table in rank order, the step's newest event time, and where this
        rank's ids sit among them."""
        names = list(own)
        if self.world_size == 1:
            return own, newest, {n: slice(0, int(v.numel())) for n, v in own.items()}
        header = torch.tensor([newest, *(int(own[n].numel()) for n in names)], dtype=torch.int64)
        flat = torch.cat([header, *(own[n] for n in names)])
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        dist.all_gather(sizes, torch.tensor([flat.numel()]), group=self.group)
        longest = max(int(s) for s in sizes)
        padded = torch.zeros(longest, dtype=torch.int64)
        padded[: flat.numel()] = flat
        parts = [torch.empty(longest, dtype=torch.int64) for _ in range(self.world_size)]
        dist.all_gather(parts, padded, group=self.group)
        me = dist.get_rank(self.group)
        everyone: dict[str, list[torch.Tensor]] = {n: [] for n in names}
        mine: dict[str, slice] = {}
        for rank, part in enumerate(parts):
            at = 1 + len(names)
            for i, name in enumerate(names):
                count = int(part[1 + i])
                if rank == me:
                    before = sum(int(p.numel()) for p in everyone[name])
                    mine[name] = slice(before, before + count)
                everyone[name].append(part[at : at + count])
                at += count
        now_ms = max(int(p[0]) for p in parts)
        return {n: torch.cat(v) for n, v in everyone.items()}, now_ms, mine

    def _count(self, name: str, step: TableStep, mine: slice) -> None:
        if self.metrics is None:
            return
        metrics, table = self.metrics, self.mapping.tables[name]
        metrics.admissions.labels(name).inc(int(step.assigned.numel()))
        metrics.evictions.labels(name, "capacity").inc(len(step.evicted))
        metrics.evictions.labels(name, "ttl").inc(len(step.expired))
        metrics.unknown_lookups.labels(name).inc(int(step.unknown[mine].sum()))
        metrics.rows_in_use.labels(name).set(table.occupied)
        metrics.memory_bytes.labels(name).set(self._table_bytes(name))

    def _table_bytes(self, name: str) -> int:
        return self.mapping.tables[name].memory_bytes() + sum(m.steps[name].undo.nbytes for m in self.in_flight)

    def memory_bytes(self) -> int:
        """What the maps take in memory on this rank, every managed table's: their arrays and index
        (made at full size), and the undo of the steps in flight."""
        return sum(self._table_bytes(t.name) for t in self.tables)

    # --- the cut: snapshots and deltas --------------------------------------------------------
    def state_dict(self) -> dict[str, object]:
        """The map at the cut: the trained batches' (the steps of the batches in flight undone on a
        copy of the arrays; the map itself stays ahead)."""
        return self.mapping.state_dict([m.steps for m in self.in_flight])

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Take a snapshot's map; call before any batch is mapped."""
        if self.in_flight:
            raise RuntimeError("a snapshot's id map can only be loaded before training starts")
        self.mapping.load_state_dict(state)
        for log_ in self.eviction_log.values():
            log_.clear()
        self.eviction_log_from = self.mapping.step

    def raw_ids(self, table: str) -> tuple[torch.Tensor, torch.Tensor]:
        """At the cut: the rows of ``table`` that hold live ids, ascending, and those raw ids."""
        ids = self.mapping.tables[table]
        return ids.live(ids.at([m.steps[table] for m in self.in_flight]) if self.in_flight else None)

    def evicted_since(self, table: str, step: int) -> Evictions | None:
        """Ids of ``table`` evicted after id-space step ``step`` up to the cut, oldest first (an id
        may appear more than once); None when the log does not reach back that far (it keeps
        10,000 steps, and starts afresh at a restore): then take everything (``raw_ids``)."""
        if step < self.eviction_log_from:
            return None
        later = [e for s, e in self.eviction_log[table] if s > step]
        if not later:
            return Evictions.none()
        return Evictions(torch.cat([e.rows for e in later]), torch.cat([e.ids for e in later]))

    @property
    def step(self) -> int:
        """The id-space step of the cut: how many steps the trained batches took."""
        return self.mapping.step - len(self.in_flight)


@dataclass(frozen=True)
class _Shard:
    weights: torch.Tensor  # [local rows, local cols], a view into the kernel's weights
    states: list[torch.Tensor]  # the optimizer's per-row state, views too
    row_offset: int
    col_offset: int


class RowResetter:
    """Starts rows fresh in a sharded model: weights re-initialised, optimizer state zeroed, on
    each shard this rank holds.

    It writes into fbgemm's table-batched kernels (``split_embedding_weights`` and
    ``split_optimizer_states`` are views), where ``fbgemm::reset_weight_momentum`` would on a GPU;
    it has no CPU kernel. The new weights are drawn from a generator seeded by the table and the
    step, and cut to each shard, so every sharding gives a row the same values."""

    def __init__(self, model: nn.Module, tables: Sequence[TableConfig], seed: int):
        from torchrec.distributed.batched_embedding_kernel import BaseBatchedEmbedding, BaseBatchedEmbeddingBag

        self.seed = seed
        self.order = {t.name: i for i, t in enumerate(tables)}
        self.tables = {t.name: t for t in tables}
        self.shards: dict[str, list[_Shard]] = {t.name: [] for t in tables}
        # Pooled tables' kernels, and unpooled ones' (a sequence's, din's history).
        for module in _kernels(model, (BaseBatchedEmbeddingBag, BaseBatchedEmbedding)):
            if not any(shard.name in self.shards for shard in module.config.embedding_tables):
                continue
            kernel = module.emb_module
            weights = kernel.split_embedding_weights()
            # One list of state tensors per table; none at all for a stateless optimizer (sgd).
            states = kernel.split_optimizer_states() or [[] for _ in weights]
            for i, shard in enumerate(module.config.embedding_tables):
                if shard.name in self.shards:
                    offsets = shard.local_metadata.shard_offsets if shard.local_metadata else [0, 0]
                    self.shards[shard.name].append(_Shard(weights[i], list(states[i]), offsets[0], offsets[1]))

    def fresh_weights(self, table: str, rows: torch.Tensor, step: int) -> torch.Tensor:
        """The full rows (all columns) that ``reset`` writes, the same on every rank."""
        config = self.tables[table]
        bound = math.sqrt(1.0 / config.num_embeddings)
        seed = ((self.seed * 1_000_003 + self.order[table]) * 1_000_000_007 + step) % 2**63
        generator = torch.Generator().manual_seed(seed)
        return torch.empty(int(rows.numel()), config.embedding_dim).uniform_(-bound, bound, generator=generator)

    def reset(self, table: str, rows: torch.Tensor, step: int) -> None:
        if rows.numel() == 0:
            return
        fresh = self.fresh_weights(table, rows, step)
        with torch.no_grad():
            for shard in self.shards[table]:
                local_rows, local_cols = shard.weights.shape
                mine = (rows >= shard.row_offset) & (rows < shard.row_offset + local_rows)
                local = rows[mine] - shard.row_offset
                cols = slice(shard.col_offset, shard.col_offset + local_cols)
                shard.weights[local] = fresh[mine][:, cols].to(shard.weights.dtype)
                for state in shard.states:
                    state[local] = 0


def _kernels(model: nn.Module, kind: type[nn.Module] | tuple[type[nn.Module], ...]) -> list[nn.Module]:
    """The modules of ``kind`` in ``model``'s sharded collections, whose lookups TorchRec keeps in a
    plain list that ``nn.Module.modules()`` does not walk."""
    found: dict[int, nn.Module] = {}
    for module in model.modules():
        for lookup in getattr(module, "_lookups", None) or ():
            found.update({id(m): m for m in lookup.modules() if isinstance(m, kind)})
    return list(found.values())
