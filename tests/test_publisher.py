"""The publisher's parts on one real rank: touched ids, a delivery that fails and is retried while
training goes on, the directory target, the base export's call, and the delivery config."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from conftest import REPO, SCHEMA
from streamtrain.checkpoint import DeliveryPosition, StreamState
from streamtrain.config import ConfigError, parse_config
from streamtrain.decode import AvroBatchDecoder
from streamtrain.delivery.deltas import Assembler, Delta, DeltaId, DensePiece, RowPiece
from streamtrain.delivery.publisher import (
    PRUNE_SECONDS,
    RETRY_MAX_SECONDS,
    BaseExports,
    DeliveryFailed,
    DirectoryTarget,
    Publisher,
    TouchedRows,
)
from streamtrain.dev.produce import AvroEncoder, ClickStream, encoded_events
from streamtrain.device import init_distributed
from streamtrain.metrics import WorkerMetrics
from streamtrain.source import RawEvent
from streamtrain.train import Trainer

# Where DLRM's tables sit in the DMP's state dict and plan.
EBC_PATH = "dlrm.sparse_arch.embedding_bag_collection"


def config_for(tmp_path: Path, **delivery):
    raw = yaml.safe_load((REPO / "tests" / "worker-small.yaml").read_text())
    raw["kafka"] = {"bootstrap_servers": "127.0.0.1:9", "topic": "clicks"}
    raw["checkpoint"] = {"path": str(tmp_path / "snapshots")}
    raw["delivery"] = {"enabled": True, **delivery}
    return parse_config(raw, environ={})


def test_delivery_config_names_the_field_and_the_fix(tmp_path):
    raw = yaml.safe_load((REPO / "tests" / "worker-small.yaml").read_text())
    raw["kafka"] = {"bootstrap_servers": "127.0.0.1:9", "topic": "clicks"}
    raw["delivery"] = {"enabled": True}
    with pytest.raises(ConfigError, match=r"delivery.enabled needs checkpoint.path.*STREAMTRAIN_CHECKPOINT__PATH"):
        parse_config(raw, environ={}).checkpoint_path_for_delivery()
    raw["checkpoint"] = {"path": "/snapshots"}
    with pytest.raises(ConfigError, match=r"delivery.topic: clicks is the training or dead-letter topic"):
        parse_config({**raw, "delivery": {"enabled": True, "topic": "clicks"}}, environ={})
    delivery = parse_config(raw, environ={}).delivery
    assert delivery.resolved_topic("clicks") == "clicks.model"
    assert delivery.resolved_path("/snapshots") == "/snapshots/serving"
    assert delivery.resolved_model_id("clicks") == "clicks"
    assert not parse_config({**raw, "delivery": {}}, environ={}).delivery.enabled  # off by default


def kjt(ids: dict[str, list[int]]) -> KeyedJaggedTensor:
    keys = list(ids)
    return KeyedJaggedTensor.from_lengths_sync(
        keys,
        torch.tensor([v for k in keys for v in ids[k]], dtype=torch.int64),
        torch.tensor([len(ids[k]) for k in keys], dtype=torch.int32),
    )


def test_touched_rows_are_each_tables_unique_rows_sorted_and_a_take_starts_afresh():
    touched = TouchedRows({"a": 10, "b": 8})
    assert not touched
    touched.add(kjt({"a": [5, 3, 5], "b": []}))
    touched.add(kjt({"a": [3, 9], "b": [1]}))
    touched.add(kjt({"a": [2], "b": [1, 7]}))
    assert touched
    taken = touched.take()
    assert not touched
    assert taken["a"].tolist() == [2, 3, 5, 9] and taken["b"].tolist() == [1, 7]
    assert taken["a"].dtype == np.int64
    assert all(ids.size == 0 for ids in touched.take().values())  # a take starts afresh
    touched.add(kjt({"a": [], "b": []}))
    assert not touched  # a batch of no lookups touches nothing


def test_the_union_of_several_ranks_takes_is_every_row_any_of_them_touched_once():
    touched = TouchedRows({"a": 10, "b": 8})
    touched.add(kjt({"a": [4], "b": [0]}))
    mine = touched.take()
    union = touched.union([mine, {"a": np.array([1, 4, 9]), "b": np.array([], np.int64)}])
    assert union["a"].tolist() == [1, 4, 9] and union["b"].tolist() == [0]
    assert not touched and all(ids.size == 0 for ids in touched.take().values())


def test_a_feature_sharing_a_table_touches_its_owners_rows():
    touched = TouchedRows({"cate_id": 10}, {"recent_cate_ids": "cate_id"})
    touched.add(kjt({"cate_id": [4], "recent_cate_ids": [7, 4, 2]}))
    assert {table: ids.tolist() for table, ids in touched.take().items()} == {"cate_id": [2, 4, 7]}


@pytest.fixture(scope="module")
def batches():
    raw = yaml.safe_load((REPO / "tests" / "worker-small.yaml").read_text())
    raw["kafka"] = {"bootstrap_servers": "unused:9092", "topic": "unused"}
    decoder = AvroBatchDecoder(parse_config(raw, environ={}).features)
    events = [
        RawEvent(0, i, value, 0)
        for i, (_k, value, _p, _c) in enumerate(encoded_events(ClickStream(8, 0), AvroEncoder(SCHEMA), 1536))
    ]
    return [decoder.decode(events[i : i + 256]).batch for i in range(0, len(events), 256)]


class FlakyTarget:
    """A delta target that refuses deliveries, as an unreachable topic would, until ``reachable``."""

    def __init__(self):
        self.reachable = threading.Event()
        self.failures = 0
        self.delivered: list[Delta] = []

    def send(self, delta: Delta) -> int:
        if not self.reachable.is_set():
            self.failures += 1
            raise DeliveryFailed("the delta topic is unreachable")
        self.delivered.append(delta)
        return 1

    def close(self) -> None:
        pass


def test_a_failed_delivery_is_retried_while_training_goes_on_and_nothing_is_lost(tmp_path, batches):
    config = config_for(tmp_path, delta_interval_steps=1, delta_interval_seconds=3600)
    trainer = Trainer(config, init_distributed())
    metrics = WorkerMetrics()
    stream = StreamState()
    target = FlakyTarget()
    publisher = Publisher(
        config, trainer.model, trainer.plan, 0, 1, None, None, stream, lambda: 0, metrics=metrics, target=target
    )
    publisher.bases = None  # no base exports here: see test_the_base_export_is_called_with_the_agreed_flags
    stream.delivery = DeliveryPosition(chain=4, next_sequence=10)

    touched: list[set[int]] = []
    for result in trainer.train(iter(batches)):
        stream.step = result.step
        publisher.record(result.batch.sparse_features)
        touched.append(set(result.batch.sparse_features["user_id"].values().tolist()))
        publisher.act({"delta": publisher.due(), "delta_sent": publisher.sent()})
    # Six steps trained while the first delta waited for its retries: one delta in flight, no other cut.
    assert publisher.in_flight and stream.delivery == DeliveryPosition(4, 11)
    target.reachable.set()
    assert publisher.done.wait(RETRY_MAX_SECONDS + 5)
    publisher.act({"delta_sent": publisher.sent()})
    publisher.stop_deltas(clean=True, seconds=10)  # the stop's delta carries every row touched meanwhile
    publisher.close(clean=True, seconds=10)
    first, last = target.delivered
    assert (first.id.base_version, first.id.sequence, first.id.step) == (4, 10, 1)
    assert (last.id.base_version, last.id.sequence, last.id.step) == (4, 11, len(batches))
    user_rows = lambda delta: {i for p in delta.rows if p.table == "user_id" for i in p.ids.tolist()}  # noqa: E731
    assert user_rows(first) == touched[0]
    assert user_rows(last) == set().union(*touched[1:])
    assert stream.delivery == DeliveryPosition(4, 12)
    assert metrics.delta_failures._value.get() == target.failures > 0
    assert metrics.deltas_published._value.get() == 2


def test_a_data_parallel_tables_deltas_carry_the_rows_its_optimizer_moved_without_a_lookup(tmp_path):
    """The planner replicates small tables (data_parallel) and Adam updates them, which moves every
    row with momentum left, looked up or not: the deltas must still add up to the trained state."""
    config = config_for(tmp_path, delta_interval_steps=1, delta_interval_seconds=3600)
    trainer = Trainer(config, init_distributed())
    replicated = [t for t, p in trainer.plan.plan[EBC_PATH].items() if p.sharding_type == "data_parallel"]
    assert "age_level" in replicated, trainer.plan
    records = ClickStream(8, 0).chunk(1024).records
    for record in records[512:]:  # the last two batches look up one age_level row, the first two all of them
        record["age_level"] = 3
    encoder, decoder = AvroEncoder(SCHEMA), AvroBatchDecoder(config.features)
    events = [RawEvent(0, i, encoder.encode(r), 0) for i, r in enumerate(records)]
    batches = [decoder.decode(events[i : i + 256]).batch for i in range(0, len(events), 256)]
    weight = lambda table: trainer.model.state_dict()[f"{EBC_PATH}.embedding_bags.{table}.weight"]  # noqa: E731
    replica = {table: weight(table).detach().clone() for table in replicated}
    stream, target = StreamState(), FlakyTarget()
    target.reachable.set()
    publisher = Publisher(config, trainer.model, trainer.plan, 0, 1, None, None, stream, lambda: 0, target=target)
    publisher.bases = None
    stream.delivery = DeliveryPosition(chain=1, next_sequence=0)
    for result in trainer.train(iter(batches)):
        stream.step = result.step
        publisher.record(result.batch.sparse_features)
        assert publisher.done.wait(10)
        publisher.act({"delta": publisher.due(), "delta_sent": publisher.sent()})
    publisher.stop_deltas(clean=True, seconds=10)
    publisher.close(clean=True, seconds=10)
    assert [d.id.step for d in target.delivered] == [1, 3, 4]
    for delta in target.delivered:
        for piece in delta.rows:
            if piece.table in replica:
                replica[piece.table][torch.from_numpy(piece.ids)] = torch.from_numpy(piece.values)
    for table in replicated:
        torch.testing.assert_close(replica[table], weight(table).detach(), rtol=0, atol=0, msg=table)


def test_the_directory_target_writes_the_parts_then_the_marker(tmp_path):
    delta = Delta(
        DeltaId("clicks", 3, 7, 120, 1_700_000_000_000, 0),
        [RowPiece("user_id", np.arange(5, dtype=np.int64), 0, np.ones((5, 8), np.float32))],
        [DensePiece("dense.weight", (2, 2), 0, np.arange(4, dtype=np.float32))],
    )
    DirectoryTarget(str(tmp_path / "deltas")).send(delta)
    folder = tmp_path / "deltas" / "delta-000003-000000007"
    assert (folder / "COMPLETE").exists()
    assembler = Assembler()
    (whole,) = [d for d in (assembler.add(p.read_bytes()) for p in sorted(folder.glob("part-*"))) if d]
    assert (whole.id.base_version, whole.id.sequence, whole.id.step) == (3, 7, 120)
    assert whole.rows[0].ids.tolist() == list(range(5)) and whole.dense[0].values.tolist() == [0, 1, 2, 3]


def test_the_directory_target_makes_the_folders_it_creates_durable_in_their_parents(tmp_path, monkeypatch):
    """A delta's name must survive a power loss like its parts: the deltas root (made by the first
    delta) is fsynced in its parent, and each delta folder in the root."""
    from streamtrain import durable

    synced: list[str] = []
    fsync = durable._fsync
    monkeypatch.setattr(durable, "_fsync", lambda path, directory=False: synced.append(path) or fsync(path, directory))
    delta = Delta(DeltaId("clicks", 3, 7, 120, 0, 0), dense=[DensePiece("w", (2,), 0, np.ones(2, np.float32))])
    DirectoryTarget(str(tmp_path / "bucket" / "deltas")).send(delta)
    root = tmp_path / "bucket" / "deltas"
    assert str(tmp_path) in synced and str(tmp_path / "bucket") in synced, "the new root's names"
    assert str(root) in synced, "the delta folder's name in the root"
    assert synced.index(str(root)) < synced.index(str(root / "delta-000003-000000007" / "COMPLETE.tmp"))


def manifest(chain: int, sequence: int) -> str:
    """A manifest with nothing but its position in the chain that matters."""
    fields = dict.fromkeys(["model_id", "source_snapshot"], "m") | dict.fromkeys(["base_version", "step"], 1)
    fields |= dict.fromkeys(["event_time_high_water_ms", "cut_wall_time_ms", "created_at"], 0)
    fields |= {key: {} for key in ["next_offsets", "trained", "config", "reader_schema", "versions"]}
    fields |= {"tables": [], "dense": [], "tasks": [], "world_size": 1, "parameters": {"tables": {}, "dense": {}}}
    return json.dumps({"format": 1, "chain": chain, "delta_sequence": sequence, **fields})


def test_the_directory_target_removes_the_deltas_no_kept_base_needs(tmp_path):
    """Bases kept: chain 3 from delta 5 on (its oldest), and one from delta 9; a base still being
    written does not count. Deltas of chain 2, and of chain 3 before 5, go; the rest stay."""
    bases = tmp_path / "serving"
    for name, chain, sequence in [("base-000004", 3, 5), ("base-000005", 3, 9), ("base-000006.partial", 3, 1)]:
        (bases / name).mkdir(parents=True)
        (bases / name / "manifest.json").write_text(manifest(chain, sequence))
    clock = [0.0]
    target = DirectoryTarget(str(tmp_path / "deltas"), str(bases), clock=lambda: clock[0])

    def send(chain: int, sequence: int) -> None:
        target.send(Delta(DeltaId("clicks", chain, sequence, sequence, 0, 0), [], []))

    def left() -> list[str]:
        return sorted(p.name for p in (tmp_path / "deltas").iterdir())

    for chain, sequence in [(2, 8), (2, 9), (3, 3), (3, 4), (3, 5)]:
        send(chain, sequence)  # the first send prunes (nothing yet to prune but its own older ones)
    assert left() == ["delta-000002-000000009", "delta-000003-000000003", "delta-000003-000000004",
                      "delta-000003-000000005"], "pruned more often than every PRUNE_SECONDS"  # fmt: skip
    clock[0] += PRUNE_SECONDS
    send(3, 6)
    assert left() == ["delta-000003-000000005", "delta-000003-000000006"]
    assert target.prune(str(tmp_path / "no-bases-yet")) == 0 and len(left()) == 2


def test_the_base_export_is_called_with_the_agreed_flags(tmp_path, monkeypatch):
    """A stand-in for ``streamtrain export`` (built elsewhere) records its arguments and writes a base.
    It ends once the file ``RELEASE_EXPORT`` names exists, so that the test sees an export running:
    one that ended first, on a loaded host, unpinned its snapshot before the test looked (CI)."""
    stand_in = tmp_path / "export.py"
    release = tmp_path / "release"
    monkeypatch.setenv("RELEASE_EXPORT", str(release))
    stand_in.write_text(
        "import json, os, sys, time\n"
        "deadline = time.monotonic() + 60\n"
        "while not os.path.exists(os.environ['RELEASE_EXPORT']) and time.monotonic() < deadline:\n"
        "    time.sleep(0.01)\n"
        "args = sys.argv[1:]\n"
        "out, version = args[args.index('--out') + 1], int(args[args.index('--version') + 1])\n"
        "os.makedirs(f'{out}/base-{version:06d}')\n"
        "open(f'{out}/calls.jsonl', 'a').write(json.dumps(args) + '\\n')\n"
        "sys.exit(int(os.environ.get('FAIL_EXPORT', '0')))\n"
    )
    config = config_for(tmp_path, keep_bases=2).delivery
    metrics = WorkerMetrics()
    pinned: set[int] = set()
    bases = BaseExports(
        config, str(tmp_path / "snapshots"), metrics, pinned, export_command=[sys.executable, str(stand_in)]
    )
    assert bases.allocate() == 1
    bases.start(0, new_chain=True, version=1)
    assert pinned == {0}  # the checkpointer keeps the snapshot while it is exported
    assert bases.exporting_chain_start  # a stop waits for it instead of superseding it
    release.touch()
    bases.wait(60)
    assert pinned == set() and not bases.exporting_chain_start
    for step in (5, 10):
        bases.start(step, new_chain=False)
        bases.wait(60)
    serving = tmp_path / "snapshots" / "serving"
    calls = [json.loads(line) for line in (serving / "calls.jsonl").read_text().splitlines()]
    assert calls[0] == [
        "--checkpoint", str(tmp_path / "snapshots"), "--step", "0", "--out", str(serving),
        "--version", "1", "--keep", "2", "--new-chain",
    ]  # fmt: skip
    assert [c[c.index("--version") + 1] for c in calls] == ["1", "2", "3"] and "--new-chain" not in calls[1]
    assert metrics.bases_published._value.get() == 3

    # A failed export is counted, and its version is not handed out again.
    monkeypatch.setenv("FAIL_EXPORT", "1")
    bases.start(15, new_chain=False)
    bases.wait(60)
    assert metrics.bases_failed._value.get() == 1
    fresh = BaseExports(config, str(tmp_path / "snapshots"), None, export_command=[sys.executable, str(stand_in)])
    assert fresh.allocate() == 5
    started = time.monotonic()
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    slow = BaseExports(config, str(tmp_path / "snapshots"), metrics, export_command=sleeper)
    slow.start(20, new_chain=False)
    slow.wait(0.5)  # past its bound at a stop: stopped and counted
    assert time.monotonic() - started < 15 and metrics.bases_failed._value.get() == 2


def test_a_worker_with_delivery_and_no_checkpoint_path_exits_2_naming_the_field():
    result = subprocess.run(
        [sys.executable, "-m", "streamtrain", "worker", "--config", str(REPO / "tests" / "worker-small.yaml")],
        cwd=REPO,
        env={**os.environ, "STREAMTRAIN_DELIVERY__ENABLED": "true"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert "delivery.enabled needs checkpoint.path" in result.stderr and "STREAMTRAIN_CHECKPOINT__PATH" in result.stderr
