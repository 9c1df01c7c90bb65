"""An open-addressing hash index from raw 64-bit ids to the rows of a managed table.

The index holds rows only; an id's key is read from ``ids[row]``, the table's own array of raw ids,
so an entry costs one small integer (int16 below 2^15 rows, int32 beyond) where a Python dict entry
costs about 100 bytes. Slots are ``ceil(rows / MAX_LOAD)``, fixed when the table is made, so the
index is at its full size from the start. A slot's home is the id's splitmix64 hash, scaled to the
slot count (multiply-shift, so any count works and none is wasted on rounding up to a power of
two); collisions probe linearly, and a deletion shifts the entries behind it back (no tombstones,
so probes never lengthen with churn). The table never holds more than ``rows`` ids, so a free slot
always ends a probe.

Every operation is a numba loop over numpy arrays. The layout depends only on the order of the
inserts and deletes, which every rank performs alike; lookups do not depend on the layout at all.

A step's distinct ids are found by the same probe over a scratch table
(``streamtrain.idstep.distinct_hashed``): one pass, where a sort (``torch.unique``, ``np.unique``)
costs log n passes.
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from streamtrain.threads import Slices

MAX_LOAD = 0.7  # linear probing: about 6 probes for a miss at this load, 2 for a hit
EMPTY = -1

I64 = npt.NDArray[np.int64]


@intrinsic
def prefetch(typingctx, array, index):
    """Ask for ``array[index]``'s cache line ahead of its read (LLVM's prefetch, kept in every cache
    level), from a numba loop. A loop over a step's ids reads the index, the map's arrays and the
    sketch at random; asked a few ids ahead, those reads overlap instead of waiting one by one."""
    if not isinstance(array, types.Array) or not isinstance(index, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        byte = ir.IntType(8).as_pointer()
        at = builder.bitcast(builder.gep(data, [args[1]]), byte)
        i32 = ir.IntType(32)
        declared = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [byte, i32, i32, i32]), "llvm.prefetch.p0"
        )
        builder.call(declared, [at, i32(0), i32(3), i32(1)])  # a read, kept close, of data
        return context.get_dummy_value()

    return types.void(array, index), codegen


@njit(cache=True, nogil=True, boundscheck=False)
def mix(z: np.uint64) -> np.uint64:
    """The splitmix64 finaliser of one uint64 (``decode.splitmix64`` over arrays)."""
    z += np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


@njit(cache=True, nogil=True, boundscheck=False)
def scaled(hashed: np.uint64, size: int) -> np.int64:
    """A hash's top 32 bits scaled to [0, size) by multiply-shift."""
    return np.int64(((hashed >> np.uint64(32)) * np.uint64(size)) >> np.uint64(32))


@njit(cache=True, nogil=True, boundscheck=False)
def _home(key: np.int64, size: int) -> np.int64:
    return scaled(mix(np.uint64(key)), size)


@njit(cache=True, nogil=True, boundscheck=False)
def _slot_of(slots: np.ndarray, ids: I64, key: np.int64) -> np.int64 | int:
    """The slot holding ``key``, or the free slot where its probe ends, as ``-1 - slot``."""
    size = slots.shape[0]
    at = _home(key, size)
    for _ in range(size):  # the index is never full: a free slot ends every probe
        row = slots[at]
        if row == EMPTY:
            return -1 - at
        if ids[row] == key:
            return at
        at += 1
        if at == size:
            at = 0
    return np.int64(-1 - size)


@njit(cache=True, nogil=True, boundscheck=False)
def _find(slots: np.ndarray, ids: I64, keys: I64, rows: I64) -> None:
    for i in range(keys.shape[0]):
        at = _slot_of(slots, ids, keys[i])
        rows[i] = slots[at] if at >= 0 else EMPTY


@njit(cache=True, nogil=True, boundscheck=False)
def insert_rows(slots: np.ndarray, ids: I64, rows: I64) -> int:
    """Index ``rows`` under the ids they hold now; the number of ids that were already indexed."""
    clashes = 0
    for i in range(rows.shape[0]):
        at = _slot_of(slots, ids, ids[rows[i]])
        if at >= 0:
            clashes += 1
        else:
            slots[-1 - at] = rows[i]
    return clashes


@njit(cache=True, nogil=True, boundscheck=False)
def delete_rows(slots: np.ndarray, ids: I64, rows: I64) -> int:
    """Drop ``rows`` (still holding their ids) from the index; the number that were not in it."""
    size = slots.shape[0]
    missing = 0
    for i in range(rows.shape[0]):
        hole = _slot_of(slots, ids, ids[rows[i]])
        if hole < 0 or slots[hole] != rows[i]:
            missing += 1
            continue
        # Backward shift: an entry further along the run moves into the hole unless its home lies
        # cyclically in (hole, entry], where the hole is not on its probe path.
        at = hole
        for _ in range(size):
            at += 1
            if at == size:
                at = 0
            row = slots[at]
            if row == EMPTY:
                break
            home = _home(ids[row], size)
            stays = (hole < home <= at) if hole <= at else (home > hole or home <= at)
            if not stays:
                slots[hole] = row
                hole = at
        slots[hole] = EMPTY
    return missing


class IdIndex:
    """Raw id -> row for the ids held in ``ids`` (the table's array, which the index reads)."""

    def __init__(self, ids: I64):
        self.ids = ids
        capacity = int(ids.shape[0])
        dtype = np.int16 if capacity < 2**15 else np.int32
        self.slots = np.full(max(1, math.ceil(capacity / MAX_LOAD)), EMPTY, dtype=dtype)

    def find(self, keys: I64, slices: Slices | None = None) -> I64:
        """The row of each key, or -1 where it has none; on ``slices``' threads, where given."""
        rows = np.empty(keys.shape[0], dtype=np.int64)
        if slices is None:
            _find(self.slots, self.ids, keys, rows)
        else:  # lookups only read the index: any cut of the keys gives the same rows
            slices.map(lambda part: _find(self.slots, self.ids, keys[part], rows[part]), slices.cut(keys.shape[0]))
        return rows

    def insert(self, rows: I64) -> None:
        """Index ``rows``, whose ids are already written to ``ids`` and not indexed yet."""
        if insert_rows(self.slots, self.ids, rows):
            raise AssertionError("an id was indexed twice: the map would give it two rows")

    def delete(self, rows: I64) -> None:
        """Drop ``rows``, whose ids are still in ``ids``, from the index."""
        if delete_rows(self.slots, self.ids, rows):
            raise AssertionError("a row to drop was not in the index")

    def clear(self) -> None:
        self.slots.fill(EMPTY)

    def __len__(self) -> int:
        return int(np.count_nonzero(self.slots != EMPTY))

    @property
    def nbytes(self) -> int:
        return int(self.slots.nbytes)
