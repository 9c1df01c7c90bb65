"""The Confluent wire format: payloads framed by confluent-kafka's AvroSerializer under two writer
schema versions, resolved to the worker's reader schema; writer schemas from a directory or a
registry reached over HTTP."""

from __future__ import annotations

import copy
import json
import logging
import re

import numpy as np
import pytest
import yaml
from confluent_kafka import Producer
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroSerializer
from confluent_kafka.serialization import MessageField, SerializationContext

from conftest import SCHEMA, SMALL_CONFIG
from schema_registry import StandInRegistry, stand_in_registry
from streamtrain.config import ConfigError, SchemaRegistryConfig, parse_config
from streamtrain.decode import AvroBatchDecoder, FastavroDecoder
from streamtrain.dev.produce import AvroEncoder, ClickStream
from streamtrain.registry import SchemaDirectory, SchemaRegistry, SchemaSourceUnavailable
from streamtrain.schema import load_schema
from streamtrain.source import RawEvent

READER = load_schema(SCHEMA)


def writer_v1() -> dict:
    """An older producer: user_id still an int (promoted to long), no recent_cate_ids yet (the
    reader's default [] applies)."""
    schema = copy.deepcopy(READER)
    schema["fields"] = [f for f in schema["fields"] if f["name"] != "recent_cate_ids"]
    next(f for f in schema["fields"] if f["name"] == "user_id")["type"] = "int"
    return schema


def writer_v2() -> dict:
    """A newer producer: fields reordered, and a session_id the reader does not know (skipped)."""
    schema = copy.deepcopy(READER)
    clk = next(f for f in schema["fields"] if f["name"] == "clk")
    schema["fields"] = [clk] + [f for f in schema["fields"] if f["name"] != "clk"]
    schema["fields"].append({"name": "session_id", "type": "string"})
    return schema


def small_features(**overrides):
    raw = yaml.safe_load(SMALL_CONFIG.read_text())
    raw["kafka"] = {"bootstrap_servers": "127.0.0.1:9", "topic": "t"}
    raw["features"].update(overrides)
    return parse_config(raw, environ={}).features


def serialized_events(registry: SchemaRegistryClient, topic: str, count: int):
    """(framed payload, the same event as a reader-schema raw body), alternating v1 and v2."""
    serializers = [AvroSerializer(registry, json.dumps(w)) for w in (writer_v1(), writer_v2())]
    reader_encoder = AvroEncoder(SCHEMA)
    context = SerializationContext(topic, MessageField.VALUE)
    pairs = []
    for i, record in enumerate(ClickStream(seed=3).chunk(count).records):
        if i % 2 == 0:
            record = {k: v for k, v in record.items() if k != "recent_cate_ids"}
            as_reader = {**record, "recent_cate_ids": []}
        else:
            record = {**record, "session_id": f"s{i}"}
            as_reader = {k: v for k, v in record.items() if k != "session_id"}
        pairs.append((serializers[i % 2](record, context), reader_encoder.encode(as_reader)))
    return pairs


def columns(batch) -> dict[str, np.ndarray]:
    kjt = batch.sparse_features
    return {
        "values": kjt.values().numpy(),
        "lengths": kjt.lengths().numpy(),
        "dense": batch.dense_features.numpy(),
        "labels": batch.labels.numpy(),
        "event_time_ms": batch.event_time_ms.numpy(),
    }


def events(payloads: list[bytes]) -> list[RawEvent]:
    return [RawEvent(partition=0, offset=i, value=p, timestamp_ms=0) for i, p in enumerate(payloads)]


def test_two_writer_versions_decode_like_the_reader_schema():
    registry = SchemaRegistryClient.new_client({"url": "mock://two-versions"})
    pairs = serialized_events(registry, "clicks", 64)
    assert {p[:1] for p, _ in pairs} == {b"\x00"}
    assert len({p[1:5] for p, _ in pairs}) == 2, "the two versions must carry different schema ids"

    confluent = AvroBatchDecoder(
        small_features(wire_format="confluent", schema_registry={"url": "mock://two-versions"}),
        SchemaRegistry(SchemaRegistryConfig(url="mock://two-versions"), client=registry),
    )
    framed = confluent.decode(events([p for p, _ in pairs]))
    plain = AvroBatchDecoder(small_features()).decode(events([r for _, r in pairs]))
    assert framed.rejected == [] and plain.rejected == []
    got, expected = columns(framed.batch), columns(plain.batch)
    for name in expected:
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)
    # v1's missing recent_cate_ids became empty features, not rows of zeros
    recent = framed.batch.sparse_features["recent_cate_ids"].lengths().numpy()
    assert (recent[0::2] == 0).all() and recent[1::2].sum() > 0


def test_unknown_ids_and_bad_framing_are_rejected_with_reasons(tmp_path):
    registry = SchemaRegistryClient.new_client({"url": "mock://unknown"})
    pairs = serialized_events(registry, "clicks", 4)
    good = pairs[1][0]
    unknown = b"\x00" + (9999).to_bytes(4, "big") + good[5:]
    bad_magic = b"\x01" + good[1:]
    decoder = AvroBatchDecoder(
        small_features(wire_format="confluent", schema_registry={"url": "mock://unknown"}),
        SchemaRegistry(SchemaRegistryConfig(url="mock://unknown"), client=registry),
    )
    result = decoder.decode(events([unknown, good, bad_magic, good[:3]]))
    assert result.batch.size == 1
    assert [(e.offset, reason) for e, reason in result.rejected] == [
        (0, "unknown_schema_id"),
        (2, "bad_magic_byte"),
        (3, "bad_magic_byte"),
    ]


def test_writer_schemas_from_a_directory(tmp_path):
    registry = SchemaRegistryClient.new_client({"url": "mock://directory"})
    pairs = serialized_events(registry, "clicks", 8)
    for payload, _ in pairs:
        schema_id = int.from_bytes(payload[1:5], "big")
        (tmp_path / f"{schema_id}.avsc").write_text(registry.get_schema(schema_id).schema_str)
    source = SchemaDirectory(tmp_path)
    assert source.writer_schema(12345) is None
    decoder = AvroBatchDecoder(small_features(wire_format="confluent", writer_schemas_dir=str(tmp_path)), source)
    result = decoder.decode(events([p for p, _ in pairs]))
    assert result.rejected == [] and result.batch.size == 8


def bad_writer_schema_reasons(decoder, payloads: list[bytes]) -> list[tuple[int, str]]:
    return [(e.offset, reason) for e, reason in decoder.decode(events(payloads)).rejected]


def test_a_bad_writer_schema_file_dead_letters_its_events_as_bad_writer_schema(tmp_path, caplog):
    registry = SchemaRegistryClient.new_client({"url": "mock://bad-file"})
    good = serialized_events(registry, "clicks", 1)[0][0]
    good_id = int.from_bytes(good[1:5], "big")
    (tmp_path / f"{good_id}.avsc").write_text(registry.get_schema(good_id).schema_str)
    (tmp_path / "13.avsc").write_text('{"type": "record", "name": "Cut", "fields": [')  # not JSON
    (tmp_path / "14.avsc").write_text(
        json.dumps({"type": "record", "name": "X", "fields": [{"name": "clk", "type": "nosuch"}]})
    )  # JSON, not Avro
    payloads = [good, b"\x00\x00\x00\x00\x0d" + good[5:], b"\x00\x00\x00\x00\x0e" + good[5:]] * 2
    features = small_features(wire_format="confluent", writer_schemas_dir=str(tmp_path))
    for decoder in (
        AvroBatchDecoder(features, SchemaDirectory(tmp_path)),
        FastavroDecoder(features, SchemaDirectory(tmp_path)),
    ):
        caplog.clear()
        with caplog.at_level(logging.ERROR):
            rejected = bad_writer_schema_reasons(decoder, payloads)
            assert bad_writer_schema_reasons(decoder, payloads) == rejected  # and again, from the cache
        assert [(o, r.split(":")[0]) for o, r in rejected] == [
            (1, "bad_writer_schema"),
            (2, "bad_writer_schema"),
            (4, "bad_writer_schema"),
            (5, "bad_writer_schema"),
        ]
        assert rejected[0][1].startswith(f"bad_writer_schema: writer schema 13: {tmp_path / '13.avsc'} is not JSON")
        assert rejected[1][1].startswith("bad_writer_schema: writer schema 14: not a valid Avro schema: UnknownType")
        errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert len(errors) == 2 and "writer schema 13 is broken" in errors[0] and "14" in errors[1], errors


def test_a_registry_answer_that_is_not_a_schema_is_a_bad_writer_schema(http_registry, caplog):
    StandInRegistry.schemas.update({8: "{not json", 9: json.dumps({"type": "nosuch"})})
    features = small_features(wire_format="confluent", schema_registry={"url": http_registry})
    source = SchemaRegistry(
        SchemaRegistryConfig(url=http_registry, timeout_seconds=20, client_config={"max.retries": 0})
    )
    body = serialized_events(SchemaRegistryClient.new_client({"url": "mock://bad-answer"}), "clicks", 2)[1][0][5:]
    payloads = [b"\x00\x00\x00\x00\x07" + body, b"\x00\x00\x00\x00\x08" + body, b"\x00\x00\x00\x00\x09" + body]
    decoder = AvroBatchDecoder(features, source)
    with caplog.at_level(logging.ERROR):
        rejected = bad_writer_schema_reasons(decoder, payloads)
    assert [(o, r.split(":")[0]) for o, r in rejected] == [(1, "bad_writer_schema"), (2, "bad_writer_schema")]
    assert f"writer schema 8: schema id 8 at {http_registry} is not JSON" in rejected[0][1]
    assert "writer schema 9: not a valid Avro schema" in rejected[1][1]
    assert StandInRegistry.requests == 3, "each id asked once"


def test_wire_format_config_names_the_missing_source():
    with pytest.raises(ConfigError, match=re.escape("schema_registry.url or features.writer_schemas_dir")):
        small_features(wire_format="confluent")
    with pytest.raises(ConfigError, match="only read with wire_format: confluent"):
        small_features(writer_schemas_dir="/tmp")
    with pytest.raises(ConfigError, match="client_config_files"):
        small_features(
            wire_format="confluent",
            schema_registry={"url": "https://registry:8081", "client_config": {"basic.auth.user.info": "me:secret"}},
        )
    with pytest.raises(ConfigError, match=re.escape("basic.auth.user.info")):
        small_features(wire_format="confluent", schema_registry={"url": "https://me:secret@registry:8081"})


@pytest.fixture
def http_registry():
    with stand_in_registry({7: json.dumps(writer_v2())}) as url:
        yield url


def test_registry_over_http_retries_outages_and_knows_unknown_ids(http_registry):
    source = SchemaRegistry(
        SchemaRegistryConfig(url=http_registry, timeout_seconds=20, client_config={"max.retries": 0})
    )
    StandInRegistry.failures = 2
    assert source.writer_schema(7)["fields"][0]["name"] == "clk"
    assert StandInRegistry.requests == 3, "two 503s, then the schema"
    assert source.writer_schema(8) is None


def test_an_unreachable_registry_stops_instead_of_guessing(http_registry):
    source = SchemaRegistry(
        SchemaRegistryConfig(url=http_registry, timeout_seconds=1.5, client_config={"max.retries": 0})
    )
    StandInRegistry.failures = 1000
    with pytest.raises(SchemaSourceUnavailable, match="did not answer for schema id 7"):
        source.writer_schema(7)


@pytest.mark.integration
def test_worker_trains_framed_events_from_two_writer_versions(kafka, topic_name, start_worker, tmp_path):
    registry = SchemaRegistryClient.new_client({"url": "mock://worker"})
    pairs = serialized_events(registry, topic_name, 2000)
    for schema_id in {int.from_bytes(p[1:5], "big") for p, _ in pairs}:
        (tmp_path / f"{schema_id}.avsc").write_text(registry.get_schema(schema_id).schema_str)
    kafka.create_topic(topic_name, partitions=2)
    producer = Producer({"bootstrap.servers": kafka.bootstrap_servers})
    for i, (payload, _) in enumerate(pairs):
        producer.produce(topic_name, payload, partition=i % 2)
    assert producer.flush(30) == 0

    worker = start_worker(
        topic_name,
        "--until-end",
        env={
            "STREAMTRAIN_FEATURES__WIRE_FORMAT": "confluent",
            "STREAMTRAIN_FEATURES__WRITER_SCHEMAS_DIR": str(tmp_path),
        },
    )
    assert worker.process.wait(timeout=90) == 0, worker.output()[-3000:]
    assert "2,000 events trained" in worker.output()
