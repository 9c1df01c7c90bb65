"""The broker crashes under a running 2-rank worker and comes back: every event is trained or
dead-lettered exactly once. And a worker started while no broker answers gives up, clearly, in time.

``STREAMTRAIN_TEST_OUTAGE_SECONDS`` sets how long the broker stays down (default 30).
"""

from __future__ import annotations

import os
import signal
import time
import urllib.error
import urllib.request

import pytest

from conftest import SCHEMA
from streamtrain.deadletter import HEADER_OFFSET, HEADER_PARTITION
from streamtrain.dev.kafka import KafkaBroker
from streamtrain.dev.produce import produce
from test_checkpoint import final_stream
from test_deadletter import Sent, read_all, send
from test_distributed import trained_by_partition
from test_worker_kafka import end_offsets

pytestmark = pytest.mark.integration

PARTITIONS = 4
OUTAGE_SECONDS = float(os.environ.get("STREAMTRAIN_TEST_OUTAGE_SECONDS", "30"))


def readyz(worker) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{worker.metrics_port}/readyz", timeout=5) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()
    except OSError:
        return 0, ""


def send_bad(broker: KafkaBroker, topic: str, count: int) -> set[tuple[int, int]]:
    """``count`` undecodable payloads over the partitions; their (partition, offset)s."""
    payloads = [b"", b"\xff" * 11 + b"\x01"]  # empty_payload, bad_varint
    now = int(time.time() * 1000)
    messages = [Sent(None, payloads[i % 2], now, [], "bad") for i in range(count)]
    return set(send(broker, topic, PARTITIONS, messages))


def test_outage_of_the_broker_mid_stream_loses_and_repeats_nothing(
    topic_name, start_ranks, start_worker, live_producer, tmp_path
):
    with KafkaBroker() as broker:
        dlq = topic_name + ".dlq"
        broker.create_topic(dlq, 1)
        produce(broker.bootstrap_servers, topic_name, 2000, partitions=PARTITIONS, seed=70, schema_path=SCHEMA)
        bad = send_bad(broker, topic_name, 8)
        # A live stream through the outage: its client buffers while the broker is down.
        producer = live_producer(
            broker.bootstrap_servers, topic_name, int(500 * (OUTAGE_SECONDS + 300)), 500, "--seed", "71"
        )
        root = tmp_path / "snapshots"
        env = {
            "STREAMTRAIN_CHECKPOINT__PATH": str(root),
            "STREAMTRAIN_CHECKPOINT__INTERVAL_SECONDS": "2",
            "STREAMTRAIN_DEAD_LETTER__TOPIC": dlq,
            "STREAMTRAIN_DEAD_LETTER__DELIVERY_TIMEOUT_SECONDS": "5",
            "STREAMTRAIN_DEAD_LETTER__RETRY_BACKOFF_MAX_SECONDS": "2",
        }
        try:
            ranks = start_ranks(topic_name, 2, env=env, broker=broker)
            ranks[0].wait_for(
                lambda: (
                    sum(trained_by_partition(ranks).values()) > 2000
                    and sum(r.total("streamtrain_dead_letter_events_total") for r in ranks) >= 8
                ),
                timeout=180,
                what="the backlog trained and dead-lettered, the live stream training",
            )
            bad |= send_bad(broker, topic_name, 4)  # in flight when the broker dies, or read after it is back
            broker.kill()
            killed = time.monotonic()
            for rank in ranks:
                rank.wait_for(
                    lambda rank=rank: readyz(rank)[0] == 503,
                    timeout=20,
                    what="/readyz to answer 503 while the broker is down",
                )
                assert "the Kafka brokers are down" in readyz(rank)[1]
            trained_at_kill = sum(trained_by_partition(ranks).values())

            # Started while no broker answers: a bounded wait, then a clear error and exit code 4.
            lone = start_worker(topic_name, broker=broker, env={"STREAMTRAIN_KAFKA__CONNECT_TIMEOUT_SECONDS": "5"})
            assert lone.wait(timeout=120) == 4, lone.output()[-3000:]
            assert f"no Kafka broker at {broker.bootstrap_servers} answered within 5s" in lone.output()

            time.sleep(max(0.0, OUTAGE_SECONDS - (time.monotonic() - killed)))
            assert [readyz(rank)[0] for rank in ranks] == [503, 503]
            assert all(rank.process.poll() is None for rank in ranks)  # the outage stops no rank
            print(f"broker down for {time.monotonic() - killed:.1f}s")
            broker.restart()
            ranks[0].wait_for(
                lambda: (
                    [readyz(rank)[0] for rank in ranks] == [200, 200]
                    and sum(trained_by_partition(ranks).values()) > trained_at_kill
                ),
                timeout=120,
                what="training to resume and /readyz to answer 200",
            )
        finally:
            producer.stop(timeout=90)
        assert producer.produced() > 0
        ends = end_offsets(broker, topic_name)
        valid = sum(ends.values()) - len(bad)
        ranks[0].wait_for(
            lambda: sum(trained_by_partition(ranks).values()) == valid,
            timeout=120,
            what=f"all {valid} valid events trained",
        )
        ranks[0].signal(signal.SIGTERM)
        assert [rank.wait(timeout=60) for rank in ranks] == [0, 0]

        stream = final_stream(root)["stream"]
        bad_per_partition = {p: sum(1 for q, _o in bad if q == p) for p in range(PARTITIONS)}
        assert {int(p): n for p, n in stream["trained"].items()} == {
            p: ends[p] - bad_per_partition[p] for p in range(PARTITIONS)
        }
        assert {int(p): o for p, o in stream["next_offsets"].items()} == ends
        # Dead letters are written at least once: a retry may repeat one, but none is missing or extra.
        letters = read_all(broker, dlq, 1)
        sources = [(int(dict(m.headers())[HEADER_PARTITION]), int(dict(m.headers())[HEADER_OFFSET])) for m in letters]
        assert set(sources) == bad
        print(f"{sum(ends.values())} events, {len(bad)} bad, {len(sources) - len(set(sources))} dead letters repeated")
