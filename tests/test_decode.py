"""KJT assembly from Avro payloads: per-key values and lengths, empty and multi-valued lists, bad input."""

from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from streamtrain.config import TableConfig, parse_config
from streamtrain.decode import AvroBatchDecoder, fnv1a64, map_ids, splitmix64
from streamtrain.produce import AvroEncoder
from streamtrain.source import RawEvent

REPO = Path(__file__).resolve().parent.parent
SCHEMA = REPO / "schemas" / "click_event.avsc"


def event(**overrides) -> dict:
    record = {
        "event_time": 1_700_000_000_000, "user_id": 11, "adgroup_id": 22, "cate_id": 33, "campaign_id": 44,
        "customer": 55, "brand": 66, "cms_segid": 1, "cms_group_id": 2, "final_gender_code": 1,
        "age_level": 3, "pvalue_level": 1, "shopping_level": 2, "occupation": 0, "new_user_class_level": 4,
        "pid": "430548_1007", "recent_cate_ids": [5, 6, 7], "price": 99.5, "clk": 1, "buy": 0,
    }
    record.update(overrides)
    return record


@pytest.fixture(scope="module")
def decoder() -> AvroBatchDecoder:
    raw = yaml.safe_load((REPO / "tests" / "worker-small.yaml").read_text())
    raw["kafka"] = {"bootstrap_servers": "unused:9092", "topic": "unused"}
    return AvroBatchDecoder(parse_config(raw, environ={}).features)


def raw_events(records: list[dict], partition: int = 0, first_offset: int = 100) -> list[RawEvent]:
    encoder = AvroEncoder(SCHEMA)
    return [RawEvent(partition, first_offset + i, encoder.encode(r), 0) for i, r in enumerate(records)]


def test_values_and_lengths_per_key(decoder):
    records = [
        event(cate_id=33, recent_cate_ids=[5, 6, 7], brand=66, clk=1),
        event(cate_id=34, recent_cate_ids=[], brand=None, clk=0, price=0.0),
        event(cate_id=35, recent_cate_ids=[8], brand=67, clk=1),
    ]
    result = decoder.decode(raw_events(records))
    batch = result.batch
    assert result.rejected == [] and batch.size == 3
    kjt = batch.sparse_features.to_dict()
    assert kjt["cate_id"].lengths().tolist() == [1, 1, 1]
    assert kjt["cate_id"].values().tolist() == [33, 34, 35]
    # multi-valued, including an empty list
    assert kjt["recent_cate_ids"].lengths().tolist() == [3, 0, 1]
    assert kjt["recent_cate_ids"].values().tolist() == [5, 6, 7, 8]
    # a null in a union becomes a zero-length feature
    assert kjt["brand"].lengths().tolist() == [1, 0, 1]
    assert kjt["brand"].values().tolist() == map_ids(np.array([66, 67]), decoder.features.tables[3]).tolist()
    # strings are hashed into their table
    assert kjt["pid"].values().tolist() == [fnv1a64("430548_1007") % 64] * 3
    assert batch.labels.tolist() == [1.0, 0.0, 1.0]
    assert torch.allclose(batch.dense_features[:, 0], torch.log1p(torch.tensor([99.5, 0.0, 99.5])))
    assert batch.event_time_ms.tolist() == [1_700_000_000_000] * 3
    assert batch.sparse_features.keys() == [t.name for t in decoder.features.tables]


def test_spans_cover_every_consumed_event_and_count_the_trained(decoder):
    good = raw_events([event(), event()], partition=2, first_offset=10)
    bad = [RawEvent(2, 12, b"\x02", 0), RawEvent(3, 7, None, 0)]
    result = decoder.decode(good + bad)
    assert result.batch.size == 2
    assert {(e.partition, e.offset) for e, _ in result.rejected} == {(2, 12), (3, 7)}
    assert all(reason.startswith("undecodable") for _, reason in result.rejected)
    spans = result.batch.spans
    assert (spans[2].events, spans[2].next_offset) == (2, 13)
    assert (spans[3].events, spans[3].next_offset) == (0, 8)


def test_non_finite_dense_values_are_rejected(decoder):
    result = decoder.decode(raw_events([event(price=float("nan")), event(price=float("inf")), event()]))
    assert [reason for _, reason in result.rejected] == ["non_finite_dense", "non_finite_dense"]
    assert result.batch.size == 1


def test_an_empty_batch_is_well_formed(decoder):
    batch = decoder.decode([]).batch
    assert batch.size == 0
    assert batch.dense_features.shape == (0, 1)
    assert batch.sparse_features.lengths().numel() == 0
    assert batch.spans == {}


def test_id_mapping_is_documented_and_stable():
    modulo = TableConfig(name="t", field="f", num_embeddings=10, embedding_dim=4)
    hashed = TableConfig(name="t", field="f", num_embeddings=10, embedding_dim=4, id_mapping="hash")
    assert map_ids(np.array([3, 13, -1, -11]), modulo).tolist() == [3, 3, 9, 9]
    # splitmix64 reference values (Vigna's splitmix64 with x as the state increment input)
    assert splitmix64(np.array([0], dtype=np.uint64)).tolist() == [0xE220A8397B1DCDAF]
    rows = map_ids(np.array([0, 1, 2, -5]), hashed)
    assert ((rows >= 0) & (rows < 10)).all()
    assert rows.tolist() == map_ids(np.array([0, 1, 2, -5]), hashed).tolist()
    # FNV-1a 64 reference vectors
    assert fnv1a64("") == 0xCBF29CE484222325
    assert fnv1a64("a") == 0xAF63DC4C8601EC8C
    assert fnv1a64(b"foobar") == 0x85944171F73967E8
