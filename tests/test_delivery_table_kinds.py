"""Delivery of the table kinds beyond one feature per table: a feature sharing another's table
(``shares_table_with``) is served from the owner's rows, base and deltas alike; a managed table
(``id_mapping: managed``), whose id space bases and deltas do not carry yet, is refused at start."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from conftest import SCHEMA
from delivery_states import held_out
from streamtrain.decode import AvroBatchDecoder
from streamtrain.delivery.artifact import ServableModel, export_snapshot, read_current
from streamtrain.delivery.deltas import Assembler, Delta
from streamtrain.dev.produce import produce
from streamtrain.source import RawEvent

pytestmark = pytest.mark.integration

RECENT = 8  # recent_cate_ids in tests/worker-small.yaml; it shares cate_id's table here


def delivery_env(root: Path, deltas: Path, every_steps: int) -> dict[str, str]:
    return {
        "STREAMTRAIN_CHECKPOINT__PATH": str(root),
        "STREAMTRAIN_CHECKPOINT__INTERVAL_STEPS": str(every_steps),
        "STREAMTRAIN_CHECKPOINT__INTERVAL_SECONDS": "3600",
        "STREAMTRAIN_CHECKPOINT__KEEP_LAST": "1000",
        "STREAMTRAIN_DELIVERY__ENABLED": "true",
        "STREAMTRAIN_DELIVERY__DIRECTORY": str(deltas),
        "STREAMTRAIN_DELIVERY__DELTA_INTERVAL_STEPS": str(every_steps),
        "STREAMTRAIN_DELIVERY__DELTA_INTERVAL_SECONDS": "3600",
        "STREAMTRAIN_DELIVERY__BASE_INTERVAL_SECONDS": "3600",
    }


def directory_deltas(deltas: Path) -> list[Delta]:
    """Every complete delta in a directory target, in sequence order."""
    assembler = Assembler()
    found = []
    for folder in sorted(deltas.glob("delta-*")):
        assert (folder / "COMPLETE").exists(), f"{folder} is incomplete after a clean stop"
        for part in sorted(folder.glob("part-*")):
            delta = assembler.add(part.read_bytes())
            if delta is not None:
                found.append(delta)
    return sorted(found, key=lambda d: (d.id.base_version, d.id.sequence))


def scores(model: ServableModel, payloads: list[bytes]) -> np.ndarray:
    decoder = AvroBatchDecoder(model.manifest.features, tasks=model.manifest.tasks)
    return model.score(decoder.decode([RawEvent(0, i, p, 0) for i, p in enumerate(payloads)]).batch)


def test_a_shared_table_is_delivered_as_its_owners_rows_and_base_plus_deltas_score_as_the_final_base(
    kafka, topic_name, start_worker, tmp_path
):
    produce(kafka.bootstrap_servers, topic_name, 1500, partitions=2, seed=71, schema_path=SCHEMA)
    env = delivery_env(tmp_path / "snapshots", tmp_path / "deltas", every_steps=2)
    env[f"STREAMTRAIN_FEATURES__TABLES__{RECENT}__SHARES_TABLE_WITH"] = "cate_id"
    worker = start_worker(topic_name, "--until-end", env=env)
    assert worker.wait(timeout=180) == 0, worker.output()[-3000:]

    serving = tmp_path / "snapshots" / "serving"
    final_base = serving / read_current(serving)["path"]  # type: ignore[index]
    # The start's base is exported here: the worker's own may be superseded by the stop's in so short a run.
    start_base = export_snapshot(tmp_path / "snapshots", 0, tmp_path / "start")
    manifest = json.loads((final_base / "manifest.json").read_text())
    assert "recent_cate_ids" not in manifest["parameters"]["tables"] and "cate_id" in manifest["parameters"]["tables"]
    deltas = [d for d in directory_deltas(tmp_path / "deltas") if d.id.base_version == manifest["chain"]]
    assert len(deltas) >= 2 and deltas[-1].id.step == manifest["step"] > 0
    tables = {piece.table for delta in deltas for piece in delta.rows}
    assert "cate_id" in tables and "recent_cate_ids" not in tables

    served = ServableModel(start_base)
    assert served.manifest.raw["step"] == 0
    payloads, records = held_out(500)
    before = scores(served, payloads)
    for delta in deltas:
        served.apply(delta)
    want = scores(ServableModel(final_base), payloads)
    assert np.abs(before - want).max() > 1e-3  # the deltas carried the training
    # Held-out events whose recent categories are only looked up through the shared table: the
    # rows they reach were touched by either feature and must have come with the deltas.
    assert any(r["recent_cate_ids"] for r in records)
    assert np.abs(scores(served, payloads) - want).max() <= 1e-6


def test_delivery_of_a_managed_table_is_refused_at_start_naming_the_field_and_fix(
    kafka, topic_name, start_worker, tmp_path
):
    env = delivery_env(tmp_path / "snapshots", tmp_path / "deltas", every_steps=2)
    env |= {
        "STREAMTRAIN_FEATURES__TABLES__0__ID_MAPPING": "managed",
        "STREAMTRAIN_FEATURES__TABLES__0__ROWS": "1000",
        "STREAMTRAIN_FEATURES__TABLES__0__NUM_EMBEDDINGS": "1000",
    }
    worker = start_worker(topic_name, "--until-end", env=env)
    assert worker.wait(timeout=120) == 2, worker.output()[-3000:]
    output = worker.output()
    assert "features.tables.0.id_mapping: managed (user_id) cannot be delivered yet" in output
    assert "delivery.enabled: false" in output and "id_mapping: hash or modulo" in output
    assert not (tmp_path / "snapshots").exists()  # refused before anything was written
