"""Managed ids: every live id of a managed table has a row of its own, with admission and eviction.

A table with ``id_mapping: managed`` reaches this stage with raw 64-bit ids (strings hashed to 64
bits by the decoder). Just before the trainer takes a batch, ``IdSpace.translate`` turns them into
rows; the table itself stays a plain sharded table that the planner places as usual.

Why a mapping of our own rather than TorchRec's managed collision (``MCHManagedCollisionModule``),
decided on this stack (torchrec 1.8, fbgemm-gpu-cpu 1.8, CPU, gloo; see NOTES.md):
  - MCH needs row-wise sharding, which CPU does not offer (a hand-made plan only), and a table
    size divisible by the world size. Ours works with whatever sharding the planner picks, at any
    world size, and a snapshot restores at another one, since its buckets do not depend on it.
  - MCH's eviction resets rows through ``fbgemm::reset_weight_momentum``, which has no CPU kernel
    (row-wise Adagrad crashes; Adagrad and SGD keep the old state). A reset of our own was needed
    either way; ours is ``RowResetter``.
  - MCH has no ttl, its admission is a threshold applied only at eviction intervals (meanwhile
    new ids share the last row), its history buffer is sized by the first batch (later, larger
    batches lose ids silently), and a changed size fails restore with an assertion.
  - Exactly-once needs the mapping of the trained batches at each cut, while the pipeline has
    already mapped up to two batches ahead; a mapping we own can take those steps back (below).

How it scales: a table's map is split into a fixed number of virtual buckets (``buckets`` in its
config), each a fixed range of rows, an id's bucket fixed by a salted hash of it. Each rank owns a
contiguous run of buckets (so its rows are one range, indexed by one offset) and holds and maps only
their ids: every step a rank sends each distinct id of its batch, with its count, to the bucket's
owner, and gets the row back with the next step's exchange (``_Exchange``: one all-to-all a step),
so the map's memory and work per rank fall as 1 / world size. Buckets rather than ranks own rows, so
the map never depends on the world size: a snapshot stores it per bucket, and a restore at another
world size moves buckets whole.

How it stays right:
  - **Rank-consistent.** A bucket's map is updated by the ids of that bucket alone, from every
    rank, with the step's newest event time over all ranks, deterministically (``TableIds``): the
    map is the one a single process builds from the same global steps, whichever rank owns a
    bucket, and an id gets one row whichever rank reads it.
  - **Collision-free.** A row holds one live id. An id not admitted (yet), or one that found no
    row because the step alone held more new ids than the table has rows, reads the table's last
    row, the *unknown row*, which trains like any row: the embedding of "an id we do not know".
  - **Fresh rows.** A row given to a new id is re-initialised (uniform in +-sqrt(1/rows), as
    TorchRec initialises tables) and its optimizer state zeroed, on whichever ranks hold its
    shards: the owners send every rank the rows they gave, with the rows back. This happens just
    before the forward pass of the batch that first uses it, not when the batch is mapped: the
    batches already in the pipeline may still train the row's old id.
  - **Exactly-once.** The pipeline maps batches ahead of training, so the map is up to two steps
    ahead of the weights, one more at several ranks, where a batch waits for the next one's exchange
    to bring its rows back, and one more when mapped ahead (below). Each step records what it
    overwrote (its ``Undo``: the rows it wrote and their old values, the low bits a halving
    dropped), held while its batch is in flight; the map at the cut, which snapshots and deltas
    read, is a copy of the arrays with those steps undone, made only when they ask. A restore maps
    the re-read batches again from it.
  - **Mapped one batch ahead** (``IdSpace.translated``, ``batching.map_ahead``; on by default with
    cuda). Batch N+1 is mapped on a thread of the id space's own while batch N trains, so the map's
    work and its exchange's waits leave the training thread. Nothing above changes, for the map is a
    function of the global steps alone, whenever it runs:
      - a row evicted for N+1 may be one that N reads: N trains it as its old id's row, and the
        reset comes before N+1's forward pass, so the new id starts fresh and the old id's last
        update goes with the old id (it was evicted); the cut after N (N+1 undone) holds the old
        id there, with N's update in the weights. This is what the pipeline's own lookahead
        already does, one batch deeper (and what the exchange's rows coming back a step later do);
      - the cut: a lock covers each step's update of the map together with its place in flight,
        and the cut's readers (``state_dict``, ``raw_ids``, ``evicted_since``, ``step``), and is
        never held across a collective. The cut (the map less the steps in flight) changes only
        when a batch has trained, on the training thread, so the snapshot's cut and the delta's,
        both read on that thread between two steps, are one map;
      - the exchange: the id space's collectives run on its own gloo group, apart from the training
        step's, and all on the mapper's thread, so every rank makes them in one order. No rank waits
        on a map its peers have not started: a rank hands batch N to its mapper when it takes
        batch N-1 for the pipeline, and waits for N's map one pipeline step later, past that
        step's collectives, which its peers reach only after they took N-1 too;
      - a paused stream needs one more empty step to train its last real batch
        (``IdSpace.batches_held``, in ``Trainer.lookahead``, which the lockstep counts).

Memory: each rank's buckets' share of the map, made at full size. Per row, the raw id (int64) and whether it is in
use (bool), plus only what the policy reads: the step last seen (uint32, as an age modulo 2^32) for
lru and ttl, the event time last seen (int64) for ttl in seconds, a saturating int32 count for lfu;
and an open-addressing index (``streamtrain.idindex``: an int16 or int32 slot per 0.7 rows, the key
read from the ids) in place of a Python dict. lru: 8 + 1 + 4 + 2.9 = 15.9 bytes per row below 2^15
rows, 18.7 beyond. ``min_count`` adds a uint16 sketch of two hash rows at least twice the rows wide
(8 to 16 bytes per row, at least 1,024 cells a bucket). A recency bucket keeps its next victims in
order (about half a byte per row; ``idstep.give_rows``). Per step, a table's map is one compiled
pass (``streamtrain.idstep.map_step``): the distinct ids by hashing (not sorting: the map's result
depends on no arrival order, since new ids take rows in the order of their ids), their lookups,
the waiting ids' sightings and estimates, the rows given (each bucket's free rows, then, only in a
full bucket, a partition of its rows by eviction key), the arrays' writes with their undo, and
each id's row and flags. A large step's lookups and sketch counts go to the rank's threads.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import numpy as np
import torch
import torch.distributed as dist
from numba import njit
from prometheus_client import Counter
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from streamtrain.config import EvictionConfig, FeaturesConfig, TableConfig
from streamtrain.decode import ClickBatch
from streamtrain.idindex import IdIndex
from streamtrain.idstep import (
    ADMIT_ALL,
    ADMIT_MIN_COUNT,
    ADMIT_PROBABILITY,
    COUNT_MAX,
    SKETCH_MAX,
    SKETCH_SALTS,
    VICTIMS_KEPT,
    MapArrays,
    MapRules,
    StepOutcome,
    admit_and_write,
    bucket_of,
    count_sightings,
    distinct_hashed,
    look_up,
    map_step,
    split_hits,
)
from streamtrain.metrics import IdSpaceMetrics
from streamtrain.threads import IDAHEAD, IDMAP, Slices, name_this_thread

log = logging.getLogger(__name__)

_SKETCH_MIN_WIDTH = 1024
# Steps are kept modulo 2^32 (uint32) and compared as ages, step - last_step modulo 2^32, which are
# exact while an id's age stays under 2^32 steps (about 50 days at 1,000 steps a second); an older
# id still in a table that never needed its row may then look young. Snapshots hold absolute steps.
_STEP_MASK = (1 << 32) - 1
# Evictions kept for readers of "what was evicted since step X" (deltas); older ones are dropped,
# and a reader asking from before them is told to take everything instead.
_EVICTION_LOG_STEPS = 10_000
# The fewest ids a helper thread takes: below it, handing a slice over costs about what it saves.
MIN_SLICE_IDS = 8_192
# Batches mapping ahead takes ahead of those it hands on: one is mapped while the trainer trains.
MAPPED_AHEAD = 1


@njit(cache=True, nogil=True, boundscheck=False)
def _put_newest_first(array: np.ndarray, positions: np.ndarray, old: np.ndarray) -> None:
    """Write ``old`` back at ``positions``, last first: a position written twice ends as it began."""
    for i in range(positions.shape[0] - 1, -1, -1):
        array[positions[i]] = old[i]


def managed_tables(features: FeaturesConfig) -> list[TableConfig]:
    return [t for t in features.tables if t.id_mapping == "managed"]


@dataclass(frozen=True)
class Evictions:
    """Ids that lost their rows, with the rows they held."""

    rows: torch.Tensor  # int64
    ids: torch.Tensor  # int64, the raw ids

    @staticmethod
    def none() -> Evictions:
        return _NO_EVICTIONS

    def __len__(self) -> int:
        return int(self.rows.numel())


@dataclass
class Undo:
    """What one step overwrote in a table's arrays, to take the step back on a copy of them (the
    map at the cut): per write the array's name, the rows (or sketch cells) and their old values;
    per halving the columns halved and the low bits it dropped, packed. A step's undo is about 12 to
    27 bytes per distinct id it saw, held while its batch is in flight."""

    # (name, rows, old values) per write; (name, columns, packed low bits) per halving
    writes: list[tuple[str, np.ndarray | slice, np.ndarray]] = field(default_factory=list)

    def write(self, arrays: TableArrays, name: str, rows: np.ndarray) -> np.ndarray:
        """Record the values at ``rows`` of array ``name`` before they are written; the array."""
        array = arrays.flat(name)
        self.record(name, rows, array[rows])
        return array

    def record(self, name: str, rows: np.ndarray, old: np.ndarray) -> None:
        """Record that ``rows`` of array ``name`` held ``old`` before a write; a row may appear more
        than once, with the value it held before each write. Both are kept as given, not copied (a
        step's cells are hundreds of KiB): the caller hands them over and writes them no more. The
        positions keep their dtype: a sketch's flat cell numbers pass 2**31 once it holds that many
        cells."""
        self.writes.append((name, rows, old))

    def halve(self, arrays: TableArrays, name: str, columns: slice = slice(None)) -> None:
        """Halve array ``name``, or only its ``columns`` (one bucket's sketch cells, in each hash row)."""
        part = _columns(arrays, name, columns)
        self.writes.append((name, columns, np.packbits((part & 1).astype(np.bool_))))
        part >>= 1

    def undo(self, arrays: TableArrays) -> None:
        for name, rows, old in reversed(self.writes):
            if isinstance(rows, slice):
                part = _columns(arrays, name, rows)
                part <<= 1
                part |= np.unpackbits(old, count=part.size).reshape(part.shape).astype(part.dtype)
            else:
                _put_newest_first(arrays.flat(name), rows, old)

    @property
    def nbytes(self) -> int:
        return sum((0 if isinstance(rows, slice) else rows.nbytes) + old.nbytes for _name, rows, old in self.writes)


def _columns(arrays: TableArrays, name: str, columns: slice) -> np.ndarray:
    """A view of ``columns`` of array ``name`` (its last axis)."""
    array = getattr(arrays, name)
    assert array is not None, name
    return array[..., columns]


@dataclass(frozen=True)
class TableStep:
    """What one step did to one table (``TableIds.update``); ``undo`` records how to take it back."""

    step: int
    rows: torch.Tensor  # the row of each id given, in order (the unknown row for ids without one)
    unknown: torch.Tensor  # bool per id given: it reads the unknown row
    evicted: Evictions  # ids evicted for lack of room
    assigned: torch.Tensor  # rows given to new ids, which start fresh
    expired: Evictions  # ids evicted by ttl
    undo: Undo


_NO_CELLS = np.zeros((0, 0), dtype=np.int64)
_NO_EVICTIONS = Evictions(torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64))
_NO_ROWS = np.zeros(0, dtype=np.int64)
_NO_ID_TENSOR = torch.zeros(0, dtype=torch.int64)
# stand-ins for the arrays a policy does not keep (the step's kernel reads them as empty)
_NO_SKETCH = np.zeros((len(SKETCH_SALTS), 0), dtype=np.uint16)
_NO_COUNTS = np.zeros(0, dtype=np.int32)
_NO_STEPS = np.zeros(0, dtype=np.uint32)
_NO_TIMES = np.zeros(0, dtype=np.int64)


@dataclass
class TableArrays:
    """A table's per-row arrays, only those its policy reads: ``last_step`` for lru and ttl,
    ``last_time_ms`` for ttl in event time, ``counts`` for lfu, ``sketch`` for min_count."""

    ids: np.ndarray  # int64, the raw id a row holds (or held, when not in use)
    in_use: np.ndarray  # bool
    last_step: np.ndarray | None  # uint32, the step (modulo 2^32) an id was last seen
    last_time_ms: np.ndarray | None  # int64
    counts: np.ndarray | None  # int32, saturating at COUNT_MAX
    sketch: np.ndarray | None  # uint16 [salts, width], saturating at SKETCH_MAX

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


def bucket_start(table: TableConfig, bucket: int) -> int:
    """The first row of ``bucket`` (a bucket's rows run to the next one's first)."""
    return bucket * table.live_rows() // table.id_buckets()


def owned_buckets(table: TableConfig, rank: int, world_size: int) -> range:
    """The buckets of ``table`` that ``rank`` maps: a contiguous run, so its rows are one range."""
    buckets = table.id_buckets()
    return range(rank * buckets // world_size, (rank + 1) * buckets // world_size)


def bucket_key(bucket: int) -> str:
    return f"bucket{bucket:05d}"


def whole_map(state: dict[str, dict[str, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """A table's raw id and in-use flag per row, from a snapshot's map of it (per bucket: buckets
    hold consecutive rows, so their arrays in bucket order are the table's)."""
    keys = sorted(state)
    return torch.cat([state[k]["ids"] for k in keys]), torch.cat([state[k]["in_use"] for k in keys])


class TableIds:
    """One managed table's map from raw ids to rows, of the buckets ``buckets`` (all by default):
    every method is deterministic and each bucket's map depends only on its own ids, so the map is
    the same whichever rank holds a bucket, at any world size.

    Rows given in and out (``TableStep``, ``find``, ``live``) are the table's; the arrays hold the
    owned buckets' rows only, from ``start``."""

    def __init__(self, table: TableConfig, buckets: range | None = None, slices: Slices | None = None):
        """``slices``: the threads that share a large step's lookups and sketch counts."""
        self.name = table.name
        self.slices = slices
        self.unknown_row = table.live_rows()
        owned = range(table.id_buckets()) if buckets is None else buckets
        self.buckets = owned
        self.bucket_count = table.id_buckets()
        self.start = bucket_start(table, owned.start)
        # each owned bucket's first row in the arrays, and the end of the last
        self.bucket_starts = np.array([bucket_start(table, b) - self.start for b in (*owned, owned.stop)], np.int64)
        self.capacity = int(self.bucket_starts[-1])
        self.eviction = table.eviction or EvictionConfig()
        self.admission = table.admission
        n, policy = self.capacity, self.eviction.policy
        waiting = self.admission is not None and self.admission.min_count is not None
        widest = -(-table.live_rows() // self.bucket_count)
        self.sketch_width = max(_SKETCH_MIN_WIDTH, 1 << math.ceil(math.log2(2 * widest)))
        self.arrays = TableArrays(
            ids=np.zeros(n, dtype=np.int64),
            in_use=np.zeros(n, dtype=np.bool_),
            last_step=np.zeros(n, dtype=np.uint32) if policy in ("lru", "ttl") else None,
            last_time_ms=np.zeros(n, dtype=np.int64) if self.eviction.ttl_seconds is not None else None,
            counts=np.zeros(n, dtype=np.int32) if policy == "lfu" else None,
            sketch=np.zeros((len(SKETCH_SALTS), self.sketch_width * len(owned)), np.uint16) if waiting else None,
        )
        self.index = IdIndex(self.arrays.ids)
        self.occupied = 0
        # what spares a step most reads of a bucket's rows (``idstep.give_rows``): derived from the
        # arrays, never in a snapshot; a recency bucket keeps a sixteenth of its rows' worth of victims
        self.free_from = self.bucket_starts[:-1].copy()
        kept = 0 if policy == "lfu" else min(VICTIMS_KEPT, max(1, widest // 16))
        self.victim_rows = np.zeros((len(owned), kept), np.int32)
        self.victim_steps = np.zeros((len(owned), kept), np.uint32)
        self.victims_kept = np.zeros((len(owned), 4), np.int64)
        # per owned bucket, the sum of its sketch cells, kept as they change
        self.sketch_totals = np.zeros(len(owned), dtype=np.int64)
        rule = self.admission
        admission = (
            ADMIT_ALL if rule is None else ADMIT_PROBABILITY if rule.probability is not None else ADMIT_MIN_COUNT
        )
        self.rules = MapRules(
            bucket_count=self.bucket_count,
            first_bucket=owned.start,
            sketch_width=self.sketch_width,
            admission=admission,
            probability=float(rule.probability) if rule is not None and rule.probability is not None else 1.0,
            min_count=int(rule.min_count) if rule is not None and rule.min_count is not None else 0,
            start=self.start,
            unknown_row=self.unknown_row,
        )

    # --- the update -----------------------------------------------------------------------
    def update(self, ids: torch.Tensor, step: int, now_ms: int, counts: torch.Tensor | None = None) -> TableStep:
        """Map ``ids`` (all ranks' ids of step ``step`` in the owned buckets, whose newest event is
        at ``now_ms``; each seen ``counts`` times, once by default), admitting and evicting as
        configured: one compiled pass (``streamtrain.idstep.map_step``), or on several threads a
        large step's lookups and sketch counts; then the sketch's halvings and, every
        ``interval_steps``, the interval's work."""
        values = ids.numpy()
        weights = values if counts is None else counts.numpy()
        arrays, rules = self._map_arrays(), self.rules
        try:
            if self.slices is not None and len(self.slices.cut(values.size)) > 1:
                done = self._update_on_threads(values, weights, counts is not None, arrays, step, now_ms)
            else:
                done = map_step(values, weights, counts is not None, arrays, rules, step, now_ms)
        except ValueError as error:
            raise ValueError(f"table {self.name}: {error}") from None
        undo = Undo()
        if rules.admission == ADMIT_MIN_COUNT:
            undo.record("sketch", done.cells, done.old_cells)
            self._halve_full_buckets(undo)
        for name, old in (("last_step", done.old_steps), ("last_time_ms", done.old_times), ("counts", done.old_counts)):
            if getattr(self.arrays, name) is not None:
                undo.record(name, done.touched, old)
        undo.record("ids", done.assigned, done.old_ids)
        undo.record("in_use", done.assigned, done.old_in_use)
        self.occupied += int(done.assigned.size) - int(done.victims.size)
        expired = self._interval(undo, step, now_ms) if step % self.eviction.interval_steps == 0 else Evictions.none()
        return TableStep(
            step=step,
            rows=torch.from_numpy(done.rows),
            unknown=torch.from_numpy(done.unknown),
            evicted=Evictions(torch.from_numpy(done.victims + self.start), torch.from_numpy(done.evicted_ids)),
            assigned=torch.from_numpy(done.assigned + self.start),
            expired=expired,
            undo=undo,
        )

    def _map_arrays(self) -> MapArrays:
        arrays = self.arrays
        return MapArrays(
            self.index.slots,
            arrays.ids,
            arrays.in_use,
            _NO_STEPS if arrays.last_step is None else arrays.last_step,
            _NO_TIMES if arrays.last_time_ms is None else arrays.last_time_ms,
            _NO_COUNTS if arrays.counts is None else arrays.counts,
            _NO_SKETCH if arrays.sketch is None else arrays.sketch,
            self.sketch_totals,
            self.bucket_starts,
            self.free_from,
            self.victim_rows,
            self.victim_steps,
            self.victims_kept,
        )

    def _update_on_threads(
        self, values: np.ndarray, weights: np.ndarray, weighted: bool, arrays: MapArrays, step: int, now_ms: int
    ) -> StepOutcome:
        """``map_step`` with a large step's lookups and sketch counts on ``slices``' threads: the
        lookups only read the index, so any cut of the distinct ids gives the same rows; the waiting
        ids are counted by runs of whole buckets, each thread writing its ids' estimates and undo
        records where one thread would. The distinct ids, the rows given and the writes stay on the
        calling thread."""
        slices, rules = self.slices, self.rules
        assert slices is not None
        unique, hashes, sums, inverse = distinct_hashed(values, weights, weighted)
        rows, local_buckets = np.empty(unique.size, np.int64), np.empty(unique.size, np.int64)
        owned = len(self.buckets)

        def look(part: slice) -> bool:
            return look_up(
                arrays.slots, arrays.ids, unique[part], hashes[part], rules.bucket_count, rules.first_bucket,
                owned, rows[part], local_buckets[part],
            )  # fmt: skip

        if not all(slices.map(look, slices.cut(unique.size))):
            raise ValueError("an id reached a rank that does not own its bucket")
        seen, waiting = split_hits(rows)
        estimate, cells, old_cells = _NO_ROWS, _NO_ROWS, _NO_SKETCH[0]
        if rules.admission == ADMIT_MIN_COUNT:
            hash_rows = arrays.sketch.shape[0]
            estimate = np.empty(waiting.size, np.int64)
            cells = np.empty(hash_rows * waiting.size, np.int64)
            old_cells = np.empty(hash_rows * waiting.size, np.uint16)

            def count(buckets: slice) -> None:
                count_sightings(
                    arrays.sketch, arrays.sketch_totals, rules.sketch_width, unique, sums, local_buckets,
                    waiting, estimate, cells, old_cells, buckets.start, buckets.stop,
                )  # fmt: skip

            # runs of whole buckets, one a thread: a bucket's cells and total are its own, so the
            # threads never write side by side, and each cell sees its sightings in the order one
            # thread alone would (the ids' hashes spread them evenly over the buckets)
            runs = len(slices.cut(waiting.size))
            slices.map(count, [slice(owned * r // runs, owned * (r + 1) // runs) for r in range(runs)])
        return admit_and_write(
            unique, sums, inverse, rows, local_buckets, seen, waiting, estimate, cells, old_cells, arrays, rules,
            step, now_ms,
        )  # fmt: skip

    def _halve_full_buckets(self, undo: Undo) -> None:
        """TinyLFU's sample: once a bucket's cells hold a sighting each on average, halve them,
        however many steps that took. Halving only every interval_steps lets a stream with many ids
        seen once fill every cell between halvings, and then every new id looks seen before. Each
        bucket by itself, so that its map depends on its own ids only, at any world size."""
        sketch = self.arrays.sketch
        assert sketch is not None
        for bucket in np.flatnonzero(self.sketch_totals >= len(SKETCH_SALTS) * self.sketch_width).tolist():
            columns = slice(bucket * self.sketch_width, (bucket + 1) * self.sketch_width)
            undo.halve(self.arrays, "sketch", columns)
            self.sketch_totals[bucket] = int(sketch[:, columns].sum(dtype=np.int64))

    def _recount_sketch(self) -> None:
        sketch = self.arrays.sketch
        assert sketch is not None
        per_bucket = sketch.reshape(len(SKETCH_SALTS), len(self.buckets), self.sketch_width)
        self.sketch_totals = per_bucket.sum(axis=(0, 2), dtype=np.int64)

    def _interval(self, undo: Undo, step: int, now_ms: int) -> Evictions:
        arrays, eviction = self.arrays, self.eviction
        if arrays.sketch is not None:  # waiting ids' counts fade, so a trickle is never admitted by age alone
            undo.halve(arrays, "sketch")
            self._recount_sketch()
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
        # freed rows are given again, lowest first
        np.minimum.at(self.free_from, np.searchsorted(self.bucket_starts, rows, side="right") - 1, rows)
        undo.write(arrays, "in_use", rows)[rows] = False
        self.occupied -= int(rows.size)
        return Evictions(torch.from_numpy(rows + self.start), torch.from_numpy(arrays.ids[rows].copy()))

    # --- reading ----------------------------------------------------------------------------
    def find(self, ids: np.ndarray) -> np.ndarray:
        """The rows of ``ids`` (int64, of the owned buckets), -1 where an id has none."""
        rows = self.index.find(ids)
        return np.where(rows >= 0, rows + self.start, rows)

    def live(self, arrays: TableArrays | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows holding live ids, ascending, and their raw ids: in this map, or in ``arrays``."""
        arrays = self.arrays if arrays is None else arrays
        rows = np.flatnonzero(arrays.in_use)
        return torch.from_numpy(rows + self.start), torch.from_numpy(arrays.ids[rows].copy())

    def memory_bytes(self) -> int:
        """Bytes of the map: its arrays and index, which are made at their full size, and what it
        keeps to spare a step reads of its rows."""
        kept = (self.free_from, self.victim_rows, self.victim_steps, self.victims_kept)
        return self.arrays.nbytes + self.index.nbytes + sum(a.nbytes for a in kept)

    def at(self, undone: Sequence[TableStep]) -> TableArrays:
        """A copy of the arrays as they were before ``undone``, this map's newest steps in order."""
        arrays = self.arrays.copy()
        for taken in reversed(undone):
            taken.undo.undo(arrays)
        return arrays

    # --- snapshots ---------------------------------------------------------------------------
    def state_dict(self, step: int, arrays: TableArrays | None = None) -> dict[str, dict[str, torch.Tensor]]:
        """The map (or ``arrays``, the map at ``step``) in the snapshot's format: per owned bucket,
        each array as int64 (arrays its policy does not keep are zeros), so that a bucket loads
        whole on whichever rank owns it at restore."""
        arrays = self.arrays if arrays is None else arrays
        if arrays.last_step is not None:
            last_step = step - ((step & _STEP_MASK) - arrays.last_step.astype(np.int64)) % (1 << 32)
        else:
            last_step = np.zeros(self.capacity, dtype=np.int64)
        per_row = {
            "ids": arrays.ids,
            "in_use": arrays.in_use,
            "last_step": last_step,
            "last_time_ms": arrays.last_time_ms,
            "counts": arrays.counts.astype(np.int64) if arrays.counts is not None else None,
        }
        state = {}
        for at, bucket in enumerate(self.buckets):
            first, end = int(self.bucket_starts[at]), int(self.bucket_starts[at + 1])
            cells = slice(at * self.sketch_width, (at + 1) * self.sketch_width)
            sketch = arrays.sketch[:, cells].astype(np.int64) if arrays.sketch is not None else _NO_CELLS
            zeros = np.zeros(end - first, np.int64)
            state[bucket_key(bucket)] = {
                **{
                    name: torch.from_numpy(zeros.copy() if value is None else value[first:end].copy())
                    for name, value in per_row.items()
                },
                "sketch": torch.from_numpy(np.ascontiguousarray(sketch)),
            }
        return state

    def load_state_dict(self, state: dict[str, dict[str, torch.Tensor]]) -> None:
        arrays = self.arrays
        for at, bucket in enumerate(self.buckets):
            first, end = int(self.bucket_starts[at]), int(self.bucket_starts[at + 1])
            part = state[bucket_key(bucket)]
            arrays.ids[first:end] = part["ids"].numpy()
            arrays.in_use[first:end] = part["in_use"].numpy()
            if arrays.last_step is not None:
                arrays.last_step[first:end] = part["last_step"].numpy() & _STEP_MASK
            if arrays.last_time_ms is not None:
                arrays.last_time_ms[first:end] = part["last_time_ms"].numpy()
            if arrays.counts is not None:
                arrays.counts[first:end] = np.minimum(part["counts"].numpy(), COUNT_MAX)
            if arrays.sketch is not None:
                cells = slice(at * self.sketch_width, (at + 1) * self.sketch_width)
                # absent where the snapshot's admission kept no sketch of this size: its ids count from zero
                arrays.sketch[:, cells] = np.minimum(part["sketch"].numpy(), SKETCH_MAX) if "sketch" in part else 0
        if arrays.sketch is not None:
            self._recount_sketch()
        rows = np.flatnonzero(arrays.in_use)
        self.free_from[:] = self.bucket_starts[:-1]
        self.victims_kept[:] = 0
        self.index.clear()
        try:
            self.index.insert(rows)
        except AssertionError as error:
            raise ValueError(f"table {self.name}: the snapshot's id map gives one id several rows") from error
        self.occupied = int(rows.size)


class IdMapping:
    """All managed tables' maps (of the buckets ``rank`` owns), and the step they have reached."""

    def __init__(self, tables: Sequence[TableConfig], rank: int = 0, world_size: int = 1, threads: int = 1):
        """``threads``: for a large step's lookups and sketch counts (``MIN_SLICE_IDS`` ids a thread)."""
        slices = Slices(threads, MIN_SLICE_IDS, IDMAP) if threads > 1 else None
        self.tables = {t.name: TableIds(t, owned_buckets(t, rank, world_size), slices) for t in tables}
        self.step = 0

    def update(
        self, ids: dict[str, torch.Tensor], now_ms: int, counts: dict[str, torch.Tensor] | None = None
    ) -> dict[str, TableStep]:
        """Map each table's ``ids`` of the step: all ranks' ids of the owned buckets, each seen
        ``counts`` times (once by default)."""
        self.step += 1
        return {
            name: table.update(ids[name], self.step, now_ms, counts[name] if counts else None)
            for name, table in self.tables.items()
        }

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


@dataclass
class _Mapped:
    """A batch's step, mapped and not yet trained: what it did to each table (with its undo, which
    the cut needs until the batch has trained), and the rows to reset before its forward pass."""

    steps: dict[str, TableStep]  # of this rank's buckets
    step: int
    # rows given to new ids in every rank's buckets, ascending; None until they come back from the ranks
    fresh: dict[str, torch.Tensor] | None = None


@dataclass(frozen=True)
class _Awaited:
    """This rank's last step, whose rows are still with the owners of their buckets: the next
    exchange brings them back, with every owner's fresh rows."""

    mapped: _Mapped
    sent: np.ndarray  # [owner, table]: how many ids this rank sent each owner
    positions: tuple[np.ndarray, ...]  # per table: each own id's place among those sent


@dataclass(frozen=True)
class _Owed:
    """What this rank's buckets owe the other ranks from their last step, which the next exchange
    carries: the rows of every sender's ids, and the rows given to new ids."""

    rows: tuple[np.ndarray, ...]  # per table: the rows of every sender's ids, in sender order
    got: np.ndarray  # [sender, table]: how many ids each sender sent
    fresh: tuple[np.ndarray, ...]  # per table

    @staticmethod
    def nothing(tables: int, world: int) -> _Owed:
        return _Owed((_NO_ROWS,) * tables, np.zeros((world, tables), np.int64), (_NO_ROWS,) * tables)


@dataclass(frozen=True)
class _Held:
    """A batch taken and not yet handed on: its KJT's values (in numpy) and each managed table's span of them."""

    batch: ClickBatch
    values: np.ndarray
    spans: dict[str, slice]


class IdSpace:
    """The managed tables' id space on one rank: maps each step's batch (``translated``), resets
    the rows it gave away before that batch trains (``before_forward``), and gives the map at the
    cut (the map less the steps of the batches still in flight) to snapshots and deltas. Every rank
    calls each method at the same step.

    ``translated(..., ahead=True)`` maps each batch on a thread of its own while the caller trains
    the batches before it. The cut's readers and the mapper meet at ``lock``, which covers a step's
    update of the map together with its place in flight, and is never held across a collective:
    the cut (the map less the steps in flight) changes only when a batch has trained, on the
    training thread, so a snapshot and a delta cut taken between two steps read one map, whatever
    the mapper is doing. Every collective of the id space (its own gloo group's) is made on the
    thread that maps, so every rank makes them in the same order."""

    def __init__(
        self,
        features: FeaturesConfig,
        world_size: int,
        group: dist.ProcessGroup | None,
        metrics: IdSpaceMetrics | None = None,
        threads: int = 1,
    ):
        """``threads``: the rank's threads for a large step's map (the calling thread's among them)."""
        self.tables = managed_tables(features)
        self.features = features
        self.world_size = world_size
        self.group = group
        self.rank = dist.get_rank(group) if world_size > 1 else 0
        self.metrics = metrics
        # mapped up to the newest batch in flight, for this rank's buckets
        self.mapping = IdMapping(self.tables, self.rank, world_size, threads)
        # the rank that owns each bucket, per table: 16 bits, which numpy's stable argsort radix-sorts
        ranks = np.arange(world_size, dtype=np.uint16)
        self.owners = {
            t.name: np.repeat(ranks, [len(owned_buckets(t, r, world_size)) for r in range(world_size)])
            for t in self.tables
        }
        self.lock = threading.Lock()  # over the map, in_flight and the eviction log (mapping ahead)
        self.in_flight: deque[_Mapped] = deque()  # mapped, not yet trained: the cut undoes them
        self.to_reset: deque[_Mapped] = deque()  # mapped, forward pass not yet started
        self.held: deque[_Held] = deque()  # taken by ``translated``, their rows not yet back
        # At several ranks: the last step, whose rows its owners send back with the next exchange,
        # and what this rank's buckets owe the others from it, which that exchange carries.
        self.awaited: _Awaited | None = None
        self.owed = _Owed.nothing(len(self.tables), world_size)
        self.slot = _slot_head(len(self.tables))  # the exchange's, which every rank agrees on
        self.resetter: RowResetter | None = None
        self.eviction_log: dict[str, deque[tuple[int, Evictions]]] = {t.name: deque() for t in self.tables}
        # The id-space step after which the log holds every eviction: a restore starts it afresh.
        self.eviction_log_from = 0
        # Each table's counters, labelled once: a step adds to them, where finding a labelled child
        # and summing the unknown rows through torch took about 60 us a table and step.
        self.counters: dict[str, tuple[Counter, Counter, Counter, Counter]] = {}
        if metrics:
            for name, table in self.mapping.tables.items():
                metrics.rows.labels(name).set(table.capacity)
                # read when scraped, not set each step: the memory sums the undo of every step in flight
                metrics.rows_in_use.labels(name).set_function(functools.partial(getattr, table, "occupied"))
                metrics.memory_bytes.labels(name).set_function(functools.partial(self._memory_bytes_of, name))
                self.counters[name] = (
                    metrics.admissions.labels(name),
                    metrics.evictions.labels(name, "capacity"),
                    metrics.evictions.labels(name, "ttl"),
                    metrics.unknown_lookups.labels(name),
                )

    # --- the stage -------------------------------------------------------------------------
    def batches_held(self, ahead: bool) -> int:
        """How many batches ``translated`` takes ahead of the one it hands on: at several ranks one,
        whose rows come back with the next batch's exchange; ``ahead`` maps one more on its thread."""
        return (1 if self.world_size > 1 else 0) + (MAPPED_AHEAD if ahead else 0)

    def translated(self, batches: Iterable[ClickBatch], ahead: bool = False) -> Iterator[ClickBatch]:
        """``batches`` with their managed tables' raw ids replaced by rows, in order.

        At several ranks a step makes one all-to-all: its ids go to the ranks that own their
        buckets, and in the same messages come back the rows of the step before, with the rows the
        owners gave new ids then (which every rank resets). So a batch is handed on once the next
        one has been taken, and the last one after an exchange of no ids when ``batches`` ends; the
        cut leaves it out until it has trained, like any batch in flight (``batches_held``: a paused
        stream needs as many more empty steps to train its last real batch).

        ``ahead``: each batch is mapped on a thread of the id space's own (``st-idahead``) while the
        caller trains the batches before it, so that the map's work and its exchange's waits overlap
        the training step. Batches are taken from ``batches`` on the caller's thread, in order, one
        more ahead of those handed on (``MAPPED_AHEAD``)."""
        if not ahead:
            for batch in batches:
                yield from self._take(batch)
            yield from self._take(None)
            return
        with ThreadPoolExecutor(
            1, thread_name_prefix=IDAHEAD, initializer=name_this_thread, initargs=(IDAHEAD,)
        ) as mapper:
            taking: Future[list[ClickBatch]] | None = None
            for batch in batches:
                upcoming = mapper.submit(self._take, batch)
                if taking is not None:
                    yield from taking.result()
                taking = upcoming
            if taking is not None:
                yield from taking.result()
            yield from mapper.submit(self._take, None).result()

    def translate(self, batch: ClickBatch) -> ClickBatch:
        """``batch`` alone, translated: at several ranks, its exchange and one that brings its rows back."""
        (translated,) = self.translated([batch])
        return translated

    def _take(self, batch: ClickBatch | None) -> list[ClickBatch]:
        """Maps ``batch``'s step (None: none, the stream has ended); the batches whose rows came back."""
        started = time.perf_counter()
        own: dict[str, torch.Tensor] | None = None
        newest = 0
        if batch is not None:
            held = self._held(batch)
            self.held.append(held)
            own = {name: torch.from_numpy(held.values[span]) for name, span in held.spans.items()}
            # one far-future event (microseconds in a millisecond field) would make every row stale: the
            # worker counts the clamped events (streamtrain_event_times_clamped_total)
            times = batch.event_time_ms.cpu().numpy()
            newest = min(int(times.max()), self.features.event_time_bound_ms()) if batch.size else 0
        rows = self.map_ids(own, newest)
        done = [] if rows is None else [self._with_rows(self.held.popleft(), rows)]
        if self.metrics and batch is not None:
            self.metrics.step_seconds.observe(time.perf_counter() - started)
        return done

    def _held(self, batch: ClickBatch) -> _Held:
        # The slices and writes go through numpy: each costs about a microsecond there, and several
        # through torch's dispatcher, a dozen of them a step on the training thread.
        features = batch.sparse_features
        offsets = features.offset_per_key()
        at = {key: i for i, key in enumerate(features.keys())}
        spans = {t.name: slice(offsets[at[t.name]], offsets[at[t.name] + 1]) for t in self.tables}
        return _Held(batch, features.values().cpu().numpy(), spans)

    def _with_rows(self, held: _Held, rows: dict[str, torch.Tensor]) -> ClickBatch:
        features = held.batch.sparse_features
        raw = features.values()
        values = held.values.copy()
        for name, span in held.spans.items():
            values[span] = rows[name].numpy()
        translated_values = torch.from_numpy(values)
        if raw.is_pinned():  # so the pipeline's copy to the GPU stays asynchronous
            translated_values = translated_values.pin_memory()
        translated = KeyedJaggedTensor(
            keys=features.keys(),
            values=translated_values.to(raw.device),
            lengths=features.lengths(),
            # the decoder's, so that the pipeline does not sum them again with a .tolist() (a sync on a GPU)
            length_per_key=features.length_per_key(),
            offset_per_key=features.offset_per_key(),
        )
        return replace(held.batch, sparse_features=translated)

    def map_ids(self, own: dict[str, torch.Tensor] | None, newest: int = 0) -> dict[str, torch.Tensor] | None:
        """Map one step: ``own``, this rank's raw ids per managed table, whose newest event is at
        ``newest``; the step joins those in flight. Returns the rows of the step whose rows came
        back, per table in its ids' order: at one rank this step's; at several the step before's,
        which this step's exchange brought (None at the first). ``own`` None maps no step, and
        only brings back the last one's rows (at the stream's end)."""
        if self.world_size == 1:
            if own is None:
                return None
            mapped = self._update(own, newest)
            rows = {name: step.rows for name, step in mapped.steps.items()}
            mapped.fresh = {n: torch.from_numpy(np.sort(s.assigned.numpy())) for n, s in mapped.steps.items()}
            self.to_reset.append(mapped)
            self._count(mapped, rows)
            return rows
        no_ids = {t.name: _NO_ID_TENSOR for t in self.tables}
        exchange = _Exchange(self, no_ids if own is None else own, newest, self.owed, self.awaited)
        awaited, self.awaited = self.awaited, None
        self.owed = _Owed.nothing(len(self.tables), self.world_size)
        if own is not None:
            mapped = self._update(exchange.received, exchange.now_ms, exchange.counts)
            self.to_reset.append(mapped)
            steps = [mapped.steps[name] for name in exchange.names]
            self.owed = _Owed(
                tuple(s.rows.numpy() for s in steps), exchange.got, tuple(s.assigned.numpy() for s in steps)
            )
            self.awaited = _Awaited(mapped, exchange.sent, exchange.positions)
        self._exchanged(exchange)
        if awaited is None:
            return None
        rows = exchange.rows_of(awaited)
        awaited.mapped.fresh = {name: torch.from_numpy(np.sort(given)) for name, given in exchange.fresh.items()}
        self._count(awaited.mapped, rows)
        return rows

    def _update(
        self, ids: dict[str, torch.Tensor], now_ms: int, counts: dict[str, torch.Tensor] | None = None
    ) -> _Mapped:
        """The map's update and its place in flight, together: the cut never sees one without the other."""
        with self.lock:
            steps = self.mapping.update(ids, now_ms, counts)
            mapped = _Mapped(steps, self.mapping.step)
            self.in_flight.append(mapped)
            return mapped

    def before_forward(self) -> None:
        """The next batch's forward pass starts: re-initialise the rows its step gave away."""
        mapped = self.to_reset.popleft()
        if self.resetter is None:
            return
        assert mapped.fresh is not None, "a batch was handed on before its step's rows came back"
        for name, rows in mapped.fresh.items():
            self.resetter.reset(name, rows, mapped.step)

    def _exchanged(self, exchange: _Exchange) -> None:
        if self.metrics:
            self.metrics.exchange_seconds.observe(exchange.seconds)

    def trained(self) -> None:
        """The oldest batch in flight has trained: its step joins the cut."""
        with self.lock:
            mapped = self.in_flight.popleft()
            for name, step in mapped.steps.items():
                log_ = self.eviction_log[name]
                for evictions in (step.evicted, step.expired):
                    if len(evictions):
                        log_.append((mapped.step, evictions))
                while log_ and log_[0][0] <= mapped.step - _EVICTION_LOG_STEPS:
                    log_.popleft()
            self.eviction_log_from = max(self.eviction_log_from, mapped.step - _EVICTION_LOG_STEPS)

    def _count(self, mapped: _Mapped, rows: dict[str, torch.Tensor]) -> None:
        """``mapped``: a step of this rank's buckets; ``rows``: of this rank's own ids of that step."""
        if not self.counters:
            return
        for name, step in mapped.steps.items():
            admissions, capacity, ttl, unknown = self.counters[name]
            admissions.inc(len(step.assigned))
            capacity.inc(len(step.evicted))
            ttl.inc(len(step.expired))
            unknown.inc(int(np.count_nonzero(rows[name].numpy() == self.mapping.tables[name].unknown_row)))

    def _memory_bytes_of(self, name: str) -> int:
        with self.lock:
            return self._table_bytes(name)

    def _table_bytes(self, name: str) -> int:
        return self.mapping.tables[name].memory_bytes() + sum(m.steps[name].undo.nbytes for m in self.in_flight)

    def memory_bytes(self) -> int:
        """What the maps take in memory on this rank, every managed table's: their arrays and index
        (made at full size), and the undo of the steps in flight."""
        with self.lock:
            return sum(self._table_bytes(t.name) for t in self.tables)

    # --- the cut: snapshots and deltas --------------------------------------------------------
    def state_dict(self) -> dict[str, object]:
        """The map at the cut: the trained batches' (the steps of the batches in flight undone on a
        copy of the arrays; the map itself stays ahead)."""
        with self.lock:
            return self.mapping.state_dict([m.steps for m in self.in_flight])

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Take a snapshot's map; call before any batch is mapped."""
        if self.in_flight:
            raise RuntimeError("a snapshot's id map can only be loaded before training starts")
        with self.lock:
            self.mapping.load_state_dict(state)
            for log_ in self.eviction_log.values():
                log_.clear()
            self.eviction_log_from = self.mapping.step

    def raw_ids(self, table: str) -> tuple[torch.Tensor, torch.Tensor]:
        """At the cut: the rows of ``table`` that hold live ids, ascending, and those raw ids."""
        ids = self.mapping.tables[table]
        with self.lock:
            return ids.live(ids.at([m.steps[table] for m in self.in_flight]) if self.in_flight else None)

    def evicted_since(self, table: str, step: int) -> Evictions | None:
        """Ids of ``table`` evicted after id-space step ``step`` up to the cut, oldest first (an id
        may appear more than once); None when the log does not reach back that far (it keeps
        10,000 steps, and starts afresh at a restore): then take everything (``raw_ids``)."""
        with self.lock:
            if step < self.eviction_log_from:
                return None
            later = [e for s, e in self.eviction_log[table] if s > step]
        if not later:
            return Evictions.none()
        return Evictions(torch.cat([e.rows for e in later]), torch.cat([e.ids for e in later]))

    @property
    def step(self) -> int:
        """The id-space step of the cut: how many steps the trained batches took."""
        with self.lock:
            return self.mapping.step - len(self.in_flight)


class _Exchange:
    """One step's exchange, in one all-to-all: this rank's ids to the ranks that own their buckets
    and, in the same messages, back to each rank the rows of the ids it sent this rank's buckets the
    step before, and to every rank the rows those buckets gave new ids then. A rank sends each
    distinct id once, with how often its events hold it, so a popular id costs its owner no more
    than a rare one.

    A step's rows come back with the next step's exchange, not in an all-to-all of their own: under a
    training step each all-to-all waits for the slowest rank (on a 2-core host, the second one a step
    took the map's time at 2 ranks from 2.6-2.8 ms to 3.4-3.6). So a batch waits for the next one's
    exchange before it trains (``IdSpace.translated``), one batch more in flight, which the cut and the
    resets already allow for: a row evicted for the next step may be one this batch reads (the module
    docstring).

    Every rank must reset the rows its shards hold, whichever rank's ids took them: each owner sends
    the rows its buckets gave to every rank, ahead of the forward pass that needs them, so the fresh
    rows cost no collective of their own either.

    The messages go out in slots, a message to each rank padded to a size every rank knows, so
    that their sizes need no all-to-all of their own (they vary from step to step). Each slot opens
    with its sizes (the rows coming back need none: the receiver sent their ids) and the longest
    message its sender had for any rank; every rank reads every sender's, so all agree on the next
    step's slot, and all see when a message outgrew this one: then every rank sends its message
    again, sized exactly, in a second all-to-all."""

    def __init__(
        self, id_space: IdSpace, own: dict[str, torch.Tensor], newest: int, owed: _Owed, awaited: _Awaited | None
    ):
        """``owed``: what this rank's buckets owe from the last step; ``awaited``: this rank's last
        step, whose rows come back (None if there is none)."""
        self.group, world, self.names = id_space.group, id_space.world_size, list(own)
        tables = len(own)
        self.seconds = 0.0  # in the all-to-alls: their latency and the wait for the slowest rank
        positions = []  # per table: each own id's among the ids sent
        # per rank: newest, the longest message, the ids per table, the fresh rows per table
        head = _slot_head(tables)
        header = np.empty((world, head), dtype=np.int64)
        header[:, 0] = newest
        outgoing = []
        for at, (name, values) in enumerate(own.items()):
            bucket_count = id_space.mapping.tables[name].bucket_count
            ids, counts, per_owner, sent_at = _by_owner(values.numpy(), id_space.owners[name], bucket_count, world)
            positions.append(sent_at)
            header[:, 2 + at] = per_owner
            header[:, 2 + tables + at] = owed.fresh[at].size
            outgoing.append((ids, counts))
        self.sent = header[:, 2 : 2 + tables]  # [owner, table]
        self.positions = tuple(positions)
        slots = np.zeros((world, id_space.slot), dtype=np.int64)
        messages, out_sizes = _messages(
            tuple(ids for ids, _counts in outgoing),
            tuple(counts for _ids, counts in outgoing),
            owed.rows,
            owed.got,
            owed.fresh,
            self.sent,
            slots,
            head,
        )
        header[:, 1] = head + out_sizes.max()
        slots[:, :head] = header
        incoming = torch.empty(slots.size, dtype=torch.int64)
        self._all_to_all(incoming, torch.from_numpy(slots.reshape(-1)))
        got_slots = incoming.numpy().reshape(world, -1)
        longest, slot = int(got_slots[:, 1].max()), got_slots.shape[1]
        id_space.slot = max(head, longest + longest // 4)  # room for the next step's sizes to grow
        self.now_ms = int(got_slots[:, 0].max())
        self.got = got_slots[:, 2 : 2 + tables].copy()  # [sender, table]
        fresh_got = got_slots[:, 2 + tables : head]
        # [owner, table]: the rows each owner sends back, one for each id this rank sent it last step
        back = awaited.sent if awaited is not None else np.zeros((world, tables), np.int64)
        if longest <= slot:
            buffer, starts = incoming.numpy(), np.arange(world, dtype=np.int64) * slot + head
        else:
            in_sizes = 2 * self.got.sum(1) + back.sum(1) + fresh_got.sum(1)
            exact = torch.empty(int(in_sizes.sum()), dtype=torch.int64)
            self._all_to_all(exact, torch.from_numpy(messages), in_sizes.tolist(), out_sizes.tolist())
            buffer, starts = exact.numpy(), np.cumsum(in_sizes) - in_sizes
        # every sender's ids of a table, in sender order, with their counts; the rows back, in owner
        # order; and the fresh rows likewise
        ids, counts, self.answers, fresh_rows, id_bounds, self.answer_bounds, fresh_bounds = _received(
            buffer, starts, self.got, back, fresh_got
        )
        id_at, fresh_at = id_bounds.tolist(), fresh_bounds.tolist()
        self.received, self.counts, self.fresh = {}, {}, {}
        for at, name in enumerate(self.names):
            self.received[name] = torch.from_numpy(ids[id_at[at] : id_at[at + 1]])
            self.counts[name] = torch.from_numpy(counts[id_at[at] : id_at[at + 1]])
            self.fresh[name] = fresh_rows[fresh_at[at] : fresh_at[at + 1]]

    def rows_of(self, awaited: _Awaited) -> dict[str, torch.Tensor]:
        """The rows of the awaited step's own ids per table, in their order."""
        rows, row_bounds = _rows_back(self.answers, self.answer_bounds, awaited.positions)
        row_at = row_bounds.tolist()
        return {name: torch.from_numpy(rows[row_at[at] : row_at[at + 1]]) for at, name in enumerate(self.names)}

    def _all_to_all(
        self,
        output: torch.Tensor,
        data: torch.Tensor,
        in_sizes: list[int] | None = None,
        out_sizes: list[int] | None = None,
    ) -> None:
        started = time.perf_counter()
        dist.all_to_all_single(output, data, in_sizes, out_sizes, group=self.group)
        self.seconds += time.perf_counter() - started


@njit(cache=True, nogil=True, boundscheck=False)
def _by_owner(
    values: np.ndarray, owners: np.ndarray, bucket_count: int, world: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """One rank's ``values`` of a table as the exchange sends them: the distinct ids grouped by the
    rank that owns their bucket (``owners``, per bucket), in rank order and each group in the order
    its ids first appear, with how often each appears; the ids going to each rank; and each value's
    position among those sent, where its row comes back. One pass where a dozen numpy calls were."""
    unique, _hashes, counts, positions = distinct_hashed(values, values, False)
    k = unique.shape[0]
    owner_of = np.empty(k, np.int64)
    per_owner = np.zeros(world, np.int64)
    for j in range(k):
        owner_of[j] = owners[bucket_of(unique[j], bucket_count)]
        per_owner[owner_of[j]] += 1
    next_at = np.empty(world, np.int64)
    start = 0
    for owner in range(world):
        next_at[owner] = start
        start += per_owner[owner]
    ids, sent_counts, sent_at = np.empty(k, np.int64), np.empty(k, np.int64), np.empty(k, np.int64)
    for j in range(k):
        at = next_at[owner_of[j]]
        next_at[owner_of[j]] = at + 1
        ids[at], sent_counts[at], sent_at[j] = unique[j], counts[j], at
    for i in range(positions.shape[0]):
        positions[i] = sent_at[positions[i]]
    return ids, sent_counts, per_owner, positions


# The exchange's messages, laid out and read in one compiled pass each, where they took about forty
# numpy calls a step (a few microseconds each beside a training step). ``sent`` and ``got`` are
# [rank, table]: the ids this rank sends each owner, and those each sender sent it.


@njit(cache=True, nogil=True, boundscheck=False)
def _messages(
    ids: tuple[np.ndarray, ...],
    counts: tuple[np.ndarray, ...],
    answers: tuple[np.ndarray, ...],
    answered: np.ndarray,
    fresh: tuple[np.ndarray, ...],
    sent: np.ndarray,
    slots: np.ndarray,
    head: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Each rank's message past the slot's header, in rank order: for every table in turn the ids
    of its buckets (``ids``, grouped by owner) then their counts; for every table the rows of the
    ids it sent this rank's buckets the step before (``answers``, per table in sender order,
    ``answered`` [sender, table] of them); and every table's ``fresh`` rows; and their sizes.
    Written into ``slots`` after the header too, where every one fits."""
    world, tables = sent.shape
    fresh_total = 0
    for t in range(tables):
        fresh_total += fresh[t].shape[0]
    sizes = np.empty(world, np.int64)
    for rank in range(world):
        sizes[rank] = fresh_total + 2 * sent[rank].sum() + answered[rank].sum()
    messages = np.empty(sizes.sum(), np.int64)
    taken = np.zeros(tables, np.int64)  # of each table's ids, those already laid out
    answers_taken = np.zeros(tables, np.int64)  # and of its answers
    at = 0
    for rank in range(world):
        for t in range(tables):
            n, first = sent[rank, t], taken[t]
            messages[at : at + n] = ids[t][first : first + n]
            messages[at + n : at + 2 * n] = counts[t][first : first + n]
            taken[t] += n
            at += 2 * n
        for t in range(tables):
            n, first = answered[rank, t], answers_taken[t]
            messages[at : at + n] = answers[t][first : first + n]
            answers_taken[t] += n
            at += n
        for t in range(tables):
            n = fresh[t].shape[0]
            messages[at : at + n] = fresh[t]
            at += n
    if head + sizes.max() <= slots.shape[1]:
        at = 0
        for rank in range(world):
            slots[rank, head : head + sizes[rank]] = messages[at : at + sizes[rank]]
            at += sizes[rank]
    return messages, sizes


@njit(cache=True, nogil=True, boundscheck=False)
def _table_bounds(per_rank: np.ndarray) -> np.ndarray:
    """Where each table's part begins and ends when every rank's ``per_rank`` [rank, table] are put
    together table by table: ``tables`` + 1 bounds."""
    tables = per_rank.shape[1]
    bounds = np.zeros(tables + 1, np.int64)
    for t in range(tables):
        bounds[t + 1] = bounds[t] + per_rank[:, t].sum()
    return bounds


@njit(cache=True, nogil=True, boundscheck=False)
def _received(
    buffer: np.ndarray, starts: np.ndarray, got: np.ndarray, back: np.ndarray, fresh_got: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The messages in ``buffer`` (each sender's from ``starts``), read per table: every sender's
    ids in sender order and their counts (``got`` of them), the rows back likewise (``back``), and
    the fresh rows (``fresh_got``); and where each table's part begins and ends in the ids, the rows
    back and the fresh rows (``tables`` + 1 bounds each)."""
    world, tables = got.shape
    id_bounds, back_bounds, fresh_bounds = _table_bounds(got), _table_bounds(back), _table_bounds(fresh_got)
    ids, counts = np.empty(id_bounds[tables], np.int64), np.empty(id_bounds[tables], np.int64)
    rows, fresh = np.empty(back_bounds[tables], np.int64), np.empty(fresh_bounds[tables], np.int64)
    next_id, next_row = id_bounds[:tables].copy(), back_bounds[:tables].copy()
    next_fresh = fresh_bounds[:tables].copy()
    for sender in range(world):
        at = starts[sender]
        for t in range(tables):
            n, to = got[sender, t], next_id[t]
            ids[to : to + n] = buffer[at : at + n]
            counts[to : to + n] = buffer[at + n : at + 2 * n]
            next_id[t] += n
            at += 2 * n
        for t in range(tables):
            n, to = back[sender, t], next_row[t]
            rows[to : to + n] = buffer[at : at + n]
            next_row[t] += n
            at += n
        for t in range(tables):
            n, to = fresh_got[sender, t], next_fresh[t]
            fresh[to : to + n] = buffer[at : at + n]
            next_fresh[t] += n
            at += n
    return ids, counts, rows, fresh, id_bounds, back_bounds, fresh_bounds


@njit(cache=True, nogil=True, boundscheck=False)
def _rows_back(
    answers: np.ndarray, answer_bounds: np.ndarray, positions: tuple[np.ndarray, ...]
) -> tuple[np.ndarray, np.ndarray]:
    """From the owners' ``answers`` (per table, in owner order, the rows of the ids sent each), each
    table's rows of this rank's values: the row of the id sent at each value's ``positions``;
    concatenated over the tables, with ``tables`` + 1 bounds."""
    tables = len(positions)
    row_bounds = np.zeros(tables + 1, np.int64)
    for t in range(tables):
        row_bounds[t + 1] = row_bounds[t] + positions[t].shape[0]
    rows = np.empty(row_bounds[tables], np.int64)
    for t in range(tables):
        for i in range(positions[t].shape[0]):
            rows[row_bounds[t] + i] = answers[answer_bounds[t] + positions[t][i]]
    return rows, row_bounds


def _slot_head(tables: int) -> int:
    """A slot's header: the newest event time, the longest message, then the ids and the fresh rows
    per table."""
    return 2 + 2 * tables


@dataclass(frozen=True)
class _Shard:
    weights: torch.Tensor  # [local rows, local cols], a view into the kernel's weights
    states: list[torch.Tensor]  # the optimizer's per-row state, views too
    row_offset: int
    col_offset: int


@dataclass(frozen=True)
class _HostShards:
    """A table's shards on this rank as the reset kernel takes them: numpy views of the weights and
    of each optimizer state (as [rows, values a row]), their offsets, and each state's shard (-1
    for the stand-in a stateless optimizer passes)."""

    weights: tuple[np.ndarray, ...]
    row_offsets: np.ndarray
    col_offsets: np.ndarray
    states: tuple[np.ndarray, ...]
    state_shards: np.ndarray


class RowResetter:
    """Starts rows fresh in a sharded model: weights re-initialised, optimizer state zeroed, on
    each shard this rank holds.

    It writes into fbgemm's table-batched kernels (``split_embedding_weights`` and
    ``split_optimizer_states`` are views), where ``fbgemm::reset_weight_momentum`` would on a GPU;
    it has no CPU kernel. The new weights are drawn from a generator seeded by the table and the
    step (``fresh_weights``), and cut to each shard, so every sharding gives a row the same values.

    On the host, a table's reset is one numba call (``_reset_rows``): it draws what torch's CPU
    generator draws for that seed, bit for bit (MT19937, as ``torch.Generator``), and writes each
    shard's rows in place, where the torch path takes about a dozen operator calls a shard. Shards
    off the host (a GPU's), or a host whose torch draws otherwise (checked once), take the torch
    path."""

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
        self.on_host = {name: _on_host(shards) for name, shards in self.shards.items()} if _draws_like_torch() else {}

    def _seed(self, table: str, step: int) -> int:
        return ((self.seed * 1_000_003 + self.order[table]) * 1_000_000_007 + step) % 2**63

    def _bound(self, table: str) -> float:
        return math.sqrt(1.0 / self.tables[table].num_embeddings)

    def fresh_weights(self, table: str, rows: torch.Tensor, step: int) -> torch.Tensor:
        """The full rows (all columns) that ``reset`` writes, the same on every rank."""
        bound = self._bound(table)
        generator = torch.Generator().manual_seed(self._seed(table, step))
        return torch.empty(int(rows.numel()), self.tables[table].embedding_dim).uniform_(
            -bound, bound, generator=generator
        )

    def reset(self, table: str, rows: torch.Tensor, step: int) -> None:
        """Start ``rows`` (ascending, distinct) of ``table`` fresh on this rank's shards of it."""
        if rows.numel() == 0 or not self.shards[table]:
            return
        host = self.on_host.get(table)
        if host is not None:
            _reset_rows(
                rows.numpy(),
                self._seed(table, step),
                self.tables[table].embedding_dim,
                self._bound(table),
                host.weights,
                host.row_offsets,
                host.col_offsets,
                host.states,
                host.state_shards,
            )
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


def _on_host(shards: list[_Shard]) -> _HostShards | None:
    """``shards`` as the reset kernel takes them, or None where it cannot write them in place: off
    the host, not float32, or not contiguous (a view numpy would have to copy)."""
    tensors = [shard.weights for shard in shards] + [state for shard in shards for state in shard.states]
    if not shards or any(t.device.type != "cpu" or t.dtype != torch.float32 or not t.is_contiguous() for t in tensors):
        return None
    states = [(at, state) for at, shard in enumerate(shards) for state in shard.states]
    return _HostShards(
        weights=tuple(shard.weights.detach().numpy() for shard in shards),
        row_offsets=np.array([shard.row_offset for shard in shards], dtype=np.int64),
        col_offsets=np.array([shard.col_offset for shard in shards], dtype=np.int64),
        # a stateless optimizer passes one empty stand-in, so the kernel's types stay the same
        states=tuple(state.detach().numpy().reshape(state.shape[0], -1) for _at, state in states)
        or (np.zeros((0, 1), dtype=np.float32),),
        state_shards=np.array([at for at, _state in states] or [-1], dtype=np.int64),
    )


_MT_WORDS, _MT_SHIFT = 624, 397  # MT19937's state and its twist's offset
_LOW_31, _HIGH_1 = np.uint64(0x7FFFFFFF), np.uint64(0x80000000)
_U32 = np.uint64(0xFFFFFFFF)


@njit(cache=True, nogil=True, boundscheck=False)
def _torch_uniform(seed: int, count: int, bound: float) -> np.ndarray:
    """What ``torch.empty(count).uniform_(-bound, bound, generator=torch.Generator().manual_seed(seed))``
    draws, bit for bit: torch's CPU generator is MT19937 seeded with the seed's low 32 bits, and a
    float takes one 32-bit draw's low 24 bits as x in [0, 1), then x * (to - from) + from with one
    rounding (a fused multiply-add; in float64 it is exact, so rounding that once to float32 gives
    the same)."""
    state = np.empty(_MT_WORDS, dtype=np.uint64)
    state[0] = np.uint64(seed) & _U32
    for i in range(1, _MT_WORDS):
        previous = state[i - 1]
        state[i] = (np.uint64(1812433253) * (previous ^ (previous >> np.uint64(30))) + np.uint64(i)) & _U32
    low, high = np.float32(-bound), np.float32(bound)
    span, start = np.float64(high - low), np.float64(low)
    out = np.empty(count, dtype=np.float32)
    at = _MT_WORDS
    for k in range(count):
        if at == _MT_WORDS:
            for i in range(_MT_WORDS):
                y = (state[i] & _HIGH_1) | (state[(i + 1) % _MT_WORDS] & _LOW_31)
                twisted = state[(i + _MT_SHIFT) % _MT_WORDS] ^ (y >> np.uint64(1))
                state[i] = twisted ^ np.uint64(0x9908B0DF) if y & np.uint64(1) else twisted
            at = 0
        y = state[at]
        at += 1
        y ^= y >> np.uint64(11)
        y ^= (y << np.uint64(7)) & np.uint64(0x9D2C5680)
        y ^= (y << np.uint64(15)) & np.uint64(0xEFC60000)
        y ^= y >> np.uint64(18)
        x = np.float64(y & np.uint64(0xFFFFFF)) / 16777216.0
        out[k] = np.float32(x * span + start)
    return out


@njit(cache=True, nogil=True, boundscheck=False)
def _reset_rows(
    rows: np.ndarray,
    seed: int,
    dim: int,
    bound: float,
    weights: tuple[np.ndarray, ...],
    row_offsets: np.ndarray,
    col_offsets: np.ndarray,
    states: tuple[np.ndarray, ...],
    state_shards: np.ndarray,
) -> None:
    """``RowResetter.reset`` of one table on the host: the fresh rows drawn as torch draws them,
    each shard's part of them written, and its optimizer states' rows zeroed."""
    fresh = _torch_uniform(seed, rows.shape[0] * dim, bound)
    for s in range(len(weights)):
        shard = weights[s]
        for r in range(rows.shape[0]):
            local = rows[r] - row_offsets[s]
            if 0 <= local < shard.shape[0]:
                shard[local, :] = fresh[r * dim + col_offsets[s] : r * dim + col_offsets[s] + shard.shape[1]]
    for t in range(len(states)):
        s = state_shards[t]
        if s < 0:
            continue
        state = states[t]
        for r in range(rows.shape[0]):
            local = rows[r] - row_offsets[s]
            if 0 <= local < state.shape[0]:
                state[local, :] = 0


_CHECKED_DRAW: list[bool] = []


def _draws_like_torch() -> bool:
    """Whether ``_torch_uniform`` draws what this torch draws (checked once a process): the host
    reset kernel is used only then."""
    if not _CHECKED_DRAW:
        seed, count, bound = 2**62 + 12_345, 700, math.sqrt(1 / 1_000_003)  # past one twist of the state
        expected = torch.empty(count).uniform_(-bound, bound, generator=torch.Generator().manual_seed(seed))
        _CHECKED_DRAW.append(bool(np.array_equal(_torch_uniform(seed, count, bound), expected.numpy())))
        if not _CHECKED_DRAW[0]:
            log.warning("this torch draws other uniform weights than MT19937 gives: fresh rows reset through torch")
    return _CHECKED_DRAW[0]


def _kernels(model: nn.Module, kind: type[nn.Module] | tuple[type[nn.Module], ...]) -> list[nn.Module]:
    """The modules of ``kind`` in ``model``'s sharded collections, whose lookups TorchRec keeps in a
    plain list that ``nn.Module.modules()`` does not walk."""
    found: dict[int, nn.Module] = {}
    for module in model.modules():
        for lookup in getattr(module, "_lookups", None) or ():
            found.update({id(m): m for m in lookup.modules() if isinstance(m, kind)})
    return list(found.values())
