"""The data path made ready for GPUs, checked on CPU: pinned batches (a seam, since pinning needs a
CUDA driver), step values read one step late, KJT length caches, the vote after the forward, and
snapshot staging chosen per device. What only a GPU can show is listed in docs/gpus.md."""

from __future__ import annotations

import itertools
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import streamtrain.checkpoint as checkpoint_module
from streamtrain.batch import Prefetcher, host_staging
from streamtrain.checkpoint import (
    Checkpointer,
    CheckpointError,
    KeptBuffersStager,
    StagerPerSnapshot,
    StreamState,
    kept_default_stager,
    snapshot_stager,
    staging_options,
)
from streamtrain.config import BatchingConfig, parse_config
from streamtrain.decode import AvroBatchDecoder, ClickBatch, DecodeResult, FastavroDecoder, PartitionSpan
from streamtrain.dev.produce import AvroEncoder, ClickStream, encoded_events
from streamtrain.device import init_distributed
from streamtrain.metrics import WorkerMetrics
from streamtrain.source import EventBatch, RawEvent
from streamtrain.train import StepReadout, StepResult, Trainer
from streamtrain.worker import _Progress

REPO = Path(__file__).resolve().parent.parent
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def small_config(tmp_path: Path | None = None):
    raw = yaml.safe_load((REPO / "tests" / "worker-small.yaml").read_text())
    raw["kafka"] = {"bootstrap_servers": "unused:9092", "topic": "unused"}
    if tmp_path is not None:
        raw["checkpoint"] = {"path": str(tmp_path / "snapshots")}
    return parse_config(raw, environ={})


@pytest.fixture(scope="module")
def config():
    return small_config()


@pytest.fixture(scope="module")
def events() -> list[RawEvent]:
    encoder = AvroEncoder(REPO / "schemas" / "click_event.avsc")
    return [
        RawEvent(i % 2, i, value, 0)
        for i, (_k, value, _p, _c) in enumerate(encoded_events(ClickStream(7, 0), encoder, 1200))
    ]


@pytest.fixture(scope="module")
def uneven_batches(config, events) -> list[ClickBatch]:
    """Batches of different sizes, an empty one among them, so a value paired with the wrong
    batch shows."""
    decoder = AvroBatchDecoder(config.features)
    cuts = [0, 256, 256, 356, 612, 649, 905, 1161]
    return [decoder.decode(events[a:b]).batch for a, b in itertools.pairwise(cuts)]


# --- pinned copies (item 3) ------------------------------------------------------------------


def _pinning_spy(monkeypatch) -> set[int]:
    """Tensor.pin_memory replaced by a copy that remembers what it made: a CPU-only host has no
    driver to pin with."""
    pinned: set[int] = set()

    def pin_memory(self, device=None):
        copy = self.clone()
        pinned.add(id(copy))
        return copy

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    return pinned


def _tensors(batch: ClickBatch) -> dict[str, torch.Tensor]:
    kjt = batch.sparse_features
    return {
        "dense": batch.dense_features,
        "labels": batch.labels,
        "event_time": batch.event_time_ms,
        "loss_scale": batch.loss_scale,
        "values": kjt.values(),
        "lengths": kjt.lengths(),
    }


def test_pin_memory_pins_every_tensor_of_a_batch(monkeypatch, config, events):
    batch = AvroBatchDecoder(config.features).decode(events[:50]).batch
    pinned = _pinning_spy(monkeypatch)
    result = batch.pin_memory()
    assert {name for name, t in _tensors(result).items() if id(t) not in pinned} == set()
    for name, tensor in _tensors(batch).items():
        assert torch.equal(_tensors(result)[name], tensor), name
    assert result.spans == batch.spans and result.global_batch_size == batch.global_batch_size
    assert result.sparse_features._length_per_key == batch.sparse_features._length_per_key


@CUDA
def test_cuda_pin_memory_pins_every_tensor_of_a_batch(config, events):
    batch = AvroBatchDecoder(config.features).decode(events[:50]).batch.pin_memory()
    assert all(t.is_pinned() for t in _tensors(batch).values())
    assert batch.in_global_step(100, 2).loss_scale.is_pinned()


def test_pin_the_global_step_loss_scale_is_pinned_when_the_batch_was(monkeypatch, config, events):
    batch = AvroBatchDecoder(config.features).decode(events[:50]).batch
    asked: list[bool] = []
    original = torch.tensor

    def tensor(*args, pin_memory=False, **kwargs):
        asked.append(pin_memory)
        return original(*args, **kwargs)

    monkeypatch.setattr(torch, "tensor", tensor)
    unpinned = batch.in_global_step(100, 2)
    batch.loss_scale.is_pinned = lambda: True  # as after pin_memory() on a GPU host
    pinned = batch.in_global_step(100, 2)
    assert asked == [False, True]
    assert float(unpinned.loss_scale) == float(pinned.loss_scale) == pytest.approx(0.02)


class _ListSource:
    topic = "clicks"
    topic_partitions = 1

    def __init__(self, events: list[RawEvent]):
        self.events = list(events)

    @property
    def exhausted(self) -> bool:
        return not self.events

    def poll(self, n: int, timeout: float) -> EventBatch:
        got, self.events = self.events[:n], self.events[n:]
        return EventBatch.of_events(got)

    def commit(self, offsets: dict[int, int]) -> None:
        pass

    def lag(self) -> dict[int, int]:
        return {}

    def pick_up_new_partitions(self) -> list[int]:
        return []


class _NoRejections:
    def paused(self) -> bool:
        return False

    def handle(self, events_read: int, rejected: list, stopping: threading.Event) -> bool:
        return True


class _RecordingDecoder:
    def __init__(self, decoder: AvroBatchDecoder):
        self.decoder = decoder
        self.made: list[ClickBatch] = []

    def decode(self, events: EventBatch) -> DecodeResult:
        result = self.decoder.decode(events)
        self.made.append(result.batch)
        return result


def _drain(device: torch.device, config, events: list[RawEvent]) -> tuple[list[ClickBatch], _RecordingDecoder]:
    decoder = _RecordingDecoder(AvroBatchDecoder(config.features))
    prefetcher = Prefetcher(
        _ListSource(events),  # type: ignore[arg-type]
        decoder,  # type: ignore[arg-type]
        BatchingConfig(batch_size=40, max_batch_wait_ms=1000, queue_size=8),
        WorkerMetrics(),
        _NoRejections(),  # type: ignore[arg-type]
        device=device,
    ).start()
    handed: list[ClickBatch] = []
    deadline = time.monotonic() + 30
    while not prefetcher.finished and time.monotonic() < deadline:
        batch = prefetcher.get(0.1)
        if batch is not None:
            handed.append(batch)
    prefetcher.join(5)
    assert prefetcher.finished and prefetcher.error is None
    return handed, decoder


def test_the_prefetcher_says_the_sizes_of_the_batches_get_hands_over_next(config, events):
    prefetcher = Prefetcher(
        _ListSource(events[:100]),  # type: ignore[arg-type]
        AvroBatchDecoder(config.features),
        BatchingConfig(batch_size=40, max_batch_wait_ms=1000, queue_size=8),
        WorkerMetrics(),
        _NoRejections(),  # type: ignore[arg-type]
    ).start()
    prefetcher.thread.join(30)  # it has queued all three batches and the end
    assert prefetcher.waiting(2) == [40, 40]
    assert prefetcher.waiting(8) == [40, 40, 20]  # the end is no batch
    handed = [prefetcher.get(1.0) for _ in range(3)]
    assert [b.size for b in handed if b is not None] == [40, 40, 20]
    assert prefetcher.waiting(8) == [] and prefetcher.get(1.0) is None and prefetcher.finished


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="SCHED_BATCH is Linux's")
def test_the_prefetch_thread_alone_runs_as_a_batch_thread(config, events):
    prefetcher = Prefetcher(
        _ListSource(events),  # type: ignore[arg-type]
        AvroBatchDecoder(config.features),
        BatchingConfig(batch_size=40, max_batch_wait_ms=1000, queue_size=1),
        WorkerMetrics(),
        _NoRejections(),  # type: ignore[arg-type]
    ).start()
    try:
        assert prefetcher.get(10.0) is not None  # the thread has started, and waits on the full queue
        assert os.sched_getscheduler(prefetcher.thread.native_id) == os.SCHED_BATCH
        assert os.sched_getscheduler(0) == os.SCHED_OTHER  # the trainer's thread keeps its policy
    finally:
        prefetcher.join(5)


def test_pin_prefetcher_on_cpu_hands_batches_over_as_decoded(monkeypatch, config, events):
    set_devices: list[object] = []
    monkeypatch.setattr(torch.cuda, "set_device", set_devices.append)
    pinned = _pinning_spy(monkeypatch)
    handed, decoder = _drain(torch.device("cpu"), config, events[:100])
    assert [b.size for b in handed] == [40, 40, 20]
    assert all(h is d for h, d in zip(handed, decoder.made, strict=True))
    assert set_devices == [] and pinned == set()
    assert host_staging(torch.device("cpu"))(handed[0]) is handed[0]


def test_pin_prefetcher_for_cuda_pins_in_its_thread_on_the_trainers_device(monkeypatch, config, events):
    calls: list[tuple[str, str, object]] = []
    monkeypatch.setattr(
        torch.cuda, "set_device", lambda d: calls.append(("set_device", threading.current_thread().name, d))
    )

    def pin_memory(self: ClickBatch) -> ClickBatch:
        calls.append(("pin", threading.current_thread().name, self.size))
        return self.in_global_step(-1, 1)  # a different batch, to see that it is the one handed over

    monkeypatch.setattr(ClickBatch, "pin_memory", pin_memory)
    handed, _ = _drain(torch.device("cuda", 1), config, events[:100])
    assert calls == [
        ("set_device", "streamtrain-prefetch", torch.device("cuda", 1)),
        ("pin", "streamtrain-prefetch", 40),
        ("pin", "streamtrain-prefetch", 40),
        ("pin", "streamtrain-prefetch", 20),
    ]
    assert [b.global_batch_size for b in handed] == [-1, -1, -1]


# --- KJT length caches (item 5) ----------------------------------------------------------------


def _assert_cached(batch: ClickBatch) -> None:
    kjt = batch.sparse_features
    assert kjt._length_per_key is not None and kjt._offset_per_key is not None
    fresh = KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values(), lengths=kjt.lengths())
    assert kjt._length_per_key == fresh.length_per_key()
    assert kjt._offset_per_key == fresh.offset_per_key()


def test_device_batches_carry_kjt_length_caches_from_every_path(config, events):
    compiled = AvroBatchDecoder(config.features)
    with_rejections = [*events[:30], RawEvent(0, 999, b"\x01", 0), *events[30:60]]
    result = compiled.decode(with_rejections)
    assert len(result.rejected) == 1
    for batch in (
        compiled.decode(events[:64]).batch,
        result.batch,  # the rows of the kept events only
        compiled.decode([]).batch,  # the lockstep's filler
        FastavroDecoder(config.features).decode(events[:64]).batch,
        FastavroDecoder(config.features).decode(with_rejections).batch,
        FastavroDecoder(config.features).decode([]).batch,
        compiled.decode(events[:64]).batch.in_global_step(128, 2),
    ):
        _assert_cached(batch)
    assert compiled.decode([]).batch.sparse_features._length_per_key == [0] * len(config.features.tables)


# --- step values read one step late (item 4) ---------------------------------------------------


def test_device_step_readouts_match_the_eager_reading_batch_by_batch(config, uneven_batches):
    env = init_distributed()
    trainer = Trainer(config, env)
    results = list(trainer.train(iter(uneven_batches)))

    eager = Trainer(config, env)  # the same seed: the same weights; read as the old code did

    def taken_as_train_takes_them():  # the FIFO tells the dense optimizer which batch it steps
        for batch in uneven_batches:
            eager.taken.append(batch)
            yield batch

    source = taken_as_train_takes_them()
    expected = []
    while True:
        try:
            loss_sum, logits, labels = eager.pipeline.progress(source)
        except StopIteration:
            break
        eager.taken.popleft()
        expected.append((float(loss_sum), logits, labels))

    assert [r.batch for r in results] == uneven_batches
    assert len(expected) == len(results)
    for result, (loss_sum, logits, labels) in zip(results, expected, strict=True):
        assert result.loss_sum == loss_sum
        assert torch.equal(result.logits, logits.float())
        assert torch.equal(result.labels, labels)
        # and the values belong to the batch they are reported with
        assert result.logits.shape == result.batch.labels.shape
        bce = F.binary_cross_entropy_with_logits(result.logits, result.batch.labels, reduction="sum")
        assert result.loss_sum == pytest.approx(float(bce), rel=1e-5, abs=1e-6)


def _result(step: int, size: int, rng: np.random.Generator) -> StepResult:
    labels = torch.from_numpy((rng.random(size) < 0.3).astype(np.float32))
    logits = torch.from_numpy(rng.normal(size=size).astype(np.float32))
    loss_sum = F.binary_cross_entropy_with_logits(logits, labels, reduction="sum")
    batch = ClickBatch(
        dense_features=torch.zeros(size, 1),
        sparse_features=KeyedJaggedTensor(
            keys=["t"], values=torch.zeros(0, dtype=torch.int64), lengths=torch.zeros(size, dtype=torch.int32)
        ).sync(),
        labels=labels,
        event_time_ms=torch.full((size,), int(time.time() * 1000)),
        loss_scale=torch.tensor(1.0),
        spans={0: PartitionSpan(size, step * 1000)},
        global_batch_size=size,
    )
    return StepResult(step, batch, StepReadout(loss_sum, logits), 0.01, 0.001)


def test_device_progress_reads_values_one_step_late_with_the_eager_figures(caplog):
    rng = np.random.default_rng(3)
    results = [_result(step, size, rng) for step, size in enumerate([50, 0, 80, 33, 120, 7], start=1)]
    progress = _Progress(WorkerMetrics(), 0, "clicks", 3600, lambda: 0, [])
    quality = progress.metrics.progressive_quality
    read_before: list[float] = []
    with progress:
        for result in results:
            progress.record(result)
            progress.metrics.task_quality.compute()  # as a scrape reads it: what was added is folded in
            read_before.append(quality.sums[3])
            assert progress.trained == sum(r.batch.size for r in results[: result.step])
    # each step's values are read at the next step; the last at the end
    assert read_before == [sum(r.batch.size for r in results[: i - 1]) for i in range(1, len(results) + 1)]

    eager = WorkerMetrics()
    for result in results:
        if result.batch.size:
            eager.progressive_quality.add(result.logits.numpy(), result.batch.labels.numpy())
            eager.loss.set(result.loss_sum / result.batch.size)
    assert np.array_equal(quality.positives, eager.progressive_quality.positives)
    assert np.array_equal(quality.negatives, eager.progressive_quality.negatives)
    assert np.array_equal(quality.sums, eager.progressive_quality.sums)
    assert quality.compute() == eager.progressive_quality.compute()
    assert progress.metrics.registry.get_sample_value("streamtrain_loss") == eager.registry.get_sample_value(
        "streamtrain_loss"
    )
    assert progress.loss_sum == pytest.approx(sum(r.loss_sum for r in results))
    assert progress.loss_events == progress.trained == 290


# --- the vote after the forward (item 6) -------------------------------------------------------


def _weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    def plain(value):
        value = value.to_local() if hasattr(value, "to_local") else value
        if hasattr(value, "local_shards"):
            (value,) = value.local_shards()
        return value.detach().clone()

    return {k: plain(v) for k, v in trainer.model.state_dict().items()}


def test_device_batch_i_plus_2_is_fetched_after_batch_is_forward(config, uneven_batches):
    trainer = Trainer(config, init_distributed())
    order: list[str] = []
    trainer.model.register_forward_pre_hook(lambda *_: order.append("forward"))

    def fetched():
        for i, batch in enumerate(uneven_batches[:4]):
            order.append(f"fetch {i}")
            yield batch

    list(trainer.train(fetched()))
    assert order[:5] == ["fetch 0", "fetch 1", "forward", "fetch 2", "forward"]


def test_device_vote_after_forward_trains_the_same_weights(config, uneven_batches):
    env = init_distributed()
    after = Trainer(config, env)
    before = Trainer(config, env)
    before.pipeline = TrainPipelineSparseDist(
        before.model, before.optimizer, env.device, execute_all_batches=True, enqueue_batch_after_forward=False
    )
    losses_after = [r.loss_sum for r in after.train(iter(uneven_batches))]
    losses_before = [r.loss_sum for r in before.train(iter(uneven_batches))]
    assert losses_after == losses_before
    weights_after, weights_before = _weights(after), _weights(before)
    assert weights_after.keys() == weights_before.keys()
    for key, value in weights_after.items():
        assert torch.equal(value, weights_before[key]), key


# --- snapshot staging per device (item 9) ------------------------------------------------------


def test_device_snapshot_staging_is_chosen_per_device():
    assert isinstance(snapshot_stager(torch.device("cpu"), "thread"), KeptBuffersStager)
    assert snapshot_stager(torch.device("cpu"), "process") is None  # DCP's own, for its helper process
    assert staging_options(torch.device("cpu"), "thread") is None
    cuda = staging_options(torch.device("cuda", 0), "thread")
    assert cuda is not None
    assert cuda.use_pinned_memory and cuda.use_non_blocking_copy
    assert not cuda.use_async_staging  # async_save returns once the cut is on the host
    assert not cuda.use_shared_memory
    with pytest.raises(CheckpointError, match="async_mode: process does not support a CUDA trainer"):
        staging_options(torch.device("cuda", 0), "process")


def test_device_stager_per_snapshot_stages_every_snapshot_as_a_copy():
    """The stager for a torch whose DefaultStager closes itself after a stage (2.11): every
    snapshot stages, and each staged state is a copy that later steps do not move."""
    stager = StagerPerSnapshot(StagingOptions(False, False, False, False))
    weights = {"table": torch.arange(4.0), "nested": {"bias": torch.ones(2)}, "step": 3}
    staged = []
    for _ in range(3):
        staged.append(stager.stage(weights))
        weights["table"] += 1
    assert [s["table"].tolist() for s in staged] == [[0, 1, 2, 3], [1, 2, 3, 4], [2, 3, 4, 5]]
    assert all(s["step"] == 3 and torch.equal(s["nested"]["bias"], torch.ones(2)) for s in staged)


def test_device_cpu_checkpointer_keeps_dcps_own_staging_only_for_the_helper_process(tmp_path, config):
    trainer = Trainer(config, init_distributed())
    for mode, kept in (("thread", True), ("process", False)):
        checkpoint_config = small_config(tmp_path)
        checkpoint = checkpoint_config.checkpoint.model_copy(update={"async_mode": mode})
        checkpointer = Checkpointer(checkpoint, checkpoint_config, trainer.model, trainer.optimizer, 0, 1, None)
        assert (checkpointer.stager is not None) == kept, mode


def test_device_staged_snapshots_are_the_cut_through_a_kept_stager(monkeypatch, tmp_path, uneven_batches):
    """The CUDA route, with pinning and non-blocking copies (which need a GPU) switched off: the
    DTensor state goes through DCP's DefaultStager, whose host buffers are reused by the next
    snapshot (on torch 2.11, a DefaultStager made per snapshot), and each snapshot is still its
    step's cut."""
    monkeypatch.setattr(
        checkpoint_module,
        "snapshot_stager",
        lambda device, mode: kept_default_stager(StagingOptions(False, False, False, False)),
    )
    config = small_config(tmp_path)
    env = init_distributed()
    trainer = Trainer(config, env)
    checkpointer = Checkpointer(config.checkpoint, config, trainer.model, trainer.optimizer, 0, 1, None)
    assert isinstance(checkpointer.stager, (DefaultStager, StagerPerSnapshot))
    list(trainer.train(iter(uneven_batches[:2])))
    checkpointer.save(StreamState(step=2, next_offsets={0: 2}, trained={0: 2}))
    list(trainer.train(iter(uneven_batches[2:4])))
    at_save = _weights(trainer)
    checkpointer.start_save(StreamState(step=4, next_offsets={0: 4}, trained={0: 4}))
    list(trainer.train(iter(uneven_batches[4:])))  # the weights move on while the save is written
    assert any(not torch.equal(at_save[k], v) for k, v in _weights(trainer).items())
    assert checkpointer.finish_save() is not None

    restored = Trainer(config, env)
    stream = Checkpointer(config.checkpoint, config, restored.model, restored.optimizer, 0, 1, None).restore()
    assert stream is not None and stream.step == 4
    for key, value in _weights(restored).items():
        assert torch.equal(value, at_save[key]), key
