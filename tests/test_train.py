"""The train stage on real TorchRec: planner, DMP, fused optimizer, TrainPipelineSparseDist (1 rank)."""

from pathlib import Path

import pytest
import torch
import yaml

from streamtrain.config import parse_config
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


def table_weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    weights = {}
    for name, value in trainer.model.state_dict().items():
        if "embedding_bags" in name:
            local = value.to_local() if hasattr(value, "to_local") else value
            weights[name.split(".")[-2]] = local.detach().clone()
    return weights


def test_every_table_is_trained_and_an_empty_batch_is_harmless(config, batches):
    real, decoder = batches
    trainer = Trainer(config, init_distributed())
    before = table_weights(trainer)
    assert set(before) == {t.name for t in config.features.tables}
    stream = [real[0], decoder.decode([]).batch, *real[1:]]
    results = list(trainer.train(iter(stream)))
    assert [r.batch.size for r in results] == [b.size for b in stream]
    assert all(torch.isfinite(torch.tensor(r.loss_sum)) for r in results)
    assert results[1].loss_sum == 0.0 and results[1].logits.numel() == 0
    after = table_weights(trainer)
    unchanged = [name for name in before if torch.equal(before[name], after[name])]
    assert unchanged == [], f"tables not updated: {unchanged}"
    sharding = {
        name: p.sharding_type for name, p in trainer.plan.plan["dlrm.sparse_arch.embedding_bag_collection"].items()
    }
    assert "table_wise" in sharding.values()
