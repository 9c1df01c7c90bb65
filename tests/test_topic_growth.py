"""Partitions added to the input topic while the worker runs, on the real broker: each is read by the
rank its number names, from its beginning, and trained exactly once, through a crash and a restore."""

from __future__ import annotations

import json
import logging
import re
import signal
import time

import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewPartitions

from conftest import SCHEMA, end_offsets
from streamtrain.checkpoint import StreamState, list_snapshots
from streamtrain.config import KafkaConfig
from streamtrain.dev.kafka import create_topic
from streamtrain.dev.produce import produce
from streamtrain.source import KafkaSource

pytestmark = pytest.mark.integration


def grow(kafka, topic: str, partitions: int) -> None:
    admin = AdminClient({"bootstrap.servers": kafka.bootstrap_servers, "broker.address.family": "v4"})
    admin.create_partitions([NewPartitions(topic, partitions)])[topic].result(timeout=30)


def produce_into(kafka, topic: str, counts: dict[int, int], seed: int) -> None:
    """Click events, ``counts[p]`` into each partition ``p``."""
    for partition, count in counts.items():
        produce(kafka.bootstrap_servers, topic, count, partition=partition, seed=seed + partition, schema_path=SCHEMA)


def write(kafka, topic: str, counts: dict[int, int]) -> None:
    """Payloads the source reads without decoding them, ``counts[p]`` into each partition ``p``:
    one producer, cheaper than ``produce_into``."""
    producer = Producer({"bootstrap.servers": kafka.bootstrap_servers, "broker.address.family": "v4"})
    for partition, count in counts.items():
        for i in range(count):
            producer.produce(topic, b"%d" % i, partition=partition)
    assert producer.flush(30) == 0


def read_until(source: KafkaSource, count: int, timeout: float = 60.0) -> list[tuple[int, int]]:
    """(partition, offset) of what ``source`` reads, looking for new partitions as the worker does,
    until ``count`` events or ``timeout``."""
    read: list[tuple[int, int]] = []
    deadline = time.monotonic() + timeout
    while len(read) < count and time.monotonic() < deadline:
        source.pick_up_new_partitions()
        events = source.poll(1000, 0.2)
        read += zip(events.partitions.tolist(), events.offsets.tolist(), strict=True)
    return read


@pytest.mark.parametrize("fetch_queue", [True, False], ids=["fetch-queue", "consume"])
def test_a_source_reads_partitions_added_while_it_runs_from_their_beginning(kafka, topic_name, fetch_queue, caplog):
    create_topic(kafka.bootstrap_servers, topic_name, 2)
    write(kafka, topic_name, {0: 90, 1: 110})
    config = KafkaConfig(
        bootstrap_servers=kafka.bootstrap_servers,
        topic=topic_name,
        group_id=f"group-{topic_name}",
        start_at="latest",  # the old partitions start at their end; new ones have only new events
        partition_discovery_seconds=0.2,
        fetch_queue=fetch_queue,
    )
    ranks = [KafkaSource(config, rank, 2, committed=False) for rank in range(2)]
    try:
        starts = {p: o for source in ranks for p, o in source.next_offset.items()}
        assert sum(starts.values()) == 200
        grow(kafka, topic_name, 5)
        caplog.set_level(logging.INFO, logger="streamtrain.source")
        write(kafka, topic_name, {p: 30 + p for p in range(5)})
        ends = end_offsets(kafka, topic_name, 5)
        for source in ranks:
            mine = [p for p in range(5) if p % 2 == source.rank]
            expected = sorted((p, o) for p in mine for o in range(starts.get(p, 0), ends[p]))
            read = read_until(source, len(expected))
            time.sleep(0.5)
            read += read_until(source, 1, timeout=0.5)  # nothing more: no event twice
            assert sorted(read) == expected
            assert source.partitions == mine and source.topic_partitions == 5
            assert {p: source.next_offset[p] for p in mine} == {p: ends[p] for p in mine}
            deadline = time.monotonic() + 10
            while sorted(source.lag()) != mine and time.monotonic() < deadline:
                source.poll(10, 0.1)
            assert source.lag() == dict.fromkeys(mine, 0)  # the lag covers the new partitions too
        said = caplog.text
        assert f"topic {topic_name} grew from 2 to 5 partitions; rank 0 reads 2 from offset 0, 4 from offset 0" in said
        assert f"topic {topic_name} grew from 2 to 5 partitions; rank 1 reads 3 from offset 0" in said
    finally:
        for source in ranks:
            source.close()


def test_a_partition_a_restored_snapshot_knows_resumes_at_its_position_when_found_later(kafka, topic_name):
    """The start-up metadata can miss a partition just added (another broker's view lags): one the
    restored snapshot trained resumes where the snapshot says, not at its beginning."""
    create_topic(kafka.bootstrap_servers, topic_name, 1)
    write(kafka, topic_name, {0: 40})
    config = KafkaConfig(
        bootstrap_servers=kafka.bootstrap_servers,
        topic=topic_name,
        group_id=f"group-{topic_name}",
        start_at="latest",
        partition_discovery_seconds=0.2,
    )
    source = KafkaSource(config, start_offsets={0: 40, 1: 15}, committed=False)
    try:
        assert source.partitions == [0] and source.next_offset == {0: 40}
        grow(kafka, topic_name, 2)
        write(kafka, topic_name, {1: 25})
        read = read_until(source, 10)
        assert sorted(read) == [(1, offset) for offset in range(15, 25)]
    finally:
        source.close()


def stream_of_newest_snapshot(root) -> StreamState:
    (newest, *_older) = [s for s in list_snapshots(str(root)) if s.complete]
    return StreamState.from_json(json.dumps(newest.metadata["stream"]))


def trained(ranks) -> float:
    return sum(rank.total("streamtrain_events_trained_total") for rank in ranks)


def test_partitions_added_while_the_worker_runs_are_trained_exactly_once_through_a_crash(
    kafka, topic_name, start_ranks, tmp_path
):
    produce(kafka.bootstrap_servers, topic_name, 100, partitions=2, seed=3, schema_path=SCHEMA)
    skipped = end_offsets(kafka, topic_name, 2)  # kafka.start_at latest: never trained
    root = tmp_path / "snapshots"
    env = {
        "STREAMTRAIN_KAFKA__START_AT": "latest",
        "STREAMTRAIN_KAFKA__PARTITION_DISCOVERY_SECONDS": "0.5",
        "STREAMTRAIN_CHECKPOINT__PATH": str(root),
        "STREAMTRAIN_CHECKPOINT__INTERVAL_SECONDS": "3600",  # snapshots on request (SIGUSR1) and at the stop
        "STREAMTRAIN_METRICS__LAG_REFRESH_SECONDS": "0.5",
    }
    ranks = start_ranks(topic_name, 2, env=env)
    ranks[0].wait_for(
        lambda: all(r.scrape().get(f'streamtrain_topic_partitions{{topic="{topic_name}"}}') == 2 for r in ranks),
        timeout=180,
        what="both ranks reading",
    )
    produce_into(kafka, topic_name, {0: 150, 1: 150}, seed=30)
    grow(kafka, topic_name, 5)  # rank 0 picks up 2 and 4, rank 1 only 3
    produce_into(kafka, topic_name, dict.fromkeys(range(5), 60), seed=40)
    ranks[0].wait_for(lambda: trained(ranks) >= 600, timeout=120, what="every event trained, new partitions too")
    time.sleep(1.0)  # nothing beyond the stream may be counted
    assert trained(ranks) == 600
    for rank, picked, partitions in ((ranks[0], 2, (2, 4)), (ranks[1], 1, (3,))):
        samples = rank.scrape()
        assert samples[f'streamtrain_partitions_picked_up_total{{topic="{topic_name}"}}'] == picked
        assert samples[f'streamtrain_topic_partitions{{topic="{topic_name}"}}'] == 5
        rank.wait_for(
            lambda rank=rank, partitions=partitions: all(
                f'streamtrain_consumer_lag_events{{partition="{p}",topic="{topic_name}"}}' in rank.scrape()
                for p in partitions
            ),
            timeout=20,
            what="the lag gauges of the new partitions",
        )
    assert f"topic {topic_name} grew from 2 to 5 partitions; rank 0 reads 2 from offset 0, 4 from offset 0" in (
        ranks[0].output()
    )
    assert "rank 1 reads 3 from offset 0" in ranks[1].output()

    # A snapshot taken after the pickup holds the new partitions' positions in its cut.
    ranks[1].signal(signal.SIGUSR1)
    ranks[0].wait_for(lambda: list_snapshots(str(root)), timeout=60, what="the requested snapshot")
    ranks[0].wait_for(lambda: list_snapshots(str(root))[0].complete, timeout=60, what="the snapshot committed")
    ends = end_offsets(kafka, topic_name, 5)
    assert stream_of_newest_snapshot(root).next_offsets == ends

    # Trained but not in any snapshot when the ranks die: trained again once after the restore.
    produce_into(kafka, topic_name, dict.fromkeys(range(5), 20), seed=50)
    ranks[0].wait_for(lambda: trained(ranks) >= 700, timeout=120, what="the events after the snapshot trained")
    for rank in ranks:
        rank.kill()

    again = start_ranks(topic_name, 2, env=env)
    produce_into(kafka, topic_name, dict.fromkeys(range(5), 10), seed=60)
    again[0].wait_for(lambda: trained(again) >= 150, timeout=180, what="the restored ranks catching up")
    assert re.search(r"starting at \{0: \d+, 2: \d+, 4: \d+\} \(the snapshot's positions\)", again[0].output())
    for rank in again:
        rank.signal(signal.SIGTERM)
    assert [rank.wait(timeout=90) for rank in again] == [0, 0], again[0].output()[-3000:]
    ends = end_offsets(kafka, topic_name, 5)
    final = stream_of_newest_snapshot(root)
    assert final.next_offsets == ends
    assert final.trained == {p: ends[p] - skipped.get(p, 0) for p in range(5)}  # each event once
