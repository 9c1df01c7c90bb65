"""`streamtrain serve` on a real broker, real HTTP and real bases: deltas cut from states of a model
real ranks trained, produced to a topic (chunked below its max.message.bytes, shuffled, repeated),
bring the server's scores to the later state's; a lost delta makes it reload the newest base; a
server SIGKILLed mid-stream and restarted converges; /score takes Avro and JSON, bad events apart."""

from __future__ import annotations

import base64
import json
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from confluent_kafka import Consumer, KafkaError, Producer
from confluent_kafka.admin import AdminClient, NewTopic
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from conftest import REPO, scrape
from delivery_states import held_out, ranks_scores, set_delivery, small_config, train_states
from streamtrain.config import KafkaConfig
from streamtrain.delivery import artifact
from streamtrain.delivery.artifact import ServableModel, export_snapshot
from streamtrain.delivery.deltas import Delta, DeltaId, DensePiece, RowPiece, encode
from streamtrain.delivery.publisher import DeliveryFailed, TopicTarget
from streamtrain.delivery.safeload import UnsafeBase
from streamtrain.delivery.serve import DirectoryDeltas, KafkaDeltas, ScoringServer
from streamtrain.delivery.spec import FormatError
from streamtrain.dev.kafka import free_port
from streamtrain.topics import OutputTopic
from test_delivery_publisher import delta_messages
from test_delivery_spec import code_in_an_expression

pytestmark = pytest.mark.integration

EVENTS = 50
MAX_MESSAGE_BYTES = 16_384
BATCHES = [2, 2, 2, 2]


@pytest.fixture(scope="module")
def states(tmp_path_factory):
    return four_states(tmp_path_factory)


def four_states(tmp_path_factory):
    """Four snapshots of one model, two steps apart, and the ranks' scores at each."""
    root = tmp_path_factory.mktemp("states")
    snapshots = train_states(root, 1, small_config(), BATCHES, [EVENTS])
    flat = []
    for snapshot in snapshots:
        dcp_to_torch_save(snapshot, snapshot.with_suffix(".pt"))
        flat.append(torch.load(snapshot.with_suffix(".pt"), weights_only=False)["model"])
    return root, snapshots, flat


def cut(flat: list[dict], before: int, after: int, sequence: int, chain: int = 1) -> Delta:
    """The delta from state ``before`` to ``after``: the rows that changed, each table sent as two
    column pieces as column-wise shards send them, and every dense parameter."""
    old, new = flat[before], flat[after]
    rows, dense = [], []
    for name, weight in new.items():
        if ".embedding_bags." in name:
            changed = torch.nonzero((weight != old[name]).any(dim=1)).flatten()
            values = weight[changed].numpy()
            table = name.split(".")[-2]
            half = values.shape[1] // 2
            rows += [
                RowPiece(table, changed.numpy(), 0, values[:, :half]),
                RowPiece(table, changed.numpy(), half, values[:, half:]),
            ]
        else:
            dense.append(DensePiece(name, tuple(weight.shape), 0, weight.numpy().reshape(-1)))
    step = sum(BATCHES[: after + 1])
    return Delta(DeltaId("clicks", chain, sequence, step, 1_000 * after, int(time.time() * 1000)), rows, dense)


def create_delta_topic(kafka, topic: str) -> None:
    admin = AdminClient({"bootstrap.servers": kafka.bootstrap_servers, "broker.address.family": "v4"})
    futures = admin.create_topics([NewTopic(topic, 1, config={"max.message.bytes": str(MAX_MESSAGE_BYTES)})])
    futures[topic].result(timeout=30)


def publish(kafka, topic: str, *deltas: Delta, repeat: bool = True) -> int:
    """Produces each delta's chunks shuffled, with some sent twice (as a producer's retries would)."""
    producer = Producer(
        {
            "bootstrap.servers": kafka.bootstrap_servers,
            "acks": "all",
            "enable.idempotence": True,
            "linger.ms": 5,
            # librdkafka batches records up to this size, and the broker checks the whole batch
            # against the topic's max.message.bytes
            "message.max.bytes": MAX_MESSAGE_BYTES,
        }
    )
    failures: list[str] = []
    sent = 0
    for delta in deltas:
        chunks = encode(delta, MAX_MESSAGE_BYTES)
        assert len(chunks) > 3 and all(len(c) <= MAX_MESSAGE_BYTES for c in chunks)
        shuffled = chunks + (chunks[:2] if repeat else [])
        random.Random(delta.id.sequence).shuffle(shuffled)
        for chunk in shuffled:
            producer.produce(topic, chunk, key=b"clicks", on_delivery=lambda e, _m: e and failures.append(str(e)))
        sent += len(shuffled)
    assert producer.flush(30) == 0 and not failures, failures[:3]
    return sent


def post(port: int, body: object) -> dict:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/score", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as reply:
        return json.loads(reply.read())


def served(port: int) -> np.ndarray:
    payloads, _ = held_out(EVENTS)
    reply = post(port, {"events": [base64.b64encode(p).decode() for p in payloads]})
    return np.array([r["probabilities"] for r in reply["results"]], dtype=np.float32)


def wait_for(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.2)
    pytest.fail(f"timed out after {timeout}s waiting for {what}")


def distance(port: int, root: Path, state: int) -> float:
    return float(np.abs(served(port) - ranks_scores(root, state, EVENTS)).max())


def base_of(states, tmp_path: Path) -> Path:
    """A bases' folder under ``tmp_path`` serving base 1, of state 0: a copy of one export per states."""
    root, snapshots, _flat = states
    exported = root / "serving-base-1"
    if not exported.exists():
        export_snapshot(snapshots[0], None, root / "exporting", version=1, new_chain=True)
        (root / "exporting").rename(exported)
    out = tmp_path / "serving"
    shutil.copytree(exported, out)
    return out


def test_chunked_shuffled_repeated_deltas_bring_the_server_to_the_later_state(kafka, topic_name, states, tmp_path):
    root, _snapshots, flat = states
    out = base_of(states, tmp_path)
    create_delta_topic(kafka, topic_name)
    publish(kafka, topic_name, cut(flat, 0, 1, 0))
    with ScoringServer(out, KafkaDeltas(kafka.bootstrap_servers, topic_name)) as server:
        assert server.wait_ready(60), "not ready once the delta present at start was applied"
        assert distance(server.port, root, 1) <= 1e-6
        # a repeat of delta 0 after delta 1 is skipped as already applied
        publish(kafka, topic_name, cut(flat, 1, 2, 1), cut(flat, 0, 1, 0), cut(flat, 2, 3, 2))
        samples = wait_for(
            lambda: (s := scrape(server.port)).get("streamtrain_serve_delta_sequence") == 2 and s,
            60,
            "delta 2 applied",
        )
        assert distance(server.port, root, 3) <= 1e-6
        assert samples["streamtrain_serve_deltas_applied_total"] == 3
        assert samples["streamtrain_serve_deltas_skipped_total"] == 1
        assert samples["streamtrain_serve_deltas_failed_total"] == 0
        assert samples["streamtrain_serve_step"] == sum(BATCHES)
        assert samples["streamtrain_serve_base_version"] == 1
        assert samples["streamtrain_serve_delta_apply_seconds_count"] == 3
        assert samples["streamtrain_serve_freshness_seconds"] > 0


def test_a_lost_delta_makes_the_server_reload_the_newest_base_and_still_end_equal(kafka, topic_name, states, tmp_path):
    root, snapshots, flat = states
    out = base_of(states, tmp_path)
    create_delta_topic(kafka, topic_name)
    publish(kafka, topic_name, cut(flat, 0, 1, 0))
    with ScoringServer(out, KafkaDeltas(kafka.bootstrap_servers, topic_name), base_wait_seconds=60) as server:
        assert server.wait_ready(60)
        publish(kafka, topic_name, cut(flat, 2, 3, 2))  # delta 1 never arrives
        time.sleep(1.0)
        assert distance(server.port, root, 1) <= 1e-6  # it waits for a base, serving what it has
        set_delivery(snapshots[2], chain=1, next_sequence=2)  # the worker's periodic base after delta 1
        export_snapshot(snapshots[2], None, out, version=2)
        wait_for(lambda: scrape(server.port).get("streamtrain_serve_delta_sequence") == 2, 60, "delta 2 applied")
        samples = scrape(server.port)
        assert distance(server.port, root, 3) <= 1e-6
        assert samples["streamtrain_serve_base_version"] == 2
        assert samples["streamtrain_serve_base_loads_total"] == 2
        assert samples["streamtrain_serve_deltas_failed_total"] == 0


def test_a_delta_of_a_newer_chain_makes_the_server_load_that_chains_base(kafka, topic_name, states, tmp_path):
    root, snapshots, flat = states
    out = base_of(states, tmp_path)
    create_delta_topic(kafka, topic_name)
    publish(kafka, topic_name, cut(flat, 0, 1, 0))
    with ScoringServer(out, KafkaDeltas(kafka.bootstrap_servers, topic_name), base_wait_seconds=60) as server:
        assert server.wait_ready(60)
        # a worker restored from state 2 starts chain 3 with the base it starts from, then goes on
        set_delivery(snapshots[2], chain=1, next_sequence=2)
        export_snapshot(snapshots[2], None, out, version=3, new_chain=True)
        publish(kafka, topic_name, cut(flat, 2, 3, 2, chain=3))
        wait_for(lambda: scrape(server.port).get("streamtrain_serve_chain") == 3, 60, "chain 3 followed")
        wait_for(lambda: scrape(server.port).get("streamtrain_serve_delta_sequence") == 2, 60, "delta 2 applied")
        assert distance(server.port, root, 3) <= 1e-6
        samples = scrape(server.port)
        assert samples["streamtrain_serve_base_version"] == 3 and samples["streamtrain_serve_deltas_failed_total"] == 0


def test_a_server_killed_mid_stream_and_restarted_converges(kafka, topic_name, states, tmp_path):
    root, _snapshots, flat = states
    out = base_of(states, tmp_path)
    create_delta_topic(kafka, topic_name)
    port = free_port()

    def start() -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "streamtrain", "serve", "--model", str(out), "--deltas", topic_name,
             "--bootstrap-servers", kafka.bootstrap_servers, "--port", str(port), "--threads", "1"],
            cwd=REPO, stdout=subprocess.DEVNULL, stderr=(tmp_path / "serve.log").open("ab"),
        )  # fmt: skip

    server = start()
    try:
        publish(kafka, topic_name, cut(flat, 0, 1, 0))
        wait_for(lambda: scrape(port).get("streamtrain_serve_deltas_applied_total") == 1, 120, "delta 0 applied")
        publish(kafka, topic_name, cut(flat, 1, 2, 1))
        server.send_signal(signal.SIGKILL)
        server.wait(timeout=10)
        publish(kafka, topic_name, cut(flat, 2, 3, 2))
        server = start()
        wait_for(lambda: ready(port), 120, "the restarted server ready")
        assert scrape(port)["streamtrain_serve_delta_sequence"] == 2
        assert distance(port, root, 3) <= 1e-6
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as reply:
            assert json.loads(reply.read()) == {"ok": True}
    finally:
        server.kill()
        server.wait(timeout=10)
    log = (tmp_path / "serve.log").read_text()
    assert "Traceback" not in log, log[-3000:]


def ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as reply:
            return bool(json.loads(reply.read())["ready"])
    except OSError:  # not listening yet, or 503 while the deltas present at start are applied
        return False


def test_score_takes_avro_and_json_and_answers_bad_events_one_by_one(states, tmp_path):
    root, _snapshots, _flat = states
    out = base_of(states, tmp_path)
    payloads, records = held_out(6)
    want = ranks_scores(root, 0, EVENTS)[:6]
    events: list[object] = [base64.b64encode(p).decode() for p in payloads[:3]]
    events += [{k: v for k, v in r.items() if k not in ("clk", "buy", "event_time")} for r in records[3:]]
    bad = {
        1: "%%% not base64",
        3: base64.b64encode(b"\x01").decode(),  # Avro that ends too soon
        5: {"user_id": 1},  # a JSON event without most of its fields
        7: 42,
    }
    for index in sorted(bad):
        events.insert(index, bad[index])
    with ScoringServer(out) as server:
        assert server.wait_ready(30)
        reply = post(server.port, {"events": events})
        assert reply["tasks"] == ["clk"] and reply["base_version"] == 1 and reply["delta_sequence"] == -1
        results = reply["results"]
        assert len(results) == len(events)
        good = [r for i, r in enumerate(results) if i not in bad]
        assert all("error" in results[i] for i in bad), results
        got = np.array([r["probabilities"] for r in good], dtype=np.float32)
        assert np.abs(got - want).max() <= 1e-6
        with pytest.raises(urllib.error.HTTPError) as refused:
            post(server.port, ["not", "an", "object"])
        assert refused.value.code == 400
        samples = scrape(server.port)
        assert samples['streamtrain_serve_score_requests_total{outcome="ok"}'] == 1
        assert samples['streamtrain_serve_score_requests_total{outcome="bad_request"}'] == 1
        assert samples["streamtrain_serve_rejected_events_total"] == len(bad)
        assert samples["streamtrain_serve_score_seconds_count"] == 1


def test_a_delta_directory_is_followed_in_order_once_each_delta_is_complete(states, tmp_path):
    root, _snapshots, flat = states
    out = base_of(states, tmp_path)
    deltas = tmp_path / "deltas"

    def write(delta: Delta, complete: bool = True) -> None:
        folder = deltas / f"delta-{delta.id.base_version}-{delta.id.sequence}"
        folder.mkdir(parents=True)
        for part, chunk in enumerate(encode(delta, MAX_MESSAGE_BYTES)):
            (folder / f"part-{part:06d}").write_bytes(chunk)
        if complete:
            (folder / "COMPLETE").touch()

    write(cut(flat, 0, 1, 0))
    write(cut(flat, 1, 2, 1), complete=False)  # still being written: not read yet
    with ScoringServer(out, DirectoryDeltas(deltas)) as server:
        assert server.wait_ready(30)
        assert distance(server.port, root, 1) <= 1e-6
        write(cut(flat, 2, 3, 2))
        (deltas / "delta-1-1" / "COMPLETE").touch()
        wait_for(lambda: scrape(server.port).get("streamtrain_serve_delta_sequence") == 2, 60, "delta 2 applied")
        assert distance(server.port, root, 3) <= 1e-6


class DiesPartway:
    """A producer that delivers its first ``delivered`` chunks and fails the rest, as an attempt
    cut short by a broker that went away: librdkafka's timeout, through the delivery callback."""

    def __init__(self, producer: Producer, delivered: int):
        self.producer, self.left = producer, delivered

    def produce(self, topic: str, value: bytes, key: bytes, on_delivery) -> None:
        if self.left > 0:
            self.left -= 1
            self.producer.produce(topic, value, key=key, on_delivery=on_delivery)
        else:
            on_delivery(KafkaError(KafkaError._MSG_TIMED_OUT), None)

    def __getattr__(self, name: str):
        return getattr(self.producer, name)


def test_a_delta_send_that_failed_partway_and_was_retried_is_applied(kafka, topic_name, states, tmp_path):
    root, _snapshots, flat = states
    out = base_of(states, tmp_path)
    create_delta_topic(kafka, topic_name)
    target = TopicTarget(
        KafkaConfig(bootstrap_servers=kafka.bootstrap_servers, topic="clicks"),
        OutputTopic(topic_name, "delta", "delivery.topic"),
        "clicks",
        10,
    )
    delta = cut(flat, 0, 1, 0)  # stamped at the cut, as the publisher stamps it
    try:
        target._connect()
        producer = target.producer
        target.producer = DiesPartway(producer, 3)
        with pytest.raises(DeliveryFailed, match="timed out"):
            target.send(delta)
        target.producer = producer
        time.sleep(0.05)  # the publisher retries a second later at the soonest
        target.send(delta)
    finally:
        target.close()
    chunks = delta_messages(kafka.bootstrap_servers, topic_name)
    assert len(chunks) == 3 + len(encode(delta, MAX_MESSAGE_BYTES))
    assert (
        len({json.loads(chunk[8 : 8 + int.from_bytes(chunk[4:8], "little")])["published_at_ms"] for chunk in chunks})
        == 1
    )
    with ScoringServer(out, KafkaDeltas(kafka.bootstrap_servers, topic_name)) as server:
        assert server.wait_ready(60)
        assert distance(server.port, root, 1) <= 1e-6
        samples = scrape(server.port)
        assert samples["streamtrain_serve_deltas_applied_total"] == 1
        assert not any(k.startswith("streamtrain_serve_bad_deltas_total") for k in samples), samples


def test_an_idle_server_still_scores_after_retention_removes_the_base_it_serves(kafka, topic_name, states, tmp_path):
    """A server follows deltas on base 1 and scores nothing while newer bases are published and
    retention removes base-000001/: its first score after that must succeed, as /readyz says."""
    root, _snapshots, flat = states
    out = base_of(states, tmp_path)
    create_delta_topic(kafka, topic_name)
    publish(kafka, topic_name, cut(flat, 0, 1, 0))
    with ScoringServer(out, KafkaDeltas(kafka.bootstrap_servers, topic_name)) as server:
        assert server.wait_ready(60)
        # Base 2 published as an export publishes it, its chain starting there (no gap: base 1 stays
        # served), then the export's retention keeping one base.
        shutil.copytree(out / "base-000001", out / "base-000002")
        manifest = json.loads((out / "base-000002" / "manifest.json").read_text())
        (out / "base-000002" / "manifest.json").write_text(json.dumps(manifest | {"base_version": 2, "chain": 2}))
        artifact._point_current(out, 2, "base-000002")
        artifact._retain(out, keep=1)
        assert not (out / "base-000001").exists()
        assert ready(server.port)
        assert distance(server.port, root, 1) <= 1e-6
        assert scrape(server.port)['streamtrain_serve_score_requests_total{outcome="ok"}'] == 1


def test_a_manifest_naming_files_outside_its_base_or_a_tampered_program_is_refused(states, tmp_path):
    out = base_of(states, tmp_path)
    base = out / "base-000001"
    manifest = json.loads((base / "manifest.json").read_text())
    elsewhere = str((REPO / "schemas" / "click_event.avsc").resolve())  # a valid schema, outside the base
    np.savez(tmp_path / "maps.npz", **{"user_id.rows": np.zeros(1, np.int64), "user_id.ids": np.zeros(1, np.int64)})
    features = manifest["config"]["features"]
    for name, changed in [
        (
            "absolute",
            {**manifest, "config": {**manifest["config"], "features": {**features, "schema_path": elsewhere}}},
        ),
        (
            "dotdot",
            {**manifest, "config": {**manifest["config"], "features": {**features, "schema_path": "../../x.avsc"}}},
        ),
        ("id-map", {**manifest, "id_maps": {"user_id": {"unknown_row": 0, "file": str(tmp_path / "maps.npz")}}}),
    ]:
        copy = tmp_path / name / "base-000001"
        shutil.copytree(base, copy)
        (copy / "manifest.json").write_text(json.dumps(changed))
        with pytest.raises(FormatError, match="must be a relative path inside the base"):
            ServableModel(copy)
    copy = tmp_path / "tampered" / "base-000001"
    shutil.copytree(base, copy)
    code_in_an_expression(base / "model.pt2", copy / "model.pt2", tmp_path / "ran")
    with pytest.raises(UnsafeBase, match="size expression"):
        ServableModel(copy)
    assert not (tmp_path / "ran").exists(), "loading a base ran code from it"


class LeaderMoving:
    """The delta consumer, whose time lookups answer with a partition error (as librdkafka reports
    one, in the partition, without raising) until ``settled`` is set."""

    def __init__(self, consumer: Consumer):
        self.consumer, self.settled = consumer, threading.Event()

    def offsets_for_times(self, partitions: list, timeout: float) -> list:
        if self.settled.is_set():
            return self.consumer.offsets_for_times(partitions, timeout=timeout)
        return [
            SimpleNamespace(
                topic=partitions[0].topic, partition=0, offset=-1, error=KafkaError(KafkaError.LEADER_NOT_AVAILABLE)
            )
        ]

    def __getattr__(self, name: str):
        return getattr(self.consumer, name)


def test_a_failed_time_lookup_is_retried_not_taken_for_no_deltas(kafka, topic_name, states, tmp_path):
    root, _snapshots, flat = states
    out = base_of(states, tmp_path)
    create_delta_topic(kafka, topic_name)
    publish(kafka, topic_name, cut(flat, 0, 1, 0))
    deltas = KafkaDeltas(kafka.bootstrap_servers, topic_name)
    lookups = LeaderMoving(deltas._consumer)
    deltas._consumer = lookups
    server = ScoringServer(out, deltas)
    starting = threading.Thread(target=server.start, daemon=True)
    starting.start()
    try:
        wait_for(lambda: server.follower.metrics.source_retries._value.get() >= 2, 60, "the lookup retried")
        assert "rewinding the delta source failed" in (server.follower.behind or "")
        assert not server.ready
        lookups.settled.set()
        starting.join(timeout=60)
        assert server.wait_ready(60)
        assert distance(server.port, root, 1) <= 1e-6  # delta 0, published before the base's cut, applied
        assert ready(server.port)
    finally:
        lookups.settled.set()
        starting.join(timeout=60)
        server.stop()
