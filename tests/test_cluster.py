"""Cluster faults under a running deployment: a 3-node KRaft cluster (replication factor 3,
min.insync.replicas 2), ``streamtrain worker --nproc 2`` training a live stream with malformed
events in it, deltas on a topic, and ``streamtrain serve`` following them.

Each test faults the cluster while the worker trains and serve follows, then stops the stream and
checks, from the topics and the snapshots: every valid event trained exactly once in the newest
snapshot's lineage, its positions at the topic's end offsets; every malformed event
dead-lettered; and serve, by its deltas alone, scoring as a fresh export of that snapshot does.

The tests share one deployment (``deployment``), started by the first of them: a worker's start
and its first base take a minute or more here. Each test begins with the cluster whole and the
deployment training, and leaves it checked, its stream stopped, for the next.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from confluent_kafka.admin import NewPartitions

from conftest import SMALL_CONFIG
from streamtrain.delivery.deltas import HEADER_ALLOWANCE, decode_chunk
from streamtrain.dev.kafka import KafkaCluster
from streamtrain.dev.stack import Stack, export_newest, held_out, model_scores, read_messages
from streamtrain.exitcodes import ExitCode

pytestmark = pytest.mark.integration

RATE = 150  # events/s: a stream the ranks keep up with on a loaded 2-core host
MALFORMED_EVERY = 40
HELD_OUT = 300


@pytest.fixture(scope="module")
def cluster():
    with KafkaCluster() as cluster:
        yield cluster


def open_stack(
    cluster: KafkaCluster,
    topic: str,
    workdir: Path,
    partitions: int = 4,
    environment: dict[str, str] | None = None,
    delta_topic_config: dict[str, str] | None = None,
) -> Stack:
    """A stack on the cluster, once every node is back and in sync (whatever the test before did)."""
    cluster.heal()
    stack = Stack(cluster, topic, workdir, SMALL_CONFIG, partitions, environment)
    stack.create_topics()
    if delta_topic_config:  # created by hand only for a setting the worker does not make; else by the worker
        cluster.create_topic(stack.delta_topic, 1, config=delta_topic_config)
    return stack


@pytest.fixture(scope="module")
def deployment(cluster, tmp_path_factory):
    """One deployment for every test here. It starts on 2 partitions, for the test that adds two.
    Its deltas are chunks of 2 KiB, more than the producer has in flight (5), and an attempt to
    send one fails after 2 s: a broker fault then cuts a send short, and the retry must be served."""
    with open_stack(
        cluster,
        f"cluster-{uuid.uuid4().hex[:8]}",
        tmp_path_factory.mktemp("deployment"),
        partitions=2,
        environment={"STREAMTRAIN_DELIVERY__DELIVERY_TIMEOUT_SECONDS": "2"},
        delta_topic_config={"max.message.bytes": str(HEADER_ALLOWANCE + 2048)},
    ) as stack:
        yield stack


def stack_logs(stack: Stack) -> str:
    return "".join(
        f"\n--- {name}:\n{run.output()}" for name, run in (("worker", stack.worker), ("serve", stack.serve)) if run
    )


def wait_for(condition: Callable[[], object], timeout: float, what: str, stack: Stack, worker_runs: bool = True):
    """Until ``condition()`` is true; fails with the stack's logs past ``timeout`` seconds, or as
    soon as the worker exits while it should run."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if worker_runs and stack.worker is not None and not stack.worker.running:
            pytest.fail(f"the worker exited with {stack.worker.process.poll()} waiting for {what}{stack_logs(stack)}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}{stack_logs(stack)}")
        time.sleep(0.25)


def running(stack: Stack, seed: int) -> None:
    """A live stream, the worker training it, and serve following the worker's deltas from its
    first base: started if need be (serve starts with the worker, and waits for that base), on a
    whole cluster."""
    stack.cluster.heal()
    if stack.writer is None:
        stack.write(count=RATE * 900, rate=RATE, malformed_every=MALFORMED_EVERY, seed=seed)
    worker = stack.worker if stack.worker is not None else stack.start_worker()
    serve = stack.serve if stack.serve is not None else stack.start_serve(base_wait=300)
    trained = worker.trained()
    wait_for(lambda: worker.trained() > trained + RATE and serve.ready(), 300, "training, and serve ready", stack)


def training_goes_on(stack: Stack, what: str) -> None:
    """The worker trains more events than it had: a fault does not stall it."""
    assert stack.worker is not None
    before = stack.worker.trained()
    wait_for(lambda: stack.worker.trained() > before + RATE // 2, 90, f"training to go on {what}", stack)


def check(stack: Stack, tmp_path: Path) -> None:
    """Stops the stream and lets the worker train it to the end; then every event is trained once,
    every malformed one dead-lettered, and serve scores as an export of the newest snapshot."""
    acknowledged = stack.stop_writing()
    contents = stack.contents()
    # every acknowledged write is on the topic, once
    assert sum(contents.valid().values()) == acknowledged["valid"]
    assert len(contents.malformed) == acknowledged["malformed"] > 0
    reached = stack.wait_until_snapshot_reaches(contents.ends, 180)
    assert reached, f"no snapshot reached the end offsets {contents.ends}{stack_logs(stack)}"

    accounting = stack.account(contents)
    assert accounting.next_offsets == contents.ends
    assert accounting.trained == contents.valid()
    assert (accounting.lost, accounting.duplicated, accounting.mismatches) == (0, 0, [])
    sources = stack.dead_letters()  # written at least once: a retry may repeat one
    assert set(sources) == contents.malformed

    # Every snapshot from here on holds the same model: nothing is left to train, and a step
    # without events changes no weight. serve gets there by the delta cut after the last events.
    payloads = held_out(HELD_OUT)
    _step, base = export_newest(stack.snapshots, tmp_path / "export")
    expected = model_scores(base, payloads)
    serve = stack.serve
    assert serve is not None

    def serves_the_export() -> bool:
        return serve.ready() and float(np.abs(serve.score(payloads) - expected).max()) < 1e-6

    wait_for(serves_the_export, 90, "serve to score as an export of the newest snapshot", stack)
    # It got there by the deltas alone: no gap made it wait for a base, but each worker start's
    # new chain did.
    metrics = serve.metrics()
    assert metrics["streamtrain_serve_base_loads_total"] == stack.starts["worker"], stack_logs(stack)
    assert metrics["streamtrain_serve_deltas_failed_total"] == 0, stack_logs(stack)
    print(
        f"{sum(contents.ends.values())} events ({len(contents.malformed)} malformed), "
        f"{accounting.snapshots} snapshots in the lineage, {len(sources) - len(set(sources))} dead letters repeated"
    )


def test_cluster_rolling_restart_while_training_loses_and_repeats_nothing(deployment, tmp_path):
    running(deployment, seed=81)
    # Each node in turn stops cleanly and comes back; the next waits until every partition is
    # fully replicated again. With any one node down the worker trains on.
    deployment.cluster.rolling_restart(
        while_down=lambda node: training_goes_on(deployment, f"with node {node} stopped")
    )
    training_goes_on(deployment, "after the rolling restart")
    check(deployment, tmp_path)
    # The worker created the dead-letter topic itself, replicated as the cluster's topics are.
    described = deployment.cluster.admin().list_topics(deployment.dead_letter_topic, timeout=10)
    replicas = {len(p.replicas) for p in described.topics[deployment.dead_letter_topic].partitions.values()}
    assert replicas == {3}, f"the dead-letter topic's replication factors: {replicas}"


def test_cluster_sigkill_of_the_input_leader_loses_and_repeats_nothing(deployment, tmp_path):
    running(deployment, seed=82)
    cluster = deployment.cluster
    victim = cluster.leading_most(deployment.topic)
    cluster.kill(victim)
    killed = time.monotonic()
    # Its partitions get new leaders once it is fenced; the worker reads them from there.
    wait_for(
        lambda: victim not in cluster.leaders(deployment.topic).values(),
        60,
        f"new leaders for node {victim}'s partitions",
        deployment,
    )
    training_goes_on(deployment, f"with node {victim} killed")
    time.sleep(max(0.0, 8.0 - (time.monotonic() - killed)))  # down for a few seconds at least
    cluster.restart(victim)
    cluster.wait_until_fully_replicated(120)
    training_goes_on(deployment, "after the node is back")
    check(deployment, tmp_path)


def partial_attempts(stack: Stack) -> list[tuple[int, int]]:
    """(chain, sequence) of each delta on the delta topic whose chunks a failed attempt left only
    some of, before a retry sent them all again: a part seen again before every part was seen."""
    first_runs: dict[tuple[int, int], set[int]] = {}
    retried: dict[tuple[int, int], int] = {}  # the delta's parts, once a part came again
    for chunk in read_messages(stack.bootstrap_servers, stack.delta_topic, 1):
        header, _piece = decode_chunk(chunk.value())
        delta = (header.base_version, header.sequence)
        run = first_runs.setdefault(delta, set())
        if header.part in run:
            retried.setdefault(delta, header.parts)
        elif delta not in retried:
            run.add(header.part)
    return [delta for delta, parts in retried.items() if len(first_runs[delta]) < parts]


def test_cluster_delta_send_that_fails_partway_is_retried_and_served(deployment, tmp_path):
    stack = deployment
    running(stack, seed=83)
    cluster = stack.cluster
    for _ in range(3):  # a delta is cut every second: the first freeze nearly always lands on a send
        leader = cluster.leader(stack.delta_topic, 0)
        followers = [node.node_id for node in cluster.nodes if node.node_id != leader]
        # The delta partition's followers freeze: its leader writes the chunks in flight but
        # cannot have them replicated, so the attempt times out with those written and the rest
        # never sent; once the followers thaw, the written chunks are replicated and readable.
        for follower in followers:
            cluster.pause(follower)
        try:
            time.sleep(4.5)  # past the 2 s delivery timeout, short of the 6 s after which a node is fenced
        finally:
            for follower in followers:
                cluster.resume(follower)
        cluster.wait_until_fully_replicated(120)
        training_goes_on(stack, "after the freeze")
        if partial := partial_attempts(stack):
            break
    else:
        pytest.fail("no delta send was cut short in 3 freezes")
    assert stack.worker is not None and stack.serve is not None
    assert stack.worker.metrics(0).get("streamtrain_delta_failures_total", 0) > 0
    # serve takes the retried delta and goes on past it, while the worker trains
    chain, sequence = max(partial)
    serve = stack.serve
    wait_for(
        lambda: (served := serve.served()) is not None and (served.chain, served.next_sequence) > (chain, sequence),
        60,
        f"serve to apply delta {sequence} of chain {chain}, which was cut short and retried",
        stack,
    )
    check(stack, tmp_path)


# Exit codes after which a restart cannot help: a supervisor stops and calls an operator.
NEEDS_AN_OPERATOR = {
    ExitCode.FAILED,
    ExitCode.CONFIG,
    ExitCode.LOGIN_REFUSED,
    ExitCode.RESTORE_REFUSED,
    ExitCode.OUTPUT_TOPIC_MISSING,
}


def lagged_partitions(stack: Stack) -> set[int]:
    """The partitions the ranks report a consumer lag for."""
    assert stack.worker is not None
    return {
        int(key.split('partition="')[1].split('"')[0])
        for rank in range(2)
        for key in stack.worker.metrics(rank)
        if key.startswith("streamtrain_consumer_lag_events{")
    }


def test_cluster_partitions_added_while_the_worker_runs_are_trained_exactly_once(deployment, tmp_path):
    stack = deployment
    running(stack, seed=84)
    stack.stop_writing()
    partitions = stack.partitions + 2
    added = stack.cluster.admin().create_partitions([NewPartitions(stack.topic, partitions)])
    added[stack.topic].result(timeout=30)
    stack.partitions = partitions
    stack.write(count=RATE * 900, rate=RATE, malformed_every=MALFORMED_EVERY, seed=85)  # over them all
    exits: list[int] = []

    def reads_every_partition() -> bool:
        """The worker reads the new partitions as it runs, or stops with a code that a restart
        resolves, and is restarted, as a supervisor would."""
        worker = stack.worker
        assert worker is not None
        if not worker.running:
            code = worker.process.poll()
            assert code not in NEEDS_AN_OPERATOR, f"the worker exited with {code}{stack_logs(stack)}"
            exits.append(code)
            worker.kill()
            stack.start_worker()
            return False
        return lagged_partitions(stack) == set(range(partitions))

    wait_for(reads_every_partition, 180, "the worker to read the partitions added", stack, worker_runs=False)
    training_goes_on(stack, f"on {partitions} partitions")
    print(f"the worker exited with {exits} and was restarted" if exits else "the worker took them as it ran")
    check(stack, tmp_path)
