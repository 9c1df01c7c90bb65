"""The late-label joiner (deploy/joiner/, Kafka Streams) on the real broker: impressions and actions
in, samples out in the sample contract, exactly once across a SIGKILL of the joiner mid-stream, every
other input accounted for in the rejects topic by reason, and the worker training on the samples."""

from __future__ import annotations

import collections
import io
import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import fastavro
import numpy as np
import pytest
import yaml
from confluent_kafka import OFFSET_BEGINNING, Consumer, Producer, TopicPartition

from streamtrain.dev.kafka import KafkaBroker, die_with_parent
from streamtrain.dev.produce import AvroEncoder, ClickStream
from streamtrain.schema import without_logical_types

REPO = Path(__file__).resolve().parent.parent
JOINER = REPO / "deploy" / "joiner"
SAMPLE_SCHEMA = JOINER / "schemas" / "sample.avsc"
JOINER_LIBS = Path(os.environ.get("STREAMTRAIN_JOINER_LIBS") or REPO / ".cache" / "joiner" / "libs")
TASKS = {"clk": 60_000, "buy": 600_000}  # attribution windows, ms
PARTITIONS = 4
REASON_HEADER = "streamtrain.joiner.reason"
DETAIL_HEADER = "streamtrain.joiner.detail"


class JoinerProcess:
    """``java dev.streamtrain.joiner.Joiner joiner.properties``, its output in a file."""

    def __init__(self, properties: Path, log_path: Path):
        if not any(JOINER_LIBS.glob("streamtrain-joiner-*.jar")):
            pytest.fail(
                f"no joiner jars in {JOINER_LIBS}: run `make setup` (it builds deploy/joiner with mvn), or set "
                "STREAMTRAIN_JOINER_LIBS to a folder `mvn -f deploy/joiner/pom.xml package -Djoiner.dir=DIR` filled"
            )
        self.log_path = log_path
        with open(log_path, "ab") as log:
            self.process = subprocess.Popen(
                ["java", "-Xmx256m", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1", "-cp", f"{JOINER_LIBS}/*",
                 "dev.streamtrain.joiner.Joiner", str(properties)],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                preexec_fn=die_with_parent, start_new_session=True,
            )  # fmt: skip

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)


@dataclass
class PlantedStream:
    """Impressions and actions with what the joiner must make of them."""

    impressions: list[tuple[int, bytes, bytes]] = field(default_factory=list)  # (time, key, value)
    actions: list[tuple[int, bytes, bytes]] = field(default_factory=list)  # (time, key, value)
    shown: dict[int, dict] = field(default_factory=dict)  # impression id -> impression
    labels: dict[tuple[int, str], int] = field(default_factory=dict)  # (impression id, task) -> action time
    rejected: collections.Counter = field(default_factory=collections.Counter)

    def sample_times(self) -> list[int]:
        """When each sample happens: an impression's when it is shown, a label's when its action is."""
        return [i["event_time"] for i in self.shown.values()] + list(self.labels.values())


def planted_stream(impression_schema: Path, action_schema: Path, count: int, seed: int = 7) -> PlantedStream:
    """``count`` impressions 10 ms apart, the click stream's clicks and purchases as actions within
    their windows, and around them what must yield nothing: clicks after their window, repeated
    clicks and purchases, actions on impressions never shown, an action of no task, a repeated
    impression, and bytes that are not Avro on both topics."""
    rng = np.random.default_rng(seed)
    impressions, actions = AvroEncoder(impression_schema), AvroEncoder(action_schema)
    stream = PlantedStream()
    # An hour ago: the broker deletes a week-old record at its next retention check, and refuses one
    # from the future (log.message.timestamp.after.max.ms).
    start = int(time.time() * 1000) - 3_600_000
    records = ClickStream(seed=seed, start_time_ms=start, events_per_second=100).chunk(count).records

    def act(impression_id: int, action: str, at: int) -> None:
        value = actions.encode({"impression_id": impression_id, "action": action, "event_time": at})
        stream.actions.append((at, b"%d" % impression_id, value))

    for number, record in enumerate(records):
        impression_id = 10_000 + number
        shown_at = record["event_time"]
        impression = {k: v for k, v in record.items() if k not in TASKS} | {"impression_id": impression_id}
        stream.shown[impression_id] = impression
        stream.impressions.append((shown_at, b"%d" % impression_id, impressions.encode(impression)))
        if record["clk"]:
            clicked_at = shown_at + int(rng.integers(1, 50_000))
            act(impression_id, "clk", clicked_at)
            stream.labels[impression_id, "clk"] = clicked_at
            if rng.random() < 0.1:  # the same click again, still within the window
                act(impression_id, "clk", clicked_at + int(rng.integers(1, 10_000)))
                stream.rejected["duplicate_action"] += 1
        elif rng.random() < 0.02:  # a click seen after its window closed
            act(impression_id, "clk", shown_at + TASKS["clk"] + int(rng.integers(1, 30_000)))
            stream.rejected["outside_window"] += 1
        if record["buy"]:
            bought_at = stream.labels[impression_id, "clk"] + int(rng.integers(1, 300_000))
            act(impression_id, "buy", bought_at)
            stream.labels[impression_id, "buy"] = bought_at
            act(impression_id, "buy", bought_at + 1_000)
            stream.rejected["duplicate_action"] += 1
    for number in range(40):  # actions on impressions that were never shown
        act(10**9 + number, "clk", start + int(rng.integers(1, count * 10)))
    stream.rejected["no_impression"] += 40
    act(10_000, "share", start + 5)  # not a task of the joiner's
    stream.rejected["unknown_action"] += 1
    # a producer's retry: the same impression twice, trained once
    stream.impressions.insert(count // 2, stream.impressions[count // 2 - 1])
    stream.rejected["duplicate_impression"] += 1
    stream.impressions.insert(count // 3, (stream.impressions[count // 3][0], b"1", b"\xff\xff\xff not avro"))
    stream.rejected["malformed_impression"] += 1
    stream.actions.append((start + count * 5, b"2", b"\x02"))  # an impression id, then nothing
    stream.rejected["malformed_action"] += 1
    stream.actions.sort(key=lambda action: action[0])
    return stream


def produce(kafka: KafkaBroker, topic: str, messages: list[tuple[int, bytes, bytes]]) -> None:
    """Keyed by impression id with one partitioner for both inputs, so an impression and its actions
    share a partition number: the co-partitioning a Kafka Streams join needs."""
    producer = Producer({"bootstrap.servers": kafka.bootstrap_servers, "linger.ms": 20})
    for timestamp, key, value in messages:
        producer.produce(topic, value, key, timestamp=timestamp)
    assert producer.flush(30) == 0


class TopicReader:
    """Reads every partition of a topic from its start, as a read_committed (or read_uncommitted)
    consumer does, without a consumer group; ``messages`` holds what it has read."""

    def __init__(self, kafka: KafkaBroker, topic: str, partitions: int, isolation: str = "read_committed"):
        self.consumer = Consumer(
            {
                "bootstrap.servers": kafka.bootstrap_servers,
                "group.id": "unused",
                "isolation.level": isolation,
                "enable.auto.commit": False,
                "fetch.wait.max.ms": 50,
                "broker.address.family": "v4",
            }
        )
        self.consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(partitions)])
        self.messages: list = []

    def read(self, timeout: float = 0.5) -> list:
        """Whatever has arrived, waiting at most ``timeout`` for something; all read so far."""
        batch = self.consumer.consume(num_messages=10_000, timeout=timeout)
        for message in batch:
            assert message.error() is None, message.error()
        self.messages.extend(batch)
        return self.messages

    @staticmethod
    def read_until_quiet(*readers: TopicReader, quiet: float = 2.0) -> None:
        """Reads each until none has had anything new for ``quiet`` seconds."""
        quiet_since = time.monotonic()
        while time.monotonic() - quiet_since < quiet:
            before = sum(len(reader.messages) for reader in readers)
            if sum(len(reader.read(0.1)) for reader in readers) > before:
                quiet_since = time.monotonic()

    def close(self) -> None:
        self.consumer.close()


def decoder(schema: dict):
    parsed = fastavro.parse_schema(without_logical_types(schema))
    return lambda value: fastavro.schemaless_reader(io.BytesIO(value), parsed, parsed)


def joiner_properties(path: Path, kafka: KafkaBroker, topic: str, state_dir: Path) -> Path:
    path.write_text(
        "\n".join(
            [
                f"application.id=joiner-{topic}",
                f"bootstrap.servers={kafka.bootstrap_servers}",
                f"state.dir={state_dir}",
                # With the same state.dir, a restarted joiner takes the killed one's place at once
                # and fences its transaction, instead of waiting out the session and the transaction.
                "group.instance.id=joiner-0",
                f"joiner.impressions.topic={topic}-impressions",
                f"joiner.actions.topic={topic}-actions",
                f"joiner.samples.topic={topic}-samples",
                f"joiner.rejects.topic={topic}-rejects",
                f"joiner.impression.schema={JOINER / 'schemas' / 'impression.avsc'}",
                f"joiner.action.schema={JOINER / 'schemas' / 'action.avsc'}",
                "joiner.tasks=" + ",".join(f"{task}:{window}ms" for task, window in TASKS.items()),
                "",
            ]
        )
    )
    return path


@pytest.mark.integration
def test_delayed_joiner_writes_each_sample_once_across_a_kill_and_the_worker_trains_them(
    kafka, topic_name, start_worker, tmp_path
):
    began = time.monotonic()
    properties = joiner_properties(tmp_path / "joiner.properties", kafka, topic_name, tmp_path / "state")
    # beside the rest: the schema the joiner derives is the one committed for the worker
    printed = subprocess.Popen(
        ["java", "-cp", f"{JOINER_LIBS}/*", "dev.streamtrain.joiner.Joiner", "--sample-schema", str(properties)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    stream = planted_stream(JOINER / "schemas" / "impression.avsc", JOINER / "schemas" / "action.avsc", 4000)
    for suffix in ("impressions", "actions", "samples"):
        kafka.create_topic(f"{topic_name}-{suffix}", partitions=PARTITIONS)
    kafka.create_topic(f"{topic_name}-rejects", partitions=1)
    kafka.create_topic(f"{topic_name}-samples.dlq", partitions=1)  # the worker's dead-letter topic
    # Two halves by event time: the kill falls in the second, after the first is committed.
    middle = stream.impressions[len(stream.impressions) // 2][0]
    expected_first = sum(t < middle for t in stream.sample_times())
    expected = len(stream.sample_times())
    samples = TopicReader(kafka, f"{topic_name}-samples", PARTITIONS)
    written = TopicReader(kafka, f"{topic_name}-samples", PARTITIONS, "read_uncommitted")
    rejects = TopicReader(kafka, f"{topic_name}-rejects", 1)
    for topic, messages in (("impressions", stream.impressions), ("actions", stream.actions)):
        produce(kafka, f"{topic_name}-{topic}", [m for m in messages if m[0] < middle])
    joiner = JoinerProcess(properties, tmp_path / "joiner.log")
    try:
        wait_for(lambda: len(samples.read()) >= expected_first, joiner, "the first half's samples")
        first_half = time.monotonic() - began
        for topic, messages in (("impressions", stream.impressions), ("actions", stream.actions)):
            produce(kafka, f"{topic_name}-{topic}", [m for m in messages if m[0] >= middle])
        # The kill: as soon as the second half's first samples are written, before they are committed.
        wait_for(lambda: len(written.read(0.05)) > expected_first, joiner, "the second half's first samples")
        joiner.kill()
        TopicReader.read_until_quiet(samples, quiet=1.0)  # a commit under way at the kill still lands
        committed_at_kill = len(samples.messages)
        assert expected_first <= committed_at_kill < expected, joiner.output()[-5000:]
        joiner = JoinerProcess(properties, tmp_path / "joiner.log")
        wait_for(lambda: len(samples.read()) >= expected, joiner, "every sample")
        joined = time.monotonic() - began
        # Started now, its end offsets taken once it has built its model: a sample committed after
        # that, one too many, is caught below, and one before it makes the count trained wrong.
        worker = start_worker(f"{topic_name}-samples", "--until-end", config=worker_config(tmp_path))
        TopicReader.read_until_quiet(samples, rejects, written)  # and nothing more
    finally:
        joiner.kill()
        for reader in (samples, written, rejects):
            reader.close()
    assert len(samples.messages) == expected
    check_samples(stream, samples.messages)
    headers = [dict(m.headers()) for m in rejects.messages]
    assert collections.Counter(h[REASON_HEADER].decode() for h in headers) == stream.rejected
    assert all((DETAIL_HEADER in h) == h[REASON_HEADER].startswith(b"malformed") for h in headers), (
        "what was wrong with a value, and only then"
    )
    assert printed.wait(timeout=60) == 0 and json.loads(printed.stdout.read()) == json.loads(SAMPLE_SCHEMA.read_text())
    assert worker.wait(timeout=90) == 0, worker.output()[-3000:]
    assert f"{expected:,} events trained" in worker.output()
    print(
        f"first half joined at {first_half:.1f}s, all at {joined:.1f}s, trained at {time.monotonic() - began:.1f}s; "
        f"at the kill {committed_at_kill} samples committed, {len(written.messages) - expected} aborted"
    )


def worker_config(tmp_path: Path) -> Path:
    """The suite's small worker on the sample schema, each task's null label masked."""
    config = yaml.safe_load((REPO / "tests" / "worker-small.yaml").read_text())
    config["features"]["schema_path"] = str(SAMPLE_SCHEMA)
    del config["features"]["label"]
    config["model"]["tasks"] = [{"name": task, "label": task, "required": False} for task in TASKS]
    (tmp_path / "worker.yaml").write_text(yaml.safe_dump(config))
    return tmp_path / "worker.yaml"


def wait_for(condition, joiner: JoinerProcess, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if joiner.process.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"waiting for {what}, the joiner exited or {timeout:.0f}s passed:\n{joiner.output()[-5000:]}")


def check_samples(stream: PlantedStream, messages: list) -> None:
    """Each impression's sample and each label's, once, in the contract: the impression's fields,
    its time, the kind, and the labels (0 on an impression, 1 for the label's task, else null)."""
    decode = decoder(json.loads(SAMPLE_SCHEMA.read_text()))
    seen: collections.Counter = collections.Counter()
    for message in messages:
        sample = decode(message.value())
        impression_id = sample["impression_id"]
        assert message.key() == b"%d" % impression_id
        impression = stream.shown[impression_id]
        assert {k: sample[k] for k in impression if k != "event_time"} == {
            k: v for k, v in impression.items() if k != "event_time"
        } | {"price": pytest.approx(impression["price"])}  # a float32
        assert sample["impression_time"] == impression["event_time"]
        if sample["sample_kind"] == "impression":
            seen[impression_id, "impression"] += 1
            assert sample["event_time"] == impression["event_time"]
            assert [sample[task] for task in TASKS] == [0] * len(TASKS)
        else:
            assert sample["sample_kind"] == "label"
            (task,) = [task for task in TASKS if sample[task] is not None]
            seen[impression_id, task] += 1
            assert sample[task] == 1
            assert sample["event_time"] == stream.labels[impression_id, task]
    assert set(seen.values()) == {1}, "each sample once"
    assert set(seen) == {(i, "impression") for i in stream.shown} | set(stream.labels)
