"""Managed ids (streamtrain/idspace.py): the config and the map's rules first, then the invariants on
real gloo ranks training through the pipeline: collision-free, rank-consistent, fresh rows for each
sparse optimizer, the map of the trained batches in the snapshot, and a restore at another world
size that maps as the uninterrupted run did. The SIGKILL trial on the real broker is in
tests/test_idspace_faults.py."""

from __future__ import annotations

import copy
import mmap
import threading
from collections import defaultdict

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
import yaml
from prometheus_client import CollectorRegistry
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from conftest import REPO, SCHEMA, join_as_spawned_rank, leave_spawned_rank
from streamtrain.checkpoint import Checkpointer, CheckpointError, StreamState
from streamtrain.config import AdmissionConfig, ConfigError, TableConfig, parse_config
from streamtrain.decode import AvroBatchDecoder, ClickBatch
from streamtrain.delivery.publisher import table_keys
from streamtrain.dev.kafka import free_port
from streamtrain.dev.produce import AvroEncoder, ClickStream, encoded_events
from streamtrain.device import gloo_group, init_distributed
from streamtrain.idspace import (
    MIN_SLICE_IDS,
    IdMapping,
    IdSpace,
    TableArrays,
    TableIds,
    TableStep,
    Undo,
    bucket_start,
    whole_map,
)
from streamtrain.lockstep import PIPELINE_LOOKAHEAD
from streamtrain.metrics import IdSpaceMetrics
from streamtrain.source import RawEvent
from streamtrain.threads import IDAHEAD, IDMAP
from streamtrain.train import Trainer

# Small tables for the stream's Zipf ids (a million users), so rows are evicted from the first steps;
# split into buckets that 2 and 3 ranks share unevenly (din's history table in 2: at 3 ranks, one
# rank owns none of them).
ROWS = {"user_id": 200, "adgroup_id": 300}
BUCKETS = {"user_id": 4, "adgroup_id": 3, "recent_cate_ids": 2}
# Every new id gets a row at its first sighting (the default admission waits for a second).
EVERY_ID = {"probability": 1}
GLOBAL_BATCH = 256
STEPS = 12


def managed_raw(
    optimizer: str = "row_wise_adagrad", sharding: dict[str, str] | None = None, rows: dict[str, int] = ROWS
) -> dict:
    raw = yaml.safe_load((REPO / "tests" / "worker-small.yaml").read_text())
    raw["kafka"] = {"bootstrap_servers": "unused:9092", "topic": "unused"}
    raw["model"]["sparse_optimizer"] = optimizer
    for table in raw["features"]["tables"]:
        if table["name"] in rows:
            del table["num_embeddings"]
            table.update(
                id_mapping="managed",
                rows=rows[table["name"]],
                buckets=BUCKETS[table["name"]],
                eviction={"policy": "lru", "interval_steps": 4},
                admission=EVERY_ID,
            )
        if sharding and table["name"] in sharding:
            table["sharding_types"] = [sharding[table["name"]]]
    if "adgroup_id" in rows:  # ids seen twice before they get a row: some lookups read the unknown row
        raw["features"]["tables"][1]["admission"] = {"min_count": 2}
    return raw


# --- config -------------------------------------------------------------------------------------


def table(**fields) -> TableConfig:
    return TableConfig.model_validate({"name": "t", "field": "f", "embedding_dim": 4, **fields})


def test_a_managed_table_is_sized_by_rows():
    managed = table(id_mapping="managed", rows=1000)
    assert managed.num_embeddings == 1000 and managed.live_rows() == 999
    assert table(id_mapping="managed", rows=1000, num_embeddings=1000).num_embeddings == 1000


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"id_mapping": "managed"}, "id_mapping managed needs rows"),
        ({"id_mapping": "managed", "rows": 100, "num_embeddings": 50}, "num_embeddings 50 disagrees with rows 100"),
        ({"num_embeddings": 10, "rows": 10}, "rows is only read with id_mapping: managed"),
        ({"id_mapping": "managed", "rows": 10, "eviction": {"policy": "ttl"}}, "policy ttl needs exactly one horizon"),
        (
            {"id_mapping": "managed", "rows": 10, "eviction": {"policy": "lru", "ttl_steps": 5}},
            "ttl_steps is only read with policy: ttl",
        ),
        ({"id_mapping": "managed", "rows": 10, "admission": {}}, "set exactly one of min_count"),
        ({"id_mapping": "managed", "rows": 10, "admission": {"min_count": 70_000}}, "less than or equal to 65535"),
        (
            {"id_mapping": "managed", "rows": 10, "sharding_types": ["data_parallel"]},
            "a managed table cannot be data_parallel",
        ),
    ],
)
def test_bad_managed_tables_are_refused_naming_the_field_and_fix(fields, message):
    raw = managed_raw()
    raw["features"]["tables"][0] = {"name": "user_id", "field": "user_id", "embedding_dim": 8, **fields}
    with pytest.raises(ConfigError, match=r"features\.tables\.0") as error:
        parse_config(raw, environ={})
    assert message in str(error.value)


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_managed_table_is_planned_table_wise_beside_the_hash_tables_not_in_a_sharding_of_its_own(world_size):
    # Denied data_parallel and allowed column_wise, the planner put these 1,021-row tables column_wise
    # (one shard at 16 columns): a sharding of their own, with its own dists and kernel, a slower step.
    from streamtrain.train import plan_sharding, topology

    raw = yaml.safe_load((REPO / "deploy" / "worker.yaml").read_text())
    for spec in raw["features"]["tables"]:
        if spec["name"] in ("user_id", "adgroup_id"):
            del spec["num_embeddings"]
            spec.update(id_mapping="managed", rows=1021)
    config = parse_config(raw)
    planned = topology(config, world_size, "cpu", dry_run=True)
    _model, plan = plan_sharding(config, world_size, "cpu", planner_topology=planned)
    types = {name: ps.sharding_type for tables in plan.plan.values() for name, ps in tables.items()}
    assert types["user_id"] == types["adgroup_id"] == types["cate_id"] == "table_wise"


def test_the_decoder_hands_managed_tables_the_raw_ids():
    managed = parse_config(managed_raw(), environ={})
    wide = managed_raw(rows={})
    for t in wide["features"]["tables"][:2]:
        t.update(num_embeddings=2**40, id_mapping="modulo")  # modulo a bound above every id: the id itself
    plain = parse_config(wide, environ={})
    events = [RawEvent(0, i, v, 0) for i, (_k, v, _p, _c) in enumerate(encoded_events(ClickStream(3, 0), ENCODER, 300))]
    ours, theirs = (AvroBatchDecoder(c.features).decode(events).batch.sparse_features for c in (managed, plain))
    for key in ROWS:
        assert torch.equal(ours[key].values(), theirs[key].values())
        assert int(ours[key].values().max()) >= ROWS[key]  # raw ids, not rows


def test_a_translated_batch_keeps_the_decoders_length_caches():
    """The pipeline reads each KJT's lengths per key: the decoder gives them (no sum and .tolist() a
    step, which is a sync on a GPU), and replacing the raw ids by rows keeps them."""
    config = parse_config(managed_raw(), environ={})
    events = [RawEvent(0, i, v, 0) for i, (_k, v, _p, _c) in enumerate(encoded_events(ClickStream(3, 0), ENCODER, 300))]
    batch = AvroBatchDecoder(config.features).decode(events).batch
    translated = IdSpace(config.features, 1, None).translate(batch).sparse_features
    assert translated._length_per_key is not None and translated._offset_per_key is not None
    summed = KeyedJaggedTensor(keys=translated.keys(), values=translated.values(), lengths=translated.lengths())
    assert translated._length_per_key == summed.length_per_key()
    assert translated._offset_per_key == summed.offset_per_key()


ENCODER = AvroEncoder(SCHEMA)


# --- the map's rules ------------------------------------------------------------------------------


def ids_table(rows: int = 4, admission: dict = EVERY_ID, **fields) -> TableIds:
    return TableIds(table(id_mapping="managed", rows=rows, admission=admission, **fields))


def map_once(ids: TableIds, values: list[int], step: int, now_ms: int = 0) -> TableStep:
    given = torch.tensor(values, dtype=torch.int64)
    result = ids.update(given, step, now_ms)
    assert_collision_free(ids, given, result)
    return result


def row_of(ids: TableIds, raw_id: int) -> int:
    return int(ids.find(np.array([raw_id], dtype=np.int64))[0])


def assert_collision_free(ids: TableIds, given: torch.Tensor, step: TableStep) -> None:
    rows, raw = ids.live()
    assert len(set(raw.tolist())) == len(raw), "a live id holds two rows"
    assert ids.find(raw.numpy()).tolist() == rows.tolist(), "the index disagrees with the rows"
    assert len(ids.index) == ids.occupied == len(rows)
    gone = torch.cat([step.evicted.ids, step.expired.ids])
    assert (ids.find(gone[~torch.isin(gone, raw)].numpy()) == -1).all(), "an evicted id still finds a row"
    holders: dict[int, set[int]] = defaultdict(set)
    for raw_id, row in zip(given.tolist(), step.rows.tolist(), strict=True):
        holders[row].add(raw_id)
        if row != ids.unknown_row:
            assert int(ids.arrays.ids[row]) == raw_id
    assert all(len(h) == 1 for row, h in holders.items() if row != ids.unknown_row), "two ids share a row"
    assert torch.equal(step.unknown, step.rows == ids.unknown_row)


def test_lru_evicts_the_id_seen_longest_ago():
    ids = ids_table(rows=4)  # three live rows and the unknown row
    for step, values in enumerate([[1], [2], [3], [1]], start=1):
        map_once(ids, values, step)
    evicted = map_once(ids, [4], 5).evicted
    assert evicted.ids.tolist() == [2]
    assert row_of(ids, 4) == int(evicted.rows[0])


def test_lfu_evicts_the_id_seen_least_often():
    ids = ids_table(rows=4, eviction={"policy": "lfu"})
    for step, values in enumerate([[1, 1, 1], [2], [3, 3]], start=1):
        map_once(ids, values, step)
    assert map_once(ids, [4], 4).evicted.ids.tolist() == [2]


def test_ttl_frees_the_rows_of_ids_unseen_past_the_horizon_in_steps_or_event_time():
    ids = ids_table(rows=10, eviction={"policy": "ttl", "ttl_steps": 2, "interval_steps": 1})
    expired = [map_once(ids, values, step).expired.ids.tolist() for step, values in enumerate([[1], [2], [2], [2]], 1)]
    assert expired == [[], [], [], [1]] and row_of(ids, 1) == -1
    timed = ids_table(rows=10, eviction={"policy": "ttl", "ttl_seconds": 10, "interval_steps": 1})
    map_once(timed, [1], 1, now_ms=0)
    assert map_once(timed, [2], 2, now_ms=9_000).expired.ids.tolist() == []
    assert map_once(timed, [2], 3, now_ms=10_001).expired.ids.tolist() == [1]


def test_min_count_admission_reads_the_unknown_row_until_the_count_is_reached():
    ids = ids_table(rows=10, admission={"min_count": 2})
    assert map_once(ids, [7, 8, 8], 1).rows.tolist() == [ids.unknown_row, 0, 0]
    assert map_once(ids, [7], 2).rows.tolist() == [1]


def test_a_managed_table_waits_for_an_ids_second_sighting_by_default():
    assert table(id_mapping="managed", rows=10).admission == AdmissionConfig(min_count=2)
    assert table(id_mapping="managed", rows=10, admission=EVERY_ID).admission == AdmissionConfig(probability=1)


def test_ids_seen_once_do_not_fill_the_admission_sketch_however_long_the_interval():
    """A tail of ids seen once, far more per interval than the sketch has cells, still waits: the
    sketch halves once its cells hold a sighting each on average (and the undo takes that back)."""
    section = {"eviction": {"policy": "lru", "interval_steps": 10_000}, "admission": {"min_count": 2}}
    tables = [table(id_mapping="managed", rows=1_000, **section)]
    ahead, behind = IdMapping(tables), IdMapping(tables)
    # 10 ids seen every step amid 300 new ids a step; the sketch has 2 x 2,048 cells, and halves
    # every 5 steps or so (at step 57 among others). Halving only by interval, 94% of them get rows.
    recurring = np.arange(10)
    steps = [torch.from_numpy(np.concatenate((recurring, 1_000 + 300 * at + np.arange(300)))) for at in range(58)]
    results = [ahead.update({"t": values}, now_ms=0) for values in steps]
    one_offs_admitted = sum(int((~r["t"].unknown[recurring.size :]).sum()) for r in results[10:])
    assert one_offs_admitted < 0.4 * 48 * 300, one_offs_admitted
    assert (ahead.tables["t"].find(recurring) >= 0).all()
    for values in steps[:-2]:
        behind.update({"t": values}, now_ms=0)
    halvings = [isinstance(rows, slice) for r in results[-2:] for _name, rows, _old in r["t"].undo.writes]
    assert any(halvings), "no halving in the steps in flight: nothing to take back"
    assert_same_state(ahead.state_dict(results[-2:]), behind.state_dict())


def test_probability_admission_admits_that_share_the_same_way_every_time():
    draws = [ids_table(rows=20_001, admission={"probability": 0.3}) for _ in range(2)]
    values = list(range(10_000, 30_000))
    first, second = (map_once(ids, values, 1) for ids in draws)
    assert torch.equal(first.rows, second.rows)
    assert 0.28 < float((~first.unknown).float().mean()) < 0.32


def test_more_new_ids_than_rows_in_one_step_read_the_unknown_row_and_live_ids_keep_theirs():
    ids = ids_table(rows=4)
    map_once(ids, [1, 2], 1)
    result = map_once(ids, [1, 2, *range(10, 20)], 2)
    assert result.rows[:2].tolist() == [row_of(ids, 1), row_of(ids, 2)]  # seen this step: never a victim
    assert int((~result.unknown).sum()) == 3 and len(result.evicted) == 0


@pytest.mark.parametrize("policy", ["lru", "lfu", "ttl"])
def test_no_two_ids_share_a_row_under_heavy_churn(policy):
    rng = np.random.default_rng(7)
    eviction = {"policy": policy, "interval_steps": 3} | ({"ttl_steps": 5} if policy == "ttl" else {})
    ids = ids_table(rows=50, eviction=eviction, admission={"min_count": 2})
    evicted = 0
    for step in range(1, 200):
        values = (rng.zipf(1.3, size=int(rng.integers(0, 120))) % 5000).tolist()
        result = map_once(ids, values, step, now_ms=step * 1000)
        evicted += len(result.evicted) + len(result.expired)
    assert evicted > 100 and ids.occupied > 0


@pytest.mark.parametrize(
    "section",
    [
        {"eviction": {"policy": "lfu", "interval_steps": 2}, "admission": {"min_count": 2}},
        {"eviction": {"policy": "ttl", "ttl_steps": 3, "interval_steps": 2}},
        {"eviction": {"policy": "ttl", "ttl_seconds": 1, "interval_steps": 1}, "admission": {"min_count": 2}},
    ],
)
def test_the_map_at_the_cut_undoes_the_steps_in_flight_across_halvings_and_expiry(section):
    """One map kept ahead, less the undo of its newest steps, is the map a second one that stopped
    there holds: every write, halving (lfu counts, the sketch) and expiry is taken back exactly."""
    rng = np.random.default_rng(3)
    tables = [table(id_mapping="managed", rows=30, **section)]
    ahead, behind = IdMapping(tables), IdMapping(tables)
    # a popular head (zipf) and a churning tail (uniform over many ids)
    steps = [torch.from_numpy(np.concatenate((rng.zipf(1.5, 30) % 300, rng.integers(0, 3000, 30)))) for _ in range(60)]
    in_flight = [ahead.update({"t": values}, now_ms=700 * at) for at, values in enumerate(steps, 1)][-2:]
    for at, values in enumerate(steps[:-2], 1):
        behind.update({"t": values}, now_ms=700 * at)
    assert sum(len(s["t"].evicted) + len(s["t"].expired) for s in in_flight) > 0
    assert_same_state(ahead.state_dict(in_flight), behind.state_dict())


def test_the_cut_restores_sketch_cells_that_several_waiting_ids_of_a_step_share():
    """A step of more new ids than its bucket's sketch has cells per hash row counts several ids in
    one cell (pigeonhole); taking it back leaves each cell as it was before the step."""
    tables = [table(id_mapping="managed", rows=30, admission={"min_count": 3})]
    ahead, behind = IdMapping(tables), IdMapping(tables)
    earlier = [torch.arange(100) % 40, torch.arange(100) % 70]
    for at, values in enumerate(earlier, 1):
        ahead.update({"t": values}, now_ms=at)
        behind.update({"t": values}, now_ms=at)
    crowded = ahead.update({"t": torch.arange(1_000, 1_000 + 3 * ahead.tables["t"].sketch_width)}, now_ms=3)
    assert_same_state(ahead.state_dict([crowded]), behind.state_dict())


def test_the_cut_restores_sketch_cells_numbered_past_2_31():
    """A sketch of 2**31 cells or more numbers them past int32 (its two hash rows, flattened): the undo
    keeps the cells' numbers as they are. The cells are an anonymous mapping, made only where touched."""
    cells = 2**31 + 16
    sketch = np.frombuffer(mmap.mmap(-1, 2 * cells), dtype=np.uint16).reshape(2, cells // 2)
    arrays = TableArrays(np.zeros(1, np.int64), np.zeros(1, np.bool_), None, None, None, sketch)
    far = np.array([2**31 + 5], dtype=np.int64)
    undo = Undo()
    undo.write(arrays, "sketch", far)[far] = 7
    undo.undo(arrays)
    flat = arrays.flat("sketch")
    assert flat[2**31 + 5] == 0 and flat[2**31 + 5 - 2**32 + cells] == 0  # not written back elsewhere


def test_the_maps_radix_sort_orders_signed_ids_as_numpys_stable_sort():
    """``sort_order`` (numba's own sorts take about ten times numpy's): the same order, ties in their
    order, for ids of either sign, and none or one."""
    from streamtrain.idstep import sort_order

    rng = np.random.default_rng(3)
    for n in (0, 1, 7, 3_000):
        for keys in (
            rng.integers(np.iinfo(np.int64).min, np.iinfo(np.int64).max, n, dtype=np.int64),
            rng.integers(-5, 5, n).astype(np.int64),  # ties, and bytes every key shares
        ):
            assert np.array_equal(sort_order(keys), np.argsort(keys, kind="stable"))


def test_a_large_step_mapped_on_several_threads_maps_as_one_thread_does():
    """Lookups and sketch counts of a step with over MIN_SLICE_IDS ids a thread go to helper threads,
    the sketch's by whole buckets: the rows, the map, and the map at the cut (each sketch write
    undone) are one thread's, and the helpers did run."""
    rng = np.random.default_rng(5)
    tables = [table(id_mapping="managed", rows=8_000, buckets=9, admission={"min_count": 2})]
    one, three = IdMapping(tables), IdMapping(tables, threads=3)
    # a head that recurs and a tail over many ids: over 2 x MIN_SLICE_IDS distinct, mostly waiting
    size = 3 * MIN_SLICE_IDS + 5
    steps = [
        torch.from_numpy(np.concatenate((rng.zipf(1.2, size // 3), rng.integers(0, 200_000, size - size // 3))))
        for _ in range(8)
    ]
    evicted = 0
    for at, values in enumerate(steps, 1):
        alone, shared = one.update({"t": values}, now_ms=at), three.update({"t": values}, now_ms=at)
        assert torch.equal(alone["t"].rows, shared["t"].rows)
        evicted += len(alone["t"].evicted)
    assert evicted > 10_000  # the table filled: every step admits and evicts
    assert_same_state(three.state_dict([shared]), one.state_dict([alone]))
    assert_same_state(three.state_dict(), one.state_dict())
    assert any(t.name.startswith(IDMAP) for t in threading.enumerate()), "no helper thread ran"


def test_the_cut_tells_deltas_each_rows_raw_id_and_what_was_evicted_since_a_step():
    config = parse_config(managed_raw(rows={"user_id": 40}), environ={})
    decoder = AvroBatchDecoder(config.features)
    id_space = IdSpace(config.features, 1, None)
    steps = global_batches(4)
    for events in steps[:3]:  # mapped ahead of training; the cut is at the first two
        id_space.translate(decoder.decode(events).batch)
    for _ in range(2):
        id_space.before_forward()
        id_space.trained()
    assert id_space.step == 2
    assert_same_state(id_space.state_dict(), oracle(steps[:2], {"user_id": 40}))
    rows, raw_ids = id_space.raw_ids("user_id")
    at_cut = id_space.state_dict()["user_id"]
    assert rows.tolist() == list(range(39)) and raw_ids.tolist() == [int(whole_map(at_cut)[0][r]) for r in rows]
    since_first, since_start = id_space.evicted_since("user_id", 1), id_space.evicted_since("user_id", 0)
    assert since_first is not None and since_start is not None
    assert 0 < len(since_first) <= len(since_start)  # step 2 evicted; step 1 filled free rows
    assert not set(since_first.ids.tolist()) & set(raw_ids.tolist())  # evicted, and not back
    assert len(id_space.evicted_since("user_id", 2)) == 0
    at_cut = id_space.state_dict()
    id_space.in_flight.clear()
    id_space.load_state_dict(at_cut)  # as a restore does
    assert id_space.step == 2
    assert id_space.evicted_since("user_id", 1) is None  # the log starts afresh at the cut
    assert len(id_space.evicted_since("user_id", 2)) == 0


def test_the_id_space_metrics_count_each_step_and_read_the_map_when_scraped():
    """Counters add each step's admissions, evictions and unknown lookups; the rows in use and the
    memory (the undo of the steps in flight included) are read from the map when scraped."""
    config = parse_config(managed_raw(rows={"user_id": 40}), environ={})
    decoder = AvroBatchDecoder(config.features)
    registry = CollectorRegistry()
    id_space = IdSpace(config.features, 1, None, IdSpaceMetrics(registry))
    table = id_space.mapping.tables["user_id"]

    def sample(name: str, **labels: str) -> float:
        value = registry.get_sample_value(name, {"table": "user_id", **labels})
        assert value is not None, name
        return value

    admitted = evicted = unknown = 0
    for events in global_batches(3):
        batch = id_space.translate(decoder.decode(events).batch)
        step = id_space.in_flight[-1].steps["user_id"]
        admitted, evicted = admitted + len(step.assigned), evicted + len(step.evicted)
        user_rows = batch.sparse_features["user_id"].values()
        unknown += int((user_rows == table.unknown_row).sum())
    assert evicted > 0 and unknown > 0  # 40 rows, so the steps evict, and waiting ids read the unknown row
    assert sample("streamtrain_idspace_admissions_total") == admitted
    assert sample("streamtrain_idspace_evictions_total", reason="capacity") == evicted
    assert sample("streamtrain_idspace_evictions_total", reason="ttl") == 0
    assert sample("streamtrain_idspace_unknown_lookups_total") == unknown
    assert sample("streamtrain_idspace_rows_in_use") == table.occupied > 0
    in_flight = sample("streamtrain_idspace_memory_bytes")
    assert in_flight > table.memory_bytes()
    for _ in range(3):
        id_space.before_forward()
        id_space.trained()
    assert sample("streamtrain_idspace_memory_bytes") == table.memory_bytes() < in_flight  # no step in flight
    assert registry.get_sample_value("streamtrain_idspace_step_seconds_count") == 3
    assert registry.get_sample_value("streamtrain_idspace_exchange_seconds_count") == 0  # one rank exchanges nothing


# --- real ranks -----------------------------------------------------------------------------------


def global_batches(steps: int = STEPS) -> list[list[RawEvent]]:
    events = [
        RawEvent(0, i, value, 0)
        for i, (_k, value, _p, _c) in enumerate(encoded_events(ClickStream(11, 0), ENCODER, GLOBAL_BATCH * steps))
    ]
    return [events[i : i + GLOBAL_BATCH] for i in range(0, len(events), GLOBAL_BATCH)]


def rank_batches(decoder: AvroBatchDecoder, rank: int, world_size: int, steps: list[list[RawEvent]]) -> list:
    """Each step's events dealt over the ranks; at step 3, rank 1 has none (an idle partition)."""
    out = []
    for number, events in enumerate(steps):
        mine = [] if (world_size > 1 and rank == 1 and number == 3) else events[rank::world_size]
        if world_size > 1 and rank == 0 and number == 3:
            mine = events[0::world_size] + events[1::world_size]  # rank 1's too
        out.append(decoder.decode(mine).batch.in_global_step(len(events), world_size))
    return out


def _consistency_rank(rank: int, world_size: int, port: int, out: str, optimizer: str, architecture: str) -> None:
    join_as_spawned_rank(rank, world_size, port)
    raw = managed_raw(optimizer, {"user_id": "column_wise", "adgroup_id": "table_wise"}, MANAGED_UNDER[architecture])
    raw["model"]["architecture"] = architecture
    config = parse_config(raw, environ={})
    trainer = Trainer(config, init_distributed())
    id_space = trainer.id_space
    assert id_space is not None and id_space.resetter is not None
    resetter = id_space.resetter
    checked = {"rows": 0, "state_was_set": 0}
    forward = id_space.before_forward

    def forward_after_checking_the_reset() -> None:
        mapped = id_space.to_reset[0]
        before = {
            name: [(shard.weights.clone(), [s.clone() for s in shard.states]) for shard in resetter.shards[name]]
            for name in resetter.shards
        }
        forward()  # gathers the fresh rows of the stream's last batch, which no later step carried
        assert mapped.fresh is not None
        for name, rows in mapped.fresh.items():
            fresh = resetter.fresh_weights(name, rows, mapped.step)
            for shard, (old_weights, old_states) in zip(resetter.shards[name], before[name], strict=True):
                local_rows, local_cols = shard.weights.shape
                mine = (rows >= shard.row_offset) & (rows < shard.row_offset + local_rows)
                local = rows[mine] - shard.row_offset
                expected = fresh[mine][:, shard.col_offset : shard.col_offset + local_cols]
                assert torch.equal(shard.weights[local], expected), name
                assert all(bool((s[local] == 0).all()) for s in shard.states), name
                others = torch.ones(local_rows, dtype=torch.bool)
                others[local] = False
                assert torch.equal(shard.weights[others], old_weights[others]), "a reset touched another row"
                checked["rows"] += int(local.numel())
                # rows an earlier id trained: the evictions this test is about
                trained = torch.zeros(int(local.numel()), dtype=torch.bool)
                for state in old_states:
                    trained |= (state[local].reshape(int(local.numel()), -1) != 0).any(dim=1)
                checked["state_was_set"] += int(trained.sum())

    id_space.before_forward = forward_after_checking_the_reset  # type: ignore[method-assign]
    decoder = AvroBatchDecoder(config.features)
    batches = rank_batches(decoder, rank, world_size, global_batches())
    managed = MANAGED_UNDER[architecture]
    raw = {name: [b.sparse_features[name].values() for b in batches] for name in managed}
    pairs = []
    for result in trainer.train(iter(batches)):
        for name in managed:
            rows = result.batch.sparse_features[name].values().tolist()
            raw_ids = raw[name][result.step - 1].tolist()
            pairs += [(result.step, name, i, r) for i, r in zip(raw_ids, rows, strict=True)]
    # The state dict's tensors are the kernel's own: the resets above are what trains and is saved.
    whole = trainer.model.state_dict()
    state = whole[table_keys(whole, trainer.plan)["adgroup_id"]]
    shards = state.to_local().local_shards() if hasattr(state.to_local(), "local_shards") else []
    for shard in shards:
        assert (
            shard.untyped_storage().data_ptr() == resetter.shards["adgroup_id"][0].weights.untyped_storage().data_ptr()
        )
    torch.save(
        {"pairs": pairs, "at_cut": id_space.state_dict(), "ahead": id_space.mapping.state_dict(), "checked": checked},
        f"{out}/rank{rank}.pt",
    )
    leave_spawned_rank()


# Under din the history is managed too: its table is unpooled, in fbgemm's sequence kernel.
MANAGED_UNDER = {"dlrm": ROWS, "dcn_v2": ROWS, "deepfm": ROWS, "din": {**ROWS, "recent_cate_ids": 300}}


# Each optimizer once and each architecture once: the resets are written into the kernels whatever
# model holds them, so the pairs cover both without the product of the two. Three ranks once, so
# that the buckets are not split evenly.
@pytest.mark.parametrize(
    ("optimizer", "architecture", "world_size"),
    [("row_wise_adagrad", "dlrm", 2), ("adagrad", "dcn_v2", 2), ("sgd", "deepfm", 2), ("row_wise_adagrad", "din", 3)],
)
def test_ranks_map_every_id_to_one_row_alone_and_evicted_rows_start_fresh(
    tmp_path, optimizer, architecture, world_size
):
    mp.spawn(
        _consistency_rank,
        args=(world_size, free_port(), str(tmp_path), optimizer, architecture),
        nprocs=world_size,
    )
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world_size)]

    # rank-consistent: each rank holds its buckets' map, and together they are the map one process
    # builds from the same global steps; every batch has trained, so the cut is the map itself
    for result in results:
        assert_same_state(result["ahead"], result["at_cut"])
    assert_same_state(merged([r["at_cut"] for r in results]), oracle(global_batches(), MANAGED_UNDER[architecture]))
    assert all(set(r["at_cut"]["user_id"]) for r in results), "a rank owns no bucket"
    # collision-free over the ranks: at each step an id has one row, and a row one id (but unknown)
    unknown = {name: rows - 1 for name, rows in MANAGED_UNDER[architecture].items()}
    row_of: dict[tuple, set[int]] = defaultdict(set)
    id_of: dict[tuple, set[int]] = defaultdict(set)
    readers: dict[tuple, set[int]] = defaultdict(set)
    for rank, result in enumerate(results):
        for step, name, raw_id, row in result["pairs"]:
            row_of[step, name, raw_id].add(row)
            readers[step, name, raw_id].add(rank)
            if row != unknown[name]:
                id_of[step, name, row].add(raw_id)
    assert all(len(rows) == 1 for rows in row_of.values()), "an id got two rows in one step"
    assert all(len(ids) == 1 for ids in id_of.values()), "two ids shared a row in one step"
    assert sum(len(r) >= 2 for r in readers.values()) > 20  # ids several ranks read at the same step
    assert any(row == unknown["adgroup_id"] for (_s, name, _i), (row,) in row_of.items() if name == "adgroup_id")
    # fresh rows: evicted rows were reused, re-initialised, their optimizer state zeroed
    checked = [r["checked"] for r in results]
    assert sum(c["rows"] for c in checked) >= sum(ROWS.values()), checked
    if optimizer != "sgd":  # sgd keeps no state
        assert sum(c["state_was_set"] for c in checked) > 50, checked


# ids a rank maps each step: steady, then a step 4x larger than the slot, then steady again
EXCHANGE_IDS = [400, 400, 400, 1600, 400, 400]
# all-to-alls each step, and at the end the one of no ids that brings the last step's rows back:
# the first step knows no slot yet; the second carries the first's rows and fresh rows (every id's)
# on top of its ids, so it outgrows the slot the first left; the grown step does too
EXCHANGE_CALLS = [2, 2, 1, 2, 1, 1, 1]


def _exchange_rank(rank: int, world_size: int, port: int, out: str) -> None:
    join_as_spawned_rank(rank, world_size, port)
    torch.distributed.init_process_group("gloo")
    features = parse_config(managed_raw(rows={"user_id": 2_000}), environ={}).features
    id_space = IdSpace(features, world_size, None)
    calls, rows = [], []
    all_to_all = torch.distributed.all_to_all_single

    def counted(*args, **kwargs):
        calls[-1] += 1
        return all_to_all(*args, **kwargs)

    torch.distributed.all_to_all_single = counted
    rng = np.random.default_rng(rank)
    for step, n in enumerate([*EXCHANGE_IDS, None]):
        calls.append(0)
        own = None if n is None else {"user_id": torch.from_numpy(rng.integers(0, 3_000, n) + 100 * step)}
        came_back = id_space.map_ids(own, 1_000 + step)
        if came_back is not None:
            rows.append(came_back["user_id"])
            id_space.before_forward()
            id_space.trained()
    torch.save({"calls": calls, "rows": rows, "map": id_space.state_dict()}, f"{out}/rank{rank}.pt")
    leave_spawned_rank()


def test_a_step_exchanges_its_ids_and_the_last_steps_rows_in_one_all_to_all_and_when_it_outgrows_the_slot_two(
    tmp_path,
):
    """A step's rows come back in the next step's all-to-all, beside its ids, and the sizes travel
    in the messages' own slots: only a step whose messages outgrow the slot the ranks agreed on
    pays a second all-to-all, of exact sizes. Each step's rows, a step late, and the map are those a
    process builds alone."""
    mp.spawn(_exchange_rank, args=(2, free_port(), str(tmp_path)), nprocs=2)
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert all(r["calls"] == EXCHANGE_CALLS for r in results), [r["calls"] for r in results]

    features = parse_config(managed_raw(rows={"user_id": 2_000}), environ={}).features
    mapping = IdMapping([t for t in features.tables if t.id_mapping == "managed"])
    rngs = [np.random.default_rng(rank) for rank in range(2)]
    for step, n in enumerate(EXCHANGE_IDS):
        ids = np.concatenate([rng.integers(0, 3_000, n) + 100 * step for rng in rngs])
        expected = mapping.update({"user_id": torch.from_numpy(ids)}, 1_000 + step)["user_id"].rows
        assert torch.equal(torch.cat([r["rows"][step] for r in results]), expected), step
    assert all(len(r["rows"]) == len(EXCHANGE_IDS) for r in results)
    assert_same_state(merged([r["map"] for r in results]), mapping.state_dict())


@pytest.mark.parametrize("optimizer", ["row_wise_adagrad", "adagrad", "sgd"])
def test_fresh_rows_reset_on_the_host_in_one_call_are_the_torch_paths_bit_for_bit(optimizer):
    """The host reset kernel draws what torch's generator draws for the table and step, and writes
    it and the zeroed optimizer state where the torch path writes them, in every shard (user_id
    column_wise), leaving the other rows as they were."""
    config = parse_config(managed_raw(optimizer, {"user_id": "column_wise"}), environ={})
    trainer = Trainer(config, init_distributed())
    list(trainer.train(iter(rank_batches(AvroBatchDecoder(config.features), 0, 1, global_batches(3)))))
    assert trainer.id_space is not None and trainer.id_space.resetter is not None
    resetter = trainer.id_space.resetter
    host = dict(resetter.on_host)
    assert all(host[name] is not None for name in ROWS), "a CPU table took the torch path"
    tensors = {name: [t for s in resetter.shards[name] for t in (s.weights, *s.states)] for name in ROWS}
    trained = {name: [t.clone() for t in ts] for name, ts in tensors.items()}
    for name, rows in ROWS.items():
        fresh = torch.tensor([0, 3, 64, 65, rows - 2])  # the unknown row (rows - 1) is never reset
        by_path = []
        for path in (host, {}):
            for tensor, before in zip(tensors[name], trained[name], strict=True):
                tensor.copy_(before)
            resetter.on_host = path
            resetter.reset(name, fresh, step=1_000_003)
            by_path.append([t.clone() for t in tensors[name]])
        assert all(torch.equal(a, b) for a, b in zip(*by_path, strict=True)), name
        assert any(not torch.equal(a, b) for a, b in zip(by_path[0], trained[name], strict=True)), name


def _paused_rank(rank: int, world_size: int, port: int, out: str, ahead: bool) -> None:
    """Three real batches, then as many empty ones as the trainer's lookahead, then a stream that
    waits: the real batches must all have trained by then."""
    join_as_spawned_rank(rank, world_size, port)
    raw = managed_raw()
    raw["batching"] = {**raw.get("batching", {}), "map_ahead": ahead}
    config = parse_config(raw, environ={})
    trainer = Trainer(config, init_distributed())
    assert trainer.id_space is not None and trainer.map_ahead == ahead
    decoder = AvroBatchDecoder(config.features)
    real = rank_batches(decoder, rank, world_size, global_batches(3))
    results: list = []
    trained_when_the_stream_paused: list[int] = []

    def paused_stream():
        yield from real
        yield from [decoder.decode([]).batch.in_global_step(0, world_size)] * trainer.lookahead
        trained_when_the_stream_paused.append(len(results))

    for result in trainer.train(paused_stream()):
        results.append(result)
    trained = [r.batch.size for r in results[: len(real)]]
    run = {"lookahead": trainer.lookahead, "paused": trained_when_the_stream_paused, "trained": trained}
    torch.save({**run, "real": [b.size for b in real]}, f"{out}/rank{rank}.pt")
    leave_spawned_rank()


@pytest.mark.parametrize(("world_size", "ahead"), [(1, True), (2, False), (2, True)])
def test_a_paused_stream_trains_every_real_batch_once_the_trainers_lookahead_of_empty_batches_follows(
    tmp_path, world_size, ahead
):
    """A batch whose rows come back with the next batch's exchange (at several ranks), and one
    mapped ahead, each need one empty step more than the pipeline alone to train the real batches
    it holds when the stream pauses (``Trainer.lookahead``, which the lockstep's flush counts)."""
    mp.spawn(_paused_rank, args=(world_size, free_port(), str(tmp_path), ahead), nprocs=world_size)
    for rank in range(world_size):
        result = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert result["lookahead"] == PIPELINE_LOOKAHEAD + (world_size > 1) + ahead
        assert result["paused"] == [len(result["real"])], result
        assert result["trained"] == result["real"]


def local_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's part of every tensor of ``model``'s state, cloned."""
    out = {}
    for key, value in model.state_dict().items():
        local = value.to_local() if hasattr(value, "to_local") else value
        shards = [getattr(s, "tensor", s) for s in local.local_shards()] if hasattr(local, "local_shards") else [local]
        out[key] = torch.cat([t.reshape(-1) for t in shards]).clone() if shards else torch.zeros(0)
    return out


def _ahead_rank(rank: int, world_size: int, port: int, out: str) -> None:
    """The same stream trained twice, the second time mapped one batch ahead on the id space's own
    thread: per step, the rows of every batch and the cut (as snapshots and deltas read it)."""
    join_as_spawned_rank(rank, world_size, port)
    env = init_distributed()
    runs = {}
    for ahead in (False, True):
        raw = managed_raw()
        raw["batching"] = {**raw.get("batching", {}), "map_ahead": ahead}
        config = parse_config(raw, environ={})
        trainer = Trainer(config, env)
        id_space = trainer.id_space
        assert id_space is not None
        batches = rank_batches(AvroBatchDecoder(config.features), rank, world_size, global_batches())
        run: dict = {"rows": [], "cuts": [], "delta_cut": [], "mapper_ran": False, "lookahead": trainer.lookahead}
        for result in trainer.train(iter(batches)):
            run["rows"].append({name: result.batch.sparse_features[name].values().clone() for name in ROWS})
            # between two steps, as the worker reads them, while the mapper may be mapping the next batch
            cut = id_space.state_dict()
            run["cuts"].append(cut)
            for name in ROWS:
                rows, raw_ids = id_space.raw_ids(name)
                table = next(t for t in config.features.tables if t.name == name)
                run["delta_cut"].append(
                    id_space.step == result.step
                    and set(zip(rows.tolist(), raw_ids.tolist(), strict=True)) == live_pairs(table, cut[name])
                )
            run["mapper_ran"] |= any(t.name.startswith(IDAHEAD) for t in threading.enumerate())
        run["model"] = local_state(trainer.model)
        runs[ahead] = run
    torch.save(runs, f"{out}/rank{rank}.pt")
    leave_spawned_rank()


def live_pairs(table: TableConfig, buckets: dict[str, dict[str, torch.Tensor]]) -> set[tuple[int, int]]:
    """(row, raw id) of each live row in a rank's buckets of a table's map."""
    pairs = set()
    for key, part in buckets.items():
        first = bucket_start(table, int(key.removeprefix("bucket")))
        pairs |= {(first + r, int(part["ids"][r])) for r in part["in_use"].nonzero().flatten().tolist()}
    return pairs


def test_mapped_one_batch_ahead_on_a_thread_the_ranks_train_alike_and_each_cut_is_the_trained_batches_map(
    tmp_path,
):
    """With map_ahead, batch N+1 is mapped on the id space's thread while N trains. The rows of
    every batch, the fresh rows' resets and so the trained model are those of the run without it,
    bit for bit; and between two steps the snapshot's cut and the delta's (rows, raw ids, step) are
    one map, that of exactly the trained batches, whatever the mapper is doing meanwhile."""
    mp.spawn(_ahead_rank, args=(2, free_port(), str(tmp_path)), nprocs=2)
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    steps = global_batches()
    for by_mode in results:
        plain, ahead = by_mode[False], by_mode[True]
        assert not plain["mapper_ran"] and ahead["mapper_ran"] and ahead["lookahead"] == plain["lookahead"] + 1
        assert len(ahead["rows"]) == len(plain["rows"]) == len(steps)
        for ours, theirs in zip(ahead["rows"], plain["rows"], strict=True):
            assert all(torch.equal(ours[name], theirs[name]) for name in ROWS)
        assert ahead["model"].keys() == plain["model"].keys()
        assert all(torch.equal(ahead["model"][k], plain["model"][k]) for k in plain["model"]), "training differed"
        assert all(ahead["delta_cut"]), "a delta's cut read another map than the snapshot's"
    for at in range(len(steps)):
        cut = merged([by_mode[True]["cuts"][at] for by_mode in results])
        assert_same_state(cut, oracle(steps[: at + 1]))


def merged(states: list[dict]) -> dict:
    """The whole map from each rank's: the buckets of every rank, side by side."""
    whole: dict = {"step": states[0]["step"]}
    for state in states:
        assert torch.equal(state["step"], whole["step"])
        for name in (k for k in state if k != "step"):
            assert not set(whole.get(name, {})) & set(state[name]), "two ranks hold one bucket"
            whole[name] = {**whole.get(name, {}), **state[name]}
    return whole


def assert_same_state(ours: dict, theirs: dict) -> None:
    assert ours.keys() == theirs.keys()
    for key, value in ours.items():
        if isinstance(value, dict):
            assert_same_state(value, theirs[key])
        else:
            assert torch.equal(value, theirs[key]), key


def _snapshot_rank(rank: int, world_size: int, port: int, out: str, phase: str) -> None:
    """``first``: train every step, snapshotting after step SNAPSHOT_STEP; ``restored``: restore that
    snapshot (at another world size) and train the steps after it."""
    join_as_spawned_rank(rank, world_size, port)
    raw = managed_raw()
    raw["checkpoint"] = {"path": f"{out}/snapshots"}
    config = parse_config(raw, environ={})
    env = init_distributed()
    trainer = Trainer(config, env)
    assert trainer.id_space is not None
    group = gloo_group(world_size, 60)
    checkpointer = Checkpointer(
        config.checkpoint, config, trainer.model, trainer.optimizer, rank, world_size, group, None, trainer.id_space
    )
    steps = global_batches()
    saved = {}
    if phase == "first":
        batches = rank_batches(AvroBatchDecoder(config.features), rank, world_size, steps)
        for result in trainer.train(iter(batches)):
            if result.step == SNAPSHOT_STEP:
                # as the worker does, between two steps, while later batches are already mapped
                assert len(trainer.id_space.in_flight) > 0
                checkpointer.save(StreamState(step=result.step))
                saved = {"mapped_ahead": trainer.id_space.mapping.step}
    else:
        restored = checkpointer.restore()
        assert restored is not None and restored.step == SNAPSHOT_STEP
        saved = {"restored": copy.deepcopy(trainer.id_space.state_dict())}  # training goes on in place
        batches = rank_batches(AvroBatchDecoder(config.features), rank, world_size, steps[SNAPSHOT_STEP:])
        list(trainer.train(iter(batches)))
    torch.save({**saved, "final": trainer.id_space.state_dict()}, f"{out}/{phase}{rank}.pt")
    leave_spawned_rank()


SNAPSHOT_STEP = 5


def oracle(steps: list[list[RawEvent]], rows: dict[str, int] = ROWS) -> dict:
    """The map a single process builds from the same global steps, without a pipeline or ranks."""
    config = parse_config(managed_raw(rows=rows), environ={})
    decoder = AvroBatchDecoder(config.features)
    mapping = IdMapping([t for t in config.features.tables if t.id_mapping == "managed"])
    for events in steps:
        batch: ClickBatch = decoder.decode(events).batch
        mapping.update({n: batch.sparse_features[n].values() for n in rows}, int(batch.event_time_ms.max()))
    return mapping.state_dict()


@pytest.mark.parametrize("first, then", [(2, 3), (3, 1)])
def test_the_snapshot_holds_the_map_of_the_trained_batches_and_restores_at_another_world_size(tmp_path, first, then):
    """Each bucket moves whole to its owner at the new world size: every id keeps its row."""
    mp.spawn(_snapshot_rank, args=(first, free_port(), str(tmp_path), "first"), nprocs=first)
    before = [torch.load(tmp_path / f"first{r}.pt", weights_only=False) for r in range(first)]
    assert before[0]["mapped_ahead"] > SNAPSHOT_STEP  # the pipeline had mapped batches beyond the cut

    mp.spawn(_snapshot_rank, args=(then, free_port(), str(tmp_path), "restored"), nprocs=then)
    after = [torch.load(tmp_path / f"restored{r}.pt", weights_only=False) for r in range(then)]
    steps = global_batches()
    # the cut's map is that of exactly the trained steps, not of the ones mapped ahead
    restored = merged([r["restored"] for r in after])
    assert_same_state(restored, oracle(steps[:SNAPSHOT_STEP]))
    # the ranks continuing from it map as the uninterrupted ranks did, and as the oracle does
    final = merged([r["final"] for r in after])
    assert_same_state(final, merged([r["final"] for r in before]))
    assert_same_state(final, oracle(steps))
    for name in ROWS:
        ids, in_use = whole_map(final[name])
        assert ids[in_use].unique().numel() == int(in_use.sum()), f"{name}: an id holds two rows after the restore"


def checkpointer_of(config, trainer: Trainer) -> Checkpointer:
    return Checkpointer(config.checkpoint, config, trainer.model, trainer.optimizer, 0, 1, None, None, trainer.id_space)


def test_a_snapshot_restores_under_another_admission_and_ids_waiting_for_one_count_from_zero(tmp_path):
    """A snapshot taken with every id admitted (no sketch) restores under min_count, and the other
    way round: every id keeps its row."""
    raw = managed_raw()
    raw["checkpoint"] = {"path": str(tmp_path / "snapshots")}
    config = parse_config(raw, environ={})
    env = init_distributed()
    trainer = Trainer(config, env)
    list(trainer.train(iter(rank_batches(AvroBatchDecoder(config.features), 0, 1, global_batches(2)))))
    checkpointer_of(config, trainer).save(StreamState(step=2))
    user, ad = raw["features"]["tables"][:2]
    del user["admission"]  # the default, min_count 2
    ad["admission"] = EVERY_ID  # was min_count 2
    swapped = parse_config(raw, environ={})
    other = Trainer(swapped, env)
    restored = checkpointer_of(swapped, other).restore()
    assert restored is not None and restored.step == 2
    before, after = trainer.id_space.state_dict(), other.id_space.state_dict()
    for name in ROWS:
        for bucket, part in before[name].items():
            for key in ("ids", "in_use", "last_step"):
                assert torch.equal(after[name][bucket][key], part[key]), (name, bucket, key)
    assert all(int(part["sketch"].count_nonzero()) == 0 for part in after["user_id"].values())
    assert all(part["sketch"].numel() == 0 for part in after["adgroup_id"].values())


def test_a_snapshot_with_other_rows_is_refused_clearly_and_a_partial_restore_starts_that_map_empty(tmp_path):
    raw = managed_raw()
    raw["checkpoint"] = {"path": str(tmp_path / "snapshots")}
    config = parse_config(raw, environ={})
    env = init_distributed()
    trainer = Trainer(config, env)
    batches = rank_batches(AvroBatchDecoder(config.features), 0, 1, global_batches(2))
    list(trainer.train(iter(batches)))
    checkpointer_of(config, trainer).save(StreamState(step=2))
    raw["features"]["tables"][0]["rows"] = 250
    bigger = parse_config(raw, environ={})
    other = Trainer(bigger, env)
    checkpointer = checkpointer_of(bigger, other)
    with pytest.raises(CheckpointError, match=r"tables.user_id.rows: 200 in the snapshot, 250 here"):
        checkpointer.restore()
    restored = checkpointer.restore(allow_partial=True)
    assert restored is not None and restored.step == 2  # before: a KeyError after the weights had loaded
    assert other.id_space.mapping.tables["user_id"].occupied == 0  # resized: its map starts empty
    assert_same_state(other.id_space.state_dict()["adgroup_id"], trainer.id_space.state_dict()["adgroup_id"])
