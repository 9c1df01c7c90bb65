"""Snapshots through DCP: a consistent cut under async saves, verification, damage, resharding,
and exactly-once training across SIGKILLs on the real broker with real ranks."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from conftest import REPO, SCHEMA, end_offsets
from streamtrain.checkpoint import Checkpointer, CheckpointError, RestoreRefused, StreamState, list_snapshots
from streamtrain.config import parse_config
from streamtrain.decode import AvroBatchDecoder
from streamtrain.dev.produce import AvroEncoder, ClickStream, encoded_events, produce
from streamtrain.device import init_distributed
from streamtrain.source import RawEvent
from streamtrain.train import Trainer

PARTITIONS = 4
# Who a kill trial SIGKILLs. The default run kills each once; STREAMTRAIN_TEST_KILL_TRIALS adds
# trials that pick at random, for a long, on-demand run.
KILL_VICTIMS = ("rank 1", "rank 0", "all")
KILL_TRIALS = int(os.environ.get("STREAMTRAIN_TEST_KILL_TRIALS", str(len(KILL_VICTIMS))))


def small_config(tmp_path: Path, topic: str = "unused", **checkpoint):
    raw = yaml.safe_load((REPO / "tests" / "worker-small.yaml").read_text())
    raw["kafka"] = {"bootstrap_servers": "unused:9092", "topic": topic}
    raw["checkpoint"] = {"path": str(tmp_path / "snapshots"), **checkpoint}
    return parse_config(raw, environ={})


@pytest.fixture(scope="module")
def batches():
    config = small_config(Path("/unused"))
    decoder = AvroBatchDecoder(config.features)
    events = [
        RawEvent(0, i, value, 0)
        for i, (_k, value, _p, _c) in enumerate(encoded_events(ClickStream(5, 0), AvroEncoder(SCHEMA), 2560))
    ]
    return [decoder.decode(events[i : i + 256]).batch for i in range(0, len(events), 256)]


def weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    """This rank's tensors as plain tensors (a table-wise shard on one rank is the whole table)."""

    def plain(value):
        value = value.to_local() if hasattr(value, "to_local") else value
        if hasattr(value, "local_shards"):  # torchrec's LocalShardsWrapper inside the DTensor
            (value,) = value.local_shards()
        return value.detach().clone()

    return {k: plain(v) for k, v in trainer.model.state_dict().items()}


def checkpointer_for(config, trainer: Trainer) -> Checkpointer:
    return Checkpointer(config.checkpoint, config, trainer.model, trainer.optimizer, 0, 1, None)


def test_async_snapshot_is_the_cut_at_its_step_while_training_goes_on(tmp_path, batches):
    config = small_config(tmp_path)
    env = init_distributed()
    trainer = Trainer(config, env)
    list(trainer.train(iter(batches[:4])))
    at_save = weights(trainer)
    checkpointer = checkpointer_for(config, trainer)
    checkpointer.start_save(StreamState(step=4, next_offsets={0: 1024}, trained={0: 1024}))
    list(trainer.train(iter(batches[4:8])))  # the weights move on while the save is written
    assert any(not torch.equal(at_save[k], v) for k, v in weights(trainer).items())
    stream = checkpointer.finish_save()
    assert stream.next_offsets == {0: 1024}

    restored_trainer = Trainer(config, env)
    restored = checkpointer_for(config, restored_trainer).restore()
    assert restored == StreamState(step=4, next_offsets={0: 1024}, trained={0: 1024})
    for key, value in weights(restored_trainer).items():
        assert torch.equal(value, at_save[key]), key
    # and the optimizer state came back too: both continue identically
    again = Trainer(config, env)
    checkpointer_for(config, again).restore()
    assert [r.loss_sum for r in restored_trainer.train(iter(batches[4:6]))] == [
        r.loss_sum for r in again.train(iter(batches[4:6]))
    ]


def _staged_addresses(staged: dict) -> dict[str, int]:
    return {k: v.data_ptr() for k, v in weights_of(staged["model"]).items()}


def weights_of(state: dict) -> dict[str, torch.Tensor]:
    def plain(value):
        value = value.to_local() if hasattr(value, "to_local") else value
        if hasattr(value, "local_shards"):
            (value,) = value.local_shards()
        return value

    return {k: plain(v) for k, v in state.items()}


def test_snapshots_refill_kept_host_buffers_and_each_stays_its_own_cut(tmp_path, batches):
    """A snapshot costs the training thread one copy into host buffers kept from the first one
    (DCP's own staging allocated and copied each table three times, the bulk of a snapshot's cost),
    and refilling them for the next cut leaves the one before it as written."""
    config = small_config(tmp_path, keep_last=2)
    env = init_distributed()
    trainer = Trainer(config, env)
    checkpointer = checkpointer_for(config, trainer)
    list(trainer.train(iter(batches[:2])))
    first_cut = weights(trainer)
    checkpointer.save(StreamState(step=2, next_offsets={0: 512}, trained={0: 512}))
    list(trainer.train(iter(batches[2:4])))
    second_cut = weights(trainer)
    checkpointer.start_save(StreamState(step=4, next_offsets={0: 1024}, trained={0: 1024}))
    list(trainer.train(iter(batches[4:6])))
    assert checkpointer.finish_save() is not None

    staged = checkpointer.stager.stage({"model": trainer.model.state_dict()})
    addresses = _staged_addresses(staged)
    # refilled, not made anew: the first staging is still alive, so fresh memory could not reuse its addresses
    assert _staged_addresses(checkpointer.stager.stage({"model": trainer.model.state_dict()})) == addresses
    live = {k: v.data_ptr() for k, v in weights_of(trainer.model.state_dict()).items()}
    assert not set(addresses.values()) & set(live.values())  # copies, not the live tables

    for snapshot, cut in ((tmp_path / "snapshots" / "step-000000002", first_cut), (None, second_cut)):
        restored = Trainer(config, env)
        loader = checkpointer_for(config, restored)
        if snapshot is None:
            assert loader.restore().step == 4
        else:
            loader.warm_start(str(snapshot), with_optimizer=True)
        for key, value in weights(restored).items():
            assert torch.equal(value, cut[key]), (snapshot, key)


def test_damaged_snapshots_are_skipped_with_a_warning(tmp_path, batches, caplog):
    config = small_config(tmp_path, keep_last=5)
    env = init_distributed()
    trainer = Trainer(config, env)
    checkpointer = checkpointer_for(config, trainer)
    for step in (1, 2, 3):
        list(trainer.train(iter(batches[step : step + 1])))
        checkpointer.save(StreamState(step=step, next_offsets={0: step * 256}, trained={0: step * 256}))
    root = Path(config.checkpoint.path)
    assert (root / "latest").read_text() == "step-000000003"
    newest, middle = root / "step-000000003", root / "step-000000002"
    data_file = max((p for p in newest.iterdir() if p.suffix == ".distcp"), key=lambda p: p.stat().st_size)
    data_file.write_bytes(data_file.read_bytes()[: data_file.stat().st_size // 2])  # truncated
    (middle / "streamtrain.json").unlink()  # marker lost
    (root / "step-000000004.partial").mkdir()  # a save that crashed half-way

    states = {s.step: (s.complete, s.problem) for s in list_snapshots(str(root))}
    assert states[1] == (True, None)
    assert "truncated" in states[3][1] and "no streamtrain.json" in states[2][1] and "never finished" in states[4][1]
    with caplog.at_level("WARNING"):
        restored = checkpointer_for(config, Trainer(config, env)).restore()
    assert restored.step == 1
    assert "step-000000003" in caplog.text and "truncated" in caplog.text


def test_a_snapshot_for_another_feature_config_is_refused_unless_partial(tmp_path, batches):
    config = small_config(tmp_path)
    env = init_distributed()
    trainer = Trainer(config, env)
    checkpointer_for(config, trainer).save(StreamState(step=1, next_offsets={0: 1}, trained={0: 1}))
    raw = yaml.safe_load((REPO / "tests" / "worker-small.yaml").read_text())
    raw["kafka"] = {"bootstrap_servers": "unused:9092", "topic": "unused"}
    raw["checkpoint"] = {"path": config.checkpoint.path}
    raw["features"]["tables"][0]["num_embeddings"] = 30000
    changed = parse_config(raw, environ={})
    other = Trainer(changed, env)
    with pytest.raises(CheckpointError, match=r"tables.user_id.rows: 20000 in the snapshot, 30000 here"):
        checkpointer_for(changed, other).restore()
    restored = checkpointer_for(changed, other).restore(allow_partial=True)
    assert restored.step == 1
    saved, loaded = weights(trainer), weights(other)
    table = "dlrm.sparse_arch.embedding_bag_collection.embedding_bags.cate_id.weight"
    assert torch.equal(saved[table], loaded[table])  # unchanged tables came back


def test_a_snapshot_of_another_topics_positions_is_refused_even_partially(tmp_path, batches):
    """Offsets are per partition: restored under another kafka.topic they would seek its partitions
    to the old topic's places, skipping or repeating events, with no error. The refusal names both
    topics and the way out (init_from, which takes weights and not positions)."""
    config = small_config(tmp_path)
    env = init_distributed()
    trainer = Trainer(config, env)
    list(trainer.train(iter(batches[:1])))
    checkpointer_for(config, trainer).save(StreamState(step=1, next_offsets={0: 7}, trained={0: 7}))
    raw = yaml.safe_load((REPO / "tests" / "worker-small.yaml").read_text())
    raw["kafka"] = {"bootstrap_servers": "unused:9092", "topic": "clicks-v2"}
    raw["checkpoint"] = {"path": config.checkpoint.path}
    moved = parse_config(raw, environ={})
    for allow_partial in (False, True):
        with pytest.raises(
            RestoreRefused, match=r"in the topic 'unused', and this worker reads 'clicks-v2'.*init_from"
        ):
            checkpointer_for(moved, Trainer(moved, env)).restore(allow_partial=allow_partial)
    assert checkpointer_for(config, Trainer(config, env)).restore().next_offsets == {0: 7}  # the same topic loads
    # a warm start takes weights only, so the other topic's snapshot serves as one
    raw["checkpoint"] = {"path": str(tmp_path / "v2")}
    fresh = parse_config(raw, environ={})
    checkpointer_for(fresh, Trainer(fresh, env)).warm_start(config.checkpoint.path, with_optimizer=False)


# --- end to end: real broker, real ranks, real kills ---------------------------------------------


def final_stream(root: Path) -> dict:
    result = subprocess.run(
        [sys.executable, "-m", "streamtrain", "checkpoints", "inspect", str(root)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(result.stdout)


def rank_steps(ranks) -> str:
    return "/".join(str(int(r.scrape().get("streamtrain_global_step", -1))) for r in ranks)


@pytest.mark.integration
def test_exactly_once_across_random_sigkills(kafka, topic_name, start_ranks, live_producer, tmp_path):
    root = tmp_path / "snapshots"
    env = {
        "STREAMTRAIN_CHECKPOINT__PATH": str(root),
        "STREAMTRAIN_CHECKPOINT__INTERVAL_STEPS": "3",
        "STREAMTRAIN_DISTRIBUTED__TIMEOUT_SECONDS": "10",
    }
    produce(kafka.bootstrap_servers, topic_name, 200, partitions=PARTITIONS, seed=40, schema_path=SCHEMA)
    # A live stream at 2,000 events/s for as long as the ranks are being killed, then stopped: a
    # stream sized by count could run dry before the last trial, and a restart with nothing left
    # to replay never trains. The count only bounds it.
    producer = live_producer(kafka.bootstrap_servers, topic_name, 2000 * 60 * KILL_TRIALS, 2000, "--seed", "41")
    rng = random.Random(1234)
    trials = []
    try:
        for trial in range(KILL_TRIALS):
            ranks = start_ranks(topic_name, 2, env=env)
            ranks[0].wait_for(
                lambda ranks=ranks: all(r.scrape().get("streamtrain_batches_total", 0) > 0 for r in ranks),
                timeout=120,
                what="both ranks training",
            )
            time.sleep(rng.uniform(0.0, 2.0))
            victim = KILL_VICTIMS[trial] if trial < len(KILL_VICTIMS) else rng.choice(KILL_VICTIMS)
            targets = ranks if victim == "all" else [ranks[int(victim[-1])]]
            steps_at_kill = rank_steps(ranks)
            for rank in targets:
                rank.signal(signal.SIGKILL)
            codes = [r.wait(timeout=60) for r in ranks]
            assert all(code != 0 for code in codes), f"trial {trial}: {codes}"
            trials.append(victim)
            print(f"kill trial {trial + 1}: SIGKILL to {victim} at step {steps_at_kill}")
    finally:
        producer.stop(timeout=120)
    live_events = producer.produced()
    produced = end_offsets(kafka, topic_name)
    assert sum(produced.values()) == 200 + live_events

    survivors = start_ranks(topic_name, 2, "--until-end", env=env)
    assert [r.wait(timeout=180) for r in survivors] == [0, 0], survivors[0].output()[-3000:]
    stream = final_stream(root)["stream"]
    trained = {int(p): n for p, n in stream["trained"].items()}
    positions = {int(p): o for p, o in stream["next_offsets"].items()}
    # every event trained exactly once: no gap (positions at the end), no double count
    assert trained == produced, f"kills: {trials}"
    assert positions == produced


@pytest.mark.integration
def test_graceful_restart_continues_from_the_exact_next_offset(kafka, topic_name, start_ranks, tmp_path):
    root = tmp_path / "snapshots"
    env = {"STREAMTRAIN_CHECKPOINT__PATH": str(root)}
    produce(kafka.bootstrap_servers, topic_name, 3000, partitions=PARTITIONS, seed=42, schema_path=SCHEMA)
    first = start_ranks(topic_name, 2, env=env)
    first[0].wait_for(
        lambda: sum(r.total("streamtrain_events_trained_total") for r in first) >= 3000,
        timeout=120,
        what="the backlog trained",
    )
    first[0].signal(signal.SIGTERM)
    assert [r.wait(timeout=60) for r in first] == [0, 0]
    after_stop = final_stream(root)["stream"]["next_offsets"]
    assert sum(after_stop.values()) == 3000

    produce(kafka.bootstrap_servers, topic_name, 1000, partitions=PARTITIONS, seed=43, schema_path=SCHEMA)
    second = start_ranks(topic_name, 2, "--until-end", env=env)
    assert [r.wait(timeout=120) for r in second] == [0, 0]
    positions = {int(p): o for p, o in after_stop.items()}
    assert f"positions {dict(sorted(positions.items()))}" in second[0].output()
    stream = final_stream(root)["stream"]
    assert {int(p): n for p, n in stream["trained"].items()} == end_offsets(kafka, topic_name)


@pytest.mark.integration
def test_two_rank_snapshot_restores_into_one_rank(kafka, topic_name, start_ranks, start_worker, tmp_path):
    root = tmp_path / "snapshots"
    env = {"STREAMTRAIN_CHECKPOINT__PATH": str(root)}
    produce(kafka.bootstrap_servers, topic_name, 3000, partitions=PARTITIONS, seed=44, schema_path=SCHEMA)
    ranks = start_ranks(topic_name, 2, "--until-end", env=env)
    assert [r.wait(timeout=120) for r in ranks] == [0, 0]
    snapshot = list_snapshots(str(root))[0]
    assert snapshot.complete and snapshot.metadata["world_size"] == 2
    saved = torch.load(_as_torch_save(snapshot.path, tmp_path), weights_only=False)["model"]

    config = small_config(tmp_path, topic=topic_name)  # the snapshot's positions are in topic_name
    trainer = Trainer(config, init_distributed())
    assert checkpointer_for(config, trainer).restore().step == snapshot.step
    restored = weights(trainer)
    tables = [k for k in saved if "embedding_bags" in k]
    assert len(tables) == len(config.features.tables)
    for key in tables:
        assert torch.equal(restored[key], saved[key]), key


def _as_torch_save(snapshot: str, tmp_path: Path) -> Path:
    out = tmp_path / "full.pt"
    dcp_to_torch_save(snapshot, out)
    return out
