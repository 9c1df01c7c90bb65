"""Cluster faults under a running deployment: a 3-node KRaft cluster (replication factor 3,
min.insync.replicas 2), ``streamtrain worker --nproc 2`` training a live stream with malformed
events in it, deltas on a topic, and ``streamtrain serve`` following them.

Each test faults the cluster while the worker trains, then checks, from the topics and the
snapshots: every valid event trained exactly once in the final snapshot's lineage, its positions
at the topic's end offsets; every malformed event dead-lettered; and serve, having followed the
deltas to the final snapshot's step, scoring as a fresh export of that snapshot does.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import pytest

from conftest import SMALL_CONFIG
from streamtrain.dev.kafka import KafkaCluster
from streamtrain.dev.stack import Stack, export_of, held_out, model_scores

pytestmark = pytest.mark.integration

RATE = 150  # events/s: a stream the ranks keep up with on a loaded 2-core host
MALFORMED_EVERY = 40
HELD_OUT = 300


@pytest.fixture(scope="module")
def cluster():
    with KafkaCluster() as cluster:
        yield cluster


@pytest.fixture
def open_stack(cluster, topic_name, tmp_path):
    """Opens the test's stack on the cluster (once every partition is in sync again, whatever the
    test before did to it); whatever it started is killed at the end."""
    opened: list[Stack] = []

    def open_stack(
        partitions: int = 4, environment: dict[str, str] | None = None, delta_topic_config: dict[str, str] | None = None
    ) -> Stack:
        cluster.wait_until_fully_replicated(120)
        stack = Stack(cluster, topic_name, tmp_path, SMALL_CONFIG, partitions, environment)
        opened.append(stack)
        stack.create_topics()
        # Created here with replication factor 3, as an operator would: the worker creates a
        # missing delta topic with the brokers' default replication factor, which on many clusters
        # is 1. Once the worker creates it with the cluster's factor, this line can go.
        cluster.create_topic(stack.delta_topic, 1, config=delta_topic_config)
        return stack

    yield open_stack
    for stack in opened:
        stack.close()


@pytest.fixture
def stack(open_stack) -> Stack:
    return open_stack()


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


T0 = [time.monotonic()]


def phase(what: str) -> None:
    print(f"{time.monotonic() - T0[0]:7.1f}s {what}", flush=True)


def start(stack: Stack, seed: int) -> None:
    """A live stream, the worker training it, and serve following the worker's deltas from its
    first base (serve starts with the worker, and waits for that base)."""
    T0[0] = time.monotonic()
    stack.write(count=RATE * 900, rate=RATE, malformed_every=MALFORMED_EVERY, seed=seed)
    worker = stack.start_worker()
    serve = stack.start_serve(base_wait=300)
    wait_for(lambda: worker.trained() > RATE and serve.ready(), 300, "training, and serve ready", stack)
    phase("training, serve ready")


def training_goes_on(stack: Stack, what: str) -> None:
    """The worker trains more events than it had: a fault does not stall it."""
    assert stack.worker is not None
    before = stack.worker.trained()
    wait_for(lambda: stack.worker.trained() > before + RATE // 2, 90, f"training to go on {what}", stack)


def finish(stack: Stack, tmp_path) -> None:
    """Stops the stream, lets the worker train it to the end and stops the worker; then every
    event is trained once, every malformed one dead-lettered, and serve scores as an export."""
    phase("finish")
    acknowledged = stack.stop_writing()
    contents = stack.contents()
    phase("read")
    # every acknowledged write is on the topic, once
    assert sum(contents.valid().values()) == acknowledged["valid"]
    assert len(contents.malformed) == acknowledged["malformed"]
    assert len(contents.malformed) > 0
    reached = stack.wait_until_snapshot_reaches(contents.ends, 180)
    assert stack.worker is not None and stack.serve is not None
    phase("reached")
    assert stack.worker.stop(120) == 0, stack.worker.output()
    phase("stopped")
    assert reached, f"no snapshot reached the end offsets {contents.ends}"

    accounting = stack.account(contents)
    assert accounting.next_offsets == contents.ends
    assert accounting.trained == contents.valid()
    assert (accounting.lost, accounting.duplicated, accounting.mismatches) == (0, 0, [])
    sources = stack.dead_letters()  # written at least once: a retry may repeat one
    assert set(sources) == contents.malformed

    serve = stack.serve
    final = accounting.final_step

    def at_final() -> bool:
        served = serve.served()
        return served is not None and served.step == final

    wait_for(at_final, 90, f"serve at step {final}", stack, worker_runs=False)
    assert serve.ready()
    # It got there by the deltas alone: no gap made it wait for a base, but each worker start's
    # new chain did.
    metrics = serve.metrics()
    assert metrics["streamtrain_serve_base_loads_total"] == stack.starts["worker"], stack_logs(stack)
    assert metrics["streamtrain_serve_deltas_failed_total"] == 0, stack_logs(stack)
    phase("served")
    payloads = held_out(HELD_OUT)
    served_scores = serve.score(payloads)
    expected = model_scores(export_of(stack.snapshots, final, stack.bases, tmp_path / "export"), payloads)
    assert np.abs(served_scores - expected).max() < 1e-6
    phase("compared")
    print(
        f"{sum(contents.ends.values())} events ({len(contents.malformed)} malformed), final step {final}, "
        f"{accounting.snapshots} snapshots in its lineage, {len(sources) - len(set(sources))} dead letters repeated"
    )


def test_cluster_rolling_restart_while_training_loses_and_repeats_nothing(stack, tmp_path):
    start(stack, seed=81)
    # Each node in turn stops cleanly and comes back; the next waits until every partition is
    # fully replicated again. With any one node down the worker trains on.
    stack.cluster.rolling_restart(while_down=lambda node: training_goes_on(stack, f"with node {node} stopped"))
    phase("rolled")
    training_goes_on(stack, "after the rolling restart")
    finish(stack, tmp_path)


def test_cluster_sigkill_of_the_input_leader_loses_and_repeats_nothing(stack, tmp_path):
    start(stack, seed=82)
    cluster = stack.cluster
    victim = cluster.leading_most(stack.topic)
    cluster.kill(victim)
    killed = time.monotonic()
    # Its partitions get new leaders once it is fenced; the worker reads them from there.
    wait_for(lambda: victim not in cluster.leaders(stack.topic).values(), 60, f"new leaders for node {victim}'s", stack)
    training_goes_on(stack, f"with node {victim} killed")
    time.sleep(max(0.0, 8.0 - (time.monotonic() - killed)))  # down for a few seconds at least
    cluster.restart(victim)
    cluster.wait_until_fully_replicated(120)
    recovered = time.monotonic()
    training_goes_on(stack, "after the node is back")
    print(f"node {victim} down {recovered - killed:.1f}s")
    finish(stack, tmp_path)
