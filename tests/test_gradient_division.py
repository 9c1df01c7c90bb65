"""The gradient scale across ranks: one step on 2 gloo ranks, one of them with an empty half, gives
the same weights as 1 rank over the same global batch, for every sharding type CPU offers.

It holds only because TorchRec divides the sharded tables' gradients by the world size in the
all-to-all backward (``comm_ops.GRADIENT_DIVISION``), which ``Trainer`` pins; with it off, the
table-wise and column-wise tables move twice as far at 2 ranks.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
import yaml
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from conftest import REPO, SCHEMA, join_as_spawned_rank, leave_spawned_rank
from streamtrain.config import parse_config
from streamtrain.decode import AvroBatchDecoder
from streamtrain.dev.kafka import free_port
from streamtrain.dev.produce import AvroEncoder, ClickStream, encoded_events
from streamtrain.device import init_distributed
from streamtrain.source import RawEvent
from streamtrain.train import Trainer

SHARDING = {
    "user_id": "table_wise",
    "adgroup_id": "table_wise",
    "brand": "table_wise",
    "cate_id": "column_wise",
    "recent_cate_ids": "column_wise",
    "final_gender_code": "data_parallel",
    "age_level": "data_parallel",
    "shopping_level": "data_parallel",
    "pid": "data_parallel",
}
GLOBAL_BATCH = 512


def sgd_config() -> dict:
    raw = yaml.safe_load((REPO / "tests" / "worker-small.yaml").read_text())
    raw["kafka"] = {"bootstrap_servers": "unused:9092", "topic": "unused"}
    raw["model"]["sparse_optimizer"] = "sgd"
    raw["model"]["sparse_learning_rate"] = 1.0  # a large step: a wrong gradient scale shows far above 1e-5
    for table in raw["features"]["tables"]:
        table["sharding_types"] = [SHARDING[table["name"]]]
    return raw


def _one_step(rank: int, world_size: int, port: int, out: str, start: str) -> None:
    join_as_spawned_rank(rank, world_size, port)
    config = parse_config(sgd_config(), environ={})
    trainer = Trainer(config, init_distributed())
    # Each rank initialises its own shards, so 1 and 2 ranks start apart: both start from the
    # weights the 1-rank run began with (DCP reshards them).
    state = {"model": trainer.model.state_dict()}
    if world_size == 1:
        dcp.save(state, checkpoint_id=start)
    else:
        dcp.load(state, checkpoint_id=start)
        trainer.model.load_state_dict(state["model"])
    decoder = AvroBatchDecoder(config.features)
    events = [
        RawEvent(0, i, value, 0)
        for i, (_k, value, _p, _c) in enumerate(encoded_events(ClickStream(7, 0), AvroEncoder(SCHEMA), GLOBAL_BATCH))
    ]
    # rank 0 holds the whole global batch; rank 1's half is empty, as on an idle partition
    batch = decoder.decode(events if rank == 0 else []).batch.in_global_step(GLOBAL_BATCH, world_size)
    assert len(list(trainer.train(iter([batch])))) == 1
    dcp.save({"model": trainer.model.state_dict()}, checkpoint_id=f"{out}/step")
    if rank == 0:
        plan = trainer.plan.plan["dlrm.sparse_arch.embedding_bag_collection"]
        torch.save({name: p.sharding_type for name, p in plan.items()}, f"{out}/sharding.pt")
    leave_spawned_rank()


def flat(dcp_dir: Path) -> dict[str, torch.Tensor]:
    dcp_to_torch_save(dcp_dir, dcp_dir.with_suffix(".pt"))
    return torch.load(dcp_dir.with_suffix(".pt"), weights_only=False)["model"]


def weights_after_one_step(world_size: int, out: Path, start: Path) -> dict[str, torch.Tensor]:
    mp.spawn(_one_step, args=(world_size, free_port(), str(out), str(start)), nprocs=world_size)
    assert torch.load(out / "sharding.pt") == SHARDING
    return flat(out / "step")


def test_two_ranks_take_the_step_one_rank_takes_gradient_division(tmp_path):
    start = tmp_path / "start"
    one = weights_after_one_step(1, tmp_path / "one", start)
    two = weights_after_one_step(2, tmp_path / "two", start)
    initial = flat(start)
    assert one.keys() == two.keys() == initial.keys()
    tables = [k for k in one if "embedding_bags" in k]
    assert {k.split(".")[-2] for k in tables} == set(SHARDING)
    for key in tables:  # the step moved every table, so equal weights mean equal updates
        assert not torch.equal(one[key], initial[key]), key
    for key in sorted(one):
        torch.testing.assert_close(two[key], one[key], atol=1e-5, rtol=0, msg=lambda m, key=key: f"{key}: {m}")
