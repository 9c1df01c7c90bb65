"""Managed ids on the real broker with real worker ranks: the id-space metrics are served, and
every event trains exactly once across SIGKILLs with eviction and admission active, the ranks of
every other trial mapping one batch ahead (``batching.map_ahead``); the survivor
restores the 2-rank snapshots on 1 rank, and the map in each snapshot is that of the steps it
holds, with no id in two rows.

``STREAMTRAIN_TEST_IDSPACE_KILL_TRIALS`` sets the number of kills (default 2)."""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch
import yaml
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from conftest import SCHEMA, SMALL_CONFIG, end_offsets
from streamtrain.checkpoint import list_snapshots
from streamtrain.dev.produce import produce
from streamtrain.idspace import whole_map
from test_checkpoint import final_stream

pytestmark = pytest.mark.integration

PARTITIONS = 4
ROWS = {"user_id": 400, "adgroup_id": 300}
BUCKETS = {"user_id": 4, "adgroup_id": 3}


def managed_config(path: Path) -> Path:
    raw = yaml.safe_load(SMALL_CONFIG.read_text())
    for table in raw["features"]["tables"]:
        if table["name"] in ROWS:
            del table["num_embeddings"]
            table.update(id_mapping="managed", rows=ROWS[table["name"]], buckets=BUCKETS[table["name"]])
    user, ad = raw["features"]["tables"][:2]
    user["eviction"] = {"policy": "lru", "interval_steps": 5}
    user["admission"] = {"probability": 1}  # every new id at once; the ad table waits for a second sighting
    ad["eviction"] = {"policy": "ttl", "ttl_steps": 10, "interval_steps": 5}
    ad["admission"] = {"min_count": 2}
    path.write_text(yaml.safe_dump(raw))
    return path


def per_table(samples: dict[str, float], metric: str, table: str) -> float:
    return sum(v for k, v in samples.items() if k.startswith(metric + "{") and f'table="{table}"' in k)


def test_exactly_once_across_sigkills_with_eviction_active_and_a_restore_on_fewer_ranks(
    kafka, topic_name, start_ranks, start_worker, live_producer, tmp_path
):
    config = managed_config(tmp_path / "managed.yaml")
    root = tmp_path / "snapshots"
    env = {
        "STREAMTRAIN_CHECKPOINT__PATH": str(root),
        "STREAMTRAIN_CHECKPOINT__INTERVAL_STEPS": "3",
        "STREAMTRAIN_DISTRIBUTED__TIMEOUT_SECONDS": "10",
    }
    trials_wanted = int(os.environ.get("STREAMTRAIN_TEST_IDSPACE_KILL_TRIALS", "2"))
    produce(kafka.bootstrap_servers, topic_name, 200, partitions=PARTITIONS, seed=80, schema_path=SCHEMA)
    # A live stream while the ranks are killed, slow enough for one survivor to catch up with.
    producer = live_producer(kafka.bootstrap_servers, topic_name, 500 * 60 * trials_wanted, 500, "--seed", "81")
    rng = random.Random(99)
    try:
        for trial in range(trials_wanted):
            # every other trial maps one batch ahead (the cuda default; the CPU's is off): the survivor
            # restores snapshots that ranks wrote both ways
            ahead = {"STREAMTRAIN_BATCHING__MAP_AHEAD": "true" if trial % 2 == 0 else "false"}
            ranks = start_ranks(topic_name, 2, env=env | ahead, config=config)
            ranks[0].wait_for(
                lambda ranks=ranks: all(
                    r.total("streamtrain_idspace_evictions_total") > 0 and r.total("streamtrain_batches_total") > 5
                    for r in ranks
                ),
                timeout=120,
                what="both ranks training and evicting",
            )
            if trial == 0:
                samples = [r.scrape() for r in ranks]
                for name, rows in ROWS.items():
                    # each rank holds its buckets' share of the map, and reports it
                    assert sum(per_table(s, "streamtrain_idspace_rows", name) for s in samples) == rows - 1
                    for s in samples:
                        assert 0 < per_table(s, "streamtrain_idspace_rows", name) < rows - 1
                        assert per_table(s, "streamtrain_idspace_rows_in_use", name) > 0
                        assert per_table(s, "streamtrain_idspace_admissions_total", name) > 0
                        assert per_table(s, "streamtrain_idspace_memory_bytes", name) > 0
                assert sum(per_table(s, "streamtrain_idspace_evictions_total", "user_id") for s in samples) > 0
                assert all(s.get("streamtrain_idspace_step_seconds_count", 0) > 5 for s in samples)
                # two ranks exchange each step's ids, and time the exchanges' all-to-alls
                assert all(s.get("streamtrain_idspace_exchange_seconds_count", 0) > 5 for s in samples)
                assert all(s["streamtrain_idspace_exchange_seconds_sum"] > 0 for s in samples)
                assert sum(per_table(s, "streamtrain_idspace_unknown_lookups_total", "adgroup_id") for s in samples) > 0
            time.sleep(rng.uniform(0.0, 2.0))
            victim = rng.choice(["rank 0", "rank 1", "all"])
            for rank in ranks if victim == "all" else [ranks[int(victim[-1])]]:
                rank.signal(signal.SIGKILL)
            assert all(code != 0 for code in [r.wait(timeout=60) for r in ranks]), f"trial {trial}"
            print(f"kill trial {trial + 1}: SIGKILL to {victim}")
    finally:
        producer.stop(timeout=120)
    produced = end_offsets(kafka, topic_name)
    assert sum(produced.values()) == 200 + producer.produced()

    # one rank takes over the 2-rank snapshots: it loads every bucket
    catch_up = {"STREAMTRAIN_BATCHING__BATCH_SIZE": "1024", "STREAMTRAIN_CHECKPOINT__INTERVAL_STEPS": "10"}
    survivor = start_worker(topic_name, "--until-end", config=config, env=env | catch_up)
    assert survivor.wait(timeout=300) == 0, survivor.output()[-3000:]
    stream = final_stream(root)["stream"]
    assert {int(p): n for p, n in stream["trained"].items()} == produced
    assert {int(p): o for p, o in stream["next_offsets"].items()} == produced

    for snapshot in (s for s in list_snapshots(str(root)) if s.complete):
        flat = tmp_path / f"{snapshot.step}.pt"
        dcp_to_torch_save(snapshot.path, flat)
        id_space = torch.load(flat, weights_only=False)["id_space"]
        # the map took exactly the steps whose weights and positions the snapshot holds
        assert int(id_space["step"]) == snapshot.metadata["stream"]["step"]
        for name in ROWS:
            ids, in_use = whole_map(id_space[name])
            assert in_use.numel() == ROWS[name] - 1, f"{snapshot.path}: {name}'s buckets are not all there"
            assert ids[in_use].unique().numel() == int(in_use.sum()), f"{snapshot.path}: an id of {name} in two rows"
