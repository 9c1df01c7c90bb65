"""Topics the worker writes (dead letters, deltas): made sure of at start, created when missing.

A topic the worker writes is created with its configured partitions, replication factor and topic
configs (retention) when it is missing, or the worker exits at start with
``ExitCode.OUTPUT_TOPIC_MISSING``, naming the topic, the broker's reason and the
``kafka-topics.sh`` command that creates it: a missing output topic never blocks the stream hours
later, at the first event that cannot be decoded or the first delta.

Unless configured, the replication factor is the larger of the cluster's
``default.replication.factor`` and the source topic's. Kafka's own default is 1, which a cluster
that replicates its events three times may never have changed; dead letters and model updates are
worth as much as the events they come from. Nothing here creates a topic behind the worker's back:
its clients set ``allow.auto.create.topics`` false (``NO_AUTO_CREATE``), so a broker's
``auto.create.topics.enable`` cannot make one with the broker's defaults instead.
"""

from __future__ import annotations

import logging
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch.distributed as dist
from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient, ClusterMetadata, ConfigResource, NewTopic, PartitionMetadata

from streamtrain.config import KafkaConfig
from streamtrain.exitcodes import ExitCode
from streamtrain.source import KAFKA_LOG

log = logging.getLogger(__name__)

# For every client of the worker that writes: a topic is created by ``ensure_topics``, with its settings.
NO_AUTO_CREATE = {"allow.auto.create.topics": False}


@dataclass(frozen=True)
class OutputTopic:
    """A topic the worker writes, and what it is created with when missing."""

    name: str
    role: str  # what the logs call it, e.g. "dead-letter"
    setting: str  # the config field that names it, e.g. "dead_letter.topic"
    partitions: int = 1
    replication_factor: int | None = None  # None: see the module's docstring
    configs: Mapping[str, str] = field(default_factory=dict)  # topic configs, e.g. retention.ms


class OutputTopicMissing(RuntimeError):
    """A topic the worker writes is missing and could not be created (or could not be checked)."""

    exit_code = ExitCode.OUTPUT_TOPIC_MISSING


def ensure_topics(
    kafka: KafkaConfig, topics: Sequence[OutputTopic], timeout: float, *, say_existing: bool = True
) -> list[str]:
    """Creates those of ``topics`` that are missing; returns their names. Raises
    ``OutputTopicMissing`` naming each that is missing and could not be created. ``say_existing``:
    log what the existing ones are (at start), or nothing about them (a writer's check)."""
    if not topics:
        return []
    admin = AdminClient({"broker.address.family": "v4", **kafka.librdkafka(), "logger": KAFKA_LOG, **NO_AUTO_CREATE})
    existing, missing, unreadable = [], [], []
    for topic in topics:
        try:
            metadata = admin.list_topics(topic.name, timeout=timeout).topics.get(topic.name)
        except KafkaException as error:
            unreadable.append((topic, _reason(error)))
            continue
        refused = metadata.error if metadata is not None else None
        if metadata is not None and refused is None and metadata.partitions:
            existing.append((topic, metadata.partitions))
        elif refused is None or refused.code() in (KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_TOPIC):
            missing.append(topic)
        else:  # e.g. TOPIC_AUTHORIZATION_FAILED: creating it would not help
            unreadable.append((topic, refused.str()))
    if not (missing or unreadable or (existing and say_existing)):
        return []
    cluster = _Replication.of(admin, kafka.topic, timeout)
    if say_existing:
        for topic, partitions in existing:
            cluster.say_existing(topic, partitions)
    problems = [_cannot(topic, reason, kafka, cluster, checked=False) for topic, reason in unreadable]
    created = []
    if missing:
        futures = admin.create_topics(
            [NewTopic(t.name, t.partitions, cluster.factor(t), config=dict(t.configs)) for t in missing],
            operation_timeout=timeout,
            request_timeout=timeout,
        )
        for topic in missing:
            try:
                futures[topic.name].result(timeout=timeout)
            except KafkaException as error:
                if error.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:  # else another client just made it
                    problems.append(_cannot(topic, _reason(error), kafka, cluster))
                continue
            created.append(topic.name)
            log.info(
                "created the %s topic %s: %d partition(s), replication factor %d (%s)%s",
                topic.role,
                topic.name,
                topic.partitions,
                cluster.factor(topic),
                cluster.why(topic),
                "".join(f", {key}={value}" for key, value in sorted(topic.configs.items())),
            )
    if problems:
        raise OutputTopicMissing("; ".join(problems))
    return created


def ensure_topics_on_every_rank(
    kafka: KafkaConfig,
    topics: Sequence[OutputTopic],
    timeout: float,
    rank: int,
    world_size: int,
    group: dist.ProcessGroup | None,
) -> None:
    """Rank 0 makes sure of ``topics``; every rank raises its ``OutputTopicMissing`` if it failed,
    so that all exit with it at once rather than some waiting on a peer that left."""
    outcome: list[str | None] = [None]
    if rank == 0:
        try:
            ensure_topics(kafka, topics, timeout)
        except OutputTopicMissing as missing:
            outcome = [str(missing)]
    if world_size > 1:
        dist.broadcast_object_list(outcome, src=0, group=group)
    if outcome[0] is not None:
        raise OutputTopicMissing(outcome[0])


def create_command(kafka: KafkaConfig, topic: OutputTopic, replication_factor: int) -> str:
    """The ``kafka-topics.sh`` command that creates ``topic`` as the worker would."""
    words = ["kafka-topics.sh", "--bootstrap-server", kafka.bootstrap_servers, "--create", "--topic", topic.name]
    words += ["--partitions", str(topic.partitions), "--replication-factor", str(replication_factor)]
    for key, value in sorted(topic.configs.items()):
        words += ["--config", f"{key}={value}"]
    command = shlex.join(words)
    if kafka.client_config or kafka.client_config_files:
        command += " --command-config <a file with the worker's kafka.client_config properties>"
    return command


def _cannot(topic: OutputTopic, reason: str, kafka: KafkaConfig, cluster: _Replication, checked: bool = True) -> str:
    problem = "is missing and could not be created" if checked else "could not be checked"
    return (
        f"the {topic.role} topic {topic.name} ({topic.setting}) {problem}: {reason.rstrip('.')}. Create it with "
        f"`{create_command(kafka, topic, cluster.factor(topic))}`, or change what the worker asks for "
        f"({topic.setting}_*), or let its principal create topics (the Create operation in the ACLs)"
    )


@dataclass(frozen=True)
class _Replication:
    """The cluster's ``default.replication.factor`` and the source topic's replication factor; None
    for what cannot be read (e.g. the ACLs refuse DescribeConfigs on the cluster)."""

    default: int | None
    source: int | None

    @classmethod
    def of(cls, admin: AdminClient, source_topic: str, timeout: float) -> _Replication:
        default = source = None
        try:
            metadata: ClusterMetadata = admin.list_topics(source_topic, timeout=timeout)
            described = metadata.topics.get(source_topic)
            if described is not None and described.error is None and described.partitions:
                source = max(len(p.replicas) for p in described.partitions.values())
            broker = ConfigResource(ConfigResource.Type.BROKER, str(min(metadata.brokers)))
            configs = admin.describe_configs([broker], request_timeout=timeout)[broker].result(timeout=timeout)
            default = int(configs["default.replication.factor"].value)
        except (KafkaException, KeyError, ValueError) as error:
            log.info("the cluster's default.replication.factor could not be read (%s)", error)
        return cls(default, source)

    def factor(self, topic: OutputTopic) -> int:
        """What ``topic`` is created with: its configured factor, else the larger of the two."""
        if topic.replication_factor is not None:
            return topic.replication_factor
        return max(self.default or 1, self.source or 1)

    def why(self, topic: OutputTopic) -> str:
        if topic.replication_factor is not None:
            return topic.setting.rsplit(".", 1)[0] + ".topic_replication_factor"
        known = [f"the cluster's default.replication.factor is {self.default}" if self.default is not None else ""]
        known.append(f"the source topic's is {self.source}" if self.source is not None else "")
        return "; ".join(k for k in known if k) or "neither the cluster's default nor the source topic's is known"

    def say_existing(self, topic: OutputTopic, partitions: Mapping[int, PartitionMetadata]) -> None:
        replication = min(len(p.replicas) for p in partitions.values())
        log.info(
            "the %s topic %s exists: %d partition(s), replication factor %d",
            topic.role,
            topic.name,
            len(partitions),
            replication,
        )
        if replication < self.factor(topic):
            log.warning(
                "the %s topic %s has replication factor %d, below the %d it would be created with (%s): losing "
                "a broker can lose what it holds; raise it with kafka-reassign-partitions.sh",
                topic.role,
                topic.name,
                replication,
                self.factor(topic),
                self.why(topic),
            )


def _reason(error: KafkaException) -> str:
    kafka_error = error.args[0] if error.args else None
    return kafka_error.str() if isinstance(kafka_error, KafkaError) else str(error)
