"""Topics the worker writes, on the real broker: created at start with their settings and a
replication factor that is never 1 by accident, or every rank exits 8 at start with the command that
creates them. (The dead-letter topic's re-creation while running is in test_deadletter.py.)"""

from __future__ import annotations

import logging
import re

import pytest
from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic

from conftest import REPO, SCHEMA
from streamtrain.config import ConfigError, DeliveryConfig, KafkaConfig, load_config
from streamtrain.delivery.publisher import delta_topic
from streamtrain.dev.produce import produce
from streamtrain.exitcodes import ExitCode
from streamtrain.topics import OutputTopic, _Replication, ensure_topics

pytestmark = pytest.mark.integration


def describe(kafka, topic: str) -> tuple[int, int, dict[str, str]]:
    """The topic's partitions, replication factor, and the configs set on it."""
    admin = AdminClient({"bootstrap.servers": kafka.bootstrap_servers, "broker.address.family": "v4"})
    partitions = admin.list_topics(topic, timeout=30).topics[topic].partitions
    resource = ConfigResource(ConfigResource.Type.TOPIC, topic)
    configs = admin.describe_configs([resource])[resource].result(timeout=30)
    own = {name: entry.value for name, entry in configs.items() if not entry.is_default}
    return len(partitions), min(len(p.replicas) for p in partitions.values()), own


def test_the_delta_topic_is_created_with_one_partition_and_a_retention_reaching_the_oldest_base(
    kafka, topic_name, caplog
):
    produce(kafka.bootstrap_servers, topic_name, 10, partitions=2, seed=1, schema_path=SCHEMA)
    source = KafkaConfig(bootstrap_servers=kafka.bootstrap_servers, topic=topic_name)
    delivery = DeliveryConfig(enabled=True, keep_bases=2, base_interval_seconds=3600)
    caplog.set_level(logging.INFO, logger="streamtrain.topics")
    assert ensure_topics(source, [delta_topic(delivery, source)], timeout=30) == [f"{topic_name}.model"]
    partitions, replication, configs = describe(kafka, f"{topic_name}.model")
    assert (partitions, replication) == (1, 1)
    assert configs["retention.ms"] == str(4 * 3600 * 1000) and configs["segment.ms"] == str(3600 * 1000)
    said = "the cluster's default.replication.factor is 1; the source topic's is 1"
    assert f"created the delta topic {topic_name}.model: 1 partition(s), replication factor 1 ({said})" in caplog.text
    assert ensure_topics(source, [delta_topic(delivery, source)], timeout=30) == []  # there already


def test_an_unset_replication_factor_is_the_larger_of_the_clusters_default_and_the_source_topics(kafka, topic_name):
    """Kafka's own default.replication.factor is 1; a cluster that replicates its events 3 times may
    never have raised it. (One test broker gives 1 and 1: the larger of others is checked as such.)"""
    produce(kafka.bootstrap_servers, topic_name, 10, partitions=1, seed=2, schema_path=SCHEMA)
    admin = AdminClient({"bootstrap.servers": kafka.bootstrap_servers, "broker.address.family": "v4"})
    assert _Replication.of(admin, topic_name, timeout=30) == _Replication(default=1, source=1)
    unset = OutputTopic("t", "delta", "delivery.topic")
    assert _Replication(default=1, source=3).factor(unset) == 3
    assert _Replication(default=3, source=1).factor(unset) == 3
    assert _Replication(default=None, source=None).factor(unset) == 1  # what the cluster would do: 1
    assert _Replication(default=1, source=3).factor(OutputTopic("t", "delta", "delivery.topic", 1, 2)) == 2


def test_output_topics_that_cannot_be_created_stop_every_rank_at_start_with_code_8(
    kafka, topic_name, start_ranks, tmp_path
):
    """One broker cannot hold three replicas: the broker refuses both topics, and both ranks exit 8
    before training, each naming both topics and the command that creates each."""
    produce(kafka.bootstrap_servers, topic_name, 100, partitions=2, seed=3, schema_path=SCHEMA)
    env = {
        "STREAMTRAIN_DEAD_LETTER__TOPIC_REPLICATION_FACTOR": "3",
        "STREAMTRAIN_DELIVERY__ENABLED": "true",
        "STREAMTRAIN_DELIVERY__TOPIC_REPLICATION_FACTOR": "3",
        "STREAMTRAIN_CHECKPOINT__PATH": str(tmp_path / "snapshots"),
    }
    ranks = start_ranks(topic_name, 2, env=env)
    assert [rank.wait(timeout=180) for rank in ranks] == [ExitCode.OUTPUT_TOPIC_MISSING] * 2, ranks[0].output()
    bootstrap = kafka.bootstrap_servers
    for rank in ranks:
        output = rank.output()
        assert (
            f"the dead-letter topic {topic_name}.dlq (dead_letter.topic) is missing and could not be created: "
            "Unable to replicate the partition 3 time(s)" in output
        )
        assert (
            f"`kafka-topics.sh --bootstrap-server {bootstrap} --create --topic {topic_name}.dlq --partitions 1 "
            "--replication-factor 3`" in output
        )
        assert f"the delta topic {topic_name}.model (delivery.topic) is missing and could not be created" in output
        assert re.search(
            rf"`kafka-topics\.sh --bootstrap-server {bootstrap} --create --topic {topic_name}\.model --partitions 1 "
            r"--replication-factor 3 --config retention\.ms=\d+ --config segment\.ms=\d+`",
            output,
        )
        assert "exiting with code 8" in output
        assert "events trained" not in output  # nothing trained
    admin = AdminClient({"bootstrap.servers": bootstrap, "broker.address.family": "v4"})
    assert not {f"{topic_name}.dlq", f"{topic_name}.model"} & set(admin.list_topics(timeout=30).topics)


def test_an_existing_output_topic_is_used_as_it_is_and_a_low_replication_factor_is_said(kafka, topic_name, caplog):
    produce(kafka.bootstrap_servers, topic_name, 10, partitions=1, seed=4, schema_path=SCHEMA)
    admin = AdminClient({"bootstrap.servers": kafka.bootstrap_servers, "broker.address.family": "v4"})
    admin.create_topics([NewTopic(f"{topic_name}.dlq", 3, 1)])[f"{topic_name}.dlq"].result(timeout=30)
    source = KafkaConfig(bootstrap_servers=kafka.bootstrap_servers, topic=topic_name)
    caplog.set_level(logging.INFO, logger="streamtrain.topics")
    wanted = OutputTopic(f"{topic_name}.dlq", "dead-letter", "dead_letter.topic", 1, 2)
    assert ensure_topics(source, [wanted], timeout=30) == []
    assert describe(kafka, f"{topic_name}.dlq")[:2] == (3, 1)  # not changed
    assert f"the dead-letter topic {topic_name}.dlq exists: 3 partition(s), replication factor 1" in caplog.text
    assert "has replication factor 1, below the 2 it would be created with (dead_letter.topic_replication_factor)" in (
        caplog.text
    )


@pytest.mark.parametrize(
    "field",
    ["dead_letter.topic_partitions", "dead_letter.topic_replication_factor", "delivery.topic_replication_factor"],
)
def test_a_topic_setting_below_one_is_refused_naming_the_field(field):
    section, name = field.split(".")
    variable = f"STREAMTRAIN_{section.upper()}__{name.upper()}"
    with pytest.raises(ConfigError, match=rf"{re.escape(field)}: Input should be greater than 0"):
        load_config(REPO / "tests" / "worker-small.yaml", environ={variable: "0"})
