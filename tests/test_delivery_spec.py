"""docs/delivery-format.md is the delivery format's reference: its test vectors decode with its
layouts alone (a reader written here from the page, not from streamtrain), the worker writes
exactly those bytes, its JSON Schemas are the code's, and the rules a reader must keep (versions,
current.json's path, loading a base without pickle) hold in the code."""

from __future__ import annotations

import json
import pickle
import re
import struct
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import REPO
from streamtrain.avro_program import fnv1a64 as worker_fnv1a64
from streamtrain.config import TableConfig
from streamtrain.decode import map_ids
from streamtrain.delivery.deltas import (
    Assembler,
    Delta,
    DeltaFormatError,
    DeltaId,
    DensePiece,
    IdPiece,
    RowPiece,
    decode_chunk,
    encode,
)
from streamtrain.delivery.safeload import UnsafeBase, load_program
from streamtrain.delivery.spec import (
    FormatError,
    chunk_header_schema,
    manifest_schema,
    parse_base,
    parse_delta,
    parse_manifest,
    read_current,
)

SPEC = REPO / "docs" / "delivery-format.md"
MASK = 2**64 - 1


def spec_block(name: str) -> object:
    """The JSON block after ``<!-- name -->`` in the spec."""
    found = re.search(rf"<!-- {name} -->\n```json\n(.*?)\n```", SPEC.read_text(), re.S)
    assert found, f"{SPEC} has no block {name}"
    return json.loads(found[1])


# --- a reader of the spec's own, from its text --------------------------------------------------


def fnv1a64(data: bytes) -> int:
    h = 0xCBF29CE484222325
    for byte in data:
        h = ((h ^ byte) * 0x100000001B3) & MASK
    return h


def splitmix64(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def row_of(value: int | str, id_mapping: str, n: int) -> int:
    unsigned = fnv1a64(value.encode()) if isinstance(value, str) else value & MASK
    if id_mapping == "hash":
        return splitmix64(unsigned) % n
    return unsigned % n if isinstance(value, str) else value % n  # Python's % floors: -1 -> n - 1


def read_chunk(chunk: bytes) -> tuple[dict, dict]:
    """A chunk's header and body, by the spec's table: magic, uint32 LE length, JSON, body."""
    assert chunk[:4] == b"STD1"
    (length,) = struct.unpack("<I", chunk[4:8])
    header = json.loads(chunk[8 : 8 + length].decode("utf-8"))
    body, count = chunk[8 + length :], header["count"]
    assert header.get("format", 1) == 1 and 0 <= header["part"] < header["parts"]
    if header["kind"] == "rows":
        width = header["width"]
        assert len(body) == count * (8 + 4 * width)
        ids = list(struct.unpack(f"<{count}q", body[: 8 * count]))
        flat = struct.unpack(f"<{count * width}f", body[8 * count :])
        return header, {"ids": ids, "values": [list(flat[i * width : (i + 1) * width]) for i in range(count)]}
    if header["kind"] == "dense":
        assert len(body) == 4 * count and header["offset"] + count <= int(np.prod(header["shape"]))
        return header, {"values": list(struct.unpack(f"<{count}f", body))}
    assert header["kind"] in ("ids", "evicted") and len(body) == 16 * count
    pairs = struct.unpack(f"<{2 * count}q", body)
    return header, {"rows": list(pairs[:count]), "ids": list(pairs[count:])}


# --- the vectors ----------------------------------------------------------------------------------


def test_delivery_spec_chunk_vectors_read_with_the_layouts_alone_and_are_what_the_worker_writes():
    vectors = spec_block("chunk-vectors")
    assert isinstance(vectors, list) and [v["kind"] for v in vectors] == ["rows", "dense", "evicted"]
    chunks = [bytes.fromhex(v["hex"]) for v in vectors]
    for vector, chunk in zip(vectors, chunks, strict=True):
        header, body = read_chunk(chunk)
        assert (header["model_id"], header["base_version"], header["sequence"], header["step"]) == ("clicks", 7, 3, 120)
        assert (header["section"], header["part"], header["parts"]) == (vector["section"], vector["part"], 3)
        for key in ("ids", "values", "rows"):
            if key in vector:
                assert body[key] == vector[key]
        for key in ("column", "shape", "offset"):
            if key in vector:
                assert header[key] == vector[key]
    rows, dense, evicted = vectors
    delta = Delta(
        DeltaId("clicks", 7, 3, 120, 1_700_000_000_000, 1_700_000_000_500),
        rows=[RowPiece("user_id", np.array(rows["ids"]), rows["column"], np.array(rows["values"], np.float32))],
        dense=[
            DensePiece(dense["section"], tuple(dense["shape"]), dense["offset"], np.array(dense["values"], np.float32))
        ],
        ids=[IdPiece("user_id", np.array(evicted["rows"]), np.array(evicted["ids"]), evicted=True)],
    )
    assert encode(delta, 1 << 20) == chunks
    whole = [d for d in map(Assembler().add, reversed(chunks)) if d is not None]
    assert len(whole) == 1 and whole[0].id == delta.id


def test_delivery_spec_id_vectors_follow_the_functions_it_prints_and_are_the_decoders():
    vectors = spec_block("id-vectors")
    assert isinstance(vectors, dict)
    for text, want in vectors["fnv1a64"].items():
        assert fnv1a64(text.encode()) == int(want, 16) == worker_fnv1a64(text)
    for x, want in vectors["splitmix64"].items():
        assert splitmix64(int(x, 16)) == int(want, 16)
    for case in vectors["rows"]:
        value, mapping, n = case["value"], case["id_mapping"], case["num_embeddings"]
        assert row_of(value, mapping, n) == case["row"]
        table = TableConfig(name="t", field="f", num_embeddings=n, embedding_dim=8, id_mapping=mapping)
        raw = np.array([fnv1a64(value.encode())], np.uint64) if isinstance(value, str) else np.array([value])
        assert int(map_ids(raw, table)[0]) == case["row"]
    (text, raw_id), *_ = vectors["managed_raw_id"].items()
    assert raw_id == fnv1a64(text.encode()) - (1 << 64 if fnv1a64(text.encode()) >= 1 << 63 else 0)


def test_delivery_spec_json_schemas_are_the_codes():
    assert spec_block("manifest-schema") == manifest_schema()
    assert spec_block("chunk-header-schema") == chunk_header_schema()


# --- the rules a reader keeps -------------------------------------------------------------------


def test_delivery_spec_an_unknown_format_version_is_refused_with_a_clear_error():
    (chunk,) = encode(
        Delta(DeltaId("m", 1, 0, 1, 0, 0), dense=[DensePiece("w", (2,), 0, np.ones(2, np.float32))]), 8192
    )
    header, _body = read_chunk(chunk)
    raw = json.dumps({**header, "format": 2}).encode()
    future = b"STD1" + struct.pack("<I", len(raw)) + raw + chunk[8 + struct.unpack("<I", chunk[4:8])[0] :]
    with pytest.raises(DeltaFormatError, match="delivery format 2; this reader knows format 1 only: upgrade") as error:
        decode_chunk(future)
    assert error.value.reason == "format_version"
    with pytest.raises(FormatError, match="in delivery format 2"):
        parse_manifest(json.dumps({"format": 2}), "base-000003/manifest.json")


def test_delivery_spec_names_have_one_parser_and_current_json_stays_inside_the_folder(tmp_path):
    assert parse_base("base-000007") is not None and parse_base("base-000007").version == 7  # type: ignore[union-attr]
    assert parse_base("base-000008.partial").partial  # type: ignore[union-attr]
    assert parse_delta("delta-000003-000000007") == (3, 7) and parse_delta("delta-3-7.bak") is None
    (tmp_path / "current.json").write_text(json.dumps({"version": 7, "path": "base-000007"}))
    assert read_current(tmp_path) == {"version": 7, "path": "base-000007"}
    for escape in ["../elsewhere", "/etc", "base-000007/../../x", "base-000008.partial", 7]:
        (tmp_path / "current.json").write_text(json.dumps({"version": 7, "path": escape}))
        with pytest.raises(FormatError, match="must name a base folder"):
            read_current(tmp_path)


class _Runs:
    def __reduce__(self):
        return (Path.touch, (Path(_Runs.marker),))


def test_delivery_spec_a_base_whose_program_would_run_pickled_code_is_refused(tmp_path):
    program = torch.export.export(torch.nn.Linear(3, 2), (torch.ones(4, 3),))
    torch.export.save(program, tmp_path / "model.pt2")
    assert torch.equal(
        load_program(tmp_path / "model.pt2").module()(torch.ones(4, 3)), program.module()(torch.ones(4, 3))
    )
    _Runs.marker = str(tmp_path / "ran")
    with zipfile.ZipFile(tmp_path / "model.pt2") as archive:
        entries = {name: archive.read(name) for name in archive.namelist()}
    (sample,) = [name for name in entries if "/data/sample_inputs/" in name]
    prefix = sample.split("/data/")[0]
    evil = pickle.dumps(_Runs())
    for name, planted in [
        (sample, entries | {sample: evil}),
        ("opaque", entries | {f"{prefix}/data/constants/opaque_obj_0": evil}),
    ]:
        with zipfile.ZipFile(tmp_path / f"{name.rsplit('/', 1)[-1]}.pt2", "w") as archive:
            for entry, data in planted.items():
                archive.writestr(entry, data)
        with pytest.raises((UnsafeBase, RuntimeError, pickle.UnpicklingError)):
            load_program(tmp_path / f"{name.rsplit('/', 1)[-1]}.pt2")
    assert not Path(_Runs.marker).exists(), "loading a base ran code from it"
    with pytest.raises(UnsafeBase, match="a pickled object"):
        load_program(tmp_path / "opaque.pt2")


def test_mutated_delta_chunks_of_one_delta_must_agree_and_old_ones_are_forgotten():
    delta = Delta(DeltaId("m", 1, 4, 9, 0, 0), dense=[DensePiece("w", (4096,), 0, np.ones(4096, np.float32))])
    chunks = encode(delta, 8192)
    assert len(chunks) >= 3
    header, _body = read_chunk(chunks[1])
    assembler = Assembler()
    assert assembler.add(chunks[0]) is None
    for change, reason in [
        ({"parts": len(chunks) + 1}, "parts_disagree"),
        ({"step": 10}, "parts_disagree"),
        ({"part": len(chunks)}, "header_field"),
        ({"part": -1}, "header_field"),
    ]:
        raw = json.dumps({**header, **change}).encode()
        mutated = b"STD1" + struct.pack("<I", len(raw)) + raw + chunks[1][8 + struct.unpack("<I", chunks[1][4:8])[0] :]
        with pytest.raises(DeltaFormatError) as refused:
            assembler.add(mutated)
        assert refused.value.reason == reason, change
    assert len(assembler) == 1
    assembler.forget_before(1, 5)
    assert len(assembler) == 0
    assert all(assembler.add(c) is None for c in chunks[1:])  # part 0 was forgotten
    small = Assembler(max_pending=2)
    for sequence in range(5):
        (one, *_rest) = encode(Delta(DeltaId("m", 1, sequence, 9, 0, 0), dense=delta.dense), 8192)
        small.add(one)
    assert len(small) == 2


def test_mutated_delta_folder_names_and_a_pruned_delta_do_not_stop_a_directory_reader(tmp_path):
    from streamtrain.delivery.serve import DirectoryDeltas

    delta = Delta(DeltaId("m", 1, 0, 1, 0, 0), dense=[DensePiece("w", (2,), 0, np.ones(2, np.float32))])
    for name in ["delta-000001-000000000", "delta-000001-000000001", "delta-1-2.bak", "delta-x-y"]:
        (tmp_path / name).mkdir()
        for part, chunk in enumerate(encode(delta, 8192)):
            (tmp_path / name / f"part-{part:05d}").write_bytes(chunk)
        (tmp_path / name / "part-00000.tmp").write_bytes(b"stray")
        (tmp_path / name / "COMPLETE").touch()
    (tmp_path / "stray-file").write_bytes(b"")
    source = DirectoryDeltas(tmp_path)
    source.rewind(0)
    assert source.poll(0.1) == encode(delta, 8192)  # the .tmp part is no part
    for part in (tmp_path / "delta-000001-000000001").iterdir():  # pruned after it was listed
        part.unlink()
    (tmp_path / "delta-000001-000000001").rmdir()
    assert source.poll(0.1) == [] and source.caught_up()


def test_score_limit_state_lock_lets_scores_read_together_and_a_delta_write_alone():
    import threading

    from streamtrain.delivery.serve.follower import StateLock

    lock, inside, broken = StateLock(), {"readers": 0, "writers": 0}, []
    both_reading = threading.Barrier(2, timeout=10)

    def read(wait: bool) -> None:
        with lock.read():
            inside["readers"] += 1
            if wait:
                both_reading.wait()  # two scores hold it at once
            broken.extend(["read while written"] if inside["writers"] else [])
            inside["readers"] -= 1

    def write() -> None:
        for _ in range(300):
            with lock.write():
                inside["writers"] += 1
                broken.extend(["two writers"] if inside["writers"] > 1 else [])
                broken.extend(["written while read"] if inside["readers"] else [])
                inside["writers"] -= 1

    pair = [threading.Thread(target=read, args=(True,)) for _ in range(2)]
    for thread in pair:
        thread.start()
    for thread in pair:
        thread.join(timeout=10)
    threads = [threading.Thread(target=write) for _ in range(2)]
    threads += [threading.Thread(target=lambda: [read(False) for _ in range(300)]) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not broken and not any(t.is_alive() for t in pair + threads)


def with_header(chunk: bytes, **change: object) -> bytes:
    """``chunk`` with its header's fields changed (``raw``: the header's bytes replaced whole)."""
    (length,) = struct.unpack("<I", chunk[4:8])
    raw = change.pop("raw", None)
    if raw is None:
        raw = json.dumps({**json.loads(chunk[8 : 8 + length]), **change}).encode()
    assert isinstance(raw, bytes)
    return b"STD1" + struct.pack("<I", len(raw)) + raw + chunk[8 + length :]


def test_mutated_delta_chunks_out_of_int64_too_deep_or_of_no_layout_are_format_errors():
    delta = Delta(DeltaId("m", 1, 0, 1, 0, 0), [RowPiece("t", np.arange(2), 0, np.ones((2, 4), np.float32))])
    (chunk,) = encode(delta, 8192)
    for change, reason in [
        ({"event_time_high_water_ms": 10**400}, "header_field"),  # once served, it broke every /metrics scrape
        ({"published_at_ms": -(2**63) - 1}, "header_field"),
        ({"parts": 2**63}, "header_field"),
        ({"step": 2**64}, "header_field"),
        ({"count": 0, "width": 2**62}, "body_size"),  # numpy cannot lay out 0 rows of 2**62 columns
        ({"raw": b"[" * 100_000 + b"]" * 100_000}, "header_json"),  # deeper than the JSON parser's recursion
    ]:
        # a chunk of no rows has no body
        mutated = with_header(chunk[: 8 + struct.unpack("<I", chunk[4:8])[0]] if "width" in change else chunk, **change)
        with pytest.raises(DeltaFormatError) as refused:
            decode_chunk(mutated)
        assert refused.value.reason == reason, change


def test_delivery_spec_current_json_that_is_not_json_and_manifest_paths_outside_the_base_are_refused(tmp_path):
    from streamtrain.delivery.spec import base_file

    for broken in [b"{not json", b"\xff\xfe", b"[" * 100_000]:
        (tmp_path / "current.json").write_bytes(broken)
        with pytest.raises(FormatError) as refused:
            read_current(tmp_path)
        assert refused.value.reason == "current"
    assert base_file(tmp_path, "writer_schemas", "writer_schemas_dir") == tmp_path / "writer_schemas"
    for escape in ["../reader.avsc", "/etc/hostname", "schemas/../../x", "", "a\\..\\b"]:
        with pytest.raises(FormatError, match="must be a relative path inside the base"):
            base_file(tmp_path, escape, "features.schema_path")


def test_an_attempt_that_failed_partway_is_replaced_by_its_retry_and_refusals_keep_nothing_alive():
    dense = [DensePiece("w", (4096,), 0, np.ones(4096, np.float32))]
    first = encode(Delta(DeltaId("m", 1, 4, 9, 0, published_at_ms=1000), dense=dense), 8192)
    retry = encode(Delta(DeltaId("m", 1, 4, 9, 0, published_at_ms=2000), dense=dense), 8192)
    assert len(first) >= 3
    assembler = Assembler()
    assert assembler.add(first[0]) is None and assembler.add(first[1]) is None  # the failed attempt's
    done = [d for d in map(assembler.add, retry) if d is not None]  # a newer attempt replaces it
    assert [d.id.published_at_ms for d in done] == [2000] and len(assembler) == 0 and assembler.held == 0
    with pytest.raises(DeltaFormatError, match="parts"):  # an older attempt's chunk, after the newer one began
        assembler.add(retry[0]) or assembler.add(first[2])

    # A refused chunk does not touch its delta: the stale one is still the first to go.
    small = Assembler(max_pending=2)
    stale = encode(Delta(DeltaId("m", 1, 0, 9, 0, 0), dense=dense), 8192)
    small.add(stale[0])
    small.add(encode(Delta(DeltaId("m", 1, 1, 9, 0, 0), dense=dense), 8192)[0])
    with pytest.raises(DeltaFormatError):
        small.add(with_header(stale[1], step=10))
    small.add(encode(Delta(DeltaId("m", 1, 2, 9, 0, 0), dense=dense), 8192)[0])
    assert [key[2] for key in small._pending] == [1, 2]


def test_the_assembler_holds_a_bounded_number_of_bytes_and_refuses_a_delta_larger_than_that():
    dense = [DensePiece("w", (8192,), 0, np.ones(8192, np.float32))]
    chunks = [encode(Delta(DeltaId("m", 1, s, 9, 0, 0), dense=dense), 8192) for s in range(3)]
    size = len(chunks[0][0])
    assembler = Assembler(max_bytes=5 * size)
    for sequence in range(3):  # two parts of each: the oldest goes once six would be held
        assembler.add(chunks[sequence][0])
        assembler.add(chunks[sequence][1])
    assert [key[2] for key in assembler._pending] == [1, 2] and assembler.held <= 5 * size
    with pytest.raises(DeltaFormatError) as refused:
        Assembler(max_bytes=size - 1).add(chunks[0][0])
    assert refused.value.reason == "too_large"
    whole = Assembler(max_bytes=len(chunks[0]) * size)
    assert [d for d in map(whole.add, chunks[0]) if d is not None], "a delta that fits completes"


def code_in_an_expression(program: Path, out: Path, marker: Path) -> None:
    """Writes ``program`` to ``out`` with its first symbolic size's ``expr_str`` made to touch
    ``marker`` too, when evaluated as Python (as ``sympy.sympify`` does)."""
    with zipfile.ZipFile(program) as archive:
        entries = {name: archive.read(name) for name in archive.namelist()}
    (model,) = [name for name in entries if name.endswith("models/model.json")]
    text = entries[model].decode()
    found = re.search(r'"expr_str": "(Symbol\([^"]*\))"', text)
    assert found, "the exported program has a symbolic size"
    payload = json.dumps({"expr_str": f"__import__('pathlib').Path('{marker}').touch() or {found[1]}"})
    entries[model] = text.replace(found[0], payload[1:-1], 1).encode()
    with zipfile.ZipFile(out, "w") as archive:
        for name, data in entries.items():
            archive.writestr(name, data)


def test_delivery_spec_a_base_whose_size_expressions_would_run_code_is_refused_before_loading(tmp_path):
    """``torch.export.load`` hands each ``expr_str`` to ``sympy.sympify``, which evaluates Python."""
    batch = torch.export.Dim("batch", min=2, max=1024)
    program = torch.export.export(torch.nn.Linear(3, 2), (torch.ones(4, 3),), dynamic_shapes={"input": {0: batch}})
    torch.export.save(program, tmp_path / "model.pt2")
    load_program(tmp_path / "model.pt2")  # the grammar takes what torch writes
    code_in_an_expression(tmp_path / "model.pt2", tmp_path / "tampered.pt2", tmp_path / "ran")
    with pytest.raises(UnsafeBase, match="size expression"):
        load_program(tmp_path / "tampered.pt2")
    assert not (tmp_path / "ran").exists(), "loading a base ran code from it"
