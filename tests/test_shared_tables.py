"""A feature that looks its ids up in another feature's table (features.tables[].shares_table_with):
the config names what does not match, the EBC holds one table for both, ids of either feature
train its rows, the naive baseline shares as the worker does, and ranks train and snapshot it."""

import copy
from pathlib import Path

import pytest
import torch
import yaml

from streamtrain.bench.naive import NaiveDLRM
from streamtrain.checkpoint import compatibility_fingerprint, fingerprint_differences
from streamtrain.config import ConfigError, parse_config
from streamtrain.decode import AvroBatchDecoder
from streamtrain.dev.produce import AvroEncoder, ClickStream
from streamtrain.device import init_distributed
from streamtrain.source import RawEvent
from streamtrain.train import Trainer, plan_table

REPO = Path(__file__).resolve().parent.parent
SCHEMA = REPO / "schemas" / "click_event.avsc"
RECENT = 8  # recent_cate_ids in tests/worker-small.yaml


def raw_config(shared: bool = True) -> dict:
    raw = yaml.safe_load((REPO / "tests" / "worker-small.yaml").read_text())
    raw["kafka"] = {"bootstrap_servers": "unused:9092", "topic": "unused"}
    assert raw["features"]["tables"][RECENT]["name"] == "recent_cate_ids"
    if shared:
        raw["features"]["tables"][RECENT]["shares_table_with"] = "cate_id"
    return raw


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda t: t[RECENT].update(shares_table_with="cate"), "features.tables.8.shares_table_with: 'cate' is not"),
        (lambda t: t[RECENT].update(shares_table_with="recent_cate_ids"), "is not another table"),
        (
            lambda t: t[2].update(shares_table_with="user_id"),  # cate_id, itself shared
            "'cate_id' is not another table that has a table of its own",
        ),
        (lambda t: t[RECENT].update(num_embeddings=100), "features.tables.8.num_embeddings: 100, but the table"),
        (lambda t: t[RECENT].update(pooling="mean"), "features.tables.8.pooling: 'mean', but the table it shares"),
        (lambda t: t[RECENT].update(sharding_types=["table_wise"]), "set sharding_types and compute_kernels there"),
        (  # two id maps would give away rows of one table (cate_id is features.tables.2)
            lambda t: [x.pop("num_embeddings") and x.update(id_mapping="managed", rows=99) for x in (t[2], t[RECENT])],
            "features.tables.8.shares_table_with: cate_id is managed",
        ),
    ],
)
def test_a_shared_table_that_does_not_match_its_owner_is_refused_naming_the_field(change, message):
    raw = raw_config()
    change(raw["features"]["tables"])
    with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("'", ".")):
        parse_config(raw, environ={})


def _batches(config, count: int, seed: int) -> list:
    decoder = AvroBatchDecoder(config.features)
    encoder = AvroEncoder(SCHEMA)
    stream = ClickStream(seed)
    return [
        decoder.decode([RawEvent(0, i, encoder.encode(r), 0) for i, r in enumerate(stream.chunk(256).records)]).batch
        for _ in range(count)
    ]


def _cate_rows(trainer: Trainer) -> torch.Tensor:
    (weights,) = [v for k, v in trainer.model.state_dict().items() if k.endswith("embedding_bags.cate_id.weight")]
    local = weights.to_local() if hasattr(weights, "to_local") else weights
    # one rank holds the whole table (table-wise): its one shard is the table
    return torch.cat(local.local_shards()) if hasattr(local, "local_shards") else local.detach().clone()


def test_one_table_serves_both_features_and_either_features_ids_train_its_rows():
    config = parse_config(raw_config(), environ={})
    trainer = Trainer(config, init_distributed())
    tables = [k for k in trainer.model.state_dict() if "embedding_bags" in k]
    assert not any("recent_cate_ids" in k for k in tables) and len(tables) == len(config.features.tables) - 1
    assert [row["table"] for row in plan_table(trainer.plan, config, 1)] == [
        t.name for t in config.features.owned_tables()
    ]

    (batch,) = _batches(config, 1, seed=3)
    features = batch.sparse_features.to_dict()
    ads, recent = set(features["cate_id"].values().tolist()), set(features["recent_cate_ids"].values().tolist())
    only_recent = sorted(recent - ads)
    assert only_recent, "the batch has categories only a user's history holds"
    before = _cate_rows(trainer)
    list(trainer.train(iter([batch])))
    after = _cate_rows(trainer)
    moved = ~torch.isclose(before, after).all(dim=1)
    # a category only among the recent ones moved the shared table's row: recent_cate_ids reads it
    assert moved[only_recent].all()
    assert moved.sum() == len(ads | recent)


def test_the_naive_baseline_shares_the_table_too():
    features = parse_config(raw_config(), environ={}).features
    config = parse_config(raw_config(), environ={})
    naive = NaiveDLRM(features, config.model)
    assert len(naive.tables) == len(features.tables) - 1
    assert naive.table_of_feature[RECENT] == naive.table_of_feature[2]


def test_the_fingerprint_says_a_table_is_shared_and_unshared_configs_keep_theirs():
    shared, unshared = (parse_config(raw_config(s), environ={}) for s in (True, False))
    ours = compatibility_fingerprint(shared)
    assert ours["tables"]["recent_cate_ids"]["shares_table_with"] == "cate_id"
    assert "shares_table_with" not in compatibility_fingerprint(unshared)["tables"]["recent_cate_ids"]
    assert fingerprint_differences(ours, compatibility_fingerprint(unshared), shared) != []


@pytest.mark.integration
def test_two_ranks_train_a_shared_table_and_resume_from_its_snapshot(kafka, topic_name, start_ranks, tmp_path):
    from streamtrain.dev.produce import produce

    produce(kafka.bootstrap_servers, topic_name, 6_000, partitions=4, seed=11, schema_path=SCHEMA)
    raw = copy.deepcopy(raw_config())
    raw["checkpoint"] = {"path": str(tmp_path / "snapshots")}
    config = tmp_path / "shared.yaml"
    config.write_text(yaml.safe_dump(raw))
    # the last --config wins: the ranks start with the small config's, then this one
    first = start_ranks(topic_name, 2, "--until-end", "--config", str(config))
    assert [r.wait(timeout=180) for r in first] == [0, 0], first[0].output()[-3000:] + first[1].output()[-3000:]
    produce(kafka.bootstrap_servers, topic_name, 2_000, partitions=4, seed=12, schema_path=SCHEMA)
    second = start_ranks(topic_name, 2, "--until-end", "--config", str(config))
    assert [r.wait(timeout=180) for r in second] == [0, 0], second[0].output()[-3000:] + second[1].output()[-3000:]
    output = second[0].output() + second[1].output()
    assert "restored " in output, output[-3000:]
    trained = sum(int(r.output().split(" events trained")[0].rsplit(" ", 1)[1].replace(",", "")) for r in second)
    assert trained == 2_000
