"""Batches sized for the device, and learning rates that follow the batch (docs/batching.md): the
default batch_size per device, the scaling rule, its switch, and the rates the trainer uses."""

import pytest
import torch
import yaml

from conftest import SMALL_CONFIG
from streamtrain import device as device_module
from streamtrain.config import DEFAULT_BATCH_SIZE, MAX_LEARNING_RATE_SCALE, ConfigError, parse_config
from streamtrain.device import init_distributed
from streamtrain.train import Trainer


def small(batching: dict | None = None, device: str | None = None) -> dict:
    raw = yaml.safe_load(SMALL_CONFIG.read_text())
    raw["batching"] = batching if batching is not None else {}
    if device is not None:
        raw.setdefault("distributed", {})["device"] = device
    return raw


@pytest.fixture
def this_host(monkeypatch):
    """Which device distributed.device: auto finds here, set by the test (the host's own would
    make the default depend on where the suite runs)."""

    def on(kind: str) -> None:
        monkeypatch.setattr(device_module, "fbgemm_variant", lambda: kind)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: kind == "cuda")

    return on


@pytest.mark.parametrize("kind", ["cpu", "cuda"])
def test_batch_size_unset_or_null_is_the_default_of_the_device_auto_finds(this_host, kind):
    this_host(kind)
    assert parse_config(small(), environ={}).batching.batch_size == DEFAULT_BATCH_SIZE[kind]
    assert parse_config(small({"batch_size": None}), environ={}).batching.batch_size == DEFAULT_BATCH_SIZE[kind]


def test_batch_size_default_follows_the_device_asked_for(this_host):
    this_host("cuda")
    assert parse_config(small(device="cpu"), environ={}).batching.batch_size == 1024
    this_host("cpu")  # refused when the worker starts; the default is cuda's all the same
    assert parse_config(small(device="cuda"), environ={}).batching.batch_size == DEFAULT_BATCH_SIZE["cuda"]
    assert DEFAULT_BATCH_SIZE == {"cpu": 1024, "cuda": 16_384}


def test_batch_size_set_in_the_file_or_the_environment_wins_over_the_device_default(this_host):
    this_host("cuda")
    assert parse_config(small({"batch_size": 2048}), environ={}).batching.batch_size == 2048
    environ = {"STREAMTRAIN_BATCHING__BATCH_SIZE": "4096"}
    assert parse_config(small(), environ=environ).batching.batch_size == 4096


def test_a_bad_device_is_named_by_the_validation_not_hidden_by_the_default():
    with pytest.raises(ConfigError, match=r"distributed\.device: Input should be 'auto', 'cpu' or 'cuda'"):
        parse_config(small(device="gpu"), environ={})


def scales(batch_size: int, world_size: int = 1, optimizer: str = "row_wise_adagrad", **batching) -> tuple:
    raw = small({"batch_size": batch_size, **batching})
    raw["model"]["sparse_optimizer"] = optimizer
    return parse_config(raw, environ={}).learning_rate_scales(world_size)


@pytest.mark.parametrize(
    "batch_size, world_size, dense",
    [
        (1024, 1, 1.0),  # the reference
        (256, 1, 1.0),  # never below the rates as configured
        (512, 2, 1.0),
        (8192, 1, 8.0),
        (8192, 2, 16.0),  # the global batch counts: 16,384 events a step
        (32768, 1, 32.0),
        (32768, 4, MAX_LEARNING_RATE_SCALE),  # Adam diverged beyond
    ],
)
def test_dense_rate_scales_with_the_global_batch_and_adagrads_sparse_rate_stays(batch_size, world_size, dense):
    for optimizer in ("row_wise_adagrad", "adagrad"):
        assert scales(batch_size, world_size, optimizer) == pytest.approx((1.0, dense))
    assert scales(batch_size, world_size, "sgd") == pytest.approx((dense, dense))


def test_learning_rate_scaling_can_be_switched_off_or_referenced_elsewhere():
    assert scales(32768, 4, learning_rate_scaling="none") == (1.0, 1.0)
    assert scales(32768, 1, "sgd", reference_batch_size=8192) == pytest.approx((4.0, 4.0))


@pytest.mark.parametrize(
    "batching, field, hint",
    [
        ({"learning_rate_scaling": "sqrt"}, "batching.learning_rate_scaling", "'auto' or 'none'"),
        ({"reference_batch_size": 0}, "batching.reference_batch_size", "greater than 0"),
    ],
)
def test_learning_rate_scaling_fields_are_validated_with_the_field_named(batching, field, hint):
    with pytest.raises(ConfigError) as refused:
        parse_config(small(batching), environ={})
    assert field in str(refused.value) and hint in str(refused.value)


def test_the_trainer_uses_the_scaled_rates_for_the_sparse_and_the_dense_optimizer():
    raw = small({"batch_size": 4096})
    raw["model"]["sparse_optimizer"] = "sgd"  # scaled too, unlike Adagrad's
    config = parse_config(raw, environ={})
    trainer = Trainer(config, init_distributed())
    sparse, dense = config.model.sparse_learning_rate, config.model.dense_learning_rate
    assert _rates(trainer) == pytest.approx((4 * sparse, 4 * dense))
    raw["batching"]["learning_rate_scaling"] = "none"
    assert _rates(Trainer(parse_config(raw, environ={}), init_distributed())) == pytest.approx((sparse, dense))


def _rates(trainer: Trainer) -> tuple[float, float]:
    """The one learning rate of the fused (sparse) optimizer's groups, and of the dense one's."""
    (_, fused), (_, adam) = trainer.optimizer.optimizers
    rates = [{group["lr"] for group in optimizer.param_groups} for optimizer in (fused, adam)]
    assert all(len(r) == 1 for r in rates), rates
    return rates[0].pop(), rates[1].pop()
