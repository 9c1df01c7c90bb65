"""The delta wire format: chunks below a size, reassembled in any order, with repeats."""

import random

import numpy as np
import pytest

from streamtrain.delivery.deltas import Assembler, Delta, DeltaFormatError, DeltaId, DensePiece, RowPiece, encode


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
