"""The source's fetch queue (``streamtrain.rdkafka``) on the real broker: it reads what
``Consumer.consume`` reads, message for message, keys, timestamps, headers and tombstones
included; it holds every message of the owned partitions; and the per-message path it replaces
stays right where the handle cannot be read."""

from __future__ import annotations

import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, Producer, TopicPartition

from streamtrain import rdkafka
from streamtrain.config import KafkaConfig
from streamtrain.dev.kafka import create_topic
from streamtrain.source import EventBatch, KafkaSource

pytestmark = pytest.mark.integration

PARTITIONS = 3


@pytest.fixture
def mixed_topic(kafka, topic_name):
    """90 messages on 3 partitions: payloads of varied sizes, some keyed, some with headers (one a
    null header), every tenth a tombstone, with timestamps set by the producer."""
    create_topic(kafka.bootstrap_servers, topic_name, PARTITIONS)
    producer = Producer({"bootstrap.servers": kafka.bootstrap_servers})
    for i in range(90):
        producer.produce(
            topic_name,
            value=None if i % 10 == 9 else bytes([i % 251]) * (i * 7 % 300 + 1),
            key=f"user-{i}".encode() if i % 3 else None,
            headers=[("trace", f"t{i}".encode()), ("empty", None)] if i % 4 == 0 else None,
            partition=i % PARTITIONS,
            timestamp=1_700_000_000_000 + i,
        )
    assert producer.flush(30) == 0
    return topic_name


def consumed(kafka, topic: str, partitions: list[int]) -> dict[tuple[int, int], tuple]:
    """(partition, offset) -> (value, key, timestamp, headers), as ``Consumer.consume`` reads them."""
    consumer = Consumer({"bootstrap.servers": kafka.bootstrap_servers, "group.id": "oracle"})
    ends = {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in partitions}
    consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in partitions])
    found: dict[tuple[int, int], tuple] = {}
    try:
        for _ in range(200):
            for m in consumer.consume(100, 0.1):
                assert m.error() is None
                found[m.partition(), m.offset()] = (m.value(), m.key(), m.timestamp()[1], m.headers())
            if len(found) == sum(ends.values()):
                return found
        raise AssertionError(f"read {len(found)} of {ends}")
    finally:
        consumer.close()


def read_all(source: KafkaSource) -> list[EventBatch]:
    batches = []
    for _ in range(200):
        if source.exhausted:
            return batches
        batches.append(source.poll(16, 0.1))
    raise AssertionError(f"not exhausted at {source.next_offset} of {source.end_offset}")


def source_of(kafka, topic: str, rank: int = 0, world_size: int = 1, fetch_queue: bool = True) -> KafkaSource:
    config = KafkaConfig(
        bootstrap_servers=kafka.bootstrap_servers, topic=topic, group_id=f"g-{topic}", fetch_queue=fetch_queue
    )
    return KafkaSource(config, rank, world_size, until_end=True, committed=False)


@pytest.mark.parametrize("path", ["fetch-queue", "handle-unreadable", "configured-off"])
def test_every_message_read_as_consume_reads_it(kafka, mixed_topic, monkeypatch, path):
    if path == "handle-unreadable":
        monkeypatch.setattr(rdkafka, "_handle", lambda consumer, lib: None)
    expected = consumed(kafka, mixed_topic, [1])
    source = source_of(kafka, mixed_topic, rank=1, world_size=2, fetch_queue=path != "configured-off")
    try:
        assert (source.fetch_queue is not None) == (path == "fetch-queue")  # partition 1 of 0..2
        events = EventBatch.joined(read_all(source))
        assert sorted(zip(events.partitions.tolist(), events.offsets.tolist(), strict=True)) == sorted(expected)
        assert source.next_offset == {1: 30}
        for i in range(len(events)):
            event = events.event(i)
            value, key, timestamp, headers = expected[event.partition, event.offset]
            assert (event.value, event.key, event.timestamp_ms, event.headers) == (value, key, timestamp, headers)
            assert bytes(events.data[events.bounds[i] : events.bounds[i + 1]]) == (value or b"")
            assert events.payloads[i] == (value or b"")
        assert events.sizes.tolist() == [len(events.payloads[i]) for i in range(len(events))]
    finally:
        source.close()


def test_a_batch_cut_and_joined_keeps_each_event_with_its_payload(kafka, mixed_topic):
    source = source_of(kafka, mixed_topic)
    try:
        parts = read_all(source)
        events = EventBatch.joined(parts)
        kept = events.where(events.offsets % 2 == 0)
        for i in range(len(kept)):
            event = kept.event(i)
            assert (event.partition, event.offset) == (kept.partitions[i], kept.offsets[i])
            assert bytes(kept.data[kept.bounds[i] : kept.bounds[i + 1]]) == (event.value or b"")
        assert len(events) == 90 and len(kept) == 45
    finally:
        source.close()


def test_a_message_held_past_close_refuses_to_be_read(kafka, mixed_topic):
    """librdkafka's handle must outlive its messages: closing the source destroys the ones still
    held, and reading one after that is refused instead of reading freed memory."""
    source = source_of(kafka, mixed_topic)
    assert source.fetch_queue is not None
    events = EventBatch.joined(read_all(source))
    source.close()
    with pytest.raises(RuntimeError, match="after its consumer closed"):
        events.event(0)
