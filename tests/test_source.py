"""The source's consumer: its effective properties, where librdkafka's log goes, and where reading
starts (kafka.start_at against committed offsets), on the real broker."""

from __future__ import annotations

import logging
import time
from datetime import UTC, datetime

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition

from conftest import SCHEMA
from streamtrain.config import DeadLetterConfig, KafkaConfig
from streamtrain.deadletter import DeadLetterWriter, dead_letter_topic
from streamtrain.dev.kafka import free_port
from streamtrain.dev.produce import produce
from streamtrain.metrics import WorkerMetrics
from streamtrain.source import KAFKA_LOG, KafkaSource, consumer_properties
from streamtrain.topics import OutputTopicMissing, ensure_topics


def test_client_config_overrides_the_consumer_defaults_but_not_what_streamtrain_owns():
    config = KafkaConfig(
        bootstrap_servers="[::1]:9092",
        topic="clicks",
        group_id="trainer",
        client_config={"broker.address.family": "v6", "fetch.wait.max.ms": "500", "security.protocol": "SSL"},
    )
    errors: list = []
    props = consumer_properties(config, until_end=True, error_cb=errors.append)
    assert props["broker.address.family"] == "v6"  # an IPv6-only cluster can be read
    assert props["fetch.wait.max.ms"] == "500"
    assert props["security.protocol"] == "SSL"
    assert props["bootstrap.servers"] == "[::1]:9092" and props["group.id"] == "trainer"
    assert props["enable.auto.commit"] is False and props["enable.auto.offset.store"] is False
    assert props["enable.partition.eof"] is True and props["auto.offset.reset"] == "earliest"
    assert props["error_cb"] == errors.append and props["logger"] is KAFKA_LOG
    defaults = consumer_properties(
        KafkaConfig(bootstrap_servers="b:9092", topic="t"), until_end=False, error_cb=errors.append
    )
    assert defaults["broker.address.family"] == "v4" and defaults["fetch.wait.max.ms"] == 50


def test_librdkafka_logs_through_python_logging_not_raw_to_stderr(caplog, capfd):
    dead = KafkaConfig(bootstrap_servers=f"127.0.0.1:{free_port()}", topic="clicks")
    caplog.set_level(logging.DEBUG, logger="streamtrain.kafka")
    consumer = Consumer(consumer_properties(dead, until_end=False, error_cb=lambda error: None))
    try:
        deadline = time.monotonic() + 20
        while not any("rdkafka#consumer" in r.getMessage() for r in caplog.records) and time.monotonic() < deadline:
            consumer.poll(0.2)
    finally:
        consumer.close()
    writer = DeadLetterWriter(DeadLetterConfig(), dead, WorkerMetrics())
    with pytest.raises(OutputTopicMissing, match=r"clicks\.dlq"):
        ensure_topics(dead, [dead_letter_topic(DeadLetterConfig(), dead)], timeout=1.0)
    writer.close(timeout=1.0)
    from_librdkafka = [r for r in caplog.records if r.name == "streamtrain.kafka"]
    assert any(
        r.levelno == logging.ERROR and "rdkafka#consumer" in r.getMessage() and "Connect to" in r.getMessage()
        for r in from_librdkafka
    ), [r.getMessage() for r in caplog.records]
    assert any("rdkafka#producer" in r.getMessage() for r in from_librdkafka), [r.getMessage() for r in from_librdkafka]
    stderr = capfd.readouterr().err
    assert "|FAIL|" not in stderr and "%3|" not in stderr, stderr


def end_offsets(kafka, topic: str, partitions: int) -> dict[int, int]:
    consumer = Consumer({"bootstrap.servers": kafka.bootstrap_servers, "group.id": "inspector"})
    try:
        return {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in range(partitions)}
    finally:
        consumer.close()


def commit(kafka, topic: str, group: str, offsets: dict[int, int]) -> None:
    consumer = Consumer({"bootstrap.servers": kafka.bootstrap_servers, "group.id": group})
    try:
        consumer.commit(offsets=[TopicPartition(topic, p, o) for p, o in offsets.items()], asynchronous=False)
    finally:
        consumer.close()


def start_positions(kafka, topic: str, start_at=None, **kwargs) -> dict[int, int]:
    config = KafkaConfig(
        bootstrap_servers=kafka.bootstrap_servers, topic=topic, group_id=f"group-{topic}", start_at=start_at
    )
    source = KafkaSource(config, **kwargs)
    try:
        return dict(source.next_offset)
    finally:
        source.close()


@pytest.fixture
def two_bursts(kafka, topic_name):
    """300 events, then a moment, then 200 more on 2 partitions: (per-partition ends after the first
    burst, the moment in epoch ms, the ends after both). Kafka stamps each message with its
    producer's send time (CreateTime)."""
    produce(kafka.bootstrap_servers, topic_name, 300, partitions=2, seed=1, schema_path=SCHEMA)
    first = end_offsets(kafka, topic_name, 2)
    time.sleep(0.05)
    moment = int(time.time() * 1000)
    time.sleep(0.05)
    produce(kafka.bootstrap_servers, topic_name, 200, partitions=2, seed=2, schema_path=SCHEMA)
    return first, moment, end_offsets(kafka, topic_name, 2)


@pytest.mark.integration
def test_start_at_earliest_wins_over_committed_offsets_and_committed_win_without_start_at(
    kafka, topic_name, two_bursts
):
    first, _moment, _ends = two_bursts
    commit(kafka, topic_name, f"group-{topic_name}", first)
    assert start_positions(kafka, topic_name, "earliest") == {0: 0, 1: 0}
    assert start_positions(kafka, topic_name) == first  # no start_at: the group's committed offsets
    # With checkpointing and no snapshot, the committed offsets are not used: the earliest.
    assert start_positions(kafka, topic_name, committed=False) == {0: 0, 1: 0}


@pytest.mark.integration
def test_start_at_latest_or_a_time_in_the_middle_or_beyond_the_last_message(kafka, topic_name, two_bursts):
    first, moment, ends = two_bursts
    commit(kafka, topic_name, f"group-{topic_name}", {0: 1, 1: 1})  # start_at wins over these
    assert start_positions(kafka, topic_name, "latest") == ends
    assert start_positions(kafka, topic_name, str(moment)) == first
    iso = datetime.fromtimestamp(moment / 1000, UTC).isoformat()
    assert start_positions(kafka, topic_name, iso) == first
    assert start_positions(kafka, topic_name, str(int(time.time() * 1000) + 3_600_000)) == ends


@pytest.mark.integration
def test_start_at_does_not_move_a_restored_snapshots_positions(kafka, topic_name, two_bursts):
    _first, _moment, _ends = two_bursts
    assert start_positions(kafka, topic_name, "latest", start_offsets={0: 5}) == {0: 5, 1: 0}


@pytest.mark.integration
@pytest.mark.parametrize("fetch_queue", [True, False])
def test_until_end_reaches_the_end_of_a_transactional_topic(kafka, topic_name, fetch_queue):
    """A transaction's marker takes the offset after its last message, so the end offset is reached
    through the partition's EOF, also when the EOF comes in one batch with the last messages (an
    exactly-once joiner writes the topic this way)."""
    kafka.create_topic(topic_name, partitions=2)
    producer = Producer({"bootstrap.servers": kafka.bootstrap_servers, "transactional.id": topic_name})
    producer.init_transactions(30)
    for commit_it in (True, False, True):
        producer.begin_transaction()
        for i in range(10):
            producer.produce(topic_name, b"%d" % i, partition=i % 2)
        producer.flush(30)  # the aborted ones too are written, then skipped by the reader
        (producer.commit_transaction if commit_it else producer.abort_transaction)(30)
    del producer  # closed while the broker is up
    config = KafkaConfig(
        bootstrap_servers=kafka.bootstrap_servers, topic=topic_name, group_id=topic_name, fetch_queue=fetch_queue
    )
    source = KafkaSource(config, until_end=True)
    try:
        read, deadline = 0, time.monotonic() + 30
        while not source.exhausted and time.monotonic() < deadline:
            read += len(source.poll(1000, 2.0))  # waits the 2 s: all the messages and the EOFs in one batch
        assert read == 20, "the aborted transaction's 10 are skipped"
        assert source.next_offset == source.end_offset == {0: 18, 1: 18}  # 3 x (5 messages + a marker)
    finally:
        source.close()
