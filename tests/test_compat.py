"""The compatibility promise (docs/upgrading.md): what a worker of an earlier version left behind
(tests/fixtures/compat/, written by its make.py with that version) this one restores and serves
as it was written: the snapshot's positions and every tensor bit for bit, and the base's scores,
before and after its chain's first delta, as they were recorded. A failure here is a break of the
promise: fix the reader, or ship a tested migration and say so in docs/upgrading.md; never
regenerate the fixtures to make it pass. And each kind carries a format version that a reader
refuses, saying so, when it is newer than it knows. No broker, one in-process rank: seconds."""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml

from fixtures.compat.make import scores, tensor_digests
from streamtrain.checkpoint import FORMAT_VERSION, Checkpointer, verify_snapshot
from streamtrain.config import parse_config
from streamtrain.delivery.artifact import ServableModel
from streamtrain.delivery.deltas import decode_chunk
from streamtrain.delivery.spec import CURRENT, FormatError, current_pointer, read_current
from streamtrain.device import init_distributed
from streamtrain.train import Trainer

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "compat"
EXPECTED = json.loads((FIXTURES / "expected.json").read_text())


def fixture_config(checkpoint_path: Path):
    raw = yaml.safe_load((FIXTURES / "worker.yaml").read_text())
    raw["kafka"]["bootstrap_servers"] = "unused:9092"
    raw["features"]["schema_path"] = str(FIXTURES / "click_event.avsc")
    raw["checkpoint"]["path"] = str(checkpoint_path)
    return parse_config(raw, environ={})


def test_compat_the_snapshot_restores_exactly_its_positions_and_every_tensor(tmp_path):
    recorded = EXPECTED["snapshot"]
    snapshot = FIXTURES / recorded["folder"]
    shutil.copytree(snapshot, tmp_path / "snapshots" / snapshot.name)
    config = fixture_config(tmp_path / "snapshots")
    trainer = Trainer(config, init_distributed())
    checkpointer = Checkpointer(
        config.checkpoint, config, trainer.model, trainer.optimizer, 0, 1, None, id_space=trainer.id_space
    )
    stream = checkpointer.restore()
    assert stream is not None, "the snapshot was not restored"
    assert stream.step == recorded["step"]
    assert stream.next_offsets == {int(p): o for p, o in recorded["next_offsets"].items()}
    assert stream.trained == {int(p): n for p, n in recorded["trained"].items()}
    assert trainer.id_space is not None
    restored = tensor_digests(
        {
            "model": trainer.model.state_dict(),
            "optimizer": trainer.optimizer.state_dict(),
            "id_space": trainer.id_space.state_dict(),
        }
    )
    differ = sorted(
        k for k in recorded["tensors"].keys() | restored.keys() if recorded["tensors"].get(k) != restored.get(k)
    )
    assert not differ, f"tensors not restored as written: {differ[:10]}"


def test_compat_the_base_scores_as_recorded_and_so_does_it_after_the_delta():
    payloads = [base64.b64decode(p) for p in EXPECTED["events"]]
    base, delta = FIXTURES / EXPECTED["base"], FIXTURES / EXPECTED["delta"]
    # float32 arithmetic may round differently on another CPU's vector units, never by more
    for name, deltas in (("base", []), ("base_and_delta", [delta])):
        got, want = np.array(scores(base, deltas, payloads)), np.array(EXPECTED["scores"][name])
        assert got.shape == want.shape and np.abs(got - want).max() <= 1e-6, name
    assert np.abs(np.array(EXPECTED["scores"]["base"]) - EXPECTED["scores"]["base_and_delta"]).max() > 1e-4, (
        "the recorded delta changes no score: it would prove nothing"
    )


def test_compat_each_kind_carries_its_format_version():
    marker = json.loads((FIXTURES / EXPECTED["snapshot"]["folder"] / "streamtrain.json").read_text())
    assert marker["format"] == FORMAT_VERSION
    assert ServableModel(FIXTURES / EXPECTED["base"]).manifest.format == 1
    parts = sorted((FIXTURES / EXPECTED["delta"]).glob("part-*"))
    assert parts and all(decode_chunk(p.read_bytes())[0].format == 1 for p in parts)
    assert json.loads(current_pointer(1, "base-000001"))["format"] == 1


def test_compat_a_newer_format_is_refused_saying_so(tmp_path):
    snapshot = tmp_path / "step-000000010"
    shutil.copytree(FIXTURES / EXPECTED["snapshot"]["folder"], snapshot)
    marker = json.loads((snapshot / "streamtrain.json").read_text())
    (snapshot / "streamtrain.json").write_text(json.dumps({**marker, "format": FORMAT_VERSION + 1}))
    info = verify_snapshot(str(snapshot))
    assert not info.complete
    assert f"written in snapshot format {FORMAT_VERSION + 1} by a newer streamtrain" in str(info.problem)

    (tmp_path / CURRENT).write_text(json.dumps({"format": 2, "version": 1, "path": "base-000001"}))
    with pytest.raises(FormatError, match="delivery format 2; this reader knows format 1 only"):
        read_current(tmp_path)
    (tmp_path / CURRENT).write_text(json.dumps({"version": 1, "path": "base-000001"}))  # before the field: 1
    assert read_current(tmp_path) == {"version": 1, "path": "base-000001"}
