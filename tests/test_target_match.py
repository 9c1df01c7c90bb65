"""Target matches: the counts of history ids equal to the candidate's, their config checks, a model
that learns the planted "recently clicked this category" effect through them, and a served
program that computes them as training does."""

import copy
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from streamtrain.config import ConfigError, parse_config
from streamtrain.decode import AvroBatchDecoder
from streamtrain.delivery.artifact import ScoringModule, export_program, unsharded_model
from streamtrain.dev.produce import AvroEncoder, ClickStream
from streamtrain.device import init_distributed
from streamtrain.source import RawEvent
from streamtrain.target_match import TargetMatchDLRM, match_counts
from streamtrain.train import Trainer

REPO = Path(__file__).resolve().parent.parent
SCHEMA = REPO / "schemas" / "click_event.avsc"
CATE_MATCH = {"candidate": "cate_id", "history": "recent_cate_ids"}


def raw_config(**model) -> dict:
    raw = yaml.safe_load((REPO / "tests" / "worker-small.yaml").read_text())
    raw["kafka"] = {"bootstrap_servers": "unused:9092", "topic": "unused"}
    raw["model"] |= {"target_matches": [copy.deepcopy(CATE_MATCH)], **model}
    return raw


def decoded(config, records: list[dict]):
    encoder = AvroEncoder(SCHEMA)
    events = [RawEvent(0, i, encoder.encode(r), 0) for i, r in enumerate(records)]
    return AvroBatchDecoder(config.features, tasks=config.tasks()).decode(events).batch


def test_counts_are_the_history_ids_equal_to_the_candidates_per_event():
    # events: history holds the candidate once, twice, not at all, is empty; a candidate missing
    sparse = KeyedJaggedTensor.from_lengths_sync(
        keys=["cate_id", "recent_cate_ids"],
        values=torch.tensor([5, 7, 3, 9] + [1, 5, 7, 9, 7, 2, 4]),
        lengths=torch.tensor([1, 1, 1, 1, 0] + [1, 2, 3, 0, 1]),
    )
    counts = match_counts(sparse, [("cate_id", "recent_cate_ids")])
    assert counts.shape == (5, 1)
    # 5 vs [1]; 7 vs [5, 7]; 3 vs [9, 7, 2]; 9 vs []; none vs [4]
    assert counts[:, 0].tolist() == [0, 1, 0, 0, 0]
    twice = KeyedJaggedTensor.from_lengths_sync(
        keys=["cate_id", "recent_cate_ids"], values=torch.tensor([7, 7, 1, 7]), lengths=torch.tensor([1, 3])
    )
    assert match_counts(twice, [("cate_id", "recent_cate_ids")]).tolist() == [[2]]


def test_a_model_with_matches_reads_one_more_dense_input_and_an_empty_batch_trains():
    config = parse_config(raw_config(), environ={})
    trainer = Trainer(config, init_distributed())
    dlrm = trainer.model.module.dlrm
    assert isinstance(dlrm, TargetMatchDLRM)
    assert dlrm.dense_arch.model._mlp[0]._linear.in_features == len(config.features.dense) + 1
    records = ClickStream(seed=3).chunk(64).records
    batches = [decoded(config, records), decoded(config, []), decoded(config, records)]
    results = list(trainer.train(iter(batches)))
    assert [r.batch.size for r in results] == [64, 0, 64]
    assert all(np.isfinite(r.loss_sum) for r in results)


def test_the_planted_match_effect_is_learnt_through_the_counts():
    """ClickStream plants +1.3 in the click logit where the ad's category is among the recent ones.
    After 24k events, the same events score higher with that category in their history than
    without it, by a good part of the planted effect."""
    config = parse_config(raw_config(), environ={})
    trainer = Trainer(config, init_distributed())
    stream = ClickStream(seed=7, start_time_ms=0)
    for _ in trainer.train(decoded(config, stream.chunk(512).records) for _ in range(48)):
        pass
    held = [r for r in stream.chunk(2048).records if r["cate_id"] not in r["recent_cate_ids"]]
    matched = [{**r, "recent_cate_ids": [*r["recent_cate_ids"], r["cate_id"]]} for r in held]
    model = trainer.pipeline.detach().eval()
    with torch.no_grad():
        without, with_match = (model(decoded(config, records))[1][1] for records in (held, matched))
    assert float((with_match - without).mean()) > 0.6


@pytest.mark.parametrize(
    ("match", "message"),
    [
        ({"candidate": "cate_id", "history": "recent_cates"}, "model.target_matches.0.history: 'recent_cates' is not"),
        ({"candidate": "cate_id", "history": "cate_id"}, "model.target_matches.0: candidate and history are both"),
        ({"candidate": "brand", "history": "recent_cate_ids"}, "model.target_matches.0: 'brand' .hash, 20000 rows."),
    ],
)
def test_matches_of_unknown_or_unlike_features_are_refused_naming_the_field(match, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(raw_config(target_matches=[match]), environ={})


def test_managed_tables_cannot_match_their_rows_are_given_per_table_and_none_is_shared():
    raw = raw_config()
    tables = {t["name"]: t for t in raw["features"]["tables"]}
    for name in ("cate_id", "recent_cate_ids"):
        tables[name] |= {"id_mapping": "managed", "rows": 12961}
        del tables[name]["num_embeddings"]
    with pytest.raises(ConfigError, match="map ids to rows differently") as refused:
        parse_config(raw, environ={})
    assert "shares_table_with" not in str(refused.value)  # no way out through a shared managed table
    tables["recent_cate_ids"]["shares_table_with"] = "cate_id"
    with pytest.raises(ConfigError, match=r"features\.tables\.8\.shares_table_with: cate_id is managed"):
        parse_config(raw, environ={})


def test_the_served_program_computes_the_counts_as_training_does():
    config = parse_config(raw_config(), environ={})
    click = unsharded_model(config.features, config.model, config.tasks())
    module = ScoringModule(click, [t.name for t in config.features.tables])
    program = export_program(module, config.features).module()
    records = ClickStream(seed=9).chunk(64).records
    for size in (2, 7, 64):
        batch = decoded(config, records[:size])
        sparse = batch.sparse_features
        inputs = (batch.dense_features, sparse.values(), sparse.lengths().to(torch.int32))
        with torch.no_grad():
            assert torch.allclose(program(*inputs), module(*inputs), atol=1e-6)
    # the counts move the served score: a history holding the candidate scores differently
    plain = records[:8]
    matched = [{**r, "recent_cate_ids": [r["cate_id"]]} for r in plain]
    scores = []
    for part in (plain, matched):
        sparse = decoded(config, part).sparse_features
        with torch.no_grad():
            scores.append(program(decoded(config, part).dense_features, sparse.values(), sparse.lengths().int()))
    assert not torch.allclose(scores[0], scores[1])
