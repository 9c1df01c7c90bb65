"""The model interface end to end (streamtrain/models/): each built-in architecture beside DLRM,
and a user's model from a package on PYTHONPATH (tests/user_models/my_models.py), trains on the
real broker at 1 and 2 ranks, restores exactly-once after a SIGKILL, and is served through the
deltas equal to the trainer; a user's model that breaks the interface is refused at start-up."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
import yaml
from torchrec import JaggedTensor, KeyedJaggedTensor
from torchrec.models.dlrm import InteractionDCNArch
from torchrec.modules.crossnet import LowRankCrossNet

from conftest import REPO, SCHEMA, end_offsets, join_as_spawned_rank, leave_spawned_rank
from streamtrain.checkpoint import (
    Checkpointer,
    StreamState,
    compatibility_fingerprint,
    fingerprint_differences,
    list_snapshots,
)
from streamtrain.config import ConfigError, parse_config
from streamtrain.decode import AvroBatchDecoder
from streamtrain.delivery.artifact import check_exportable, unsharded_model
from streamtrain.dev.kafka import free_port
from streamtrain.dev.produce import AvroEncoder, ClickStream, encoded_events, produce
from streamtrain.device import init_distributed
from streamtrain.model import ClickModel, net_logits
from streamtrain.models.base import ModelInterfaceError, table_weights
from streamtrain.models.dcn_v2 import SizedInteractionDCNArch
from streamtrain.models.din import TargetAttention
from streamtrain.source import RawEvent
from streamtrain.train import Trainer, plan_sharding
from test_delivery_e2e import train_and_follow
from test_delivery_publisher import WIDE

USER_MODELS = Path(__file__).resolve().parent / "user_models"
ARCHITECTURES = {
    "dcn_v2": {"STREAMTRAIN_MODEL__ARCHITECTURE": "dcn_v2"},
    "deepfm": {"STREAMTRAIN_MODEL__ARCHITECTURE": "deepfm"},
    "din": {"STREAMTRAIN_MODEL__ARCHITECTURE": "din"},
    "user_model": {"STREAMTRAIN_MODEL__MODULE": "my_models:build", "STREAMTRAIN_MODEL__OPTIONS": "{hidden: 24}"},
}


@pytest.fixture
def user_models(monkeypatch) -> dict[str, str]:
    """The user's package importable here (the test exports bases in-process) and in the ranks."""
    monkeypatch.syspath_prepend(str(USER_MODELS))
    return {"PYTHONPATH": os.pathsep.join([str(USER_MODELS), os.environ.get("PYTHONPATH", "")])}


def config_for(**model) -> object:
    raw = yaml.safe_load((REPO / "tests" / "worker-small.yaml").read_text())
    raw["kafka"] = {"bootstrap_servers": "unused:9092", "topic": "unused"}
    raw["model"] |= model
    return parse_config(raw, environ={})


# Each model trains at 1 and 2 ranks: served from one, killed and restored at the other.
SERVED_AT = {"dcn_v2": 2, "deepfm": 1, "din": 2, "user_model": 2}


@pytest.mark.integration
@pytest.mark.parametrize(("name", "world_size"), SERVED_AT.items())
def test_architecture_trains_and_serves_the_trainers_scores_after_deltas(
    kafka, topic_name, start_ranks, tmp_path, user_models, name, world_size
):
    # At 2 ranks, WIDE shards the tables table- and column-wise, so the served order is tested too.
    env = {**ARCHITECTURES[name], **user_models, **(WIDE if world_size == 2 else {})}
    train_and_follow(kafka, topic_name, start_ranks, tmp_path, world_size, **env)
    model = list_snapshots(str(tmp_path / "snapshots"))[0].metadata["config"]["model"]
    assert model["module"] == "my_models:build" if name == "user_model" else model["architecture"] == name


@pytest.mark.integration
@pytest.mark.parametrize(("name", "world_size"), [(name, 3 - served) for name, served in SERVED_AT.items()])
def test_architecture_restores_exactly_once_after_a_sigkill(
    kafka, topic_name, start_ranks, tmp_path, user_models, name, world_size
):
    root = tmp_path / "snapshots"
    env = {
        **ARCHITECTURES[name],
        **user_models,
        "STREAMTRAIN_CHECKPOINT__PATH": str(root),
        "STREAMTRAIN_CHECKPOINT__INTERVAL_STEPS": "3",
        "STREAMTRAIN_BATCHING__BATCH_SIZE": "64",
    }
    produce(kafka.bootstrap_servers, topic_name, 3000, partitions=4, seed=45, schema_path=SCHEMA)
    ranks = start_ranks(topic_name, world_size, env=env)
    ranks[0].wait_for(
        lambda: any(s.complete and s.step >= 3 for s in list_snapshots(str(root))), 180, "a snapshot past step 0"
    )
    for rank in ranks:
        rank.signal(signal.SIGKILL)
    assert all(r.wait(timeout=60) != 0 for r in ranks)

    again = start_ranks(topic_name, world_size, "--until-end", env=env)
    assert [r.wait(timeout=180) for r in again] == [0] * world_size, again[0].output()[-3000:]
    assert "restored " in again[0].output()  # from the killed run's snapshot, its fingerprint accepted
    stream = list_snapshots(str(root))[0].metadata["stream"]
    produced = end_offsets(kafka, topic_name)
    assert {int(p): n for p, n in stream["trained"].items()} == produced
    assert {int(p): o for p, o in stream["next_offsets"].items()} == produced


@pytest.mark.parametrize(
    ("factory", "reason"),
    [
        ("no_tables", r"the model has no tables for \['user_id'"),
        ("wrong_shape", r"forward returned \(3,\) for a batch of 3 events and 1 task\(s\); it must return"),
        ("not_exportable", "the model is not exportable: torch.export fails"),
    ],
)
def test_a_bad_user_model_is_refused_at_start_up_with_the_reason(user_models, factory, reason):
    config = config_for(module=f"my_models:{factory}")
    with pytest.raises(ModelInterfaceError, match=f"model.module my_models:{factory}: .*{reason}"):
        check_exportable(config.features, config.model, config.tasks())


def test_a_bad_user_model_stops_the_worker_with_exit_code_2_and_the_reason(
    kafka, topic_name, start_worker, user_models
):
    worker = start_worker(topic_name, env={**user_models, "STREAMTRAIN_MODEL__MODULE": "my_models:no_tables"})
    assert worker.wait(timeout=120) == 2
    assert "model.module my_models:no_tables: the model has no tables" in worker.output()


def test_a_user_model_that_cannot_be_imported_is_a_config_error_naming_the_field():
    with pytest.raises(ConfigError, match=r"model\.module: cannot import 'no_such_package\.models'"):
        plan_sharding(config_for(module="no_such_package.models:build"), 1, "cpu")
    with pytest.raises(ConfigError, match=r"model\.module replaces model\.architecture"):
        config_for(module="my_models:build", architecture="dcn_v2")


def test_the_fingerprint_refuses_a_snapshot_of_another_architecture_and_keeps_dlrms():
    dlrm = config_for()
    assert "net" not in compatibility_fingerprint(dlrm)  # snapshots from before architectures still match
    others = [config_for(architecture=name) for name in ("dcn_v2", "deepfm", "din")] + [config_for(module="m:f")]
    for other in others:
        differences = fingerprint_differences(compatibility_fingerprint(other), compatibility_fingerprint(dlrm), other)
        assert differences, other.model
    wider = config_for(architecture="dcn_v2", dcn_v2={"low_rank_dim": 8})
    assert fingerprint_differences(
        compatibility_fingerprint(wider), compatibility_fingerprint(config_for(architecture="dcn_v2")), wider
    )
    other_history = config_for(architecture="din", din={"history": "brand"})
    assert fingerprint_differences(
        compatibility_fingerprint(other_history),
        compatibility_fingerprint(config_for(architecture="din")),
        other_history,
    )


@pytest.mark.parametrize("multitask", ["shared_bottom", "mmoe", "dbmtl"])
@pytest.mark.parametrize("name", ["dcn_v2", "deepfm", "din"])
def test_architecture_composes_with_every_multitask_head(name, multitask):
    tasks = [{"name": "clk", "label": "clk"}, {"name": "buy", "label": "buy", "required": False}]
    if multitask == "dbmtl":
        tasks[1]["depends_on"] = "clk"
    raw = yaml.safe_load((REPO / "tests" / "worker-small.yaml").read_text())
    raw["kafka"] = {"bootstrap_servers": "unused:9092", "topic": "unused"}
    raw["features"].pop("label")
    raw["model"] |= {"architecture": name, "multitask": multitask, "tasks": tasks}
    config = parse_config(raw, environ={})
    click = unsharded_model(config.features, config.model, config.tasks())
    keys = [t.name for t in config.features.tables]
    ids = torch.arange(5 * len(keys)) % 4
    sparse = KeyedJaggedTensor(keys=keys, values=ids, lengths=torch.ones(5 * len(keys), dtype=torch.int32))
    logits = net_logits(click.net, click.pairs, torch.rand(5, len(config.features.dense)), sparse)
    assert logits.shape == (5, 2)
    logits.sum().backward()  # every task's loss reaches the shared part
    assert all(p.grad is not None for p in click.net.parameters())


@pytest.mark.parametrize("example", sorted((REPO / "deploy" / "models").glob("*.yaml")), ids=lambda p: p.stem)
def test_each_architecture_has_an_example_config_for_the_reference_features(example):
    raw = yaml.safe_load((REPO / "deploy" / "worker.yaml").read_text())
    raw["model"] = yaml.safe_load(example.read_text())["model"]
    config = parse_config(raw, environ={})
    assert config.model.architecture == example.stem
    model = ClickModel(config.features, config.model, config.tasks(), torch.device("cpu"))
    assert model.net_name == example.stem and len(table_weights(model)) == len(config.features.owned_tables())


def test_architecture_dcn_v2_crosses_an_empty_batch_as_torchrec_crosses_a_full_one():
    """A rank with no events trains an empty batch: TorchRec's reshape([B, -1]) cannot size one."""
    cross = LowRankCrossNet(in_features=3 * 4, num_layers=2, low_rank=2)
    ours, theirs = SizedInteractionDCNArch(2, cross), InteractionDCNArch(2, cross)
    dense, sparse = torch.rand(5, 4), torch.rand(5, 2, 4)
    assert torch.equal(ours(dense, sparse), theirs(dense, sparse))
    assert ours(dense[:0], sparse[:0]).shape == (0, 12)


def test_architecture_din_names_two_tables_of_the_features():
    with pytest.raises(ConfigError, match=r"model\.din\.history: 'clicked' is not in features\.tables"):
        config_for(architecture="din", din={"history": "clicked"})
    with pytest.raises(ConfigError, match=r"model\.din: candidate and history are both 'cate_id'"):
        config_for(architecture="din", din={"history": "cate_id"})


def test_architecture_din_weighs_each_history_id_by_its_likeness_to_the_candidate_as_a_loop_does():
    attention = TargetAttention(4, [8], torch.device("cpu"))
    lengths = torch.tensor([2, 0, 3, 1])  # an event without history reads zeros
    history = JaggedTensor(values=torch.rand(6, 4), lengths=lengths)
    query = torch.rand(4, 4)
    expected = torch.zeros(4, 4)
    for event, keys in enumerate(history.to_dense()):
        for key in keys:
            q = query[event]
            weight = attention.weight(attention.mlp(torch.cat([q, key, q - key, q * key]).unsqueeze(0)))
            expected[event] += weight[0, 0] * key
    assert torch.allclose(attention(query, history), expected, atol=1e-6)
    assert attention(query[:0], JaggedTensor(values=torch.zeros(0, 4), lengths=lengths[:0])).shape == (0, 4)


def _din_rank(rank: int, world_size: int, port: int, out: str) -> None:
    join_as_spawned_rank(rank, world_size, port)
    raw = yaml.safe_load((REPO / "tests" / "worker-small.yaml").read_text())
    raw["kafka"] = {"bootstrap_servers": "unused:9092", "topic": "unused"}
    raw["model"]["architecture"] = "din"
    raw["features"]["tables"][-1]["sharding_types"] = ["row_wise"]  # recent_cate_ids, the history
    config = parse_config(raw, environ={})
    decoder = AvroBatchDecoder(config.features)
    encoder = AvroEncoder(SCHEMA)
    events = [RawEvent(0, i, encoder.encode(r), 0) for i, r in enumerate(ClickStream(3, 0).chunk(128).records)]
    batches = [decoder.decode(part).batch.in_global_step(len(part), 1) for part in (events[:64], [], events[64:])]
    trainer = Trainer(config, init_distributed())
    sizes = [result.batch.size for result in trainer.train(iter(batches))]
    Path(out, "sizes").write_text(repr(sizes))
    leave_spawned_rank()


def test_architecture_din_trains_a_step_without_events_at_one_rank(tmp_path):
    """At one rank an idle step's batch has no events at all, which TorchRec's sharded
    EmbeddingCollection cannot size (streamtrain/train.py makes it one event without ids)."""
    mp.spawn(_din_rank, args=(1, free_port(), str(tmp_path)), nprocs=1)
    assert (tmp_path / "sizes").read_text() == "[64, 0, 64]"


def test_a_user_models_snapshot_restores_across_settings_only_the_built_ins_read(tmp_path, user_models):
    """model.module builds from the tables, the dense inputs, the tasks and model.options: a snapshot of it
    restores across over_arch_layer_sizes, dense_arch_layer_sizes and model.multitask, which only the built-ins
    read, and across those it was written with before its fingerprint left them out; not across its options."""
    checkpoint = {"checkpoint": {"path": str(tmp_path / "snapshots")}}
    raw = yaml.safe_load((REPO / "tests" / "worker-small.yaml").read_text())
    raw |= {"kafka": {"bootstrap_servers": "unused:9092", "topic": "unused"}, **checkpoint}
    raw["model"] |= {"module": "my_models:build", "options": {"hidden": 24}}
    written = parse_config(raw, environ={})
    env = init_distributed()
    trainer = Trainer(written, env)
    decoder = AvroBatchDecoder(written.features)
    encoded = encoded_events(ClickStream(11, 0), AvroEncoder(SCHEMA), 256)
    events = [RawEvent(0, i, payload, 0) for i, (_key, payload, _partition, _click) in enumerate(encoded)]
    list(trainer.train(iter([decoder.decode(events).batch])))
    saved = {k: v.clone() for k, v in trainer.model.state_dict().items() if isinstance(v, torch.Tensor)}
    Checkpointer(written.checkpoint, written, trainer.model, trainer.optimizer, 0, 1, None).save(StreamState(step=1))

    raw["model"] |= {"over_arch_layer_sizes": [16, 1], "dense_arch_layer_sizes": [32, 8], "multitask": "mmoe"}
    changed = parse_config(raw, environ={})
    restored = Trainer(changed, env)
    assert Checkpointer(changed.checkpoint, changed, restored.model, restored.optimizer, 0, 1, None).restore().step == 1
    state = restored.model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in saved.items() if not hasattr(v, "to_local"))

    ours = compatibility_fingerprint(changed)
    assert "over_arch_layer_sizes" not in ours and ours["tasks"] == ["clk"]
    # as a snapshot of this model carried its fingerprint before: with the built-ins' settings, one task unnamed
    before = {k: v for k, v in ours.items() if k != "tasks"}
    before |= {"dense_arch_layer_sizes": [16, 8], "over_arch_layer_sizes": [32, 1], "heads": {"architecture": "dlrm"}}
    assert fingerprint_differences(ours, before, changed) == []
    other_options = config_for(module="my_models:build", options={"hidden": 32})
    assert fingerprint_differences(compatibility_fingerprint(other_options), ours, other_options) == [
        "net.options.hidden: 24 in the snapshot, 32 here"
    ]
