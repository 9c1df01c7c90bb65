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
    already mapped up to two batches ahead; a mapping we own can keep both (below).

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
  - **Exactly-once.** The pipeline maps batches ahead of training, so two copies are kept: the
    one ahead, which maps, and the trained one, which applies what each step decided once its
    batch has trained. Snapshots hold the trained one, which matches the weights and positions of the
    cut; a restore maps the re-read batches again from it.

Ids of a table are kept in a Python dict (id -> row) beside tensors per row; per step, the work is
a dict lookup per distinct id plus vectorised tensor updates, and a victim search over the rows
(``topk``) only when the table is full.
"""

from __future__ import annotations

import copy
import itertools
import math
import sys
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
from streamtrain.metrics import IdSpaceMetrics

_INT64_MAX = torch.iinfo(torch.int64).max
# Two hash rows for the count sketch of ids waiting for admission, with salts that make them
# independent; its width is at least twice the table's rows, so waiting ids rarely share a count.
_SKETCH_SALTS = (np.uint64(0x243F6A8885A308D3), np.uint64(0x13198A2E03707344))
_SKETCH_MIN_WIDTH = 1024
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


@dataclass(frozen=True)
class TableStep:
    """What one step does to one table: decided once (``TableIds.decide``), then applied to each
    copy of the map (``TableIds.apply``), so the trained copy repeats no lookup or search."""

    step: int
    now_ms: int  # the step's newest event time
    rows: torch.Tensor  # the row of each id given, in order (the unknown row for ids without one)
    unknown: torch.Tensor  # bool per id given: it reads the unknown row
    seen: torch.Tensor  # rows of live ids seen this step, and how often
    seen_counts: torch.Tensor
    cells: torch.Tensor  # [salts, n]: admission sketch cells of the ids counted, and their counts
    cell_counts: torch.Tensor
    evicted: Evictions  # ids evicted for lack of room
    assigned: torch.Tensor  # rows given to new ids, which start fresh; the ids, and how often seen
    new_ids: torch.Tensor
    new_counts: torch.Tensor
    expired: Evictions = field(default_factory=Evictions.none)  # ids evicted by ttl, known once applied


def _uniform(hashed: np.ndarray) -> np.ndarray:
    """Hashes as floats in [0, 1): their top 53 bits."""
    return (hashed >> np.uint64(11)).astype(np.float64) / float(1 << 53)


_NO_CELLS = torch.zeros((0, 0), dtype=torch.int64)


class TableIds:
    """One managed table's map from raw ids to rows; every method is deterministic, so ranks fed
    the same ids hold the same map."""

    def __init__(self, table: TableConfig):
        self.name = table.name
        self.capacity = table.live_rows()
        self.unknown_row = self.capacity
        self.eviction = table.eviction or EvictionConfig()
        self.admission = table.admission
        n = self.capacity
        self.ids = torch.zeros(n, dtype=torch.int64)
        self.in_use = torch.zeros(n, dtype=torch.bool)
        self.last_step = torch.zeros(n, dtype=torch.int64)
        self.last_time_ms = torch.zeros(n, dtype=torch.int64)
        self.counts = torch.zeros(n, dtype=torch.int64)
        width = max(_SKETCH_MIN_WIDTH, 1 << math.ceil(math.log2(2 * n)))
        waiting = self.admission is not None and self.admission.min_count is not None
        self.sketch = torch.zeros((len(_SKETCH_SALTS), width) if waiting else (0, 0), dtype=torch.int64)
        self.index: dict[int, int] = {}

    # --- the update -----------------------------------------------------------------------
    def update(self, ids: torch.Tensor, step: int, now_ms: int) -> TableStep:
        """Map ``ids`` (all ranks' ids of step ``step``, whose newest event is at ``now_ms``),
        admitting and evicting as configured."""
        decided = self.decide(ids, step, now_ms)
        return replace(decided, expired=self.apply(decided))

    def decide(self, ids: torch.Tensor, step: int, now_ms: int) -> TableStep:
        """What mapping ``ids`` at ``step`` does, without doing it."""
        unique, inverse, counts = torch.unique(ids, sorted=True, return_inverse=True, return_counts=True)
        keys = unique.tolist()
        found = np.fromiter(map(self.index.get, keys, itertools.repeat(-1, len(keys))), np.int64, len(keys))
        rows = torch.from_numpy(found)
        hit = rows >= 0
        seen = rows[hit]
        waiting = (~hit).nonzero().squeeze(1)
        admit, cells = self._admit(unique[waiting], counts[waiting], step)
        admitted = waiting[admit]
        free, evicted = self._rows_for(int(admitted.numel()), seen)
        assigned = torch.cat((free, evicted.rows))
        admitted = admitted[: assigned.numel()]  # the rest found no row this step: unknown
        rows[admitted] = assigned
        unknown = rows < 0
        rows[unknown] = self.unknown_row
        return TableStep(
            step=step,
            now_ms=now_ms,
            rows=rows[inverse],
            unknown=unknown[inverse],
            seen=seen,
            seen_counts=counts[hit],
            cells=cells,
            cell_counts=counts[waiting] if cells.numel() else torch.zeros(0, dtype=torch.int64),
            evicted=evicted,
            assigned=assigned,
            new_ids=unique[admitted],
            new_counts=counts[admitted],
        )

    def apply(self, decided: TableStep) -> Evictions:
        """Do what ``decide`` decided, on this copy; returns the ids ttl expired."""
        step, now_ms = decided.step, decided.now_ms
        self.last_step[decided.seen] = step
        self.last_time_ms[decided.seen] = now_ms
        self.counts[decided.seen] += decided.seen_counts
        for row, cells in enumerate(decided.cells):
            self.sketch[row].index_add_(0, cells, decided.cell_counts)
        for old in decided.evicted.ids.tolist():
            del self.index[old]
        assigned = decided.assigned
        self.ids[assigned] = decided.new_ids
        self.in_use[assigned] = True
        self.last_step[assigned] = step
        self.last_time_ms[assigned] = now_ms
        self.counts[assigned] = decided.new_counts
        self.index.update(zip(decided.new_ids.tolist(), assigned.tolist(), strict=True))
        if step % self.eviction.interval_steps == 0:
            return self._interval(step, now_ms)
        return Evictions.none()

    def _admit(self, ids: torch.Tensor, counts: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Which of ``ids`` (without rows, seen ``counts`` times) are admitted, and for min_count
        the sketch cells that count them."""
        rule = self.admission
        if rule is None or ids.numel() == 0:
            return torch.ones(ids.numel(), dtype=torch.bool), _NO_CELLS
        raw = ids.numpy().view(np.uint64)
        if rule.probability is not None:
            draw = _uniform(splitmix64(raw ^ splitmix64(np.array([step], dtype=np.uint64))))
            return torch.from_numpy(draw < rule.probability), _NO_CELLS
        assert rule.min_count is not None
        width = np.uint64(self.sketch.shape[1])
        cells = torch.stack(
            [torch.from_numpy((splitmix64(raw ^ salt) % width).astype(np.int64)) for salt in _SKETCH_SALTS]
        )
        estimate = torch.full((ids.numel(),), _INT64_MAX, dtype=torch.int64)
        for row, row_cells in enumerate(cells):
            # the cell's count once this step's sightings are added (ids sharing a cell add up)
            shared, where = torch.unique(row_cells, return_inverse=True)
            added = torch.zeros(shared.numel(), dtype=torch.int64).index_add_(0, where, counts)
            estimate = torch.minimum(estimate, self.sketch[row][row_cells] + added[where])
        return estimate >= rule.min_count, cells

    def _rows_for(self, wanted: int, seen: torch.Tensor) -> tuple[torch.Tensor, Evictions]:
        """Up to ``wanted`` rows: free ones first (lowest first), then the policy's victims among
        the rows not ``seen`` this step."""
        if wanted == 0:
            return torch.zeros(0, dtype=torch.int64), Evictions.none()
        free = (~self.in_use).nonzero().squeeze(1)[:wanted]
        short = min(wanted - int(free.numel()), self.capacity - int(free.numel()) - int(seen.numel()))
        if short <= 0:
            return free, Evictions.none()
        # Unique keys (the row breaks ties), so every rank picks the same victims.
        rank = self.counts.clamp(max=1 << 30) if self.eviction.policy == "lfu" else self.last_step
        key = rank * self.capacity + torch.arange(self.capacity)
        key[seen] = _INT64_MAX
        key[free] = _INT64_MAX
        victims = torch.topk(key, short, largest=False, sorted=True).indices
        return free, Evictions(victims, self.ids[victims].clone())

    def _interval(self, step: int, now_ms: int) -> Evictions:
        eviction = self.eviction
        if self.sketch.numel():  # waiting ids' counts fade, so a trickle is never admitted by age alone
            self.sketch //= 2
        if eviction.policy == "lfu":
            self.counts //= 2
        if eviction.policy != "ttl":
            return Evictions.none()
        if eviction.ttl_steps is not None:
            stale = self.last_step < step - eviction.ttl_steps
        else:
            assert eviction.ttl_seconds is not None
            stale = self.last_time_ms < now_ms - int(eviction.ttl_seconds * 1000)
        rows = (stale & self.in_use).nonzero().squeeze(1)
        expired = Evictions(rows, self.ids[rows].clone())
        self.in_use[rows] = False
        for old in expired.ids.tolist():
            del self.index[old]
        return expired

    # --- reading ----------------------------------------------------------------------------
    def live(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows holding live ids, ascending, and their raw ids."""
        rows = self.in_use.nonzero().squeeze(1)
        return rows, self.ids[rows].clone()

    def memory_bytes(self, full: bool = False) -> int:
        """Bytes of the map now, or (``full``) once every row holds an id."""
        tensors = (self.ids, self.in_use, self.last_step, self.last_time_ms, self.counts, self.sketch)
        # A dict entry: its slot, plus a key and a value int object (small rows are shared; ignored).
        entries = len(self.ids) if full else len(self.index)
        return sum(t.nbytes for t in tensors) + sys.getsizeof(self.index) + 64 * entries

    # --- snapshots ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        return {
            "ids": self.ids,
            "in_use": self.in_use,
            "last_step": self.last_step,
            "last_time_ms": self.last_time_ms,
            "counts": self.counts,
            "sketch": self.sketch,
        }

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for name, tensor in state.items():
            getattr(self, name).copy_(tensor)
        rows, ids = self.live()
        self.index = dict(zip(ids.tolist(), rows.tolist(), strict=True))
        if len(self.index) != int(rows.numel()):
            raise ValueError(f"table {self.name}: the snapshot's id map gives one id several rows")


class IdMapping:
    """All managed tables' maps, and the step they have reached."""

    def __init__(self, tables: Sequence[TableConfig]):
        self.tables = {t.name: TableIds(t) for t in tables}
        self.step = 0

    def update(self, ids: dict[str, torch.Tensor], now_ms: int) -> dict[str, TableStep]:
        self.step += 1
        return {name: table.update(ids[name], self.step, now_ms) for name, table in self.tables.items()}

    def apply(self, steps: dict[str, TableStep]) -> dict[str, Evictions]:
        """Take the next step as another copy decided it; the ids ttl expired, per table."""
        self.step += 1
        return {name: table.apply(steps[name]) for name, table in self.tables.items()}

    def state_dict(self) -> dict[str, object]:
        return {"step": torch.tensor(self.step), **{n: t.state_dict() for n, t in self.tables.items()}}

    def load_state_dict(self, state: dict[str, object]) -> None:
        step = state["step"]
        assert isinstance(step, torch.Tensor)
        self.step = int(step)
        for name, table in self.tables.items():
            table.load_state_dict(state[name])  # type: ignore[arg-type]


@dataclass(frozen=True)
class _Mapped:
    """A batch mapped ahead of training: what its step does to each table, which the trained copy
    repeats once it has trained, and the rows to reset before its forward pass."""

    steps: dict[str, TableStep]
    step: int

    @property
    def fresh(self) -> dict[str, torch.Tensor]:
        return {name: step.assigned for name, step in self.steps.items()}


class IdSpace:
    """The managed tables' id space on one rank: maps each step's batch (``translate``), resets
    the rows it gave away before that batch trains (``before_forward``), and keeps the trained
    copy for snapshots and deltas (``trained``). Every rank calls each method at the same step."""

    def __init__(
        self,
        features: FeaturesConfig,
        world_size: int,
        group: dist.ProcessGroup | None,
        metrics: IdSpaceMetrics | None = None,
    ):
        self.tables = managed_tables(features)
        self.world_size = world_size
        self.group = group
        self.metrics = metrics
        self.ahead = IdMapping(self.tables)
        self.at_cut = IdMapping(self.tables)
        self.in_flight: deque[_Mapped] = deque()  # mapped, not yet trained
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
        newest = int(batch.event_time_ms.max()) if batch.size else 0
        everyone, now_ms, mine = self._gather(own, newest)
        steps = self.ahead.update(everyone, now_ms)
        mapped = _Mapped(steps, self.ahead.step)
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
        """The oldest batch in flight has trained: the trained copy takes its step."""
        mapped = self.in_flight.popleft()
        expired = self.at_cut.apply(mapped.steps)
        for name, step in mapped.steps.items():
            log_ = self.eviction_log[name]
            for evictions in (step.evicted, expired[name]):
                if len(evictions):
                    log_.append((self.at_cut.step, evictions))
            while log_ and log_[0][0] <= self.at_cut.step - _EVICTION_LOG_STEPS:
                log_.popleft()
        self.eviction_log_from = max(self.eviction_log_from, self.at_cut.step - _EVICTION_LOG_STEPS)

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
        metrics, table = self.metrics, self.ahead.tables[name]
        metrics.admissions.labels(name).inc(int(step.assigned.numel()))
        metrics.evictions.labels(name, "capacity").inc(len(step.evicted))
        metrics.evictions.labels(name, "ttl").inc(len(step.expired))
        metrics.unknown_lookups.labels(name).inc(int(step.unknown[mine].sum()))
        metrics.rows_in_use.labels(name).set(len(table.index))
        metrics.memory_bytes.labels(name).set(table.memory_bytes() + self.at_cut.tables[name].memory_bytes())

    def memory_bytes(self, full: bool = False) -> int:
        """What the maps take in memory on this rank, every managed table's, both copies: now, or
        (``full``) once every row holds an id."""
        return sum(t.memory_bytes(full) for copy_ in (self.ahead, self.at_cut) for t in copy_.tables.values())

    # --- the trained copy: snapshots and deltas ------------------------------------------------
    def state_dict(self) -> dict[str, object]:
        """The map at the cut: the trained batches' (the pipeline's in-flight ones are not in it)."""
        return self.at_cut.state_dict()

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Take a snapshot's map; call before any batch is mapped."""
        if self.in_flight:
            raise RuntimeError("a snapshot's id map can only be loaded before training starts")
        self.at_cut.load_state_dict(state)
        self.ahead = copy.deepcopy(self.at_cut)
        for log_ in self.eviction_log.values():
            log_.clear()
        self.eviction_log_from = self.at_cut.step

    def raw_ids(self, table: str) -> tuple[torch.Tensor, torch.Tensor]:
        """At the cut: the rows of ``table`` that hold live ids, ascending, and those raw ids."""
        return self.at_cut.tables[table].live()

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
        """The id-space step of the cut: how many steps the trained copy has taken."""
        return self.at_cut.step


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
        from torchrec.distributed.batched_embedding_kernel import BaseBatchedEmbeddingBag

        self.seed = seed
        self.order = {t.name: i for i, t in enumerate(tables)}
        self.tables = {t.name: t for t in tables}
        self.shards: dict[str, list[_Shard]] = {t.name: [] for t in tables}
        for module in _kernels(model, BaseBatchedEmbeddingBag):
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


def _kernels(model: nn.Module, kind: type[nn.Module]) -> list[nn.Module]:
    """The modules of ``kind`` in ``model``'s sharded collections, whose lookups TorchRec keeps in a
    plain list that ``nn.Module.modules()`` does not walk."""
    found: dict[int, nn.Module] = {}
    for module in model.modules():
        for lookup in getattr(module, "_lookups", None) or ():
            found.update({id(m): m for m in lookup.modules() if isinstance(m, kind)})
    return list(found.values())
