"""The follower against bad input and a broker outage, and the scoring server against clients it
cannot trust, on a real broker, real HTTP and real bases (the states of test_delivery_serve).

- Mutated chunks (truncated, not JSON, wrong types, negative and huge numbers, parts out of range
  or disagreeing, deltas that do not fit the base) interleaved with real deltas: the server never
  stops following, never serves a half-applied delta, counts each, and ends equal to the trained
  state once a base covers the gap a refused delta leaves. ``STREAMTRAIN_FUZZ_MUTATIONS`` sets how
  many (default 1500).
- The broker down for 30 s while the server switches base: it resumes.
- /score: 413 for big bodies and too many events, 503 with Retry-After when full, 401 without the
  token; deltas keep applying while large requests are scored (the apply latency is printed).
"""

from __future__ import annotations

import base64
import itertools
import json
import os
import random
import socket
import struct
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from confluent_kafka import Producer

from conftest import scrape
from delivery_states import held_out, ranks_scores, set_delivery
from schema_registry import StandInRegistry
from streamtrain.delivery.artifact import ServableModel, export_snapshot
from streamtrain.delivery.deltas import HEADER_ALLOWANCE, MAGIC, Delta, DeltaId, DensePiece, RowPiece, encode
from streamtrain.delivery.serve import KafkaDeltas, ScoringServer, ServeLimits
from streamtrain.dev.kafka import KafkaBroker
from test_delivery_serve import (
    EVENTS,
    MAX_MESSAGE_BYTES,
    base_of,
    create_delta_topic,
    cut,
    distance,
    four_states,
    publish,
    wait_for,
)
from test_delivery_spec import read_chunk, row_of
from test_wire_format import http_registry  # noqa: F401 (a fixture)

pytestmark = pytest.mark.integration

MUTATIONS = int(os.environ.get("STREAMTRAIN_FUZZ_MUTATIONS", "1500"))
OUTAGE_SECONDS = 30


@pytest.fixture(scope="module")
def states(tmp_path_factory):
    return four_states(tmp_path_factory)


def split(chunk: bytes) -> tuple[dict, bytes]:
    (length,) = struct.unpack_from("<I", chunk, 4)
    return json.loads(chunk[8 : 8 + length]), chunk[8 + length :]


def join(header: object, body: bytes) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return MAGIC + struct.pack("<I", len(raw)) + raw + body


_INTS = {
    "rows": ["count", "part", "parts", "column", "width", "step", "sequence", "base_version", "published_at_ms"],
    "dense": ["count", "part", "parts", "offset", "step", "sequence", "base_version", "event_time_high_water_ms"],
}
_NEGATIVE = {"rows": ["count", "part", "column", "width", "step", "sequence"], "dense": ["count", "part", "offset"]}


def undecodable(rng: random.Random, chunk: bytes) -> bytes:
    """A chunk no reader may take: each kind of damage the format's checks must catch."""
    header, body = split(chunk)
    kind = header["kind"]
    damage = rng.randrange(12)
    if damage == 0:
        return chunk[: rng.randrange(len(chunk))]  # truncated anywhere
    if damage == 1:
        return join(json.dumps(header).encode()[:-1], body)  # not JSON
    if damage == 2:
        return join(rng.choice([b"[]", b"null", b'"x"', b"5", b"\xff\xfe"]), body)  # not an object
    if damage == 3:
        field = rng.choice([*_INTS[kind], "section", "kind"])
        wrong = [1.5, None, [], {}, True, ""] + ([5] if field == "section" else ["5"])
        return join({**header, field: rng.choice(wrong)}, body)  # wrong type
    if damage == 4:
        field = rng.choice(_NEGATIVE[kind])
        return join({**header, field: -rng.randint(1, 2**40)}, body)
    if damage == 5:
        field = rng.choice(["count", "width"] if kind == "rows" else ["count", "offset"])
        return join({**header, field: rng.randint(2**31, 2**70)}, body)  # huge
    if damage == 6:
        return join({**header, "part": header["parts"] + rng.randrange(5)}, body)  # part out of range
    if damage == 7:
        return join(header, body[: -rng.randint(1, len(body))] if rng.random() < 0.5 else body + b"\x00" * 4)
    if damage == 8:
        return join({**header, "format": rng.choice([0, 2, 99, "1"])}, body)
    if damage == 9:
        return join({**header, "kind": rng.choice(["sparse", "ROWS", "row"])}, body)
    if damage == 10:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
    if kind == "dense":
        return join({**header, "shape": rng.choice([5, [-1, 3], [2.5], None, "8"])}, body)
    return MAGIC + struct.pack("<I", 2**31) + chunk[8:]  # a header length past the end


def unfitting(rng: random.Random, flat: list[dict], sequence: int) -> bytes:
    """A one-chunk delta in the format that does not fit the base: refused whole at apply."""
    table = "user_id"
    dense = next(name for name in flat[0] if ".embedding_bags." not in name)
    shape = tuple(flat[0][dense].shape)
    identity = DeltaId("clicks", 1, sequence, 1, 0, 0)
    piece = rng.choice(
        [
            Delta(identity, [RowPiece(table, np.array([10**12]), 0, np.ones((1, 8), np.float32))]),
            Delta(identity, [RowPiece("no_such_table", np.array([0]), 0, np.ones((1, 8), np.float32))]),
            Delta(identity, [RowPiece(table, np.array([0]), 5, np.ones((1, 8), np.float32))]),
            Delta(identity, [RowPiece(table, np.array([-3]), 0, np.ones((1, 8), np.float32))]),
            Delta(identity, dense=[DensePiece(dense, (2**20, 2**20), 2**39, np.ones(4, np.float32))]),
            Delta(identity, dense=[DensePiece(dense, (shape[0] + 1, *shape[1:]), 0, np.ones(4, np.float32))]),
        ]
    )
    (chunk,) = encode(piece, MAX_MESSAGE_BYTES)
    return chunk


def disagreeing(rng: random.Random, chunk: bytes) -> bytes:
    header, body = split(chunk)
    change = rng.choice([{"parts": header["parts"] + rng.randint(1, 9)}, {"step": header["step"] + 1}])
    return join({**header, **change}, body)


def poisoned(chunk: bytes) -> bytes:
    """The same part of a real delta, in the format, but with a row outside its table."""
    header, body = split(chunk)
    ids = np.frombuffer(body[: 8 * header["count"]], "<i8").copy()
    ids[0] = 10**9
    return join(header, ids.tobytes() + body[8 * header["count"] :])


def test_mutated_delta_chunks_are_counted_and_skipped_and_the_server_ends_equal(kafka, topic_name, states, tmp_path):
    root, snapshots, flat = states
    out = base_of(states, tmp_path)
    create_delta_topic(kafka, topic_name)
    rng = random.Random(38)
    deltas = [cut(flat, 0, 1, 0), cut(flat, 1, 2, 1), cut(flat, 2, 3, 2), cut(flat, 2, 3, 3)]
    real = [encode(d, MAX_MESSAGE_BYTES) for d in deltas]
    # Chunks no reader takes never reach a delta: damage small ones, so a long run stays light.
    small = [encode(d, HEADER_ALLOWANCE + 512) for d in deltas]
    messages: list[bytes] = []
    bad = 0
    per_delta = MUTATIONS // 3
    for sequence in range(3):
        mutants = [undecodable(rng, rng.choice(small[sequence])) for _ in range(per_delta * 9 // 10)]
        mutants += [unfitting(rng, flat, sequence) for _ in range(per_delta - len(mutants))]
        rng.shuffle(mutants)
        chunks = list(real[sequence])
        rng.shuffle(chunks)
        if sequence == 2:  # delta 2 loses to a chunk of its own that does not fit: refused whole
            rows = next(i for i, c in enumerate(chunks) if split(c)[0]["kind"] == "rows")
            chunks.insert(0, poisoned(chunks[rows]))
            bad += 1
        # disagreeing chunks after the delta's first: refused, the delta still whole
        spoilers = [disagreeing(rng, rng.choice(real[sequence])) for _ in range(per_delta // 20)]
        messages += mutants + chunks[:1] + spoilers + chunks[1:]
        bad += len(mutants) + len(spoilers)
    messages += real[3]  # delta 3 after the refused 2: a gap, which the next base covers

    producer_config = {"bootstrap.servers": kafka.bootstrap_servers, "linger.ms": 5, "enable.idempotence": True}
    producer_config["message.max.bytes"] = MAX_MESSAGE_BYTES

    seen: list[tuple[int, int, float]] = []
    stop = threading.Event()
    with ScoringServer(out, KafkaDeltas(kafka.bootstrap_servers, topic_name), base_wait_seconds=600) as server:
        assert server.wait_ready(60)
        want = {state: ranks_scores(root, state, EVENTS) for state in range(4)}
        payloads, _ = held_out(EVENTS)
        events = [base64.b64encode(p).decode() for p in payloads]

        def watch() -> None:  # every score sees a whole state: the base's, or one after a whole delta
            while not stop.is_set():
                outcome = server.score(events)
                got = np.array([r["probabilities"] for r in outcome.results], dtype=np.float32)
                state = 3 if outcome.base_version == 2 else outcome.delta_sequence + 1
                seen.append((outcome.base_version, outcome.delta_sequence, float(np.abs(got - want[state]).max())))

        watcher = threading.Thread(target=watch, daemon=True)  # a failed check must not leave it running
        watcher.start()
        started = time.monotonic()
        producer = Producer(producer_config)
        for message in messages:
            while True:
                try:
                    producer.produce(topic_name, message, key=b"clicks")
                    break
                except BufferError:  # the local queue is full (a long run): let it drain
                    producer.poll(0.1)
            producer.poll(0)
        assert producer.flush(60) == 0
        wait_for(lambda: refused(server.port) >= bad, 120 + MUTATIONS / 100, f"{bad} refused chunks and deltas")
        wait_for(lambda: "waiting for a base" in readyz(server.port)[1].get("reason", ""), 60, "the gap noticed")
        followed = time.monotonic() - started
        samples = scrape(server.port)
        counted = {k: v for k, v in samples.items() if k.startswith("streamtrain_serve_bad_deltas_total")}
        assert sum(counted.values()) == bad, counted
        assert samples["streamtrain_serve_delta_sequence"] == 1  # delta 2 refused whole, 3 waits for a base
        assert samples["streamtrain_serve_deltas_applied_total"] == 2
        assert readyz(server.port)[0] == 503
        set_delivery(snapshots[3], chain=1, next_sequence=3)  # the worker's next base: past the gap
        export_snapshot(snapshots[3], None, out, version=2)
        wait_for(lambda: scrape(server.port).get("streamtrain_serve_delta_sequence") == 3, 120, "delta 3 applied")
        stop.set()
        watcher.join(timeout=60)
        assert distance(server.port, root, 3) <= 1e-6
        assert len(server.follower.assembler) <= server.follower.assembler.max_pending
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/healthz", timeout=5) as reply:
            assert json.loads(reply.read()) == {"ok": True}
    assert seen and max(d for _b, _s, d in seen) <= 1e-6, [s for s in seen if s[2] > 1e-6][:5]
    print(
        f"\nmutated delta chunks: {len(messages)} messages ({bad} refused: {dict(sorted(counted.items()))}) "
        f"followed in {followed:.1f}s; {len(seen)} scores during it, each of a whole state"
    )


def refused(port: int) -> float:
    return sum(v for k, v in scrape(port).items() if k.startswith("streamtrain_serve_bad_deltas_total"))


def readyz(port: int) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_the_follower_resumes_after_the_broker_is_down_for_30s_during_a_base_switch(states, tmp_path, topic_name):
    root, snapshots, flat = states
    out = base_of(states, tmp_path)
    with KafkaBroker() as broker:
        create_delta_topic(broker, topic_name)
        publish(broker, topic_name, cut(flat, 0, 1, 0))
        with ScoringServer(out, KafkaDeltas(broker.bootstrap_servers, topic_name), base_wait_seconds=600) as server:
            assert server.wait_ready(60)
            publish(broker, topic_name, cut(flat, 2, 3, 2))  # delta 1 is lost: a gap, waiting for a base
            wait_for(lambda: server.follower.behind is not None, 60, "the gap noticed")
            broker.kill()
            killed = time.monotonic()
            set_delivery(snapshots[2], chain=1, next_sequence=2)
            export_snapshot(snapshots[2], None, out, version=2)  # the switch: its replay needs the broker
            wait_for(lambda: scrape(server.port).get("streamtrain_serve_base_version") == 2, 60, "base 2 loaded")
            wait_for(
                lambda: scrape(server.port).get("streamtrain_serve_source_retries_total", 0) >= 2,
                60,
                "the replay retried while the broker is down",
            )
            time.sleep(max(0.0, OUTAGE_SECONDS - (time.monotonic() - killed)))
            assert server.follower.behind is not None and "rewinding the delta source" in server.follower.behind
            broker.restart()
            wait_for(lambda: scrape(server.port).get("streamtrain_serve_delta_sequence") == 2, 120, "delta 2 applied")
            wait_for(lambda: server.follower.behind is None, 30, "/readyz current again")
            assert distance(server.port, root, 3) <= 1e-6
            assert all(thread.is_alive() for thread in server._threads)


def request(port: int, body: bytes, token: str | None = None) -> tuple[int, dict, dict]:
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    call = urllib.request.Request(f"http://127.0.0.1:{port}/score", body, headers)
    try:
        with urllib.request.urlopen(call, timeout=60) as reply:
            return reply.status, dict(reply.headers), json.loads(reply.read())
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), json.loads(error.read())


def test_score_limit_and_token_refuse_what_a_server_facing_strangers_must(states, tmp_path):
    out = base_of(states, tmp_path)
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    payloads, _ = held_out(EVENTS)
    events = [base64.b64encode(p).decode() for p in payloads]
    limits = ServeLimits(max_request_bytes=64 * 1024, max_events=100, max_in_flight=2, token_file=token_file)
    with ScoringServer(out, limits=limits) as server:
        assert server.wait_ready(30)
        port = server.port
        body = json.dumps({"events": events}).encode()
        assert request(port, body)[0] == 401  # token: none
        assert request(port, body, "wrong")[0] == 401
        status, _headers, reply = request(port, body, "s3cret")
        assert status == 200 and len(reply["results"]) == EVENTS
        status, _headers, reply = request(port, json.dumps({"events": events * 3}).encode(), "s3cret")
        assert status == 413 and "at most 100" in reply["error"]
        status, _headers, reply = request(port, json.dumps({"events": ["x" * 70_000]}).encode(), "s3cret")
        assert status == 413 and "over 65536 bytes" in reply["error"]
        assert readyz(port)[0] == 200  # probes need no token

        # A flood while two requests hold both slots (waiting for a delta being written): the rest get 503.
        with ThreadPoolExecutor(32) as pool:
            with server.follower.lock.write():
                flood = [pool.submit(request, port, body, "s3cret") for _ in range(32)]
                wait_for(lambda: sum(f.done() for f in flood) >= 30, 60, "all but the two in flight answered")
                early = [f.result() for f in flood if f.done()]
            answers = [f.result() for f in flood]
        assert len(early) == 30 and all(s == 503 and h["Retry-After"] == "1" for s, h, _r in early)
        assert sorted(s for s, _h, _r in answers) == [200] * 2 + [503] * 30
        assert readyz(port)[0] == 200
        samples = scrape(port)
        outcomes = {"unauthorized": 2, "too_large": 1, "too_many_events": 1, "busy": 30, "ok": 3}
        assert {o: samples[f'streamtrain_serve_score_requests_total{{outcome="{o}"}}'] for o in outcomes} == outcomes


def test_score_limit_deltas_keep_applying_while_large_requests_are_scored(kafka, topic_name, states, tmp_path):
    root, _snapshots, flat = states
    out = base_of(states, tmp_path)
    create_delta_topic(kafka, topic_name)
    payloads, _ = held_out(EVENTS)
    large = json.dumps({"events": [base64.b64encode(p).decode() for p in payloads] * 200}).encode()  # 10k events
    applied: list[float] = []
    with ScoringServer(
        out,
        KafkaDeltas(kafka.bootstrap_servers, topic_name),
        on_delta_applied=lambda _delta, _at: applied.append(time.monotonic()),
        limits=ServeLimits(max_in_flight=4),
    ) as server:
        assert server.wait_ready(60)
        stop = threading.Event()
        latencies: list[float] = []

        def load() -> None:
            while not stop.is_set():
                started = time.monotonic()
                status, _h, reply = request(server.port, large)
                assert status == 200 and len(reply["results"]) == 10_000
                latencies.append(time.monotonic() - started)

        clients = [threading.Thread(target=load, daemon=True) for _ in range(3)]
        for client in clients:
            client.start()
        wait_for(lambda: len(latencies) >= 3, 120, "scoring under way")
        for sequence, (before, after) in enumerate([(0, 1), (1, 2), (2, 3)]):
            publish(kafka, topic_name, cut(flat, before, after, sequence))
            wait_for(lambda s=sequence: len(applied) > s, 60, f"delta {sequence} applied under load")
        scored_during = len(latencies)
        stop.set()
        for client in clients:
            client.join(timeout=120)
        samples = scrape(server.port)
        assert samples["streamtrain_serve_deltas_applied_total"] == 3 and scored_during >= 3
        assert distance(server.port, root, 3) <= 1e-6
        apply_seconds = samples["streamtrain_serve_delta_apply_seconds_sum"] / 3
    print(
        f"\napply latency under scoring load: {apply_seconds * 1000:.1f} ms a delta on average (3 deltas; "
        f"3 clients sending 10,000-event requests); a 10,000-event request took "
        f"{np.median(latencies) * 1000:.0f} ms (median of {len(latencies)})"
    )


def test_delivery_spec_a_third_party_reads_a_base_and_a_delta_with_the_spec_alone(states, tmp_path):
    """What docs/delivery-format.md says, and nothing of streamtrain's serving code: current.json,
    the manifest, model.pt2 after fbgemm_gpu, the spec's id mapping and chunk layout."""
    import fbgemm_gpu  # noqa: F401  (the spec: before model.pt2)

    root, _snapshots, flat = states
    out = base_of(states, tmp_path)
    current = json.loads((out / "current.json").read_text())
    base = out / current["path"]
    manifest = json.loads((base / "manifest.json").read_text())
    assert manifest["format"] == 1 and manifest["delta_sequence"] == 0
    module = torch.export.load(base / "model.pt2").module()
    parameters = dict(module.named_parameters())
    with torch.no_grad():
        for chunk in encode(cut(flat, 0, 1, 0), MAX_MESSAGE_BYTES):
            header, body = read_chunk(chunk)
            if header["kind"] == "rows":
                weight = parameters[manifest["parameters"]["tables"][header["section"]]]
                columns = slice(header["column"], header["column"] + header["width"])
                weight[torch.tensor(body["ids"]), columns] = torch.tensor(body["values"])
            else:
                weight = parameters[manifest["parameters"]["dense"][header["section"]]].view(-1)
                weight[header["offset"] : header["offset"] + header["count"]] = torch.tensor(body["values"])
    _payloads, records = held_out(EVENTS)
    (dense,) = manifest["dense"]
    assert dense["transform"] == "log1p"
    features = torch.tensor([[np.log1p(np.float64(r[dense["field"]]))] for r in records], dtype=torch.float32)
    values, lengths = [], []
    for table in manifest["tables"]:
        for record in records:
            raw = record[table["field"]]
            ids = [] if raw is None else raw if isinstance(raw, list) else [raw]
            values += [row_of(v, table["id_mapping"], table["num_embeddings"]) for v in ids]
            lengths.append(len(ids))
    with torch.no_grad():
        got = module(features, torch.tensor(values, dtype=torch.int64), torch.tensor(lengths, dtype=torch.int32))
    assert float(np.abs(got.numpy() - ranks_scores(root, 1, EVENTS)).max()) <= 1e-6


class Polls:
    """A delta source that returns the lists it is given, one a poll, once ``released``: which
    chunks share a poll is the test's to choose (a Kafka poll takes whatever has arrived, up to 500)."""

    def __init__(self, *polls: list[bytes]):
        self.polls = list(polls)
        self.released = threading.Event()
        self.released.set()

    def rewind(self, since_ms: int) -> None:
        pass

    def poll(self, timeout: float) -> list[bytes]:
        if self.released.wait(timeout) and self.polls:
            return self.polls.pop(0)
        time.sleep(timeout)
        return []

    def caught_up(self) -> bool:
        return not self.polls

    def close(self) -> None:
        pass


@pytest.mark.parametrize("reason", ["body_size", "header_json", "current", "header_field"])
def test_mutated_chunks_nobody_foresaw_cost_their_own_delta_never_the_polls_others(states, tmp_path, reason):
    """Each case shares one poll with delta 0, before it: the case is refused and counted, delta 0 applied."""
    root, _snapshots, flat = states
    good = encode(cut(flat, 0, 1, 0), MAX_MESSAGE_BYTES)
    header, _body = split(next(c for c in good if split(c)[0]["kind"] == "rows"))
    chunks = {
        # numpy cannot lay out 0 rows of 2**62 columns
        "body_size": lambda: [join({**header, "sequence": 5, "count": 0, "width": 2**62}, b"")],
        # deeper than the JSON parser's recursion
        "header_json": lambda: [join(b"[" * 50_000 + b"]" * 50_000, b"")],
        # a gap, which looks for a base in current.json, broken below
        "current": lambda: encode(cut(flat, 2, 3, 2), MAX_MESSAGE_BYTES),
        # delta 0 with a high water past int64: once served, every /metrics scrape failed on it
        "header_field": lambda: encode(
            Delta(DeltaId("clicks", 1, 0, 1, 10**400, 0), dense=cut(flat, 0, 1, 0).dense[:1]), 2**20
        ),
    }[reason]()
    out = base_of(states, tmp_path)
    polls = Polls(chunks + good)
    polls.released.clear()
    with ScoringServer(out, polls, base_wait_seconds=600) as server:
        if reason == "current":
            (out / "current.json").write_text("{not json")
        polls.released.set()
        assert server.wait_ready(60)
        wait_for(lambda: server.follower.next_sequence == 1, 30, "delta 0 applied")
        assert distance(server.port, root, 1) <= 1e-6
        samples = scrape(server.port)  # /metrics answers
        assert samples.get(f'streamtrain_serve_bad_deltas_total{{reason="{reason}"}}', 0) >= 1, samples


def test_a_delta_that_fails_while_written_is_put_back_and_the_rest_of_its_poll_is_read(states, tmp_path, monkeypatch):
    root, _snapshots, flat = states
    calls = []

    def fails_once(self, pieces):  # after the weights are written, before the delta is served
        calls.append(len(pieces))
        if len(calls) == 1:
            raise MemoryError("while writing the id maps")

    monkeypatch.setattr(ServableModel, "_apply_ids", fails_once)
    out = base_of(states, tmp_path)
    polls = Polls(encode(cut(flat, 0, 1, 0), MAX_MESSAGE_BYTES) + encode(cut(flat, 1, 2, 1), MAX_MESSAGE_BYTES))
    with ScoringServer(out, polls, base_wait_seconds=600) as server:
        assert server.wait_ready(60)
        wait_for(lambda: "waiting for a base" in (server.follower.behind or ""), 30, "delta 1 read after delta 0")
        assert distance(server.port, root, 0) <= 1e-6  # delta 0's rows and dense values were put back
        assert scrape(server.port)['streamtrain_serve_bad_deltas_total{reason="error"}'] == 1


def test_score_limit_new_schema_ids_are_looked_up_beside_the_decoding_and_bounded(
    states,
    tmp_path,
    http_registry,  # noqa: F811 (the fixture)
):
    """A client names the Confluent schema ids: one the registry is slow to answer must not hold up
    the others, and made-up ids must cost a bounded number of lookups and bounded memory."""
    from streamtrain.delivery.serve.scorer import MAX_LOOKUPS_PER_REQUEST

    root, _snapshots, _flat = states
    out = base_of(states, tmp_path)
    manifest = json.loads((out / "base-000001" / "manifest.json").read_text())
    registry = {"url": http_registry, "timeout_seconds": 5, "client_config": {"max.retries": 0}}
    manifest["config"]["features"] |= {"wire_format": "confluent", "schema_registry": registry}
    (out / "base-000001" / "manifest.json").write_text(json.dumps(manifest))
    reader = json.dumps(manifest["reader_schema"])
    StandInRegistry.schemas, StandInRegistry.delays = {7: reader, 8: reader}, {8: 3.0}
    payloads, _ = held_out(EVENTS)

    def body(*ids: int) -> bytes:
        framed = [b"\x00" + i.to_bytes(4, "big") + p for i, p in zip(itertools.cycle(ids), payloads, strict=False)]
        return json.dumps({"events": [base64.b64encode(f).decode() for f in framed]}).encode()

    with ScoringServer(out, limits=ServeLimits(max_in_flight=4)) as server, ThreadPoolExecutor(1) as pool:
        slow = pool.submit(request, server.port, body(8))
        wait_for(lambda: StandInRegistry.requests >= 1, 30, "id 8 asked for")
        status, _h, reply = request(server.port, body(7))
        assert status == 200 and not slow.done(), "a score waited for another request's registry lookup"
        got = np.array([r["probabilities"] for r in reply["results"]], dtype=np.float32)
        assert np.abs(got - ranks_scores(root, 0, EVENTS)).max() <= 1e-6
        assert slow.result()[0] == 200
        asked = StandInRegistry.requests
        for first in range(1000, 1000 + 3 * EVENTS, EVENTS):  # made-up ids, every event its own
            status, _h, reply = request(server.port, body(*range(first, first + EVENTS)))
            assert status == 200 and all("error" in r for r in reply["results"])
        assert StandInRegistry.requests - asked <= 3 * MAX_LOOKUPS_PER_REQUEST
        scorer = server.follower.served.scorer
        assert set(scorer.avro.entries) <= {7, 8}, "the decoder met only ids it knows"
        StandInRegistry.failures = 10**6  # an outage: one lookup waits out the registry's timeout, not one an id
        status, _h, reply = request(server.port, body(2000, 2001, 2002))
        errors = [r["error"] for r in reply["results"][:3]]
        assert status == 200 and "did not answer" in errors[0] and all("not looked up" in e for e in errors[1:])


def raw_request(port: int, head: bytes, body: bytes = b"", wait: float = 30) -> bytes:
    """What the server answers to bytes sent as they are (a header urllib would not send)."""
    with socket.create_connection(("127.0.0.1", port), timeout=wait) as connection:
        connection.sendall(head + body)
        return connection.recv(65536)


def test_score_limit_a_slow_body_gives_its_slot_back(states, tmp_path):
    out = base_of(states, tmp_path)
    payloads, _ = held_out(2)
    body = json.dumps({"events": [base64.b64encode(p).decode() for p in payloads]}).encode()
    with ScoringServer(out, limits=ServeLimits(max_in_flight=1, body_timeout_seconds=1.0)) as server:
        port = server.port
        with socket.create_connection(("127.0.0.1", port), timeout=15) as slow:
            slow.sendall(
                b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 9999\r\n\r\n{"
            )
            wait_for(lambda: server._in_flight == 1, 30, "the slow request in its slot")
            assert request(port, body)[0] == 503
            assert slow.recv(4096).startswith(b"HTTP/1.1 408"), "the slow body was given up"
        assert request(port, body)[0] == 200
        samples = scrape(port)
        assert samples['streamtrain_serve_score_requests_total{outcome="slow_body"}'] == 1


def test_score_limit_bytes_a_header_or_a_body_the_parsers_choke_on_get_a_counted_answer(states, tmp_path):
    out = base_of(states, tmp_path)
    (tmp_path / "token").write_text("s3cret")
    _payloads, records = held_out(1)
    event = {k: v for k, v in records[0].items() if k not in ("clk", "buy", "event_time")}
    with ScoringServer(out, limits=ServeLimits(token_file=tmp_path / "token")) as server:
        port = server.port
        answer = raw_request(
            port,
            b"POST /score HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe\r\n",
            b"Content-Length: 2\r\n\r\n{}",
        )
        assert answer.startswith(b"HTTP/1.1 401"), answer[:200]
        nested: object = 1
        for _ in range(200):
            nested = {"a": nested}
        events = [{**event, "user_id": 2**70}, {**event, "user_id": nested}, event]
        status, _h, reply = request(port, json.dumps({"events": events}).encode(), "s3cret")
        assert status == 200 and "probabilities" in reply["results"][2], reply
        assert all("error" in r for r in reply["results"][:2]), reply["results"][:2]
        deep = b'{"events": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
        assert request(port, deep, "s3cret")[0] == 400
        samples = scrape(port)
        outcomes = {
            k.split('"')[1]: v for k, v in samples.items() if k.startswith("streamtrain_serve_score_requests_total")
        }
        assert outcomes == {"unauthorized": 1, "ok": 1, "bad_request": 1}, outcomes
        assert samples["streamtrain_serve_rejected_events_total"] == 2
