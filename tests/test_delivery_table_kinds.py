"""Delivery of the table kinds beyond one feature per table: a feature sharing another's table
(``shares_table_with``) is served from the owner's rows, base and deltas alike; managed tables
(``id_mapping: managed``) are served through the trainer's map of raw ids to rows, which the base
carries and the deltas keep current, evictions included."""

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
from streamtrain.dev.produce import AvroEncoder, ClickStream, produce
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
        # Room for the stop's base export on a busy machine.
        "STREAMTRAIN_DISTRIBUTED__SHUTDOWN_GRACE_SECONDS": "90",
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
    return score_events(model, [RawEvent(0, i, p, 0) for i, p in enumerate(payloads)])


def score_events(model: ServableModel, events: list[RawEvent]) -> np.ndarray:
    decoder = AvroBatchDecoder(model.features, tasks=model.tasks)
    return model.score(decoder.decode(events).batch)


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
    assert served.manifest.step == 0
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


MANAGED = {
    # user_id: full from the first steps, so rows change hands (capacity evictions, LRU).
    "0__ID_MAPPING": "managed",
    "0__ROWS": "200",
    "0__NUM_EMBEDDINGS": "200",
    "0__EVICTION__POLICY": "lru",
    "0__EVICTION__INTERVAL_STEPS": "4",
    "0__ADMISSION__PROBABILITY": "1",  # every new id at once
    # adgroup_id: rows freed by ttl without being looked up again, and ids that wait for admission.
    "1__ID_MAPPING": "managed",
    "1__ROWS": "300",
    "1__NUM_EMBEDDINGS": "300",
    "1__EVICTION__POLICY": "ttl",
    "1__EVICTION__TTL_STEPS": "3",
    "1__EVICTION__INTERVAL_STEPS": "2",
    "1__ADMISSION__MIN_COUNT": "2",
}


def test_managed_tables_are_served_with_the_trainers_id_map_through_base_and_deltas(
    kafka, topic_name, start_worker, tmp_path
):
    # Enough for at least 3 deltas however the backlog is cut: 2,000 events made 2 when every
    # batch came full (256 events, 4 steps a rank) and 3 only when some were cut by time.
    produce(kafka.bootstrap_servers, topic_name, 4000, partitions=2, seed=72, schema_path=SCHEMA)
    env = delivery_env(tmp_path / "snapshots", tmp_path / "deltas", every_steps=2)
    env |= {f"STREAMTRAIN_FEATURES__TABLES__{key}": value for key, value in MANAGED.items()}
    worker = start_worker(topic_name, "--until-end", env=env)
    assert worker.wait(timeout=180) == 0, worker.output()[-3000:]

    serving = tmp_path / "snapshots" / "serving"
    final_base = serving / read_current(serving)["path"]  # type: ignore[index]
    final = ServableModel(final_base)
    assert set(final.id_maps) == {"user_id", "adgroup_id"}
    deltas = [d for d in directory_deltas(tmp_path / "deltas") if d.id.base_version == final.manifest.chain]
    assert len(deltas) >= 3 and deltas[-1].id.step == final.manifest.step > 0
    evicted = {p.table for d in deltas[1:] for p in d.ids if p.evicted and len(p.rows)}
    assert evicted == {"user_id", "adgroup_id"}, "no eviction between deltas: the test proves nothing"

    served = ServableModel(export_snapshot(tmp_path / "snapshots", 0, tmp_path / "start"))
    for delta in deltas:
        served.apply(delta)
    for table, want in final.id_maps.items():
        assert served.id_maps[table].row_of == want.row_of, f"{table}: the server maps ids unlike the trainer"
    # Held-out events, and events of the trained stream's seed, whose popular ids hold rows.
    held = [RawEvent(0, i, p, 0) for i, p in enumerate(held_out(400)[0])]
    encoder = AvroEncoder(SCHEMA)
    trained = [RawEvent(0, i, encoder.encode(r), 0) for i, r in enumerate(ClickStream(72, 0).chunk(400).records)]
    for events in (held, trained):
        got, want_scores = (score_events(m, events) for m in (served, final))
        assert np.abs(got - want_scores).max() <= 1e-6
    decoder = AvroBatchDecoder(final.features, tasks=final.tasks)
    users = decoder.decode(trained).batch.sparse_features["user_id"].values()
    rows = final.id_maps["user_id"].rows(users)
    assert (rows != final.id_maps["user_id"].unknown_row).any()  # served ids read their own rows
