"""The open-addressing id index (streamtrain/idindex.py) against a dict under heavy churn, and the
one-pass ``distinct_hashed`` of a step's ids (streamtrain/idstep.py) against numpy's sort-based
unique."""

from __future__ import annotations

import numpy as np
import pytest

from streamtrain.idindex import MAX_LOAD, IdIndex, mix
from streamtrain.idstep import distinct_hashed


@pytest.mark.parametrize("rows", [7, 1_000, 40_000])  # int16 slots below 2^15 rows, int32 beyond
def test_the_index_finds_exactly_the_live_ids_through_inserts_and_backward_shift_deletes(rows):
    rng = np.random.default_rng(rows)
    ids = np.zeros(rows, dtype=np.int64)
    index = IdIndex(ids)
    assert index.slots.dtype == (np.int16 if rows < 2**15 else np.int32)
    assert len(index.slots) >= rows / MAX_LOAD
    expected: dict[int, int] = {}
    free = list(range(rows))
    # a narrow key range makes home slots collide, so runs are long and deletes shift entries back
    key_range = 4 * rows
    fullest = 0
    for _ in range(60):
        live = np.array(sorted(expected.values()), dtype=np.int64)
        dropped = rng.choice(live, size=min(live.size, int(rng.integers(0, rows // 3 + 2))), replace=False)
        index.delete(dropped)
        for row in dropped.tolist():
            del expected[int(ids[row])]
            free.append(row)
        keys = np.setdiff1d(rng.integers(-key_range, key_range, size=len(free)), list(expected))
        keys = rng.permutation(keys)[: int(rng.integers(0, len(free) + 1))]
        rows_given = np.array([free.pop() for _ in range(keys.size)], dtype=np.int64)
        ids[rows_given] = keys
        index.insert(rows_given)
        expected.update(zip(keys.tolist(), rows_given.tolist(), strict=True))
        asked = np.concatenate((np.array(list(expected), dtype=np.int64), rng.integers(-key_range, key_range, 50)))
        assert index.find(asked).tolist() == [expected.get(int(k), -1) for k in asked]
        assert len(index) == len(expected)
        fullest = max(fullest, len(expected))
    assert fullest > rows * 0.9  # the churn filled the table, where probe runs are longest


def test_extreme_raw_ids_are_keys_like_any_other():
    ids = np.array([np.iinfo(np.int64).min, -1, 0, np.iinfo(np.int64).max], dtype=np.int64)
    index = IdIndex(ids)
    index.insert(np.arange(4, dtype=np.int64))
    assert index.find(ids[::-1].copy()).tolist() == [3, 2, 1, 0]
    index.delete(np.array([1], dtype=np.int64))
    assert index.find(ids).tolist() == [0, -1, 2, 3]


def test_indexing_an_id_twice_or_dropping_a_row_not_indexed_is_refused():
    ids = np.array([5, 5, 6], dtype=np.int64)
    index = IdIndex(ids)
    index.insert(np.array([0], dtype=np.int64))
    with pytest.raises(AssertionError, match="indexed twice"):
        index.insert(np.array([1], dtype=np.int64))
    with pytest.raises(AssertionError, match="not in the index"):
        index.delete(np.array([2], dtype=np.int64))


@pytest.mark.parametrize("n", [0, 1, 5_000])
def test_distinct_counts_and_sums_each_value_in_order_of_first_appearance(n):
    rng = np.random.default_rng(n)
    # colliding homes, extreme keys and heavy repeats
    pool = np.concatenate(([np.iinfo(np.int64).min, -1, 0, np.iinfo(np.int64).max], rng.integers(-50, 50, 40)))
    values = rng.choice(pool, size=n).astype(np.int64)
    weights = rng.integers(1, 9, size=n).astype(np.int64)
    unique, hashes, counts, inverse = distinct_hashed(values, values, False)
    _, firsts = np.unique(values, return_index=True)
    assert unique.tolist() == values[np.sort(firsts)].tolist()
    assert (unique[inverse] == values).all()
    assert hashes.tolist() == [mix(np.uint64(v)) for v in unique]  # the index's home for each
    assert counts.tolist() == [int((values == v).sum()) for v in unique]
    unique_w, _hashes, sums, inverse_w = distinct_hashed(values, weights, True)
    assert unique_w.tolist() == unique.tolist() and inverse_w.tolist() == inverse.tolist()
    assert sums.tolist() == [int(weights[values == v].sum()) for v in unique]
