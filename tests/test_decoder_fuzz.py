"""Safety fuzzing: random and mutated payloads (bit flips, truncations, huge lengths, random
bytes) never crash the decoder, never make it read outside a payload, never hang it, and every
bad payload is reported with a reason: the same reason on the fastavro path. What the compiled
decoder accepts, fastavro decodes to the same columns.

CI runs a short fuzz; ``STREAMTRAIN_FUZZ_PAYLOADS=100000`` runs a long one.
"""

from __future__ import annotations

import io
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import fastavro
import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from conftest import Schemas  # noqa: E402
from streamtrain import avro_program as ap  # noqa: E402
from streamtrain.config import FeaturesConfig  # noqa: E402
from streamtrain.deadletter import reason_code  # noqa: E402
from streamtrain.decode import REASONS, AvroBatchDecoder, FastavroDecoder  # noqa: E402
from streamtrain.dev.produce import AvroEncoder, ClickStream  # noqa: E402
from streamtrain.source import RawEvent  # noqa: E402

PAYLOADS = int(os.environ.get("STREAMTRAIN_FUZZ_PAYLOADS", "20000"))
BATCH = 1000

RICH_READER = {
    "type": "record",
    "name": "Rich",
    "fields": [
        {"name": "clk", "type": ["null", "int"]},
        {"name": "ts", "type": {"type": "long", "logicalType": "timestamp-micros"}},
        {
            "name": "user",
            "type": {
                "type": "record",
                "name": "User",
                "fields": [
                    {"name": "id", "type": "long"},
                    {"name": "country", "type": ["null", "string"], "default": None},
                ],
            },
        },
        {"name": "kind", "type": {"type": "enum", "name": "Kind", "symbols": ["A", "B", "C"], "default": "A"}},
        {"name": "tags", "type": {"type": "array", "items": "string"}, "default": []},
        {"name": "score", "type": ["null", "double"], "default": None},
        {"name": "flag", "type": "boolean", "default": False},
    ],
}
RICH_WRITER = {
    "type": "record",
    "name": "Rich",
    "fields": [
        {"name": "attrs", "type": {"type": "map", "values": ["null", "long", "string"]}},
        {"name": "kind", "type": {"type": "enum", "name": "Kind", "symbols": ["D", "C", "B", "A"]}},
        {
            "name": "user",
            "type": {
                "type": "record",
                "name": "User",
                "fields": [{"name": "id", "type": "int"}, {"name": "country", "type": ["null", "bytes"]}],
            },
        },
        {"name": "digest", "type": {"type": "fixed", "name": "Digest", "size": 4}},
        {"name": "clk", "type": ["null", "int"]},
        {"name": "tags", "type": {"type": "array", "items": "bytes"}},
        {"name": "score", "type": ["null", "float"]},
        {"name": "ts", "type": "long"},
    ],
}
# A recursive type: beyond the program compiler, so its payloads take the fastavro fallback.
RICH_RECURSIVE = {
    **RICH_WRITER,
    "fields": RICH_WRITER["fields"]
    + [
        {
            "name": "tree",
            "type": {
                "type": "record",
                "name": "Node",
                "fields": [{"name": "children", "type": {"type": "array", "items": "Node"}}],
            },
        }
    ],
}
RICH_FEATURES = {
    "tables": [
        {"name": "user", "field": "user.id", "num_embeddings": 1000, "embedding_dim": 4, "id_mapping": "hash"},
        {"name": "country", "field": "user.country", "num_embeddings": 50, "embedding_dim": 4},
        {"name": "kind", "field": "kind", "num_embeddings": 3, "embedding_dim": 4},
        {"name": "tags", "field": "tags", "num_embeddings": 100, "embedding_dim": 4},
        {"name": "flag", "field": "flag", "num_embeddings": 2, "embedding_dim": 4},
    ],
    "dense": [{"field": "score", "transform": "log1p"}, {"field": "user.id"}],
    "label": "clk",
    "event_time": "ts",
}


def rich_record(rng: random.Random, writer: bool) -> dict:
    text = lambda: "".join(rng.choice("abcé") for _ in range(rng.randint(0, 4)))  # noqa: E731
    record = {
        "clk": rng.choice([None, 0, 1]),
        "ts": rng.randint(-(2**40), 2**40),
        "user": {"id": rng.randint(-(2**31), 2**31 - 1), "country": rng.choice([None, text()])},
        "kind": rng.choice(["A", "B", "C"] + (["D"] if writer else [])),
        "tags": [text() for _ in range(rng.randint(0, 3))],
        "score": rng.choice([None, rng.uniform(-2, 1e3), float("nan")]),
    }
    if writer:
        record["attrs"] = {text(): rng.choice([None, rng.randint(-9, 9), text()]) for _ in range(rng.randint(0, 2))}
        record["digest"] = bytes(rng.getrandbits(8) for _ in range(4))
        record["user"]["country"] = None if record["user"]["country"] is None else record["user"]["country"].encode()
        record["tags"] = [t.encode() for t in record["tags"]]
    else:
        record["flag"] = rng.random() < 0.5
    return record


def encode(schema: dict, record: dict) -> bytes:
    out = io.BytesIO()
    fastavro.schemaless_writer(out, fastavro.parse_schema(schema), record)
    return out.getvalue()


def mutate(rng: random.Random, payload: bytes, keep: int) -> bytes:
    """One random mutation; the first ``keep`` bytes (a Confluent header) are kept, mostly."""
    data = bytearray(payload)
    kind = rng.randrange(9)
    body = range(keep, len(data)) if len(data) > keep else range(len(data))
    if kind == 0 and data:  # bit flips
        for _ in range(rng.randint(1, 4)):
            data[rng.choice(body) if body else 0] ^= 1 << rng.randrange(8)
    elif kind == 1:  # truncation
        del data[rng.randint(0, len(data)) :]
    elif kind == 2:  # a huge or negative length or count spliced in
        at = rng.randint(keep, len(data)) if len(data) >= keep else 0
        data[at:at] = rng.choice(
            [
                b"\xff\xff\xff\xff\x0f",
                b"\x80\x80\x80\x80\x80\x80\x80\x80\x80\x80\x01",
                b"\x01",
                b"\xfe\xff\xff\xff\xff\xff\xff\xff\xff\x01",
                b"\x7f",
                b"\x81\x01",
            ]
        )
    elif kind == 3:  # random bytes
        data = bytearray(rng.getrandbits(8) for _ in range(rng.randint(0, 40)))
    elif kind == 4:  # trailing bytes
        data += bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 5)))
    elif kind == 5 and len(data) > keep:  # a byte set to a boundary value
        data[rng.choice(body)] = rng.choice([0x00, 0x01, 0x7F, 0x80, 0xFF])
    elif kind == 6 and len(data) > keep + 1:  # a slice deleted from the middle
        a = rng.choice(body)
        del data[a : a + rng.randint(1, 4)]
    elif kind == 7:  # a broken Confluent header
        data[:1] = rng.choice([b"", b"\x01", b"\x00\x00"])
    # kind 8 (and the others when they cannot apply): unchanged, a valid payload
    return bytes(data)


def fuzz_payloads(count: int, seed: int) -> tuple[list[bytes], list[bytes]]:
    """(raw payloads for the reference schema, Confluent payloads for the rich schemas)."""
    rng = random.Random(seed)
    encoder = AvroEncoder(REPO / "schemas" / "click_event.avsc")
    click_seeds = [encoder.encode(r) for r in ClickStream(seed, 0).chunk(200).records]
    rich_seeds = []
    for i in range(200):
        # 0: the reader itself, 1: the evolved writer, 2: an id nobody knows, 3: the fallback
        schema_id = i % 4
        writer = schema_id in (1, 3)
        record = rich_record(rng, writer)
        if schema_id == 3:
            record["tree"] = {"children": [{"children": []}] * rng.randint(0, 2)}
        body = encode({1: RICH_WRITER, 3: RICH_RECURSIVE}.get(schema_id, RICH_READER), record)
        rich_seeds.append(b"\x00" + schema_id.to_bytes(4, "big") + body)
    half = count // 2
    return (
        [mutate(rng, rng.choice(click_seeds), 0) for _ in range(half)],
        [mutate(rng, rng.choice(rich_seeds), 5) for _ in range(count - half)],
    )


def decoders(tmp_path: Path):
    reader_path = tmp_path / "rich.avsc"
    reader_path.write_text(json.dumps(RICH_READER))
    rich = FeaturesConfig.model_validate(
        {
            **RICH_FEATURES,
            "schema_path": str(reader_path),
            "wire_format": "confluent",
            "writer_schemas_dir": str(tmp_path),
        }
    )
    source = Schemas({0: RICH_READER, 1: RICH_WRITER, 3: RICH_RECURSIVE})
    import yaml

    small = yaml.safe_load((REPO / "tests" / "worker-small.yaml").read_text())["features"]
    click = FeaturesConfig.model_validate(small)
    pairs = [
        (AvroBatchDecoder(click), FastavroDecoder(click)),
        (AvroBatchDecoder(rich, source), FastavroDecoder(rich, source)),
    ]
    for compiled, _oracle in pairs:
        compiled.decode([])  # the JIT compile, if the cache is cold, is not the time a batch takes
    return pairs


def check_batch(compiled, oracle, events) -> dict[str, int]:
    started = time.perf_counter()
    got = compiled.decode(events)
    elapsed = time.perf_counter() - started
    assert elapsed < 5.0, f"a batch of {len(events)} took {elapsed:.1f}s"
    expected = oracle.decode(events)
    reasons = {e.offset: reason_code(r) for e, r in got.rejected}
    oracle_reasons = {e.offset: reason_code(r) for e, r in expected.rejected}
    assert set(reasons.values()) <= set(REASONS)
    assert got.batch.size + len(got.rejected) == len(events)
    differ = [
        (o, reasons.get(o), oracle_reasons.get(o), events[o].value.hex())
        for o in reasons.keys() | oracle_reasons.keys()
        if reasons.get(o) != oracle_reasons.get(o)
    ]
    assert not differ, f"{len(differ)} payloads get another reason from fastavro, e.g. {differ[:3]}"
    accepted = [e.offset for e in events if e.offset not in reasons]
    # The events both accept decode to the same columns.
    both = [e for e in events if e.offset not in reasons and e.offset not in oracle_reasons]
    if len(both) != len(accepted) or len(both) != expected.batch.size:
        got, expected = compiled.decode(both), oracle.decode(both)
    kjt, expected_kjt = got.batch.sparse_features, expected.batch.sparse_features
    np.testing.assert_array_equal(kjt.values().numpy(), expected_kjt.values().numpy())
    np.testing.assert_array_equal(kjt.lengths().numpy(), expected_kjt.lengths().numpy())
    np.testing.assert_array_equal(got.batch.dense_features.numpy(), expected.batch.dense_features.numpy())
    np.testing.assert_array_equal(got.batch.labels.numpy(), expected.batch.labels.numpy())
    np.testing.assert_array_equal(got.batch.event_time_ms.numpy(), expected.batch.event_time_ms.numpy())
    assert np.isfinite(got.batch.dense_features.numpy()).all()
    for key, sizes in zip(kjt.keys(), compiled.features.tables, strict=True):
        rows = kjt[key].values().numpy()
        assert ((rows >= 0) & (rows < sizes.num_embeddings)).all()
    counts: dict[str, int] = {}
    for reason in reasons.values():
        counts[reason] = counts.get(reason, 0) + 1
    counts["decoded"] = len(accepted)
    return counts


def test_random_and_mutated_payloads_are_decoded_or_rejected_with_the_same_reason_by_both_paths(tmp_path):
    started = time.perf_counter()
    click_payloads, rich_payloads = fuzz_payloads(PAYLOADS, seed=PAYLOADS)
    totals: dict[str, int] = {}
    for (compiled, oracle), payloads in zip(decoders(tmp_path), (click_payloads, rich_payloads), strict=True):
        for first in range(0, len(payloads), BATCH):
            events = [RawEvent(0, i, p, 0) for i, p in enumerate(payloads[first : first + BATCH])]
            for reason, count in check_batch(compiled, oracle, events).items():
                totals[reason] = totals.get(reason, 0) + count
    print(f"\n{PAYLOADS:,} payloads in {time.perf_counter() - started:.1f}s: {dict(sorted(totals.items()))}")
    assert sum(totals.values()) == PAYLOADS
    assert totals["decoded"] > PAYLOADS // 10 and len(totals) >= 12, totals


def test_no_read_outside_a_payload_with_numba_bounds_checks(tmp_path):
    """Each payload alone in its buffer, with numba's bounds checks on: a read past the payload's
    end would raise IndexError in the subprocess."""
    count = PAYLOADS
    result = subprocess.run(
        [sys.executable, __file__, "bounds", str(count), str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "NUMBA_BOUNDSCHECK": "1", "NUMBA_CACHE_DIR": str(tmp_path / "numba")},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"checked {count} payloads" in result.stdout


def _bounds(count: int, tmp_path: Path) -> None:
    click_payloads, rich_payloads = fuzz_payloads(count, seed=count + 1)
    checked = 0
    for (compiled, _oracle), payloads in zip(decoders(tmp_path), (click_payloads, rich_payloads), strict=True):
        for payload in payloads:
            # Copied, so the buffer ends where the payload does.
            buf = np.frombuffer(bytes(payload), dtype=np.uint8).copy()
            starts, ends = np.zeros(1, np.int64), np.full(1, len(payload), np.int64)
            status = np.zeros(1, np.int8)
            ids = np.full(1, -1, np.int64)
            entry = np.full(1, -1, np.int64)
            if compiled.confluent:
                ap.parse_frames(buf, starts, ends, status, ids)
                if status[0] == 0:
                    entry[0] = compiled._entry(int(ids[0]))
            else:
                entry[0] = compiled._entry(None)
            if entry[0] >= 0 and len(payload):
                lengths = np.zeros((len(compiled.features.tables), 1), np.int32)
                ap.run_batch(
                    buf,
                    starts,
                    ends,
                    entry,
                    compiled.code,
                    False,
                    status,
                    lengths,
                    np.zeros((1, len(compiled.features.dense)), np.float32),
                    np.zeros((1, 1), np.float32),  # one task's label column
                    np.ones(1, np.bool_),  # and it is required
                    np.zeros(1, np.int64),
                    np.zeros((1, 4), np.int64),  # the late-label sample columns
                )
            checked += 1
    print(f"checked {checked} payloads")


if __name__ == "__main__" and sys.argv[1:2] == ["bounds"]:
    _bounds(int(sys.argv[2]), Path(sys.argv[3]))
