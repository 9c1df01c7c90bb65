"""Exactly-once under faults: ranks agree on the snapshot they restore, a failed snapshot write
neither kills training nor gets committed, the config fingerprint refuses only what changes the
tensors, and a warm start from another run's snapshot takes its weights but not its positions."""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import yaml
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from conftest import REPO, SCHEMA, join_as_spawned_rank, leave_spawned_rank, prometheus_tool
from streamtrain.checkpoint import (
    FINGERPRINT_VERSION,
    Checkpointer,
    CheckpointError,
    StreamState,
    _fingerprint_v1,
    compatibility_fingerprint,
    fingerprint_differences,
    list_snapshots,
)
from streamtrain.config import parse_config
from streamtrain.dev.kafka import free_port
from streamtrain.dev.produce import produce
from streamtrain.device import init_distributed
from streamtrain.metrics import WorkerMetrics
from streamtrain.train import Trainer
from test_checkpoint import batches, final_stream, weights  # noqa: F401 (batches: a fixture)
from test_worker_kafka import end_offsets

PARTITIONS = 4
TABLE = "dlrm.sparse_arch.embedding_bag_collection.embedding_bags.{}.weight"


def raw_config(root: Path | str, **checkpoint) -> dict:
    raw = yaml.safe_load((REPO / "tests" / "worker-small.yaml").read_text())
    raw["kafka"] = {"bootstrap_servers": "unused:9092", "topic": "unused"}
    raw["checkpoint"] = {"path": str(root), **checkpoint}
    return raw


def checkpointer(config, trainer: Trainer, metrics: WorkerMetrics | None = None) -> Checkpointer:
    return Checkpointer(config.checkpoint, config, trainer.model, trainer.optimizer, 0, 1, None, metrics)


def flat(snapshot: Path | str, out: Path) -> dict:
    dcp_to_torch_save(snapshot, out)
    return torch.load(out, weights_only=False)


# --- 3. the fingerprint ---------------------------------------------------------------------------


def _changed(path: str, value, raw: dict | None = None) -> dict:
    raw = json.loads(json.dumps(raw or raw_config("/unused")))
    *parents, last = path.split(".")
    node = raw
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node.setdefault(key, {})
    node[last] = value
    return raw


NOT_SHAPING = {
    "wire format": ("features.wire_format", "confluent", {"features.writer_schemas_dir": "tests/writer-schemas"}),
    "registry": (
        "features.wire_format",
        "confluent",
        {
            "features.schema_registry": {
                "url": "https://registry:8081",
                "client_config_files": {"basic.auth.user.info": "/secret"},
            }
        },
    ),
    "credentials": ("kafka.client_config_files", {"sasl.password": "/secret"}, {}),
    "sharding": ("features.tables.0.sharding_types", ["column_wise"], {}),
    "batch size": ("batching.batch_size", 4096, {}),
    "metrics": ("metrics.auc_window", 7, {}),
    "learning rate": ("model.sparse_learning_rate", 0.5, {}),
    "dense transform": ("features.dense.0.transform", "none", {}),
}
SHAPING = {
    "rows": ("features.tables.0.num_embeddings", 30000, "tables.user_id.rows: 20000 in the snapshot, 30000 here"),
    "dim": ("model.dense_arch_layer_sizes", [16, 4], "dense_arch_layer_sizes: [16, 8] in the snapshot, [16, 4] here"),
    "pooling": ("features.tables.2.pooling", "mean", "tables.cate_id.pooling: 'sum' in the snapshot, 'mean' here"),
    "id mapping": ("features.tables.2.id_mapping", "hash", "tables.cate_id.id_mapping: 'modulo'"),
    "field": ("features.tables.2.field", "brand", "tables.cate_id.field: 'cate_id'"),
    "optimizer": ("model.sparse_optimizer", "sgd", "sparse_optimizer: 'row_wise_adagrad' in the snapshot, 'sgd'"),
    "over arch": ("model.over_arch_layer_sizes", [16, 1], "over_arch_layer_sizes"),
    "target match": (
        "model.target_matches",
        [{"candidate": "cate_id", "history": "recent_cate_ids"}],
        "target_matches: None in the snapshot, [['cate_id', 'recent_cate_ids']] here",
    ),
}


@pytest.mark.parametrize("change", NOT_SHAPING, ids=list(NOT_SHAPING))
def test_fingerprint_ignores_what_does_not_shape_the_tensors(change):
    path, value, also = NOT_SHAPING[change]
    raw = _changed(path, value)
    for extra_path, extra in also.items():
        raw = _changed(extra_path, extra, raw)
    base, other = parse_config(raw_config("/unused"), environ={}), parse_config(raw, environ={})
    assert other != base
    ours = compatibility_fingerprint(other)
    assert fingerprint_differences(ours, compatibility_fingerprint(base), other) == []


@pytest.mark.parametrize("change", SHAPING, ids=list(SHAPING))
def test_fingerprint_refuses_what_shapes_the_tensors_or_maps_the_rows(change):
    path, value, expected = SHAPING[change]
    raw = _changed(path, value)
    if change == "dim":
        raw = _changed("features.tables", [{**t, "embedding_dim": 4} for t in raw["features"]["tables"]], raw)
    base, other = parse_config(raw_config("/unused"), environ={}), parse_config(raw, environ={})
    differences = fingerprint_differences(compatibility_fingerprint(other), compatibility_fingerprint(base), other)
    assert any(expected in d for d in differences), differences


def test_a_snapshot_from_before_id_buckets_is_refused_with_the_partial_restore_route():
    tables = [
        {**{k: v for k, v in t.items() if k != "num_embeddings"}, "id_mapping": "managed", "rows": 1000}
        if t["name"] == "user_id"
        else t
        for t in raw_config("/unused")["features"]["tables"]
    ]
    config = parse_config(_changed("features.tables", tables), environ={})
    ours = compatibility_fingerprint(config)
    theirs = copy.deepcopy(ours)
    del theirs["tables"]["user_id"]["buckets"]  # as written before buckets existed
    (reason,) = fingerprint_differences(ours, theirs, config)
    assert "before managed id maps had buckets" in reason and "--allow-partial-restore" in reason
    theirs["tables"]["user_id"]["buckets"] = ours["tables"]["user_id"]["buckets"] + 1
    (reason,) = fingerprint_differences(ours, theirs, config)  # a changed count is a plain difference
    assert reason.startswith("tables.user_id.buckets: ")


def test_fingerprint_version_1_snapshots_restore_if_nothing_changed_else_are_refused_with_a_reason():
    config = parse_config(raw_config("/unused"), environ={})
    ours = compatibility_fingerprint(config)
    assert ours["version"] == FINGERPRINT_VERSION
    assert fingerprint_differences(ours, _fingerprint_v1(config), config) == []
    batch_changed = parse_config(_changed("batching.batch_size", 4096), environ={})
    assert fingerprint_differences(ours, _fingerprint_v1(batch_changed), config) == []  # not in version 1 either
    layers_changed = parse_config(_changed("model.dense_arch_layer_sizes", [32, 8]), environ={})
    (reason,) = fingerprint_differences(ours, _fingerprint_v1(layers_changed), config)
    assert "version-1 fingerprint" in reason and "the model configuration" in reason


def test_fingerprint_a_snapshot_restores_after_a_change_that_does_not_shape_it(tmp_path, batches):  # noqa: F811
    raw = raw_config(tmp_path / "snapshots")
    config = parse_config(raw, environ={})
    env = init_distributed()
    trainer = Trainer(config, env)
    list(trainer.train(iter(batches[:2])))
    checkpointer(config, trainer).save(StreamState(step=2, next_offsets={0: 512}, trained={0: 512}))
    for path, value in [
        ("batching.batch_size", 4096),
        ("model.sparse_learning_rate", 0.5),
        ("features.tables.3.sharding_types", ["table_wise"]),
        ("features.wire_format", "confluent"),
        ("features.writer_schemas_dir", "tests/writer-schemas"),
    ]:
        raw = _changed(path, value, raw)
    changed = parse_config(raw, environ={})
    other = Trainer(changed, env)
    assert checkpointer(changed, other).restore().step == 2
    saved, restored = weights(trainer), weights(other)
    assert all(torch.equal(restored[k], saved[k]) for k in saved)


# --- 2. a failed snapshot write ---------------------------------------------------------------------


def test_a_failed_snapshot_is_counted_removed_and_retried_until_max_consecutive(tmp_path, batches):  # noqa: F811
    config = parse_config(raw_config(tmp_path / "snapshots", max_consecutive_failures=3), environ={})
    trainer = Trainer(config, init_distributed())
    metrics = WorkerMetrics(100)
    saver = checkpointer(config, trainer, metrics)
    root = Path(config.checkpoint.path)
    last_success = metrics.checkpoint_last_success._value.get()

    def failures() -> float:
        return metrics.registry.get_sample_value("streamtrain_checkpoint_failures_total")

    (root / "step-000000001.partial").write_text("in the way")  # DCP cannot make its folder here
    assert saver.save(StreamState(step=1, next_offsets={0: 256}, trained={0: 256})) is None
    assert failures() == 1 and saver.consecutive_failures == 1 and not saver.failing
    assert not (root / "step-000000001.partial").exists()  # the failed save's leftovers are gone
    assert saver.save(StreamState(step=1, next_offsets={0: 256}, trained={0: 256})).step == 1  # the retry works
    assert saver.consecutive_failures == 0 and list_snapshots(str(root))[0].complete
    assert metrics.checkpoint_last_success._value.get() > last_success

    last_success = metrics.checkpoint_last_success._value.get()
    for step in (2, 3, 4):
        (root / f"step-{step:09d}.partial").write_text("in the way")
        assert saver.save(StreamState(step=step, next_offsets={0: 256}, trained={0: 256})) is None
    assert failures() == 4 and saver.failing
    # StreamtrainCheckpointStale reads this gauge only: it does not move while snapshots fail
    assert metrics.checkpoint_last_success._value.get() == last_success
    message = saver.failing_message()
    assert "3 snapshots in a row failed (checkpoint.max_consecutive_failures is 3)" in message
    assert "step 4" in message and "code 6" in message


def test_stale_checkpoint_alert_fires_after_three_configured_intervals_while_snapshots_fail(tmp_path):
    """The alert rule itself, evaluated by promtool over series of workers whose snapshots fail: it
    measures the age against each deployment's checkpoint.interval_seconds, and never fires for a
    worker without checkpoint.path (interval 0)."""
    promtool = prometheus_tool("promtool")
    fires = [{"exp_labels": {"severity": "warning"}, "exp_annotations": _annotations("StreamtrainCheckpointStale")}]

    def case(interval: float, expected: dict[str, list]) -> dict:
        return {
            "interval": "1m",
            # the last success at t=0; afterwards only failures, one every 5 minutes
            "input_series": [
                {"series": "streamtrain_checkpoint_last_success_timestamp_seconds", "values": "0+0x40"},
                {"series": "streamtrain_checkpoint_failures_total", "values": "0+0.2x40"},
                {"series": "streamtrain_checkpoint_interval_seconds", "values": f"{interval:g}+0x40"},
            ],
            "alert_rule_test": [
                {"eval_time": at, "alertname": "StreamtrainCheckpointStale", "exp_alerts": alerts}
                for at, alerts in expected.items()
            ],
        }

    tests = [
        case(300, {"10m": [], "25m": fires, "35m": fires}),  # 3 x 300 s, held 5 minutes: from 20m
        case(60, {"5m": [], "10m": fires}),  # 3 x 60 s, held 5 minutes: from 8m
        case(0, {"10m": [], "35m": []}),  # no checkpoint.path: its start time ages, and nothing fires
    ]
    (tmp_path / "test.yml").write_text(
        yaml.safe_dump(
            {
                "rule_files": [str(REPO / "deploy" / "prometheus" / "alerts.yml")],
                "evaluation_interval": "1m",
                "tests": tests,
            }
        )
    )
    result = subprocess.run(
        [promtool, "test", "rules", str(tmp_path / "test.yml")], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def _annotations(alert: str) -> dict:
    rules = yaml.safe_load((REPO / "deploy" / "prometheus" / "alerts.yml").read_text())["groups"][0]["rules"]
    return next(r["annotations"] for r in rules if r.get("alert") == alert)


@pytest.mark.integration
@pytest.mark.parametrize("world_size", [1, 2])
def test_snapshots_failing_max_consecutive_times_stop_every_rank_with_code_6(
    kafka, topic_name, start_ranks, tmp_path, world_size
):
    root = tmp_path / "snapshots"
    root.mkdir()
    for step in range(200):
        if world_size == 1:  # DCP cannot make the snapshot's folder: every rank's write fails
            (root / f"step-{step:09d}.partial").write_text("in the way")
        else:  # every rank's writes succeed, then rank 0's commit fails: a failure on one rank only
            (root / f"step-{step:09d}.partial" / "streamtrain.json").mkdir(parents=True)
    produce(kafka.bootstrap_servers, topic_name, 6000, partitions=PARTITIONS, seed=61, schema_path=SCHEMA)
    env = {
        "STREAMTRAIN_CHECKPOINT__PATH": str(root),
        "STREAMTRAIN_CHECKPOINT__INTERVAL_STEPS": "1",
        "STREAMTRAIN_CHECKPOINT__MAX_CONSECUTIVE_FAILURES": "3",
        "STREAMTRAIN_DISTRIBUTED__TIMEOUT_SECONDS": "20",
    }
    ranks = start_ranks(topic_name, world_size, env=env)
    codes = [r.wait(timeout=180) for r in ranks]
    logs = [r.output() for r in ranks]
    assert codes == [6] * world_size, logs[0][-4000:]
    for log in logs:
        failed_at = [int(s) for s in re.findall(r"snapshot at step (\d+) failed \(\d in a row", log)]
        assert len(failed_at) == 3, log[-4000:]
        assert "3 snapshots in a row failed (checkpoint.max_consecutive_failures is 3)" in log
        stopped_after = int(re.search(r"stopped after (\d+) steps", log)[1])
        assert failed_at[0] < failed_at[-1] <= stopped_after  # training went on between the failures
    assert "Is a directory" in logs[0] or world_size == 1
    assert not any(s.complete for s in list_snapshots(str(root)))  # nothing partial was committed
    assert not (root / "latest").exists()


# --- 1. every rank restores the same snapshot -------------------------------------------------------


def _save_then_restore(rank: int, port: int, root: str, rank1_view: str, out: str) -> None:
    join_as_spawned_rank(rank, 2, port)
    config = parse_config(raw_config(root, keep_last=5), environ={})
    env = init_distributed()
    trainer = Trainer(config, env)
    group = dist.new_group(backend="gloo")
    saver = Checkpointer(config.checkpoint, config, trainer.model, trainer.optimizer, rank, 2, group)
    trainer.optimizer.init_state()  # as after a worker's first step: the fused state is lazy
    for step in (1, 2):
        assert saver.save(StreamState(step=step, next_offsets={rank: step}, trained={rank: step})) is not None
    dist.barrier()
    if rank == 0:
        # Rank 1 sees the same snapshots except that the newest one's data file is truncated, as
        # a node with a stale view of shared storage would.
        Path(rank1_view).mkdir()
        for entry in Path(root).iterdir():
            if entry.name != "step-000000002":
                (Path(rank1_view) / entry.name).symlink_to(entry)
        damaged = Path(rank1_view) / "step-000000002"
        shutil.copytree(Path(root) / "step-000000002", damaged)
        data = damaged / "__1_0.distcp"
        data.write_bytes(data.read_bytes()[:100])
    dist.barrier()
    view = config.checkpoint.model_copy(update={"path": rank1_view if rank == 1 else root})
    restored = Checkpointer(view, config, trainer.model, trainer.optimizer, rank, 2, group).restore()
    torch.save(restored.step if restored else None, f"{out}/rank-{rank}.pt")
    leave_spawned_rank()


def test_ranks_restore_the_same_snapshot_when_one_cannot_verify_the_newest(tmp_path):
    mp.spawn(
        _save_then_restore,
        args=(free_port(), str(tmp_path / "snapshots"), str(tmp_path / "rank1"), str(tmp_path)),
        nprocs=2,
    )
    assert [torch.load(tmp_path / f"rank-{rank}.pt") for rank in range(2)] == [1, 1]


@pytest.mark.integration
def test_ranks_restore_the_same_snapshot_when_one_ranks_data_fails_to_load(kafka, topic_name, start_ranks, tmp_path):
    root = tmp_path / "snapshots"
    env = {
        "STREAMTRAIN_CHECKPOINT__PATH": str(root),
        "STREAMTRAIN_CHECKPOINT__INTERVAL_STEPS": "3",
        "STREAMTRAIN_CHECKPOINT__KEEP_LAST": "10",
    }
    produce(kafka.bootstrap_servers, topic_name, 3000, partitions=PARTITIONS, seed=62, schema_path=SCHEMA)
    first = start_ranks(topic_name, 2, "--until-end", env=env)
    assert [r.wait(timeout=180) for r in first] == [0, 0], first[0].output()[-3000:]
    newest, older = [s for s in list_snapshots(str(root)) if s.complete][:2]
    # Rank 1's data file keeps its length, so the snapshot verifies, but its tensors do not load.
    data = Path(newest.path) / "__1_0.distcp"
    data.write_bytes(bytes(data.stat().st_size))
    assert list_snapshots(str(root))[0].complete

    produce(kafka.bootstrap_servers, topic_name, 1000, partitions=PARTITIONS, seed=63, schema_path=SCHEMA)
    second = start_ranks(topic_name, 2, "--until-end", env=env)
    assert [r.wait(timeout=180) for r in second] == [0, 0], second[1].output()[-3000:]
    for rank in second:
        assert f"restored {older.path}: step {older.step}," in rank.output()
    stream = final_stream(root)["stream"]
    # the events after the older snapshot were trained again, once: counts equal the end offsets
    assert {int(p): n for p, n in stream["trained"].items()} == end_offsets(kafka, topic_name)


# --- 11. warm start ---------------------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.parametrize(("source_ranks", "target_ranks"), [(2, 1), (1, 2)], ids=["2-to-1", "1-to-2"])
def test_init_from_another_runs_snapshot_takes_its_weights_not_its_positions(
    kafka, topic_name, start_ranks, tmp_path, source_ranks, target_ranks
):
    produce(kafka.bootstrap_servers, topic_name, 2000, partitions=PARTITIONS, seed=64, schema_path=SCHEMA)
    source_root, root = tmp_path / "yesterday", tmp_path / "today"
    source = start_ranks(
        topic_name, source_ranks, "--until-end", env={"STREAMTRAIN_CHECKPOINT__PATH": str(source_root)}
    )
    assert [r.wait(timeout=180) for r in source] == [0] * source_ranks, source[0].output()[-3000:]
    snapshot = list_snapshots(str(source_root))[0]
    assert snapshot.complete and sum(snapshot.metadata["stream"]["next_offsets"].values()) == 2000

    env = {
        "STREAMTRAIN_CHECKPOINT__PATH": str(root),
        "STREAMTRAIN_CHECKPOINT__INIT_OPTIMIZER": "true",
        "STREAMTRAIN_KAFKA__GROUP_ID": f"fresh-{topic_name}",
    }
    target = start_ranks(topic_name, target_ranks, "--until-end", "--init-from", snapshot.path, env=env)
    assert [r.wait(timeout=180) for r in target] == [0] * target_ranks, target[0].output()[-3000:]
    assert f"warm start: weights and optimizer state from {snapshot.path}" in target[0].output()

    # Its step 0 holds the source's weights and optimizer state exactly, at its own world size ...
    start = list_snapshots(str(root))[-1]
    assert start.step == 0 and start.metadata["world_size"] == target_ranks
    theirs, ours = flat(snapshot.path, tmp_path / "theirs.pt"), flat(start.path, tmp_path / "ours.pt")
    assert ours["model"].keys() == theirs["model"].keys()
    for key, value in theirs["model"].items():
        assert torch.equal(ours["model"][key], value), key
    fused = [k for k in theirs["optimizer"]["state"] if "embedding_bags" in k]
    assert fused
    for key in fused:
        for name, value in theirs["optimizer"]["state"][key].items():
            assert torch.equal(ours["optimizer"]["state"][key][name], value), (key, name)
    # ... but not its positions: the fresh group started at the earliest offsets, so every event
    # trained once more in this run.
    assert set(start.metadata["stream"]["next_offsets"].values()) == {0}
    assert {int(p): n for p, n in final_stream(root)["stream"]["trained"].items()} == end_offsets(kafka, topic_name)

    if source_ranks == 2:  # once the run has snapshots of its own, they win
        again = start_ranks(topic_name, target_ranks, "--until-end", "--init-from", snapshot.path, env=env)
        assert [r.wait(timeout=180) for r in again] == [0] * target_ranks
        assert "checkpoint.init_from" in again[0].output() and "is ignored" in again[0].output()


def test_init_from_a_snapshot_of_another_shape_is_refused(tmp_path, batches):  # noqa: F811
    source = parse_config(raw_config(tmp_path / "yesterday"), environ={})
    env = init_distributed()
    checkpointer(source, Trainer(source, env)).save(StreamState(step=3, next_offsets={0: 1}, trained={0: 1}))
    changed = parse_config(
        _changed("features.tables.2.num_embeddings", 500, raw_config(tmp_path / "today")), environ={}
    )
    with pytest.raises(CheckpointError, match=r"tables.cate_id.rows: 12961 in the snapshot, 500 here"):
        checkpointer(changed, Trainer(changed, env)).warm_start(str(tmp_path / "yesterday"), with_optimizer=False)


def test_init_from_needs_a_checkpoint_path():
    raw = raw_config("/unused", init_from="/yesterday")
    del raw["checkpoint"]["path"]
    with pytest.raises(ValueError, match=r"init_from needs checkpoint\.path"):
        parse_config(raw, environ={})
