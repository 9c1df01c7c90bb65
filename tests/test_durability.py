"""What survives what (docs/durability.md): a restore that loads nothing refuses and keeps the
snapshots, ``--fresh-start`` sets them aside, retention keeps the snapshots committed last and never
fails a commit, every commit is fsynced before its rename, far-future event times are clamped, and
a start-up failure closes what it opened."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import socket
import time
from pathlib import Path

import pytest
import torch
import yaml
from fsspec.implementations.local import LocalFileSystem
from torch.distributed.checkpoint import FileSystemReader

from conftest import REPO, SCHEMA, end_offsets
from streamtrain import durable, worker
from streamtrain.checkpoint import Checkpointer, StreamState, list_snapshots
from streamtrain.config import parse_config
from streamtrain.decode import AvroBatchDecoder
from streamtrain.dev.produce import AvroEncoder, ClickStream, encoded_events, produce
from streamtrain.device import init_distributed
from streamtrain.exitcodes import ExitCode
from streamtrain.idspace import IdSpace
from streamtrain.metrics import WorkerMetrics
from streamtrain.source import RawEvent
from streamtrain.train import StepReadout, StepResult, Trainer
from test_checkpoint import weights


def small_config(tmp_path: Path, features: dict | None = None, **checkpoint):
    raw = yaml.safe_load((REPO / "tests" / "worker-small.yaml").read_text())
    raw["kafka"] = {"bootstrap_servers": "unused:9092", "topic": "unused"}
    raw["checkpoint"] = {"path": str(tmp_path / "snapshots"), **checkpoint}
    raw["features"].update(features or {})
    return parse_config(raw, environ={})


def one_batch(config, count: int = 64):
    events = [
        RawEvent(0, i, value, 0)
        for i, (_k, value, _p, _c) in enumerate(encoded_events(ClickStream(5, 0), AvroEncoder(SCHEMA), count))
    ]
    return AvroBatchDecoder(config.features).decode(events).batch


def tree(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in root.rglob("*") if p.is_file()
    }


# --- fsync and rename order -------------------------------------------------------------------------


class RecordingFileSystem(LocalFileSystem):
    """A local file system that records each write and rename, and fails the ones named in ``fail``."""

    def __init__(self, events: list[tuple[str, str]], fail: set[str] = frozenset()):
        super().__init__()
        self.events, self.fail = events, fail

    def pipe_file(self, path, value, **kwargs):
        self.events.append(("write", os.path.basename(path)))
        return super().pipe_file(path, value, **kwargs)

    def mv(self, path1, path2, **kwargs):
        self.events.append(("rename", f"{os.path.basename(path1)}->{os.path.basename(path2)}"))
        if "rename" in self.fail:
            raise OSError("injected: rename failed")
        return super().mv(path1, path2, **kwargs)


@pytest.fixture
def fsyncs(monkeypatch):
    """Every fsync the durable helper makes, as ("fsync", name) in the same list as the writes."""
    events: list[tuple[str, str]] = []
    fail: set[str] = set()
    real = os.fsync

    def fsync(fd: int) -> None:
        events.append(("fsync", os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))))
        if "fsync" in fail:
            raise OSError("injected: fsync failed")
        real(fd)

    monkeypatch.setattr(durable.os, "fsync", fsync)
    return events, fail


def test_fsync_file_then_rename_then_directory_and_a_failure_before_the_rename_keeps_the_old(tmp_path, fsyncs):
    events, fail = fsyncs
    fs = RecordingFileSystem(events, fail)
    durable.publish_file(fs, str(tmp_path / "latest"), b"step-1")
    assert events == [("write", "latest.tmp"), ("fsync", "latest.tmp"), ("rename", "latest.tmp->latest"),
                      ("fsync", tmp_path.name)]  # fmt: skip

    events.clear()
    partial = tmp_path / "step-2.partial"
    (partial / "sub").mkdir(parents=True)
    (partial / "sub" / "data").write_bytes(b"x")
    (partial / "marker").write_bytes(b"{}")
    durable.publish_folder(fs, str(partial), str(tmp_path / "step-2"))
    assert events[-2:] == [("rename", "step-2.partial->step-2"), ("fsync", tmp_path.name)]
    assert set(events[:-2]) == {("fsync", "data"), ("fsync", "sub"), ("fsync", "marker"), ("fsync", "step-2.partial")}
    assert events.index(("fsync", "data")) < events.index(("fsync", "sub"))  # a folder after what is in it

    for fault in ("fsync", "rename"):  # not durable: not acknowledged, and the old pointer stands
        fail.clear()
        fail.add(fault)
        with pytest.raises(OSError, match="injected"):
            durable.publish_file(fs, str(tmp_path / "latest"), b"step-2")
        assert (tmp_path / "latest").read_bytes() == b"step-1"


def test_fsync_a_snapshot_commit_syncs_its_marker_before_the_rename_and_latest_after(tmp_path, fsyncs, monkeypatch):
    events, _ = fsyncs
    rename = LocalFileSystem.mv

    def recorded(self, path1, path2, **kwargs):
        events.append(("rename", f"{os.path.basename(path1)}->{os.path.basename(path2)}"))
        return rename(self, path1, path2, **kwargs)

    monkeypatch.setattr(LocalFileSystem, "mv", recorded)
    config = small_config(tmp_path)
    trainer = Trainer(config, init_distributed())
    Checkpointer(config.checkpoint, config, trainer.model, trainer.optimizer, 0, 1, None).save(StreamState(step=1))
    mine = [e for e in events if e[1] in {"streamtrain.json", "snapshots", "latest.tmp"} or e[0] == "rename"]
    assert mine == [
        ("fsync", "streamtrain.json"),
        ("rename", "step-000000001.partial->step-000000001"),
        ("fsync", "snapshots"),
        ("fsync", "latest.tmp"),
        ("rename", "latest.tmp->latest"),
        ("fsync", "snapshots"),
    ]


# --- retention ----------------------------------------------------------------------------------------


def test_retention_keeps_the_snapshots_committed_last_not_the_highest_steps(tmp_path):
    config = small_config(tmp_path, keep_last=2)
    trainer = Trainer(config, init_distributed())

    def saver() -> Checkpointer:  # a new process each time, as after a restart
        return Checkpointer(config.checkpoint, config, trainer.model, trainer.optimizer, 0, 1, None)

    saver().save(StreamState(step=900))  # an old run's, at a high step
    restarted = saver()
    for step in (1, 2, 3):
        restarted.save(StreamState(step=step))
    kept = list_snapshots(config.checkpoint.path)
    assert [(s.step, s.metadata["commit"]) for s in kept] == [(3, 4), (2, 3)]


def test_retention_rm_failure_leaves_the_commit_counted_as_done(tmp_path, monkeypatch):
    config = small_config(tmp_path, keep_last=1)
    trainer = Trainer(config, init_distributed())
    metrics = WorkerMetrics(100)
    saver = Checkpointer(config.checkpoint, config, trainer.model, trainer.optimizer, 0, 1, None, metrics)
    saver.save(StreamState(step=1))

    def refuse(*_args, **_kwargs):
        raise PermissionError("injected: no delete permission")

    monkeypatch.setattr(LocalFileSystem, "rm", refuse)
    assert saver.save(StreamState(step=2)).step == 2  # committed, and acknowledged as such
    assert saver.consecutive_failures == 0 and saver.last_saved_step == 2
    sample = metrics.registry.get_sample_value
    assert sample("streamtrain_checkpoint_retention_failures_total") == 1
    assert sample("streamtrain_checkpoint_failures_total") == 0
    assert (Path(config.checkpoint.path) / "latest").read_text() == "step-000000002"
    monkeypatch.undo()
    saver.save(StreamState(step=3))  # the next commit's retention removes what the last could not
    assert [s.step for s in list_snapshots(config.checkpoint.path)] == [3]


def test_listing_beside_a_commit_that_renames_its_partial_folder_half_way_does_not_fail(tmp_path, monkeypatch):
    """A reader lists snapshots while a save commits: the .partial folder it is sizing is renamed to
    its final name between the walk and a file's stat. It was an error (FileNotFoundError out of
    list_snapshots, seen by a test waiting for a snapshot); the folder now reads as gone."""
    root = tmp_path / "snapshots"
    partial = root / "step-000000003.partial"
    partial.mkdir(parents=True)
    (partial / "__0_0.distcp").write_bytes(b"x" * 10)
    stat = LocalFileSystem.info

    def info_as_the_save_commits(self, path, **kwargs):
        if str(path).endswith(".distcp") and partial.exists():
            partial.rename(root / "step-000000003")
        return stat(self, path, **kwargs)

    monkeypatch.setattr(LocalFileSystem, "info", info_as_the_save_commits)
    (snapshot,) = list_snapshots(str(root))
    assert not snapshot.complete and snapshot.bytes == 0


def test_restore_takes_the_snapshot_committed_last_as_retention_does_not_an_abandoned_higher_step(tmp_path):
    """A restart fell back from step 10 (unreadable then) to step 6 and committed step 8; retention keeps all
    three by commit. The next restart, step 10 readable again, must go on from step 8, this timeline's newest."""
    config = small_config(tmp_path, keep_last=3)
    root = Path(config.checkpoint.path)
    env = init_distributed()
    batch = one_batch(config)

    def checkpointer(trainer: Trainer) -> Checkpointer:  # a new process each time, as after a restart
        return Checkpointer(config.checkpoint, config, trainer.model, trainer.optimizer, 0, 1, None)

    first = Trainer(config, env)
    saver = checkpointer(first)
    list(first.train(iter([batch])))  # the optimizer's state exists once a step ran
    saver.save(StreamState(step=6, next_offsets={0: 6}))
    list(first.train(iter([batch])))
    saver.save(StreamState(step=10, next_offsets={0: 10}))

    marker = root / "step-000000010" / "streamtrain.json"
    kept = marker.read_bytes()
    marker.unlink()  # unreadable at this restart
    fell_back = Trainer(config, env)
    saver = checkpointer(fell_back)
    assert saver.restore().step == 6
    marker.write_bytes(kept)  # and readable again
    list(fell_back.train(iter([batch, batch])))
    newest = weights(fell_back)
    saver.save(StreamState(step=8, next_offsets={0: 8}))
    assert sorted(s.step for s in list_snapshots(str(root))) == [6, 8, 10]  # retention keeps all three

    restarted = Trainer(config, env)
    assert checkpointer(restarted).restore() == StreamState(step=8, next_offsets={0: 8})
    assert all(torch.equal(value, newest[key]) for key, value in weights(restarted).items())


def test_retention_never_removes_a_snapshot_it_could_not_read_nor_a_pinned_one(tmp_path, monkeypatch):
    config = small_config(tmp_path, keep_last=1)
    trainer = Trainer(config, init_distributed())
    saver = Checkpointer(config.checkpoint, config, trainer.model, trainer.optimizer, 0, 1, None)
    unreadable: set[str] = set()  # snapshots whose DCP metadata fails to read, once each
    read_metadata = FileSystemReader.read_metadata

    def flaky(reader):
        name = Path(reader.path).name
        if name in unreadable:
            unreadable.discard(name)
            raise OSError(f"injected: {name}'s metadata failed to read")
        return read_metadata(reader)

    monkeypatch.setattr(FileSystemReader, "read_metadata", flaky)

    def steps() -> list[int]:
        return sorted(int(p.name[5:]) for p in Path(config.checkpoint.path).glob("step-*"))

    saver.save(StreamState(step=1))
    saver.save(StreamState(step=2))
    assert steps() == [2]
    saver.pinned.add(2)  # an export reads it
    unreadable.add("step-000000002")
    saver.save(StreamState(step=3))
    assert steps() == [2, 3]  # pinned, and unreadable this once: kept
    saver.pinned.discard(2)
    unreadable.add("step-000000003")
    saver.save(StreamState(step=4))
    assert steps() == [3, 4]  # 3 unreadable this once: kept; 2 readable and let go: removed
    saver.save(StreamState(step=5))
    assert steps() == [5]  # readable again, 3 goes as retention says


def test_a_snapshot_size_that_cannot_be_read_is_counted_not_raised(tmp_path, monkeypatch):
    """The size is read on each rank by itself after the ranks agreed on the commit: raising there on one
    rank would leave the others waiting at the next collective."""
    config = small_config(tmp_path)
    trainer = Trainer(config, init_distributed())
    metrics = WorkerMetrics(100)
    saver = Checkpointer(config.checkpoint, config, trainer.model, trainer.optimizer, 0, 1, None, metrics)
    du = LocalFileSystem.du

    def failing(fs, path, *args, **kwargs):
        if re.search(r"step-\d+$", str(path)):  # a committed snapshot's folder
            raise OSError("injected: the listing failed")
        return du(fs, path, *args, **kwargs)

    monkeypatch.setattr(LocalFileSystem, "du", failing)
    assert saver.save(StreamState(step=1)).step == 1
    assert metrics.registry.get_sample_value("streamtrain_checkpoint_size_failures_total") == 1
    assert saver.last_saved_step == 1 and saver.consecutive_failures == 0


# --- event time ---------------------------------------------------------------------------------------


def test_clamp_a_far_future_event_time_neither_expires_ttl_rows_nor_skews_freshness():
    managed = {
        "id_mapping": "managed",
        "rows": 500,
        "eviction": {"policy": "ttl", "ttl_seconds": 60},
        "admission": {"probability": 1},  # the first batch's ids take rows at once
    }
    config = small_config(Path("/unused"))
    raw = config.model_dump(mode="json")
    user = next(t for t in raw["features"]["tables"] if t["name"] == "user_id")
    del user["num_embeddings"]
    user.update(managed)
    config = parse_config(raw, environ={})
    batch = one_batch(config)
    now_ms = int(time.time() * 1000)
    id_space = IdSpace(config.features, 1, None)
    id_space.translate(dataclasses.replace(batch, event_time_ms=torch.full_like(batch.event_time_ms, now_ms)))
    live = id_space.mapping.tables["user_id"].occupied
    # one producer writes microseconds into the millisecond field
    future = batch.event_time_ms.clone().fill_(now_ms)
    future[0] = now_ms * 1000
    id_space.translate(dataclasses.replace(batch, event_time_ms=future))
    assert id_space.mapping.tables["user_id"].occupied == live  # nothing expired

    metrics = WorkerMetrics(100)
    progress = worker._Progress(
        metrics, 0, "clicks", 3600, lambda: 0, [], event_time_bound=config.features.event_time_bound_ms
    )
    logits = torch.zeros(batch.size)
    readout = StepReadout(torch.tensor(0.0), logits)
    progress.record(StepResult(1, dataclasses.replace(batch, event_time_ms=future), readout, 0.01, 0.0))
    assert metrics.registry.get_sample_value("streamtrain_event_times_clamped_total") == 1
    assert metrics.freshness.sum >= -config.features.max_event_time_skew_seconds - 1  # one event an hour ahead


# --- the worker: refuse, set aside, close what it opened ------------------------------------------------


@pytest.mark.integration
def test_fresh_start_after_a_restore_that_loads_nothing_exit_7_and_lose_nothing(
    kafka, topic_name, start_worker, tmp_path
):
    root = tmp_path / "snapshots"
    env = {
        "STREAMTRAIN_CHECKPOINT__PATH": str(root),
        "STREAMTRAIN_CHECKPOINT__INTERVAL_STEPS": "1",
        "STREAMTRAIN_CHECKPOINT__KEEP_LAST": "2",
    }
    produce(kafka.bootstrap_servers, topic_name, 1000, partitions=4, seed=38, schema_path=SCHEMA)
    first = start_worker(topic_name, "--until-end", env=env)
    assert first.wait(timeout=120) == 0, first.output()[-3000:]
    damaged = sorted(p.name for p in root.glob("step-*"))
    assert len(damaged) == 2
    for name in damaged:
        data = max((p for p in (root / name).iterdir() if p.suffix == ".distcp"), key=lambda p: p.stat().st_size)
        data.write_bytes(data.read_bytes()[:10])
    before = tree(root)

    refused = start_worker(topic_name, "--until-end", env=env)
    assert refused.wait(timeout=120) == ExitCode.RESTORE_REFUSED, refused.output()[-3000:]
    output = refused.output()
    assert all(f"{root / name}: data file" in output for name in damaged), output[-3000:]
    assert "--fresh-start" in output and tree(root) == before  # nothing removed, nothing written

    fresh = start_worker(topic_name, "--until-end", "--fresh-start", env=env)
    assert fresh.wait(timeout=120) == 0, fresh.output()[-3000:]
    (aside,) = root.glob("aside-*")
    assert tree(aside) == before  # every snapshot and `latest`, as they were
    own = list_snapshots(str(root))
    assert len(own) == 2 and all(s.complete for s in own)  # its own, kept by retention
    trained = {int(p): n for p, n in own[0].metadata["stream"]["trained"].items()}
    assert trained == end_offsets(kafka, topic_name)  # started at the configured position: everything


@pytest.mark.integration
def test_startup_failure_after_the_source_opens_closes_what_it_opened(kafka, topic_name, tmp_path, monkeypatch, caplog):
    in_the_way = tmp_path / "bases"
    in_the_way.write_text("a file where delivery.path's folder should be")
    raw = small_config(tmp_path).model_dump(mode="json", exclude_none=True)
    raw["kafka"] = {"bootstrap_servers": kafka.bootstrap_servers, "topic": topic_name, "group_id": topic_name}
    raw["delivery"] = {"enabled": True, "directory": str(tmp_path / "deltas"), "path": str(in_the_way)}
    config = parse_config(raw, environ={})
    produce(kafka.bootstrap_servers, topic_name, 10, partitions=4, seed=39, schema_path=SCHEMA)
    opened = []

    class Source(worker.KafkaSource):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            opened.append(self)

    monkeypatch.setattr(worker, "KafkaSource", Source)
    with caplog.at_level("INFO", "streamtrain"), pytest.raises(FileExistsError, match=str(in_the_way)):
        worker.run_worker(config)  # the delta chain's first base version cannot be reserved
    (source,) = opened
    with pytest.raises(RuntimeError, match="closed"):
        source.consumer.assignment()
    port = int(re.search(r"metrics on http://[^:]+:(\d+)/", caplog.text)[1])
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5)
