"""KJT assembly from Avro payloads: per-key values and lengths, empty and multi-valued lists, nested
records, enums, evolution, every rejection reason, the clip policy and the fastavro fallback."""

import copy
import io
import json
import logging
import math
import re
import struct
from pathlib import Path

import fastavro
import numpy as np
import pytest
import torch
import yaml

from conftest import Schemas
from streamtrain.config import ConfigError, FeaturesConfig, TableConfig, parse_config
from streamtrain.decode import REASONS, AvroBatchDecoder, FastavroDecoder, fnv1a64, map_ids, splitmix64
from streamtrain.dev.produce import AvroEncoder
from streamtrain.source import RawEvent

REPO = Path(__file__).resolve().parent.parent
SCHEMA = REPO / "schemas" / "click_event.avsc"


def event(**overrides) -> dict:
    record = {
        "event_time": 1_700_000_000_000,
        "user_id": 11,
        "adgroup_id": 22,
        "cate_id": 33,
        "campaign_id": 44,
        "customer": 55,
        "brand": 66,
        "cms_segid": 1,
        "cms_group_id": 2,
        "final_gender_code": 1,
        "age_level": 3,
        "pvalue_level": 1,
        "shopping_level": 2,
        "occupation": 0,
        "new_user_class_level": 4,
        "pid": "430548_1007",
        "recent_cate_ids": [5, 6, 7],
        "price": 99.5,
        "clk": 1,
        "buy": 0,
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
    assert sorted(reason for _, reason in result.rejected) == ["empty_payload", "truncated"]
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


# A small schema that has every supported kind, for hand-made payloads.
RICH = {
    "type": "record",
    "name": "Rich",
    "fields": [
        {"name": "clk", "type": ["null", "int"]},
        {"name": "ts", "type": {"type": "long", "logicalType": "timestamp-micros"}},
        {
            "name": "user",
            "type": {
                "type": "record",
                "name": "User",
                "fields": [
                    {"name": "id", "type": "long"},
                    {"name": "country", "type": ["null", "string"], "default": None},
                ],
            },
        },
        {"name": "kind", "type": {"type": "enum", "name": "Kind", "symbols": ["A", "B", "C"]}},
        {"name": "tags", "type": {"type": "array", "items": "string"}, "default": []},
        {"name": "price", "type": "double"},
        {"name": "flag", "type": "boolean", "default": False},
    ],
}
RICH_FEATURES = {
    "tables": [
        {"name": "user", "field": "user.id", "num_embeddings": 10, "embedding_dim": 4},
        {"name": "country", "field": "user.country", "num_embeddings": 50, "embedding_dim": 4, "id_mapping": "hash"},
        {"name": "kind", "field": "kind", "num_embeddings": 3, "embedding_dim": 4},
        {"name": "tags", "field": "tags", "num_embeddings": 100, "embedding_dim": 4},
        {"name": "flag", "field": "flag", "num_embeddings": 2, "embedding_dim": 4},
    ],
    "dense": [{"field": "price", "transform": "log1p"}, {"field": "user.id"}],
    "label": "clk",
    "event_time": "ts",
}


def rich_features(tmp_path, reader=RICH, **overrides):
    path = tmp_path / "rich.avsc"
    path.write_text(json.dumps(reader))
    return FeaturesConfig.model_validate({**RICH_FEATURES, "schema_path": str(path), **overrides})


def rich_record(**overrides) -> dict:
    record = {
        "clk": 1,
        "ts": 1_700_000_000_123_456,
        "user": {"id": -1, "country": "fr"},
        "kind": "C",
        "tags": ["a", "b"],
        "price": 9.0,
        "flag": True,
    }
    record.update(overrides)
    return record


def encode(schema: dict, record: dict) -> bytes:
    out = io.BytesIO()
    fastavro.schemaless_writer(out, fastavro.parse_schema(schema), record)
    return out.getvalue()


def events_of(payloads: list[bytes | None]) -> list[RawEvent]:
    return [RawEvent(0, i, p, 0) for i, p in enumerate(payloads)]


def test_nested_fields_enums_booleans_and_micros(tmp_path):
    result = AvroBatchDecoder(rich_features(tmp_path)).decode(
        events_of(
            [
                encode(RICH, rich_record()),
                encode(RICH, rich_record(user={"id": 13, "country": None}, kind="A", tags=[], flag=False, clk=0)),
            ]
        )
    )
    assert result.rejected == []
    kjt = result.batch.sparse_features.to_dict()
    assert kjt["user"].values().tolist() == [9, 3]  # -1 -> n - 1 with floor modulo
    assert kjt["country"].lengths().tolist() == [1, 0]
    assert kjt["country"].values().tolist() == [int(splitmix64(np.array([fnv1a64("fr")], np.uint64))[0] % 50)]
    assert kjt["kind"].values().tolist() == [2, 0]  # the reader's symbol index
    assert kjt["tags"].values().tolist() == [fnv1a64("a") % 100, fnv1a64("b") % 100]
    assert kjt["tags"].lengths().tolist() == [2, 0]
    assert kjt["flag"].values().tolist() == [1, 0]
    assert result.batch.event_time_ms.tolist() == [1_700_000_000_123, 1_700_000_000_123]
    assert result.batch.dense_features[:, 1].tolist() == [-1.0, 13.0]
    assert result.batch.labels.tolist() == [1.0, 0.0]


def test_every_bad_payload_gets_its_reason(tmp_path):
    good = encode(RICH, rich_record())
    cases = {
        "empty_payload": None,
        "truncated": good[:-3],
        "trailing_bytes": good + b"\x00",
        "bad_varint": b"\x02" + b"\xff" * 11 + good[12:],  # clk = 1, then an 11-byte timestamp
        "bad_union_index": b"\x07" + good[1:],
        "missing_label": encode(RICH, rich_record(clk=None)),
        "non_finite_dense": encode(RICH, rich_record(price=float("nan"))),
    }
    # clk=1, ts=0, user.id=0, country=null; then kind, tags; then price=1.0, flag=false
    prefix, tail = b"\x02\x02" + b"\x00" + b"\x00" + b"\x00", struct.pack("<d", 1.0) + b"\x00"
    cases["bad_enum_index"] = prefix + b"\x0a" + b"\x00" + tail  # index 5 of 3 symbols
    cases["bad_length"] = prefix + b"\x00" + b"\x02\x03" + tail  # one tag, of length -2
    cases["absurd length"] = prefix + b"\x00" + b"\x02\xfe\xff\xff\xff\x0f" + tail  # one tag of 2 GiB
    cases["absurd count"] = prefix + b"\x00" + b"\xfe\xff\xff\xff\x0f" + tail  # 2**31 tags
    hand_made = prefix + b"\x00" + b"\x00" + tail
    assert AvroBatchDecoder(rich_features(tmp_path)).decode(events_of([hand_made])).rejected == []
    result = AvroBatchDecoder(rich_features(tmp_path)).decode(events_of([good, *cases.values(), good]))
    assert result.batch.size == 2
    assert [reason for _, reason in result.rejected] == [name if " " not in name else "bad_length" for name in cases]
    assert {reason for _, reason in result.rejected} <= set(REASONS)


def test_framing_unknown_ids_and_evolution_with_the_confluent_wire_format(tmp_path):
    writer = copy.deepcopy(RICH)
    writer["fields"] = [f for f in writer["fields"] if f["name"] not in ("tags", "flag")][::-1]
    writer["fields"][0] = {"name": "price", "type": "float"}  # float -> double
    writer["fields"].append({"name": "session", "type": {"type": "map", "values": "string"}})
    features = rich_features(tmp_path, wire_format="confluent", writer_schemas_dir=str(tmp_path))
    decoder = AvroBatchDecoder(features, Schemas({1: RICH, 2: writer}))
    record = rich_record()
    old = {**{k: v for k, v in record.items() if k not in ("tags", "flag")}, "session": {"k": "v"}}
    framed = [
        b"\x00\x00\x00\x00\x01" + encode(RICH, record),
        b"\x00\x00\x00\x00\x02" + encode(writer, old),
        b"\x00\x00\x00\x00\x03" + encode(RICH, record),
        b"\x01\x00\x00\x00\x01" + encode(RICH, record),
        b"\x00\x00",
    ]
    result = decoder.decode(events_of(framed))
    assert [(e.offset, reason) for e, reason in result.rejected] == [
        (2, "unknown_schema_id"),
        (3, "bad_magic_byte"),
        (4, "bad_magic_byte"),
    ]
    kjt = result.batch.sparse_features.to_dict()
    assert kjt["tags"].lengths().tolist() == [2, 0]  # the reader's default [] for the old writer
    assert kjt["flag"].values().tolist() == [1, 0]  # and its default false
    assert result.batch.dense_features[:, 0].tolist() == pytest.approx([math.log1p(9.0)] * 2)
    assert set(decoder.entries) == {1, 2, 3} and decoder.entries[3] < 0
    decoder.decode(events_of(framed))
    assert len(decoder.programs) == 2, "programs are built once per schema id"


def test_clip_policy_keeps_non_finite_dense_values(tmp_path):
    decoder = AvroBatchDecoder(rich_features(tmp_path, non_finite_dense="clip"))
    result = decoder.decode(
        events_of([encode(RICH, rich_record(price=p)) for p in (float("nan"), float("inf"), 1e300, -5.0, 3.0)])
    )
    assert result.rejected == []
    max32 = float(np.finfo(np.float32).max)
    # log1p(inf) = inf -> max; log1p(1e300) is finite; log1p(-5) is NaN -> 0
    assert result.batch.dense_features[:, 0].tolist() == [
        0.0,
        max32,
        pytest.approx(690.7755),
        0.0,
        pytest.approx(math.log1p(3.0)),
    ]
    fallback = FastavroDecoder(rich_features(tmp_path, non_finite_dense="clip")).decode(
        events_of([encode(RICH, rich_record(price=p)) for p in (float("nan"), float("inf"), 1e300, -5.0, 3.0)])
    )
    assert torch.equal(fallback.batch.dense_features, result.batch.dense_features)


def test_an_unsupported_writer_schema_falls_back_to_fastavro_with_a_log_line(tmp_path, caplog):
    writer = copy.deepcopy(RICH)
    # A recursive type: beyond the program compiler, fine for fastavro.
    writer["fields"].append(
        {
            "name": "tree",
            "type": {
                "type": "record",
                "name": "Node",
                "fields": [{"name": "children", "type": {"type": "array", "items": "Node"}}],
            },
        }
    )
    features = rich_features(tmp_path, wire_format="confluent", writer_schemas_dir=str(tmp_path))
    decoder = AvroBatchDecoder(features, Schemas({1: RICH, 2: writer}))
    record = rich_record()
    payloads = [
        b"\x00\x00\x00\x00\x02" + encode(writer, {**record, "tree": {"children": [{"children": []}]}}),
        b"\x00\x00\x00\x00\x01" + encode(RICH, rich_record(kind="B", tags=["x"])),
        b"\x00\x00\x00\x00\x02" + encode(writer, {**record, "tree": {"children": []}})[:-1],
        b"\x00\x00\x00\x00\x02" + encode(writer, {**rich_record(tags=[]), "tree": {"children": []}}),
    ]
    with caplog.at_level(logging.WARNING, logger="streamtrain.decode"):
        result = decoder.decode(events_of(payloads))
    assert "writer schema 2 cannot be compiled (recursive type Node)" in caplog.text
    assert [(e.offset, reason) for e, reason in result.rejected] == [(2, "truncated")]
    expected = FastavroDecoder(features, Schemas({1: RICH, 2: writer})).decode(events_of(payloads))
    assert torch.equal(result.batch.sparse_features.values(), expected.batch.sparse_features.values())
    assert torch.equal(result.batch.sparse_features.lengths(), expected.batch.sparse_features.lengths())
    # the events stay in consumption order, whichever path decoded them
    assert result.batch.sparse_features.to_dict()["tags"].lengths().tolist() == [2, 1, 0]


def test_the_program_is_readable(tmp_path):
    text = AvroBatchDecoder(rich_features(tmp_path)).describe()
    assert "UNION" in text and "ENUM" in text and "BLOCKS" in text and "ID" in text
    assert text.splitlines()[-1].split()[1] == "END"


def test_rows_grow_past_the_first_guess(tmp_path):
    many = [str(i) for i in range(5000)]
    result = AvroBatchDecoder(rich_features(tmp_path)).decode(
        events_of([encode(RICH, rich_record(tags=many)), encode(RICH, rich_record(tags=["x"]))])
    )
    kjt = result.batch.sparse_features.to_dict()
    assert kjt["tags"].lengths().tolist() == [5000, 1]
    assert kjt["tags"].values().tolist() == [fnv1a64(t) % 100 for t in many + ["x"]]


def test_nested_paths_are_checked_against_the_schema(tmp_path):
    raw = yaml.safe_load((REPO / "tests" / "worker-small.yaml").read_text())
    raw["kafka"] = {"bootstrap_servers": "unused:9092", "topic": "unused"}
    (tmp_path / "rich.avsc").write_text(json.dumps(RICH))
    raw["features"] = {**RICH_FEATURES, "schema_path": str(tmp_path / "rich.avsc")}
    raw["features"]["tables"] = [{**t, "embedding_dim": 8} for t in RICH_FEATURES["tables"]]
    assert parse_config(raw, environ={}).features.tables[0].field == "user.id"
    raw["features"]["tables"][0]["field"] = "user.idd"
    with pytest.raises(ConfigError, match=re.escape("'user.idd' is not a field of Rich")):
        parse_config(raw, environ={})


def test_ids_map_the_same_in_both_paths(tmp_path):
    extremes = [0, 1, -1, 7, -7, 2**63 - 1, -(2**63), 123456789]
    for mapping in ("modulo", "hash"):
        tables = [{**RICH_FEATURES["tables"][0], "num_embeddings": 7, "id_mapping": mapping}]
        features = rich_features(tmp_path, tables=tables)
        payloads = events_of([encode(RICH, rich_record(user={"id": i, "country": None})) for i in extremes])
        compiled = AvroBatchDecoder(features).decode(payloads).batch.sparse_features.values()
        fallback = FastavroDecoder(features).decode(payloads).batch.sparse_features.values()
        assert compiled.tolist() == fallback.tolist() == map_ids(np.array(extremes), features.tables[0]).tolist()


def reference_writer(**field_types) -> dict:
    schema = json.loads(SCHEMA.read_text())
    for f in schema["fields"]:
        f["type"] = field_types.get(f["name"], f["type"])
    return schema


def both_paths(features, source=None) -> list[AvroBatchDecoder | FastavroDecoder]:
    return [AvroBatchDecoder(features, source), FastavroDecoder(features, source)]


# Payloads the two paths once gave different reasons, kept as found (hex).
# A raw body of the reference schema whose brand union index is past its two branches; fastavro
# called it undecodable.
UNION_INDEX_PAST_BRAND = bytes.fromhex(
    "0000000001c2b2f2bedd6690b569e0c61b948f01e0c71be2ce19029ae112a00108020804020208163433303534385f31303037048a10b29b01"
    "006acc05420000"
)
# Framed with writer schema 5, the reference schema with clk ["null", "int"]; clk is null. The
# compiled path called it bad_union_index (the reader's clk is an int).
NULL_LABEL_OF_WRITER_5 = bytes.fromhex(
    "0000000005b4e08a90dc66a8ef51b4d22090a001aca61da0e0060282ad1b940112020006060004163433303533395f3130303710da21bc68"
    "fe78d47cd4c001c49b019c9f019c0200a69452410000"
)


def test_regression_payloads_get_the_same_reason_on_both_paths(decoder, tmp_path):
    for path in both_paths(decoder.features):
        assert [r for _, r in path.decode(events_of([UNION_INDEX_PAST_BRAND])).rejected] == ["bad_union_index"]
    features = FeaturesConfig.model_validate(
        {**decoder.features.model_dump(), "wire_format": "confluent", "writer_schemas_dir": str(tmp_path)}
    )
    nullable_label = Schemas({5: reference_writer(clk=["null", "int"])})
    for path in both_paths(features, nullable_label):
        assert [r for _, r in path.decode(events_of([NULL_LABEL_OF_WRITER_5])).rejected] == ["missing_label"]
        # and a label there trains
        record = event(clk=1)
        assert path.decode(
            events_of([b"\x00\x00\x00\x00\x05" + encode(nullable_label.schemas[5], record)])
        ).batch.labels.tolist() == [1.0]


def test_an_unresolvable_writer_schema_is_dead_lettered_with_why(decoder, tmp_path, caplog):
    features = FeaturesConfig.model_validate(
        {**decoder.features.model_dump(), "wire_format": "confluent", "writer_schemas_dir": str(tmp_path)}
    )
    doubles = reference_writer(price="double")  # Avro promotes float to double, never back
    source = Schemas({6: doubles})
    payloads = events_of([b"\x00\x00\x00\x00\x06" + encode(doubles, event())] * 2)
    compiled = AvroBatchDecoder(features, source)
    with caplog.at_level(logging.INFO, logger="streamtrain.decode"):
        rejected = [r for _, r in compiled.decode(payloads).rejected]
        compiled.decode(payloads)
    assert (
        rejected
        == [
            "undecodable: writer schema 6 cannot be resolved to the reader: "
            "price: writer double cannot be read as float"
        ]
        * 2
    )
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["events of writer schema 6 will be dead-lettered: price: writer double cannot be read as float"]
    fallback = FastavroDecoder(features, source).decode(payloads).rejected
    assert [r.split(":")[0] for _, r in fallback] == ["undecodable"] * 2
