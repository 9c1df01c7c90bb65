"""Dead letters: the error-rate pause, and the dead-letter topic end to end on the real broker.

The integration tests write a topic mixing valid events with one payload builder per kind of bad
payload (``BAD_PAYLOADS``), run a worker on it, and read the dead-letter topic back: the reason
each event was rejected is asserted through its ``streamtrain.error.reason`` header, never the log.
"""

from __future__ import annotations

import io
import json
import re
import signal
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import fastavro
import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, AlterConfigOpType, ConfigEntry, ConfigResource, NewTopic

from conftest import REPO, committed_offsets
from streamtrain.deadletter import (
    HEADER_DETAIL,
    HEADER_GROUP,
    HEADER_OFFSET,
    HEADER_PARTITION,
    HEADER_REASON,
    HEADER_TOPIC,
    ErrorRateLimit,
    reason_code,
)
from streamtrain.decode import AvroBatchDecoder
from streamtrain.dev.kafka import create_topic
from streamtrain.dev.produce import ClickStream
from streamtrain.registry import schema_source

DLQ_CONFIG = REPO / "tests" / "worker-dlq.yaml"
# The worker reads version 1; version 2 adds a `device` enum, which it skips.
SCHEMA = json.loads((REPO / "tests" / "writer-schemas" / "1.avsc").read_text())
SCHEMA_V2 = json.loads((REPO / "tests" / "writer-schemas" / "2.avsc").read_text())
FIELDS = [f["name"] for f in SCHEMA["fields"]]
# Recent: the broker deletes events older than its retention (7 days) at its next retention check.
BASE_TIME_MS = int(time.time() * 1000) - 3_600_000


# --- the error-rate limit ---------------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_error_rate_limit_pauses_over_a_full_window_then_resumes_with_a_fresh_one():
    clock = FakeClock()
    limit = ErrorRateLimit(max_error_rate=0.2, window_events=100, pause_seconds=30, clock=clock)
    # A bad start does not trip before the window is full.
    assert limit.record(10, Counter(truncated=10)) is None and not limit.paused()
    assert limit.record(80, None) is None  # 10 of 90
    assert limit.record(10, Counter(truncated=5)) is None  # 15 of 100: under 20%
    # The first batch leaves the window (the rest still fill it): 5 + 20 of 110.
    seen = limit.record(20, Counter(truncated=8, missing_label=12))
    assert seen == Counter(truncated=13, missing_label=12)
    assert limit.tripped_at_events == 110 and limit.paused()
    clock.now += 29.9
    assert limit.paused()
    clock.now += 0.2
    assert not limit.paused() and limit.paused_until is None
    # The window starts afresh: the rejects before the pause no longer count.
    assert limit.events == 0 and limit.record(100, Counter(truncated=20)) is None  # exactly 20% is allowed
    assert limit.record(1, Counter(truncated=1)) is not None


def test_error_rate_limit_forgets_old_batches_but_keeps_a_full_window():
    limit = ErrorRateLimit(max_error_rate=0.5, window_events=100, pause_seconds=1, clock=FakeClock())
    assert limit.record(100, Counter(bad_varint=100)) is not None  # a batch larger than the window trips alone
    limit.paused_until = None
    for _ in range(10):
        assert limit.record(50, Counter(truncated=20)) is None  # 40%
    assert 100 <= limit.events < 150 and limit.rejected / limit.events == pytest.approx(0.4)
    assert limit.record(50, Counter(truncated=50)) is not None  # the last 100: 70%


def test_the_dead_letter_topic_defaults_to_the_source_topic_dot_dlq_and_is_never_the_source_topic():
    from streamtrain.config import ConfigError, load_config

    env = {"STREAMTRAIN_KAFKA__TOPIC": "clicks"}
    config = load_config(DLQ_CONFIG, environ=env)
    assert config.dead_letter.enabled and config.dead_letter.resolved_topic(config.kafka.topic) == "clicks.dlq"
    with pytest.raises(ConfigError, match=re.escape("dead_letter.topic: must not be kafka.topic")):
        load_config(DLQ_CONFIG, environ={**env, "STREAMTRAIN_DEAD_LETTER__TOPIC": "clicks"})
    with pytest.raises(ConfigError, match=re.escape("dead_letter.max_error_rate")):
        load_config(DLQ_CONFIG, environ={**env, "STREAMTRAIN_DEAD_LETTER__MAX_ERROR_RATE": "1.5"})


def test_reason_code_is_the_text_before_any_detail():
    assert reason_code("truncated") == "truncated"
    assert reason_code("undecodable: EOFError") == "undecodable"


# --- payloads ---------------------------------------------------------------------------------------


def avro_fields(record: dict, names: list[str], schema: dict = SCHEMA) -> bytes:
    """The Avro encoding of ``names`` of ``record`` in schema order: a slice of a whole body."""
    part = {"type": "record", "name": "Part", "fields": [f for f in schema["fields"] if f["name"] in names]}
    out = io.BytesIO()
    fastavro.schemaless_writer(out, fastavro.parse_schema(part), record)
    return out.getvalue()


def framed(body: bytes, schema_id: int = 1) -> bytes:
    """The Confluent wire format: magic byte 0, the 4-byte big-endian schema id, the body."""
    return b"\x00" + schema_id.to_bytes(4, "big") + body


def zigzag(n: int) -> bytes:
    z, out = (n << 1) ^ (n >> 63), bytearray()
    while True:
        byte, z = z & 0x7F, z >> 7
        if z:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def before(name: str) -> list[str]:
    return FIELDS[: FIELDS.index(name)]


def after(name: str) -> list[str]:
    return FIELDS[FIELDS.index(name) + 1 :]


@dataclass(frozen=True)
class BadPayload:
    name: str
    build: Callable[[dict], bytes | None]  # the whole payload, from a valid record
    reason: str  # the reason code in the streamtrain.error.reason header


def _encode(record: dict) -> bytes:
    return framed(avro_fields(record, FIELDS))


def _encode_v2(record: dict, device_index: int) -> bytes:
    return framed(avro_fields(record, FIELDS, SCHEMA_V2) + zigzag(device_index), schema_id=2)


# One builder per kind of bad payload.
BAD_PAYLOADS = [
    BadPayload("empty payload", lambda r: b"", "empty_payload"),
    BadPayload("null value (a tombstone)", lambda r: None, "empty_payload"),
    BadPayload("no magic byte", lambda r: b"\x01" + _encode(r)[1:], "bad_magic_byte"),
    BadPayload("shorter than the frame header", lambda r: b"\x00\x00\x01", "bad_magic_byte"),
    BadPayload("unknown schema id", lambda r: framed(_encode(r)[5:], schema_id=99), "unknown_schema_id"),
    BadPayload("enum index out of range", lambda r: _encode_v2(r, device_index=7), "bad_enum_index"),
    BadPayload("truncated mid-record", lambda r: _encode(r)[: len(_encode(r)) // 2], "truncated"),
    BadPayload("trailing bytes", lambda r: _encode(r) + b"\x00\x00", "trailing_bytes"),
    BadPayload("varint over 10 bytes", lambda r: framed(b"\xff" * 11 + b"\x01"), "bad_varint"),
    BadPayload(
        "negative string length",
        lambda r: framed(avro_fields(r, before("pid")) + zigzag(-3) + avro_fields(r, after("pid"))),
        "bad_length",
    ),
    BadPayload(
        "absurd string length",
        lambda r: framed(avro_fields(r, before("pid")) + zigzag(1 << 40) + avro_fields(r, after("pid"))),
        "bad_length",
    ),
    BadPayload(
        "union index out of range",
        lambda r: framed(avro_fields(r, before("brand")) + zigzag(7) + avro_fields(r, after("brand"))),
        "bad_union_index",
    ),
    BadPayload("missing label", lambda r: _encode({**r, "clk": None}), "missing_label"),
    BadPayload("label outside [0, 1]", lambda r: _encode({**r, "clk": 2}), "bad_label"),
    BadPayload("NaN price", lambda r: _encode({**r, "price": float("nan")}), "non_finite_dense"),
    BadPayload("infinite price", lambda r: _encode({**r, "price": float("inf")}), "non_finite_dense"),
]


def make_decoder(features) -> AvroBatchDecoder:
    return AvroBatchDecoder(features, schema_source(features))


def test_every_bad_payload_is_rejected_with_its_reason_by_the_decoder():
    """The table checked against the decoder in-process, so a builder that does not build what it
    says fails here, not as a count mismatch in the integration test."""
    from streamtrain.config import load_config
    from streamtrain.source import RawEvent

    config = load_config(DLQ_CONFIG, environ={})
    decoder = make_decoder(config.features)
    record = ClickStream(seed=1).chunk(1).records[0]
    events = [RawEvent(0, i, case.build(record), BASE_TIME_MS) for i, case in enumerate(BAD_PAYLOADS)]
    events.append(RawEvent(0, len(events), _encode(record), BASE_TIME_MS))
    events.append(RawEvent(0, len(events), _encode_v2(record, device_index=2), BASE_TIME_MS))
    result = decoder.decode(events)
    got = {event.offset: reason_code(reason) for event, reason in result.rejected}
    want = {i: case.reason for i, case in enumerate(BAD_PAYLOADS)}
    assert got == want, [(BAD_PAYLOADS[i].name, got.get(i), r) for i, r in want.items()]
    assert result.batch.size == 2, "both writer versions of the valid event decode"


# --- on the broker ----------------------------------------------------------------------------------


@pytest.mark.integration
def test_the_writer_retries_only_what_failed_and_counts_every_dead_letter_once(kafka, topic_name):
    """Part of a write fails for real (the broker refuses a value over the topic's
    max.message.bytes) until the topic is changed; the rest is written once, and counted."""
    import threading

    from confluent_kafka.admin import AdminClient, AlterConfigOpType, ConfigEntry, ConfigResource, NewTopic

    from streamtrain.config import DeadLetterConfig, KafkaConfig
    from streamtrain.deadletter import DeadLetterWriter
    from streamtrain.metrics import WorkerMetrics
    from streamtrain.source import RawEvent

    dlq = topic_name + ".dlq"
    admin = AdminClient({"bootstrap.servers": kafka.bootstrap_servers})
    admin.create_topics([NewTopic(dlq, 2, config={"max.message.bytes": "2000"})])[dlq].result(30)
    metrics = WorkerMetrics()
    writer = DeadLetterWriter(
        DeadLetterConfig(
            topic=dlq, delivery_timeout_seconds=5, retry_backoff_seconds=0.2, retry_backoff_max_seconds=0.5
        ),
        KafkaConfig(bootstrap_servers=kafka.bootstrap_servers, topic=topic_name),
        metrics,
    )
    # Each partition's events travel in one batch: the small ones on the big one's partition fail
    # with it, the others are written at the first attempt (murmur2 of these keys puts them on both).
    rejected = [(RawEvent(0, 10 + i, b"small", BASE_TIME_MS, b"k%d" % i), "truncated") for i in range(8)]
    rejected.append((RawEvent(0, 18, b"\xff" * 5000, BASE_TIME_MS, b"big"), "bad_varint"))
    failed = metrics.dead_letter_failures.labels("MSG_SIZE_TOO_LARGE")

    def raise_the_limit() -> None:
        while failed._value.get() < 1:
            time.sleep(0.1)
        resource = ConfigResource(
            "topic",
            dlq,
            incremental_configs=[
                ConfigEntry("max.message.bytes", "100000", incremental_operation=AlterConfigOpType.SET)
            ],
        )
        admin.incremental_alter_configs([resource])[resource].result(30)

    fixer = threading.Thread(target=raise_the_limit, daemon=True)
    fixer.start()
    try:
        assert writer.write(rejected, threading.Event()) is True
    finally:
        writer.close()
    fixer.join(30)
    assert 1 < failed._value.get() < len(rejected)  # a partial failure: retried only what failed
    letters = read_all(kafka, dlq, 2)
    assert sorted(int(dict(m.headers())[HEADER_OFFSET]) for m in letters) == list(range(10, 19))  # each once
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in metrics.registry.collect()
        for s in family.samples
    }
    assert samples[("streamtrain_dead_letter_events_total", (("reason", "truncated"),))] == 8
    assert samples[("streamtrain_dead_letter_events_total", (("reason", "bad_varint"),))] == 1
    assert samples[("streamtrain_dead_letter_blocked", ())] == 0


@dataclass
class Sent:
    key: bytes | None
    value: bytes | None
    timestamp_ms: int
    headers: list[tuple[str, bytes]]
    reason: str | None  # None: a valid event


def send(kafka, topic: str, partitions: int, messages: list[Sent]) -> dict[tuple[int, int], Sent]:
    """Writes ``messages`` round-robin over the partitions; returns them by (partition, offset)."""
    create_topic(kafka.bootstrap_servers, topic, partitions)
    producer = Producer({"bootstrap.servers": kafka.bootstrap_servers, "enable.idempotence": True, "linger.ms": 20})
    placed: dict[tuple[int, int], Sent] = {}
    failures = []

    def delivered(message: Sent) -> Callable:
        def report(error, reply) -> None:
            if error is not None:
                failures.append(error)
            else:
                placed[(reply.partition(), reply.offset())] = message

        return report

    for i, message in enumerate(messages):
        producer.produce(
            topic,
            value=message.value,
            key=message.key,
            partition=i % partitions,
            timestamp=message.timestamp_ms,
            headers=message.headers,
            on_delivery=delivered(message),
        )
        producer.poll(0)
    assert producer.flush(30) == 0 and not failures, failures
    return placed


def read_all(kafka, topic: str, partitions: int) -> list:
    consumer = Consumer(
        {"bootstrap.servers": kafka.bootstrap_servers, "group.id": "dlq-inspector", "enable.auto.commit": False}
    )
    try:
        ends = {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in range(partitions)}
        consumer.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
        messages, deadline = [], time.monotonic() + 30
        while len(messages) < sum(ends.values()) and time.monotonic() < deadline:
            message = consumer.poll(0.5)
            if message is not None and message.error() is None:
                messages.append(message)
        return messages
    finally:
        consumer.close()


def valid_messages(count: int, seed: int) -> list[Sent]:
    """Valid events, alternately from writer versions 1 and 2."""
    records = ClickStream(seed=seed).chunk(count).records
    return [
        Sent(
            b"user-%d" % r["user_id"],
            _encode_v2(r, i % 3) if i % 2 else _encode(r),
            BASE_TIME_MS + i,
            [("trace", b"valid-%d" % i)],
            None,
        )
        for i, r in enumerate(records)
    ]


def dlq_env(dlq: str, **overrides: object) -> dict[str, str]:
    env = {"STREAMTRAIN_DEAD_LETTER__TOPIC": dlq}
    env.update({f"STREAMTRAIN_DEAD_LETTER__{name.upper()}": str(value) for name, value in overrides.items()})
    return env


@pytest.mark.integration
def test_bad_payloads_land_in_the_dead_letter_topic_and_the_rest_trains(kafka, topic_name, start_worker):
    partitions, dlq = 2, topic_name + ".dlq"
    create_topic(kafka.bootstrap_servers, dlq, 3)
    valid = valid_messages(600, seed=11)
    cases = BAD_PAYLOADS
    bad = []
    for copy in range(2):  # each kind twice, once per partition
        for n, case in enumerate(cases):
            record = ClickStream(seed=100 + n).chunk(1).records[0]
            key = None if copy else b"bad-%d" % n  # a null key must survive too
            bad.append(
                Sent(
                    key,
                    case.build(record),
                    BASE_TIME_MS + 10_000 + 100 * copy + n,
                    [("trace", b"bad-%d-%d" % (copy, n)), ("empty", b"")],
                    case.reason,
                )
            )
    # Each bad event between two valid ones, so the copies alternate over the two partitions.
    rest = iter(valid[200:])
    messages = valid[:200] + [m for b in bad for m in (b, next(rest), next(rest))] + list(rest)
    placed = send(kafka, topic_name, partitions, messages)

    worker = start_worker(topic_name, config=DLQ_CONFIG, env=dlq_env(dlq))
    worker.wait_for(
        lambda: (
            worker.total("streamtrain_events_trained_total") >= len(valid)
            and worker.total("streamtrain_dead_letter_events_total") >= len(bad)
        ),
        timeout=120,
        what="every valid event trained and every bad one dead-lettered",
    )
    time.sleep(1.0)  # nothing more may be counted
    samples = worker.scrape()
    assert worker.total("streamtrain_events_trained_total", samples) == len(valid)
    assert worker.total("streamtrain_events_consumed_total", samples) == len(messages)
    assert worker.total("streamtrain_dead_letter_events_total", samples) == len(bad)
    want_reasons = Counter(m.reason for m in bad)
    for reason, n in want_reasons.items():
        assert samples[f'streamtrain_decode_errors_total{{reason="{reason}"}}'] == n
        assert samples[f'streamtrain_dead_letter_events_total{{reason="{reason}"}}'] == n
    assert samples["streamtrain_dead_letter_blocked"] == 0 and samples["streamtrain_consumption_paused"] == 0
    for partition in range(partitions):  # the per-partition accounting of consumed events and bytes
        mine = [m for (p, _o), m in placed.items() if p == partition]
        labels = f'{{partition="{partition}",topic="{topic_name}"}}'
        assert samples[f"streamtrain_events_consumed_total{labels}"] == len(mine)
        assert samples[f"streamtrain_consumed_bytes_total{labels}"] == sum(len(m.value or b"") for m in mine)

    worker.signal(signal.SIGTERM)
    assert worker.wait(timeout=30) == 0
    ends = {p: 1 + max(o for (q, o) in placed if q == p) for p in range(partitions)}
    assert committed_offsets(kafka, topic_name, f"group-{topic_name}", partitions) == ends

    letters = read_all(kafka, dlq, 3)
    assert len(letters) == len(bad)
    for letter in letters:
        headers = dict(letter.headers())
        assert headers[HEADER_TOPIC] == topic_name.encode()
        assert headers[HEADER_GROUP] == f"group-{topic_name}".encode()
        source = placed[(int(headers[HEADER_PARTITION]), int(headers[HEADER_OFFSET]))]
        assert source.reason is not None, "a valid event reached the dead-letter topic"
        assert headers[HEADER_REASON] == source.reason.encode(), (letter.value(), headers)
        assert (letter.key(), letter.value(), letter.timestamp()[1]) == (source.key, source.value, source.timestamp_ms)
        assert letter.headers()[: len(source.headers)] == source.headers  # the event's own headers first
    assert Counter(dict(letter.headers())[HEADER_REASON].decode() for letter in letters) == want_reasons
    assert len(valid) + len(letters) == len(messages)


def refusing_topic(kafka, topic: str) -> None:
    """A topic whose broker refuses every dead letter: a record batch over 100 bytes is too large
    for it (max.message.bytes), as an ACL would refuse the write, until ``accepting`` raises it."""
    admin = AdminClient({"bootstrap.servers": kafka.bootstrap_servers, "broker.address.family": "v4"})
    admin.create_topics([NewTopic(topic, 1, 1, config={"max.message.bytes": "100"})])[topic].result(timeout=30)


def accepting(kafka, topic: str) -> None:
    admin = AdminClient({"bootstrap.servers": kafka.bootstrap_servers, "broker.address.family": "v4"})
    raised = ConfigEntry("max.message.bytes", "1048588", incremental_operation=AlterConfigOpType.SET)
    resource = ConfigResource(ConfigResource.Type.TOPIC, topic, incremental_configs=[raised])
    admin.incremental_alter_configs([resource])[resource].result(timeout=30)


def described(kafka, topic: str) -> tuple[int, int, str]:
    """The topic's partitions, replication factor and retention.ms."""
    admin = AdminClient({"bootstrap.servers": kafka.bootstrap_servers, "broker.address.family": "v4"})
    partitions = admin.list_topics(topic, timeout=30).topics[topic].partitions
    resource = ConfigResource(ConfigResource.Type.TOPIC, topic)
    retention = admin.describe_configs([resource])[resource].result(timeout=30)["retention.ms"].value
    return len(partitions), min(len(p.replicas) for p in partitions.values()), retention


@pytest.mark.integration
def test_an_unwritable_dead_letter_topic_blocks_consumption_until_it_can_be_written(kafka, topic_name, start_worker):
    dlq = topic_name + ".dlq"
    refusing_topic(kafka, dlq)
    valid = valid_messages(600, seed=12)
    truncated = Sent(b"bad", _encode(ClickStream(seed=3).chunk(1).records[0])[:10], BASE_TIME_MS + 5, [], "truncated")
    placed = send(kafka, topic_name, 1, valid[:300] + [truncated] + valid[300:])
    bad_offset = 300
    assert placed[(0, bad_offset)] is truncated

    worker = start_worker(topic_name, config=DLQ_CONFIG, env=dlq_env(dlq))
    worker.wait_for(
        lambda: worker.scrape().get("streamtrain_dead_letter_blocked") == 1,
        timeout=90,
        what="consumption to block on the dead-letter topic",
    )
    time.sleep(3.0)  # several attempts, and position commits (every second) while blocked
    samples = worker.scrape()
    assert samples["streamtrain_dead_letter_blocked"] == 1
    assert samples['streamtrain_dead_letter_produce_failures_total{code="MSG_SIZE_TOO_LARGE"}'] >= 2
    assert worker.total("streamtrain_events_trained_total", samples) <= bad_offset
    assert worker.total("streamtrain_dead_letter_events_total", samples) == 0
    assert committed_offsets(kafka, topic_name, f"group-{topic_name}", 1)[0] <= bad_offset
    output = worker.output()
    assert f"the dead-letter topic {dlq} exists: 1 partition(s), replication factor 1" in output  # said at start-up
    assert f"consumption of {topic_name} is BLOCKED at partition 0 offset {bad_offset}" in output

    accepting(kafka, dlq)
    worker.wait_for(
        lambda: worker.total("streamtrain_events_trained_total") == len(valid),
        timeout=60,
        what="training to resume once the dead-letter topic takes the event",
    )
    samples = worker.scrape()
    assert samples["streamtrain_dead_letter_blocked"] == 0
    assert worker.total("streamtrain_dead_letter_events_total", samples) == 1
    worker.signal(signal.SIGTERM)
    assert worker.wait(timeout=30) == 0
    assert committed_offsets(kafka, topic_name, f"group-{topic_name}", 1) == {0: len(valid) + 1}
    letters = read_all(kafka, dlq, 1)
    assert [(m.key(), m.value(), dict(m.headers())[HEADER_OFFSET]) for m in letters] == [
        (b"bad", truncated.value, b"%d" % bad_offset)
    ]


@pytest.mark.integration
def test_the_dead_letter_topic_is_created_at_start_and_again_if_deleted_while_the_worker_runs(
    kafka, topic_name, start_worker
):
    dlq = topic_name + ".dlq"  # not created: the worker creates it with these settings
    valid = valid_messages(400, seed=15)
    send(kafka, topic_name, 1, valid[:200])
    worker = start_worker(
        topic_name, config=DLQ_CONFIG, env=dlq_env(dlq, topic_partitions=2, topic_retention_seconds=172800)
    )
    worker.wait_for(
        lambda: worker.total("streamtrain_events_trained_total") == 200, timeout=90, what="the first events trained"
    )
    assert described(kafka, dlq) == (2, 1, "172800000")
    assert f"created the dead-letter topic {dlq}: 2 partition(s), replication factor 1" in worker.output()

    admin = AdminClient({"bootstrap.servers": kafka.bootstrap_servers, "broker.address.family": "v4"})
    admin.delete_topics([dlq])[dlq].result(timeout=30)
    truncated = Sent(b"bad", _encode(ClickStream(seed=4).chunk(1).records[0])[:10], BASE_TIME_MS + 5, [], "truncated")
    send(kafka, topic_name, 1, [truncated] + valid[200:])
    worker.wait_for(
        lambda: (
            worker.total("streamtrain_events_trained_total") == len(valid)
            and worker.total("streamtrain_dead_letter_events_total") == 1
        ),
        timeout=90,
        what="the dead letter written to the topic created again, and the rest trained",
    )
    samples = worker.scrape()
    assert worker.total("streamtrain_dead_letter_produce_failures_total", samples) >= 1  # counted, not silent
    assert samples["streamtrain_dead_letter_blocked"] == 0
    assert f"the dead-letter topic {dlq} was gone while the worker ran: created it again" in worker.output()
    assert described(kafka, dlq) == (2, 1, "172800000")
    worker.signal(signal.SIGTERM)
    assert worker.wait(timeout=30) == 0
    assert [m.value() for m in read_all(kafka, dlq, 2)] == [truncated.value]


@pytest.mark.integration
def test_a_poisoned_topic_pauses_consumption_loudly_and_resumes_after_the_cooldown(kafka, topic_name, start_worker):
    dlq = topic_name + ".dlq"
    create_topic(kafka.bootstrap_servers, dlq, 1)
    garbage = [Sent(None, b"\xff" * 11 + b"\x01", BASE_TIME_MS + i, [], None) for i in range(400)]
    send(kafka, topic_name, 1, garbage)

    # batch_size is 256: the first batch (256 bad events) trips the limit at once.
    worker = start_worker(
        topic_name, config=DLQ_CONFIG, env=dlq_env(dlq, max_error_rate=0.5, window_events=100, pause_seconds=4)
    )
    worker.wait_for(
        lambda: worker.scrape().get("streamtrain_consumption_paused") == 1, timeout=90, what="consumption to pause"
    )
    samples = worker.scrape()
    assert samples["streamtrain_consumption_pauses_total"] == 1
    assert worker.total("streamtrain_events_consumed_total", samples) == 256  # nothing read while paused
    assert worker.total("streamtrain_dead_letter_events_total", samples) == 256
    assert (
        f"PAUSING consumption of {topic_name} for 4s: 256 of the last 256 events could not be decoded"
        in worker.output()
    )

    # After the cooldown it reads again, and the rest (144 bad events, over the 100-event window) pauses it again.
    worker.wait_for(
        lambda: worker.scrape().get("streamtrain_consumption_pauses_total") == 2,
        timeout=30,
        what="a second pause after resuming",
    )
    samples = worker.scrape()
    assert worker.total("streamtrain_dead_letter_events_total", samples) == 400
    assert samples["streamtrain_consumption_paused"] == 1
    assert "resuming consumption" in worker.output()

    signalled = time.monotonic()  # a paused rank still answers a stop
    worker.signal(signal.SIGTERM)
    assert worker.wait(timeout=30) == 0
    assert time.monotonic() - signalled < 15


@pytest.mark.integration
def test_a_stop_while_blocked_exits_cleanly_without_passing_the_bad_event(kafka, topic_name, start_worker):
    dlq = topic_name + ".dlq"
    refusing_topic(kafka, dlq)
    valid = valid_messages(300, seed=13)
    send(kafka, topic_name, 1, valid[:100] + [Sent(b"bad", b"", BASE_TIME_MS, [], None)] + valid[100:])
    worker = start_worker(topic_name, config=DLQ_CONFIG, env=dlq_env(dlq))
    worker.wait_for(
        lambda: worker.scrape().get("streamtrain_dead_letter_blocked") == 1,
        timeout=90,
        what="consumption to block on the dead-letter topic",
    )
    signalled = time.monotonic()
    worker.signal(signal.SIGTERM)
    assert worker.wait(timeout=30) == 0
    assert time.monotonic() - signalled < 15
    assert "stopping while 1 dead letters are unwritten" in worker.output()
    # The next start reads the bad event again: the group never heard a position past it.
    assert committed_offsets(kafka, topic_name, f"group-{topic_name}", 1)[0] <= 100


@pytest.mark.integration
def test_with_dead_letters_disabled_bad_events_are_logged_counted_and_skipped(kafka, topic_name, start_worker):
    valid = valid_messages(200, seed=14)
    send(kafka, topic_name, 1, valid[:100] + [Sent(b"bad", b"", BASE_TIME_MS, [], None)] + valid[100:])
    worker = start_worker(topic_name, config=DLQ_CONFIG, env=dlq_env(topic_name + ".dlq", enabled="false"))
    worker.wait_for(
        lambda: worker.total("streamtrain_events_trained_total") == len(valid),
        timeout=90,
        what="the valid events trained",
    )
    samples = worker.scrape()
    assert worker.total("streamtrain_decode_errors_total", samples) == 1
    assert worker.total("streamtrain_dead_letter_events_total", samples) == 0
    output = worker.output()
    assert "dead_letter.enabled is false: events that cannot be decoded are logged" in output  # at start-up
    assert f"skipping 1 events of {topic_name} that cannot be decoded" in output
    worker.signal(signal.SIGTERM)
    assert worker.wait(timeout=30) == 0
    assert committed_offsets(kafka, topic_name, f"group-{topic_name}", 1) == {0: len(valid) + 1}


@pytest.mark.integration
def test_bad_writer_schema_and_unresolvable_writer_events_are_dead_lettered_with_why(
    kafka, topic_name, start_worker, tmp_path
):
    """A broken <id>.avsc and a writer the reader cannot resolve do not stop the worker: their events
    go to the dead-letter topic with the reason and a detail naming the schema id and why."""
    for name in ("1.avsc", "2.avsc"):
        (tmp_path / name).write_text((REPO / "tests" / "writer-schemas" / name).read_text())
    (tmp_path / "3.avsc").write_text('{"type": "record", "fields": [')
    doubles = {**SCHEMA, "fields": [{**f, "type": "double"} if f["name"] == "price" else f for f in SCHEMA["fields"]]}
    (tmp_path / "4.avsc").write_text(json.dumps(doubles))
    dlq = topic_name + ".dlq"
    create_topic(kafka.bootstrap_servers, dlq, 1)
    valid = valid_messages(300, seed=15)
    records = ClickStream(seed=16).chunk(6).records
    bad = [
        Sent(b"bad-%d" % i, framed(_encode(r)[5:], schema_id=3), BASE_TIME_MS + i, [], "bad_writer_schema")
        for i, r in enumerate(records[:3])
    ]
    bad += [
        Sent(b"bad-%d" % i, framed(avro_fields(r, FIELDS, doubles), schema_id=4), BASE_TIME_MS + i, [], "undecodable")
        for i, r in enumerate(records[3:], 3)
    ]
    placed = send(kafka, topic_name, 1, valid[:100] + bad[::2] + valid[100:200] + bad[1::2] + valid[200:])

    worker = start_worker(
        topic_name, config=DLQ_CONFIG, env={**dlq_env(dlq), "STREAMTRAIN_FEATURES__WRITER_SCHEMAS_DIR": str(tmp_path)}
    )
    worker.wait_for(
        lambda: (
            worker.total("streamtrain_events_trained_total") >= len(valid)
            and worker.total("streamtrain_dead_letter_events_total") >= len(bad)
        ),
        timeout=120,
        what="every valid event trained and every bad one dead-lettered",
    )
    samples = worker.scrape()
    assert worker.total("streamtrain_events_trained_total", samples) == len(valid)
    assert samples['streamtrain_dead_letter_events_total{reason="bad_writer_schema"}'] == 3
    assert samples['streamtrain_dead_letter_events_total{reason="undecodable"}'] == 3
    worker.signal(signal.SIGTERM)
    assert worker.wait(timeout=30) == 0
    output = worker.output()
    assert output.count("writer schema 3 is broken") == 1, "one ERROR line per id"
    assert (
        output.count("events of writer schema 4 will be dead-lettered: price: writer double cannot be read as float")
        == 1
    )

    letters = read_all(kafka, dlq, 1)
    assert len(letters) == len(bad)
    for letter in letters:
        headers = dict(letter.headers())
        source = placed[(0, int(headers[HEADER_OFFSET]))]
        assert headers[HEADER_REASON] == source.reason.encode() and letter.value() == source.value
        detail = headers[HEADER_DETAIL].decode()
        if source.reason == "bad_writer_schema":
            assert detail.startswith(f"bad_writer_schema: writer schema 3: {tmp_path / '3.avsc'} is not JSON"), detail
        else:
            assert detail == (
                "undecodable: writer schema 4 cannot be resolved to the reader: "
                "price: writer double cannot be read as float"
            )
