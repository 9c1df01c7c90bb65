"""The train stage on real TorchRec: planner, DMP, fused optimizer, TrainPipelineSparseDist (1 rank)."""

import gc
from pathlib import Path

import pytest
import torch
import yaml

from streamtrain import train
from streamtrain.config import ConfigError, parse_config
from streamtrain.decode import AvroBatchDecoder
from streamtrain.dev.produce import AvroEncoder, ClickStream, encoded_events
from streamtrain.device import init_distributed
from streamtrain.source import RawEvent
from streamtrain.train import Trainer

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def config():
    raw = yaml.safe_load((REPO / "tests" / "worker-small.yaml").read_text())
    raw["kafka"] = {"bootstrap_servers": "unused:9092", "topic": "unused"}
    return parse_config(raw, environ={})


@pytest.fixture(scope="module")
def batches(config):
    decoder = AvroBatchDecoder(config.features)
    events = [
        RawEvent(0, i, value, 0)
        for i, (_k, value, _p, _c) in enumerate(
            encoded_events(ClickStream(3, 0), AvroEncoder(REPO / "schemas" / "click_event.avsc"), 2048)
        )
    ]
    return [decoder.decode(events[i : i + 256]).batch for i in range(0, len(events), 256)], decoder


def model_state(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Every floating-point tensor of the model's state, as this rank holds it."""
    state = {}
    for name, value in trainer.model.state_dict().items():
        local = value.to_local() if hasattr(value, "to_local") else value
        if isinstance(local, torch.Tensor) and local.is_floating_point():
            state[name] = local.detach()
    return state


def table_weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {name.split(".")[-2]: v.clone() for name, v in model_state(trainer).items() if "embedding_bags" in name}


def test_every_table_is_trained_and_an_empty_batch_changes_nothing(config, batches):
    real, decoder = batches
    trainer = Trainer(config, init_distributed())
    before = table_weights(trainer)
    assert set(before) == {t.name for t in config.features.tables}
    stream = [real[0], real[1], decoder.decode([]).batch, decoder.decode([]).batch, *real[2:]]
    results, states = [], []
    for result in trainer.train(iter(stream)):
        results.append(result)
        states.append({k: v.clone() for k, v in model_state(trainer).items()})
    assert [r.batch.size for r in results] == [b.size for b in stream]
    # Adam's momentum would move the dense layers and the data-parallel tables at an empty step.
    for name, value in states[1].items():
        assert torch.equal(states[3][name], value), f"{name} changed at a step without events"
    assert all(torch.isfinite(torch.tensor(r.loss_sum)) for r in results)
    assert results[2].loss_sum == 0.0 and results[2].logits.numel() == 0
    after = table_weights(trainer)
    unchanged = [name for name in before if torch.equal(before[name], after[name])]
    assert unchanged == [], f"tables not updated: {unchanged}"
    sharding = {
        name: p.sharding_type for name, p in trainer.plan.plan["dlrm.sparse_arch.embedding_bag_collection"].items()
    }
    assert "table_wise" in sharding.values()


def test_while_training_the_collector_runs_only_every_few_steps_and_in_full_every_few_of_those(
    config, batches, monkeypatch
):
    real, _decoder = batches
    trainer = Trainer(config, init_distributed())
    monkeypatch.setattr(train, "GC_INTERVAL_STEPS", 2)
    monkeypatch.setattr(train, "GC_FULL_EVERY", 3)
    collections: list[tuple[int, int]] = []  # (the step just trained, generation)

    def record(phase: str, info: dict) -> None:
        if phase == "start":
            collections.append((trainer.step, info["generation"]))

    gc.callbacks.append(record)
    try:
        for _result in trainer.train(iter(real + real)):
            assert not gc.isenabled()
            while_training = list(collections)
            # Ten times what sets the collector off when it is on, and a cycle for it to find.
            cycles = [[] for _ in range(7000)]
            cycles[0].append(cycles)
            del cycles
    finally:
        gc.callbacks.remove(record)
    assert gc.isenabled()  # again, once training is over
    assert while_training == [(2, 1), (4, 1), (6, 2), (8, 1), (10, 1), (12, 2), (14, 1), (16, 1)]


def test_a_step_is_a_range_in_a_torch_profile_and_costs_no_range_otherwise(config, batches, monkeypatch):
    real, _decoder = batches
    trainer = Trainer(config, init_distributed())
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        for _result in trainer.train(iter(real[:3])):
            pass
    assert sum(event.name == "streamtrain.step" for event in profile.events()) >= 3
    entered: list[str] = []
    monkeypatch.setattr(torch.profiler, "record_function", lambda name: entered.append(name))
    for _result in trainer.train(iter(real[:3])):
        pass
    assert not [name for name in entered if name.startswith("streamtrain.")]


def test_a_table_fbgemms_kernel_cannot_build_is_refused_at_plan_time_and_trains_on_the_dense_kernel(batches):
    """A table 6 wide, planned table_wise on fbgemm's fused kernel, would fail in TorchRec at start-up
    (local_cols not divisible by 4, exit 1); the plan refuses it as a bad config, naming the field and the fix,
    for `streamtrain plan` and the worker alike. The fix it names builds and trains."""
    raw = yaml.safe_load((REPO / "tests" / "worker-small.yaml").read_text())
    raw["kafka"] = {"bootstrap_servers": "unused:9092", "topic": "unused"}
    raw["model"]["dense_arch_layer_sizes"] = [16, 6]
    for table in raw["features"]["tables"]:
        table["embedding_dim"] = 6
    narrow = parse_config(raw, environ={})
    with pytest.raises(ConfigError) as refused:
        train.plan_sharding(narrow, 2, "cpu")  # the dry run `streamtrain plan` makes
    message = str(refused.value)
    assert (
        "features.tables.0.embedding_dim: user_id is 6 wide, and the planner put it table_wise on fbgemm's fused "
        "kernel in shards [6] wide, which that kernel takes only in multiples of 4" in message
    )
    assert "compute_kernels: [dense]" in message and "STREAMTRAIN_FEATURES__TABLES__0__EMBEDDING_DIM" in message
    assert "pid" not in message  # a data_parallel replica runs on the dense kernel: not refused

    for table in raw["features"]["tables"]:
        table["compute_kernels"] = ["dense"]
    trainer = Trainer(parse_config(raw, environ={}), init_distributed())
    before = table_weights(trainer)
    results = list(trainer.train(iter(batches[0][:2])))
    assert len(results) == 2 and all(torch.isfinite(torch.tensor(r.loss_sum)) for r in results)
    after = table_weights(trainer)
    assert not torch.equal(before["user_id"], after["user_id"])  # trained on the dense kernel
