"""Model delivery end to end: real ranks train with delivery on, a real `ScoringServer` follows the
start base and the delta topic over a real broker, and its /score answers (real HTTP) equal the
trainer's own state, taken from the snapshots by a path that does not go through any delta."""

from __future__ import annotations

import base64
import json
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from conftest import SCHEMA
from delivery_states import held_out
from streamtrain.checkpoint import list_snapshots
from streamtrain.decode import AvroBatchDecoder
from streamtrain.delivery.artifact import ServableModel, export_snapshot
from streamtrain.delivery.serve import KafkaDeltas, ScoringServer
from streamtrain.dev.produce import produce
from streamtrain.registry import schema_source
from streamtrain.source import RawEvent
from test_delivery_publisher import WIDE, assembled, delivery_env, delta_messages

pytestmark = pytest.mark.integration

HELD_OUT = 2000
EVERY_STEPS = 3


def post_scores(port: int, payloads: list[bytes]) -> np.ndarray:
    body = json.dumps({"events": [base64.b64encode(p).decode() for p in payloads]}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/score", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as reply:
        results = json.loads(reply.read())["results"]
    assert all("probabilities" in r for r in results), [r for r in results if "error" in r][:3]
    return np.array([r["probabilities"] for r in results], dtype=np.float32)


def scores_of(model: ServableModel, payloads: list[bytes]) -> np.ndarray:
    features = model.features
    tasks = [t.model_copy(update={"required": False}) for t in model.tasks]
    decoder = AvroBatchDecoder(features, schema_source(features), tasks)
    decoded = decoder.decode([RawEvent(0, i, p, -1) for i, p in enumerate(payloads)])
    assert not decoded.rejected
    return model.score(decoded.batch)


def snapshot_scores(root: Path, step: int, out: Path, payloads: list[bytes]) -> np.ndarray:
    """The probabilities of the snapshot at ``step``, exported on its own: no delta involved."""
    return scores_of(ServableModel(export_snapshot(root, step, out, version=1000 + step)), payloads)


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() >= deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.2)


def train_and_follow(kafka, topic: str, start_ranks, tmp_path: Path, world_size: int, **env: str) -> None:
    produce(kafka.bootstrap_servers, topic, 1500, partitions=4, seed=71, schema_path=SCHEMA)
    root = tmp_path / "snapshots"
    settings = delivery_env(root, every_steps=EVERY_STEPS, STREAMTRAIN_BATCHING__BATCH_SIZE="64", **env)
    ranks = start_ranks(topic, world_size, "--until-end", env=settings)
    # The chain's base is the step-0 snapshot's export. The worker starts that export itself, but
    # at the stop the final snapshot's base supersedes one still running, which on a stream this
    # short is the start's: the test makes it, as the worker would, where only the server looks.
    # The server sees no later base, so whatever it serves at the end came through the deltas.
    wait_for(lambda: any(s.step == 0 and s.complete for s in list_snapshots(str(root))), 180, "the step-0 snapshot")
    served_dir = tmp_path / "served"
    start_base = export_snapshot(root, 0, served_dir, version=1, new_chain=True)
    server = ScoringServer(
        served_dir,
        KafkaDeltas(kafka.bootstrap_servers, f"{topic}.model", {"broker.address.family": "v4"}),
        base_wait_seconds=5,
        start_timeout_seconds=180,
    )
    server.start()
    try:
        assert server.follower.manifest.base_version == 1 and server.follower.step == 0
        codes = [r.wait(timeout=300) for r in ranks]
        assert codes == [0] * world_size, "\n".join(r.output()[-3000:] for r in ranks)

        deltas = assembled(delta_messages(kafka.bootstrap_servers, f"{topic}.model"))
        assert {d.id.base_version for d in deltas} == {1}
        assert [d.id.sequence for d in deltas] == list(range(len(deltas)))
        final = deltas[-1]
        steps = sorted(s.step for s in list_snapshots(str(root)) if s.complete)
        assert final.id.step == steps[-1], f"last delta at {final.id.step}, snapshots at {steps}"
        follower = server.follower
        wait_for(lambda: follower.next_sequence == len(deltas), 60, f"the server to apply {len(deltas)} deltas")

        payloads, _records = held_out(HELD_OUT)
        served = post_scores(server.port, payloads)
        # It reached the final state through the deltas alone: the one base it loaded is the start's.
        assert follower.loads == 1 and follower.manifest.base_version == 1
        assert follower.step == final.id.step
        assert server.metrics.deltas_failed._value.get() == 0
        expected = snapshot_scores(root, final.id.step, tmp_path / "reference", payloads)
        assert np.abs(served - expected).max() < 1e-6
        assert np.abs(served - scores_of(ServableModel(start_base), payloads)).max() > 1e-4

        # An intermediate delta k: the start base plus deltas 0..k is the snapshot at k's step.
        middle = [d for d in deltas[:-1] if d.id.step in steps and d.id.step > 0]
        assert middle, f"no delta but the last falls on a snapshot: deltas at {[d.id.step for d in deltas]}"
        k = middle[len(middle) // 2]
        replica = ServableModel(start_base)
        for delta in deltas[: k.id.sequence + 1]:
            replica.apply(delta)
        intermediate = snapshot_scores(root, k.id.step, tmp_path / "reference", payloads)
        assert np.abs(scores_of(replica, payloads) - intermediate).max() < 1e-6
        assert np.abs(intermediate - expected).max() > 1e-4  # k is not the end state under another name
    finally:
        server.stop()


def test_one_rank_server_follows_the_worker_to_its_final_scores(kafka, topic_name, start_ranks, tmp_path):
    train_and_follow(kafka, topic_name, start_ranks, tmp_path, 1)


def test_two_ranks_table_and_column_wise_server_follows_to_the_final_scores(kafka, topic_name, start_ranks, tmp_path):
    train_and_follow(kafka, topic_name, start_ranks, tmp_path, 2, **WIDE)
