"""The delta wire format: chunks below a size, reassembled in any order, with repeats."""

import random

import numpy as np
import pytest
import torch

from streamtrain.delivery.artifact import ServedIds
from streamtrain.delivery.deltas import (
    Assembler,
    Delta,
    DeltaFormatError,
    DeltaId,
    DensePiece,
    IdPiece,
    RowPiece,
    encode,
)


def _delta() -> Delta:
    rng = np.random.default_rng(0)
    ids = np.arange(0, 5000, 3, dtype=np.int64)
    return Delta(
        DeltaId("m", base_version=2, sequence=7, step=120, event_time_high_water_ms=1_700_000, published_at_ms=1),
        rows=[
            RowPiece("user_id", ids, 0, rng.standard_normal((len(ids), 8)).astype(np.float32)),
            RowPiece("user_id", ids, 8, rng.standard_normal((len(ids), 8)).astype(np.float32)),
        ],
        dense=[DensePiece("dlrm.dense_arch.weight", (64, 300), 0, rng.standard_normal(64 * 300).astype(np.float32))],
    )


def test_a_delta_is_chunked_below_the_size_and_reassembled_in_any_order_with_repeats():
    delta = _delta()
    chunks = encode(delta, max_bytes=16_384)
    assert len(chunks) > 10 and all(len(c) <= 16_384 for c in chunks)
    shuffled = chunks + chunks[:3]
    random.Random(1).shuffle(shuffled)
    assembler, done = Assembler(), []
    for chunk in shuffled:
        whole = assembler.add(chunk)
        if whole is not None:
            done.append(whole)
    assert len(done) == 1 and done[0].id == delta.id
    got = done[0]
    for column in (0, 8):
        pieces = [p for p in got.rows if p.column == column]
        ids = np.concatenate([p.ids for p in pieces])
        values = np.concatenate([p.values for p in pieces])
        order = np.argsort(ids)
        want = next(p for p in delta.rows if p.column == column)
        np.testing.assert_array_equal(ids[order], want.ids)
        np.testing.assert_array_equal(values[order], want.values)
    flat = np.zeros(64 * 300, dtype=np.float32)
    for piece in got.dense:
        flat[piece.offset : piece.offset + piece.values.size] = piece.values
    np.testing.assert_array_equal(flat, delta.dense[0].values)


def test_a_chunk_in_another_format_is_refused_with_what_is_wrong():
    with pytest.raises(DeltaFormatError, match="not a streamtrain delta chunk"):
        Assembler().add(b"\x00\x00\x00\x01garbage")


def test_a_managed_tables_ids_and_evictions_round_trip_in_chunks_and_an_empty_whole_map_still_travels():
    rows = np.arange(0, 3000, dtype=np.int64)
    raw = rows * -7_000_000_000_003  # raw ids are any int64, negative ones included
    delta = Delta(
        DeltaId("m", 1, 0, 5, 0, 0),
        ids=[
            IdPiece("user_id", rows, raw),
            IdPiece("user_id", rows[:2], raw[:2] + 1, evicted=True),
            IdPiece("adgroup_id", np.empty(0, np.int64), np.empty(0, np.int64), full=True),
        ],
    )
    chunks = encode(delta, max_bytes=16_384)
    assert len(chunks) > 3 and all(len(c) <= 16_384 for c in chunks)
    assembler = Assembler()
    got = [d for d in map(assembler.add, reversed(chunks)) if d is not None]
    assert len(got) == 1
    pieces = got[0].ids
    mapped = sorted((p for p in pieces if p.table == "user_id" and not p.evicted), key=lambda p: int(p.rows[0]))
    assert np.array_equal(np.concatenate([p.rows for p in mapped]), rows)
    assert np.array_equal(np.concatenate([p.ids for p in mapped]), raw)
    (evicted,) = [p for p in pieces if p.evicted]
    assert evicted.rows.tolist() == [0, 1] and evicted.ids.tolist() == (raw[:2] + 1).tolist()
    (whole,) = [p for p in pieces if p.table == "adgroup_id"]
    assert whole.full and len(whole.rows) == 0


def test_a_served_map_follows_evictions_moves_and_whole_maps():
    served = ServedIds(np.array([0, 1]), np.array([100, 101]), unknown_row=9)
    assert served.rows(torch.tensor([100, 101, 555])).tolist() == [0, 1, 9]
    served.evict(np.array([0]), np.array([100]))  # ttl freed row 0
    served.assign(np.array([1, 2]), np.array([102, 101]))  # row 1 given to 102; 101 moved to row 2
    assert served.row_of == {102: 1, 101: 2} and served.id_at == {1: 102, 2: 101}
    served.evict(np.array([2]), np.array([555]))  # an eviction of another id leaves row 2 as it is
    assert served.rows(torch.tensor([100, 101, 102])).tolist() == [9, 2, 1]
    served.clear()
    served.assign(np.array([3]), np.array([7]))
    assert served.row_of == {7: 3}
