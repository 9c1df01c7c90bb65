"""`streamtrain export`: a snapshot of 1 or 2 real ranks becomes a base that one plain CPU process
loads and scores exactly as the ranks' own sharded forward does, at several batch sizes."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch.distributed as dist

from delivery_states import held_out, ranks_scores, set_delivery, small_config, train_states
from streamtrain.cli import main
from streamtrain.config import parse_config
from streamtrain.decode import AvroBatchDecoder
from streamtrain.delivery.artifact import ServableModel, export_snapshot, read_current
from streamtrain.delivery.deltas import Delta, DeltaId, RowPiece
from streamtrain.source import RawEvent

SIZES = [1, 61, 200]
SHARDED = {
    "user_id": "table_wise",
    "adgroup_id": "table_wise",
    "brand": "table_wise",
    "cate_id": "column_wise",
    "recent_cate_ids": "column_wise",
    "pid": "data_parallel",
}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One rank's snapshot at step 3 (``<root>/step-000000003``), and its scores."""
    root = tmp_path_factory.mktemp("one-rank")
    train_states(root, 1, small_config(), [3], SIZES)
    return root


def served_scores(base, size: int) -> np.ndarray:
    model = ServableModel(base)
    decoder = AvroBatchDecoder(model.features, tasks=model.tasks)
    payloads, _ = held_out(size)
    return model.score(decoder.decode([RawEvent(0, i, p, 0) for i, p in enumerate(payloads)]).batch)


@pytest.mark.parametrize(
    ("world_size", "raw"),
    [(1, small_config()), (2, small_config(SHARDED, tasks=True))],
    ids=["1-rank", "2-ranks-table-and-column-wise-mmoe"],
)
def test_an_exported_snapshot_scores_as_the_ranks_do(tmp_path, request, world_size, raw):
    if dist.is_initialized():  # left by an earlier in-process test: the export must not lean on it
        dist.destroy_process_group()
    if world_size == 1:
        checkpoints = request.getfixturevalue("trained")
    else:
        checkpoints = tmp_path / "checkpoints"
        train_states(checkpoints, world_size, raw, [3], SIZES)
    base = export_snapshot(checkpoints, None, tmp_path / "serving")
    manifest = json.loads((base / "manifest.json").read_text())
    tasks = 2 if "tasks" in raw["model"] else 1
    assert manifest["tasks"] == (["clk", "buy"] if tasks == 2 else ["clk"])
    assert manifest["step"] == 3 and manifest["world_size"] == world_size
    assert manifest["base_version"] == manifest["chain"] == 1 and manifest["delta_sequence"] == 0
    assert manifest["reader_schema"]["name"] == "ClickEvent"
    assert set(manifest["parameters"]["tables"]) == {t["name"] for t in raw["features"]["tables"]}
    assert read_current(tmp_path / "serving") == {"version": 1, "path": base.name}
    for size in SIZES:
        want = ranks_scores(checkpoints, 0, size)
        got = served_scores(base, size)
        assert got.shape == (size, tasks)
        assert np.abs(got - want).max() <= 1e-6, f"batch of {size}"


def test_the_cli_publishes_versions_keeps_k_and_follows_the_snapshots_chain(tmp_path, trained, capsys):
    snapshots = []
    for step in (1, 2, 3):  # copies at several steps: what is under test is which one is exported, and how
        copy = tmp_path / "checkpoints" / f"step-{step:09d}"
        shutil.copytree(trained / "step-000000003", copy)
        marker = json.loads((copy / "streamtrain.json").read_text())
        marker["stream"]["step"] = step
        (copy / "streamtrain.json").write_text(json.dumps(marker))
        snapshots.append(copy)
    out = tmp_path / "serving"

    def export(*args: str) -> str:
        code = main(["export", "--checkpoint", *args, "--out", str(out), "--keep", "2"])
        output = capsys.readouterr()
        assert code == 0, output.err[-3000:]
        return output.out.strip().splitlines()[-1]

    first = export(str(snapshots[0]))  # a snapshot without a delivery entry: a new chain
    set_delivery(snapshots[1], chain=1, next_sequence=5)
    second = export(str(tmp_path / "checkpoints"), "--step", "2")
    third = export(str(snapshots[2]), "--new-chain", "--version", "9")
    manifests = [json.loads((out / name / "manifest.json").read_text()) for name in ("base-000002", "base-000009")]
    assert first.endswith("base-000001") and second.endswith("base-000002") and third.endswith("base-000009")
    assert [(m["chain"], m["delta_sequence"], m["step"]) for m in manifests] == [(1, 5, 2), (9, 0, 3)]
    assert sorted(p.name for p in out.iterdir()) == ["base-000002", "base-000009", "current.json"]
    assert read_current(out) == {"version": 9, "path": "base-000009"}

    assert main(["export", "--checkpoint", str(tmp_path / "checkpoints"), "--step", "7", "--out", str(out)]) == 1
    assert "no complete snapshot at step 7" in capsys.readouterr().err


def test_a_delta_applied_to_a_loaded_base_changes_its_scores_in_place(tmp_path, trained):
    model = ServableModel(export_snapshot(trained, None, tmp_path / "serving"))
    decoder = AvroBatchDecoder(model.features, tasks=model.tasks)
    payloads, _ = held_out(4)
    batch = decoder.decode([RawEvent(0, i, p, 0) for i, p in enumerate(payloads)]).batch
    before = model.score(batch)
    table = model.tables["pid"]
    rows = batch.sparse_features["pid"].values().numpy()
    values = np.full((len(rows), 8), 3.0, dtype=np.float32)
    model.apply(Delta(DeltaId("clicks", 1, 0, 2, 0, 0), rows=[RowPiece("pid", rows, 0, values)]))
    assert np.array_equal(table[rows].detach().numpy(), values)
    assert np.abs(model.score(batch) - before).max() > 1e-4


def test_the_config_a_snapshot_carries_has_no_hosts_or_secrets(tmp_path):
    secret = tmp_path / "password"
    secret.write_text("hunter2")
    raw = small_config()
    raw["kafka"] |= {
        "client_config": {"sasl.username": "trainer"},
        "client_config_files": {"sasl.password": str(secret)},
    }
    record = parse_config(raw, environ={}).model_record()
    text = json.dumps(record)
    assert "unused:9092" not in text and "trainer" not in text and str(secret) not in text
    assert record["kafka"] == {"topic": "clicks"} and record["delivery"] == {"model_id": "clicks"}
    assert set(record) == {"kafka", "features", "model", "delivery"}
