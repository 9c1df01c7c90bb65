"""A managed table's step in one compiled pass: the ids of a step in, their rows, flags and the
step's undo out (``streamtrain.idspace.TableIds.update`` calls it once a step).

One numba call does what took about twenty kernels and numpy calls a step, in this order:
  1. the distinct ids and their counts, by hashing (each id's splitmix64 kept: it is also the
     index's home for it);
  2. each distinct id's bucket (checked against the buckets this map owns, before anything is
     written) and its row in the index (``streamtrain.idindex``);
  3. admission of the ids without a row: every one (no rule), a draw by a hash of the id and the
     step (``probability``), or the count sketch (``min_count``): each waiting id's sightings added
     to its cell in each hash row, saturating, then its estimate read once every sighting of the
     step is in (ids sharing a cell add up);
  4. rows for the admitted ids, in the order of their ids: each bucket's lowest free rows, then
     its victims, its rows in use and not seen this step with the lowest eviction key, the row
     breaking ties (``give_rows``);
  5. the writes: the rows seen and given are touched (step, event time, lfu count), the victims
     leave the index, the new ids take their rows and enter it; each array's old values at the
     rows written are returned, for the step's undo;
  6. each of the step's ids' table row and whether it is unknown.

The result is the map the step-by-step kernels made before, bit for bit: the same rows, flags,
victims and arrays (a differential run over lru, lfu, ttl, probability and min_count, several
buckets and owned parts of them, digests every step's and the map at the cut). Only the order of
a step's undo records differs, which the cut does not see: one record an array, seen rows then
given ones, where there were two.

Per id, the work is a few hash computations and random reads: into a scratch table twice the
step's size (the distinct ids), the index, and two sketch cells for a waiting id. A step's ids are
independent of one another until the rows are given, so each loop runs its reads side by side.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import numpy.typing as npt
from numba import njit

from streamtrain.idindex import EMPTY, delete_rows, insert_rows, mix, prefetch, scaled

I64 = npt.NDArray[np.int64]

# Two hash rows for the count sketch of ids waiting for admission, with salts that make them
# independent (``count_sightings`` writes the two out).
SKETCH_SALTS = np.array([0x243F6A8885A308D3, 0x13198A2E03707344], dtype=np.uint64)
# Sketch cells saturate here (uint16): min_count is at most this (config), and halvings keep
# counts of live traffic far below it.
SKETCH_MAX = np.iinfo(np.uint16).max
# lfu counts saturate here (int32): past it an id is popular enough never to be the victim.
COUNT_MAX = 1 << 30
# Ages are kept modulo 2^32 (steps as uint32); the oldest age a row can show.
MAX_AGE = np.int64((1 << 32) - 1)
# Salts the hash that picks an id's bucket, so that it is independent of the index's.
BUCKET_SALT = np.uint64(0xA4093822299F31D0)

# How many ids ahead a loop asks for the cache lines it will read at random: enough to cover a
# read from memory at this loop's pace, few enough that the lines are still there when read.
AHEAD = 16

# The victims a recency bucket keeps ranked for the steps after the one that ranked its rows, and
# the columns of what it keeps about them: the next to look at, the end, the step they were
# ranked at and the oldest one's age then.
VICTIMS_KEPT = 256
KEPT_NEXT, KEPT_END, KEPT_STEP, KEPT_OLDEST_AGE = 0, 1, 2, 3

# admission rules
ADMIT_ALL, ADMIT_PROBABILITY, ADMIT_MIN_COUNT = 0, 1, 2


@njit(cache=True, nogil=True, boundscheck=False)
def distinct_hashed(values: I64, weights: I64, weighted: bool) -> tuple[I64, np.ndarray, I64, I64]:
    """The distinct ``values`` in the order they first appear, each one's splitmix64 hash, its count
    (or the sum of its ``weights``), and each value's position among them. Every value is hashed
    first, so that the probes can ask for their slots ``AHEAD`` values early."""
    n = values.shape[0]
    unique, hashes = np.empty(n, np.int64), np.empty(n, np.uint64)
    sums, inverse = np.empty(n, np.int64), np.empty(n, np.int64)
    size = 2 * n + 1  # at most half full: short probes
    table = np.full(size, -1, dtype=np.int32)  # each slot's position in unique
    for i in range(n):
        hashes[i] = mix(np.uint64(values[i]))
    found = 0
    for i in range(n):
        if i + AHEAD < n:
            prefetch(table, scaled(hashes[i + AHEAD], size))
        value, hashed = values[i], hashes[i]
        weight = weights[i] if weighted else 1
        at = scaled(hashed, size)
        while True:
            known = table[at]
            if known < 0:
                table[at] = found
                # found <= i: the value's own hash, read above, is the last one this overwrites
                unique[found], hashes[found], sums[found] = value, hashed, weight
                inverse[i] = found
                found += 1
                break
            if unique[known] == value:
                sums[known] += weight
                inverse[i] = known
                break
            at += 1
            if at == size:
                at = 0
    return unique[:found], hashes[:found], sums[:found], inverse


@njit(cache=True, nogil=True, boundscheck=False)
def sort_order(keys: I64) -> I64:
    """The positions of ``keys`` in ascending order, equal keys in their order: a radix sort by
    bytes, skipping a byte all keys share. numba's own sorts take about ten times numpy's, which a
    step's few thousand ids would notice."""
    n = keys.shape[0]
    flipped = np.empty(n, np.uint64)  # the sign bit flipped: signed order as unsigned
    for i in range(n):
        flipped[i] = np.uint64(keys[i]) ^ np.uint64(1 << 63)
    order, spare = np.arange(n), np.empty(n, np.int64)
    counts = np.empty(257, np.int64)
    for shift in range(0, 64, 8):
        counts[:] = 0
        for i in range(n):
            counts[((flipped[i] >> np.uint64(shift)) & np.uint64(0xFF)) + 1] += 1
        if counts.max() == n:  # every key has this byte: the order stands
            continue
        for d in range(256):
            counts[d + 1] += counts[d]
        for i in range(n):
            at = order[i]
            digit = (flipped[at] >> np.uint64(shift)) & np.uint64(0xFF)
            spare[counts[digit]] = at
            counts[digit] += 1
        order, spare = spare, order
    return order


@njit(cache=True, nogil=True, boundscheck=False)
def bucket_of(value: np.int64, bucket_count: int) -> np.int64:
    """An id's bucket: a salted hash scaled to the bucket count, independent of the index's (which
    would otherwise crowd a rank's ids into a band of its slots)."""
    if bucket_count == 1:
        return np.int64(0)
    return scaled(mix(np.uint64(value) ^ BUCKET_SALT), bucket_count)


@njit(cache=True, nogil=True, boundscheck=False)
def look_up(
    slots: np.ndarray,
    ids: I64,
    unique: I64,
    hashes: np.ndarray,
    bucket_count: int,
    first_bucket: int,
    owned: int,
    rows: I64,
    local_buckets: I64,
) -> bool:
    """Each distinct id's owned bucket (``local_buckets``, counted from ``first_bucket``) and its
    row in the index, -1 where it has none; False where an id's bucket is not owned. The reads run
    ahead of the probes in two stages: an id's home slot ``2 * AHEAD`` ids ahead, the row it holds
    (whose id the probe compares) ``AHEAD`` ids ahead."""
    size, k = slots.shape[0], unique.shape[0]
    fits = True
    for j in range(min(2 * AHEAD, k)):
        prefetch(slots, scaled(hashes[j], size))
    for j in range(k):
        if j + 2 * AHEAD < k:
            prefetch(slots, scaled(hashes[j + 2 * AHEAD], size))
        if j + AHEAD < k:
            first = slots[scaled(hashes[j + AHEAD], size)]
            if first != EMPTY:
                prefetch(ids, first)
        key = unique[j]
        local = bucket_of(key, bucket_count) - first_bucket
        fits &= (local >= 0) & (local < owned)
        local_buckets[j] = local
        at = scaled(hashes[j], size)
        while True:  # the index is never full: a free slot ends every probe
            row = slots[at]
            if row == EMPTY:
                rows[j] = -1
                break
            if ids[row] == key:
                rows[j] = row
                break
            at += 1
            if at == size:
                at = 0
    return fits


@njit(cache=True, nogil=True, boundscheck=False)
def count_sightings(
    sketch: np.ndarray,
    totals: I64,
    width: int,
    unique: I64,
    sums: I64,
    local_buckets: I64,
    waiting: I64,
    estimate: I64,
    written: I64,
    old: np.ndarray,
    first_bucket: int,
    end_bucket: int,
) -> None:
    """Add each ``waiting`` id of the buckets [``first_bucket``, ``end_bucket``) to its cell in
    each of the two hash rows of ``sketch``, saturating, and what each bucket gained to ``totals``;
    then its estimate, the lesser of its cells once every sighting is in (ids sharing a cell add
    up; a saturated cell still reads at least any min_count). An id's cell in a hash row is its
    salted hash in its bucket's ``width`` cells (a power of two, so a mask places it). Waiting id
    i's estimate goes to ``estimate[i]``, and the write of its hash row r's cell (the flat cell and
    its old value) to ``written`` and ``old`` at r * n + i: threads that take runs of buckets write
    apart, and together write what one thread taking every bucket does. The cells are placed
    first, each asked for as it is placed, so the additions that follow ``AHEAD`` ids behind find
    them arriving. The two rows are written out, not looped over: the loop's bookkeeping cost as
    much as the additions."""
    flat = sketch.reshape(-1)
    row_cells, n = sketch.shape[1], waiting.shape[0]
    mask = np.uint64(width - 1)
    # the positions among ``waiting`` of the ids of these buckets: all of them, or listed
    every = first_bucket == 0 and end_bucket == totals.shape[0]
    mine, m = waiting[:0], n
    if not every:
        mine, m = np.empty(n, np.int64), 0
        for i in range(n):
            bucket = local_buckets[waiting[i]]
            if first_bucket <= bucket < end_bucket:
                mine[m] = i
                m += 1
    for k in range(m + AHEAD):
        if k < m:
            i = k if every else mine[k]
            j = waiting[i]
            base = local_buckets[j] * width
            key = np.uint64(unique[j])
            first, second = (
                base + np.int64(mix(key ^ SKETCH_SALTS[0]) & mask),
                row_cells + base + np.int64(mix(key ^ SKETCH_SALTS[1]) & mask),
            )
            written[i], written[n + i] = first, second
            prefetch(flat, first)
            prefetch(flat, second)
        if k >= AHEAD:
            i = k - AHEAD if every else mine[k - AHEAD]
            j = waiting[i]
            first, second = written[i], written[n + i]
            before = np.int64(flat[first])
            after = min(before + sums[j], SKETCH_MAX)
            old[i], flat[first] = before, after
            gained = after - before
            before = np.int64(flat[second])  # after the first row's write: the cells may be one
            after = min(before + sums[j], SKETCH_MAX)
            old[n + i], flat[second] = before, after
            totals[local_buckets[j]] += gained + after - before
    for k in range(m):
        i = k if every else mine[k]
        estimate[i] = min(np.int64(flat[written[i]]), np.int64(flat[written[n + i]]))


@njit(cache=True, nogil=True, boundscheck=False)
def give_rows(
    local_buckets: I64,
    arrays: MapArrays,
    seen: I64,
    by_count: bool,
    step: int,
) -> tuple[I64, I64]:
    """A row for each admitted id in ``local_buckets`` (in the ids' order), or -1 where its bucket
    has none left, and the victims evicted for them. A bucket gives its lowest free rows first,
    then victims among its rows in use and not ``seen`` this step, lowest eviction key first: an
    lfu row's count (``by_count``) or an lru/ttl row's recency (``step`` - ``last_step``, modulo
    2^32, oldest first), the row breaking ties, so every rank picks the same.

    Two things spare a bucket most of its rows' reads, and change no choice:
      - its free rows are looked for from ``free_from``, below which every row is in use (rows are
        given lowest first, and only ttl frees one, moving the mark back);
      - a recency bucket that ranks its rows keeps the next ``VICTIMS_KEPT`` of them in order
        (``victims``, with the step each was last seen). Until they run out, the oldest rows in
        the bucket are those of them still as they were: a row seen or given since is younger than
        any of them, and rows untouched since age alike, keeping their order (while no age
        passes 2^32). lfu counts move, and new ids start low, so an lfu bucket ranks its rows
        each time it is short."""
    starts, in_use, counts, last_step = arrays.bucket_starts, arrays.in_use, arrays.counts, arrays.last_step
    free_from, kept_rows, kept_steps, kept = (
        arrays.free_from,
        arrays.victim_rows,
        arrays.victim_steps,
        arrays.victims_kept,
    )
    buckets, capacity = starts.shape[0] - 1, max(in_use.shape[0], 1)
    step32 = np.uint32(step & 0xFFFFFFFF)
    wanted = np.zeros(buckets, dtype=np.int64)
    for bucket in local_buckets:
        wanted[bucket] += 1
    # each bucket's rows to give, free then victims, from its first admitted id's place on
    firsts = np.zeros(buckets + 1, dtype=np.int64)
    for bucket in range(buckets):
        firsts[bucket + 1] = firsts[bucket] + wanted[bucket]
    available = np.full(local_buckets.shape[0], -1, dtype=np.int64)
    victims = np.empty(local_buckets.shape[0], dtype=np.int64)
    evicted = 0
    # sorted once a bucket is short of free rows (a bucket's seen rows are then one run, read
    # alongside its rows): a step that evicts nothing does not pay for it
    sorted_seen = seen[:0]
    for bucket in range(buckets):
        want = wanted[bucket]
        if want == 0:
            continue
        at, end = firsts[bucket], firsts[bucket + 1]
        row = free_from[bucket]
        while at < end and row < starts[bucket + 1]:
            if not in_use[row]:
                available[at] = row
                at += 1
            row += 1
        free_from[bucket] = row
        short = end - at
        if short == 0:
            continue
        if sorted_seen.shape[0] < seen.shape[0]:
            sorted_seen = seen[sort_order(seen)]
        if not by_count and _from_kept(bucket, short, at, available, victims, evicted, arrays, sorted_seen, step):
            at += short
            evicted += short
            continue
        keys = np.empty(starts[bucket + 1] - starts[bucket], dtype=np.int64)
        candidates = 0
        next_seen = np.searchsorted(sorted_seen, starts[bucket])
        for row in range(starts[bucket], starts[bucket + 1]):
            if next_seen < sorted_seen.shape[0] and sorted_seen[next_seen] == row:
                next_seen += 1
            elif in_use[row]:
                rank = np.int64(counts[row]) if by_count else MAX_AGE - np.int64(np.uint32(step32 - last_step[row]))
                keys[candidates] = rank * capacity + row
                candidates += 1
        take = min(short, candidates)
        ranked = take if by_count else min(take + kept_rows.shape[1], candidates)
        if ranked == 0:
            continue
        lowest = np.partition(keys[:candidates], ranked - 1)[:ranked] if ranked < candidates else keys[:candidates]
        lowest = lowest[sort_order(lowest)]
        for key in lowest[:take]:
            available[at] = victims[evicted] = key % capacity
            at += 1
            evicted += 1
        if not by_count:  # the next oldest, kept for the steps to come
            more = lowest[take:]
            for k in range(more.shape[0]):
                kept_row = more[k] % capacity
                kept_rows[bucket, k], kept_steps[bucket, k] = kept_row, last_step[kept_row]
            oldest = np.int64(np.uint32(step32 - last_step[more[0] % capacity])) if more.shape[0] else 0
            kept[bucket, KEPT_NEXT], kept[bucket, KEPT_END] = 0, more.shape[0]
            kept[bucket, KEPT_STEP], kept[bucket, KEPT_OLDEST_AGE] = step, oldest
    # each admitted id takes the next of its bucket's rows, in the ids' order
    given = np.empty(local_buckets.shape[0], dtype=np.int64)
    for i in range(local_buckets.shape[0]):
        bucket = local_buckets[i]
        given[i] = available[firsts[bucket]]
        firsts[bucket] += 1
    return given, victims[:evicted]


@njit(cache=True, nogil=True, boundscheck=False)
def _from_kept(
    bucket: int,
    short: int,
    at: int,
    available: I64,
    victims: I64,
    evicted: int,
    arrays: MapArrays,
    seen: I64,
    step: int,
) -> bool:
    """Give ``bucket``'s ``short`` victims from the rows it keeps in order, if enough of them are
    still as they were kept (in use, last seen when they were kept, not seen this step), and no
    age has passed 2^32 since; else False, and nothing is given."""
    kept, kept_rows, kept_steps = arrays.victims_kept, arrays.victim_rows, arrays.victim_steps
    in_use, last_step = arrays.in_use, arrays.last_step
    if kept[bucket, KEPT_END] == 0 or step - kept[bucket, KEPT_STEP] + kept[bucket, KEPT_OLDEST_AGE] >= 1 << 32:
        return False
    found, k = 0, kept[bucket, KEPT_NEXT]
    while found < short and k < kept[bucket, KEPT_END]:
        row = kept_rows[bucket, k]
        k += 1
        if in_use[row] and last_step[row] == kept_steps[bucket, k - 1]:
            where = np.searchsorted(seen, row)
            if where == seen.shape[0] or seen[where] != row:
                available[at + found] = victims[evicted + found] = row
                found += 1
    if found < short:
        return False
    kept[bucket, KEPT_NEXT] = k
    return True


@njit(cache=True, nogil=True, boundscheck=False)
def admitted_by_draw(unique: I64, waiting: I64, probability: float, step: int) -> np.ndarray:
    """Whether each waiting id is admitted at ``step`` with ``probability``: a draw by a hash of the
    id and the step, the same on every rank (the hash's top 53 bits as a float in [0, 1))."""
    salt = mix(np.uint64(step))
    admitted = np.empty(waiting.shape[0], dtype=np.bool_)
    for i in range(waiting.shape[0]):
        draw = np.float64(mix(np.uint64(unique[waiting[i]]) ^ salt) >> np.uint64(11)) / 9007199254740992.0
        admitted[i] = draw < probability
    return admitted


class MapArrays(NamedTuple):
    """A table's map as the step's kernels take it (``TableIds``'s arrays; those a policy does not
    keep are empty)."""

    slots: np.ndarray  # the index's (streamtrain.idindex)
    ids: I64
    in_use: np.ndarray
    last_step: np.ndarray  # uint32
    last_time_ms: I64
    counts: np.ndarray  # int32
    sketch: np.ndarray  # uint16 [hash rows, cells]
    sketch_totals: I64  # per owned bucket
    bucket_starts: I64  # each owned bucket's first row in the arrays, and the end of the last
    # what spares a bucket reads of its rows (``give_rows``), kept as the map changes
    free_from: I64  # per owned bucket: every row below it is in use
    victim_rows: np.ndarray  # int32 [owned buckets, VICTIMS_KEPT]: a recency bucket's next victims
    victim_steps: np.ndarray  # uint32, likewise: the step each was last seen when kept
    victims_kept: I64  # [owned buckets, 4]: KEPT_NEXT, KEPT_END, KEPT_STEP, KEPT_OLDEST_AGE


class MapRules(NamedTuple):
    """How a table maps: its buckets, admission, and where its rows sit in the table."""

    bucket_count: int  # of the whole table
    first_bucket: int  # the first owned one
    sketch_width: int  # cells a bucket in each hash row
    admission: int  # ADMIT_ALL, ADMIT_PROBABILITY or ADMIT_MIN_COUNT
    probability: float
    min_count: int
    start: int  # the table row of the arrays' first row
    unknown_row: int


class StepOutcome(NamedTuple):
    """What a step did: each of its values' table row and whether it reads the unknown row; the
    rows given (in the arrays' rows, in the order of their ids);
    the victims and the ids they held; and what the undo needs: the sketch cells written and their
    old values, the rows touched (seen, then given) with their old steps, event times and counts
    (empty for arrays not kept), and the given rows' old ids and in-use flags."""

    rows: I64
    unknown: np.ndarray
    assigned: I64
    victims: I64
    evicted_ids: I64
    cells: I64
    old_cells: np.ndarray
    touched: np.ndarray  # int32
    old_steps: np.ndarray
    old_times: I64
    old_counts: np.ndarray
    old_ids: I64
    old_in_use: np.ndarray


@njit(cache=True, nogil=True, boundscheck=False)
def split_hits(rows: I64) -> tuple[I64, I64]:
    """The positions of the distinct ids found in the index (seen) and of those not (waiting)."""
    hits = 0
    for j in range(rows.shape[0]):
        hits += rows[j] >= 0
    seen, waiting = np.empty(hits, np.int64), np.empty(rows.shape[0] - hits, np.int64)
    h = w = 0
    for j in range(rows.shape[0]):
        if rows[j] >= 0:
            seen[h] = j
            h += 1
        else:
            waiting[w] = j
            w += 1
    return seen, waiting


@njit(cache=True, nogil=True, boundscheck=False)
def map_step(
    values: I64, weights: I64, weighted: bool, arrays: MapArrays, rules: MapRules, step: int, now_ms: int
) -> StepOutcome:
    """Map a step's ``values`` (each seen ``weights`` times where ``weighted``, else once) in one
    pass, writing ``arrays``."""
    unique, hashes, sums, inverse = distinct_hashed(values, weights, weighted)
    rows, local_buckets = np.empty(unique.shape[0], np.int64), np.empty(unique.shape[0], np.int64)
    owned = arrays.bucket_starts.shape[0] - 1
    if not look_up(
        arrays.slots, arrays.ids, unique, hashes, rules.bucket_count, rules.first_bucket, owned, rows, local_buckets
    ):
        raise ValueError("an id reached a rank that does not own its bucket")  # before anything is written
    seen, waiting = split_hits(rows)
    hash_rows = arrays.sketch.shape[0] if rules.admission == ADMIT_MIN_COUNT else 0
    estimate = np.empty(waiting.shape[0] if hash_rows else 0, np.int64)
    cells = np.empty(hash_rows * waiting.shape[0], np.int64)
    old_cells = np.empty(hash_rows * waiting.shape[0], arrays.sketch.dtype)
    if hash_rows:
        count_sightings(
            arrays.sketch,
            arrays.sketch_totals,
            rules.sketch_width,
            unique,
            sums,
            local_buckets,
            waiting,
            estimate,
            cells,
            old_cells,
            0,
            owned,
        )
    return admit_and_write(
        unique,
        sums,
        inverse,
        rows,
        local_buckets,
        seen,
        waiting,
        estimate,
        cells,
        old_cells,
        arrays,
        rules,
        step,
        now_ms,
    )


@njit(cache=True, nogil=True, boundscheck=False)
def admit_and_write(
    unique: I64,
    sums: I64,
    inverse: I64,
    rows: I64,
    local_buckets: I64,
    seen: I64,
    waiting: I64,
    estimate: I64,
    cells: I64,
    old_cells: np.ndarray,
    arrays: MapArrays,
    rules: MapRules,
    step: int,
    now_ms: int,
) -> StepOutcome:
    """The step's rest, once its distinct ids are looked up and the waiting ones counted
    (``estimate``, for min_count): admission, rows given, the writes and each value's answer."""
    last_step, last_time_ms, counts, ids, in_use = (
        arrays.last_step,
        arrays.last_time_ms,
        arrays.counts,
        arrays.ids,
        arrays.in_use,
    )
    keeps_steps, keeps_times, keeps_counts = last_step.shape[0] > 0, last_time_ms.shape[0] > 0, counts.shape[0] > 0
    # admission of the waiting ids, in their order
    if rules.admission == ADMIT_MIN_COUNT:
        admit = estimate >= rules.min_count
    elif rules.admission == ADMIT_PROBABILITY:
        admit = admitted_by_draw(unique, waiting, rules.probability, step)
    else:
        admit = np.ones(waiting.shape[0], np.bool_)
    admitted = waiting[admit]
    # new ids take rows in the order of their ids, whichever rank's batch brought them first
    admitted = admitted[sort_order(unique[admitted])]
    step32 = np.uint32(step & 0xFFFFFFFF)
    seen_rows = rows[seen]
    given, victims = give_rows(local_buckets[admitted], arrays, seen_rows, keeps_counts, step)
    placed = given >= 0  # the rest found no row this step: unknown
    admitted, assigned = admitted[placed], given[placed]

    # the writes, each array's old values first
    touched = np.concatenate((seen_rows, assigned)).astype(np.int32)
    old_steps = last_step[touched] if keeps_steps else last_step[:0]
    old_times = last_time_ms[touched] if keeps_times else last_time_ms[:0]
    old_counts = counts[touched] if keeps_counts else counts[:0]
    for t in range(touched.shape[0]):
        row = touched[t]
        if keeps_steps:
            last_step[row] = step32
        if keeps_times:
            last_time_ms[row] = now_ms
        if keeps_counts:  # a seen id adds its sightings; a new one starts at them
            if t < seen.shape[0]:
                counts[row] = min(np.int64(counts[row]) + sums[seen[t]], COUNT_MAX)
            else:
                counts[row] = min(sums[admitted[t - seen.shape[0]]], COUNT_MAX)
    evicted_ids = ids[victims]
    if delete_rows(arrays.slots, ids, victims):  # while the rows still hold the evicted ids
        raise AssertionError("a row to drop was not in the index")
    old_ids, old_in_use = ids[assigned], in_use[assigned]
    for a in range(assigned.shape[0]):
        ids[assigned[a]] = unique[admitted[a]]
        in_use[assigned[a]] = True
    if insert_rows(arrays.slots, ids, assigned):
        raise AssertionError("an id was indexed twice: the map would give it two rows")

    # each value's row and whether it is unknown, by its distinct id
    distinct_rows = rows.copy()
    for a in range(assigned.shape[0]):
        distinct_rows[admitted[a]] = assigned[a]
    n = inverse.shape[0]
    table_rows, unknown = np.empty(n, np.int64), np.empty(n, np.bool_)
    for i in range(n):
        row = distinct_rows[inverse[i]]
        unknown[i] = row < 0
        table_rows[i] = rules.unknown_row if row < 0 else row + rules.start
    return StepOutcome(
        table_rows, unknown, assigned, victims, evicted_ids, cells, old_cells,
        touched, old_steps, old_times, old_counts, old_ids, old_in_use,
    )  # fmt: skip
