"""Decoding on several threads per rank (batching.decode_threads): the same batches as on one, with
the same rejections, spans and order; and a worker on the real broker that trains, dead-letters and
commits exactly what a one-thread worker does."""

from __future__ import annotations

import itertools
import re
import threading
from collections import Counter

import pytest
import torch

from conftest import committed_offsets
from streamtrain.config import load_config
from streamtrain.deadletter import HEADER_OFFSET, HEADER_PARTITION, HEADER_REASON
from streamtrain.decode import MIN_SLICE_EVENTS, AvroBatchDecoder
from streamtrain.dev.kafka import create_topic
from streamtrain.dev.produce import ClickStream
from streamtrain.device import decode_threads
from streamtrain.source import EventBatch, RawEvent
from streamtrain.threads import DECODE
from test_deadletter import BAD_PAYLOADS, DLQ_CONFIG, Sent, dlq_env, read_all, send, valid_messages
from test_decoder_fuzz import decoders, fuzz_payloads

PARTITIONS = 3


def assert_same(got, expected) -> None:
    """Two DecodeResults hold the same batch, the same spans and the same rejections, in order."""
    a, b = got.batch, expected.batch
    for name in ("dense_features", "labels", "event_time_ms", "loss_scale"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    ka, kb = a.sparse_features, b.sparse_features
    assert ka.keys() == kb.keys()
    assert torch.equal(ka.values(), kb.values()) and torch.equal(ka.lengths(), kb.lengths())
    assert ka.length_per_key() == kb.length_per_key() and ka.offset_per_key() == kb.offset_per_key()
    # and per key, as the trainer splits them (torchrec cannot split a KJT of no events)
    for key, jagged in (ka.to_dict() if a.size else {}).items():
        assert torch.equal(jagged.values(), kb[key].values())
    assert a.spans == b.spans and a.global_batch_size == b.global_batch_size
    assert [(e.partition, e.offset, reason) for e, reason in got.rejected] == [
        (e.partition, e.offset, reason) for e, reason in expected.rejected
    ]


def events_of(payloads: list[bytes]) -> EventBatch:
    """Payloads spread over partitions, offsets rising in each, as a fetch delivers them."""
    return EventBatch.of_events([RawEvent(i % PARTITIONS, 1000 + i, p, 0) for i, p in enumerate(payloads)])


def test_several_threads_decode_varied_and_malformed_batches_exactly_as_one(tmp_path):
    """The fuzz's mutated payloads (every rejection reason, a writer schema fastavro decodes, unknown
    ids), cut into batches of sizes that split unevenly, or not at all, over the threads."""
    sizes = [3 * MIN_SLICE_EVENTS + 7, 5_000, MIN_SLICE_EVENTS - 1, 2 * MIN_SLICE_EVENTS, 1]
    click_payloads, rich_payloads = fuzz_payloads(2 * sum(sizes), seed=37)
    for (one, _oracle), payloads in zip(decoders(tmp_path), (click_payloads, rich_payloads), strict=True):
        several = AvroBatchDecoder(one.features, one.fallback.schema_source, threads=3)
        seen = Counter()
        first = 0
        for size in sizes:
            events = events_of(payloads[first : first + size])
            assert len(events) == size
            first += size
            assert len(several.slices.cut(len(events))) == min(3, max(1, len(events) // MIN_SLICE_EVENTS))
            expected = one.decode(events)
            assert_same(several.decode(events), expected)
            seen.update(reason.split(":")[0] for _e, reason in expected.rejected)
        assert len(seen) >= 8, seen  # the batches did hold many kinds of bad payload
    helpers = [t for t in threading.enumerate() if t.name.startswith(DECODE)]
    assert len(helpers) >= 2, "the slices were not decoded on helper threads"


def test_a_batch_of_only_rejected_or_no_events_decodes_on_several_threads():
    config = load_config(DLQ_CONFIG, environ={})
    decoder = AvroBatchDecoder(config.features, threads=2)
    for payloads in ([b"\x07"] * (2 * MIN_SLICE_EVENTS), []):
        result = decoder.decode(events_of(payloads))
        assert result.batch.size == 0 and len(result.rejected) == len(payloads)
        assert result.batch.sparse_features.values().numel() == 0
        assert sum(span.events for span in result.batch.spans.values()) == 0


def test_decode_threads_default_to_one_on_the_cpu_and_the_spare_cores_with_cuda(monkeypatch):
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.setattr("os.sched_getaffinity", lambda _pid: set(range(16)))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert decode_threads(None, cpu) == 1
    assert decode_threads(None, cuda) == 14  # 16 cores, less the trainer and librdkafka's
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert decode_threads(None, cuda) == 2  # 4 cores per rank, less the trainer and librdkafka's
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "16")
    assert decode_threads(None, cuda) == 1
    assert decode_threads(3, cpu) == 3 and decode_threads(5, cuda) == 5


def test_decode_threads_is_configured_from_the_environment_and_a_bad_value_names_the_field():
    assert load_config(DLQ_CONFIG, environ={}).batching.decode_threads is None
    env = {"STREAMTRAIN_BATCHING__DECODE_THREADS": "4"}
    assert load_config(DLQ_CONFIG, environ=env).batching.decode_threads == 4
    assert load_config(DLQ_CONFIG, environ={"STREAMTRAIN_BATCHING__DECODE_THREADS": ""}).batching.decode_threads is None
    with pytest.raises(Exception, match=r"batching\.decode_threads"):
        load_config(DLQ_CONFIG, environ={"STREAMTRAIN_BATCHING__DECODE_THREADS": "0"})


@pytest.mark.integration
def test_a_worker_decoding_on_several_threads_trains_dead_letters_and_commits_as_one_thread_does(
    kafka, topic_name, start_worker
):
    """Batches of 4 slices, bad payloads of every kind among valid ones: the same events trained,
    the same dead letters (with their reasons) and the same committed offsets."""
    partitions = 2
    bad = [
        Sent(None, case.build(ClickStream(seed=100 + n).chunk(1).records[0]), 0, [], case.reason)
        for n, case in enumerate(BAD_PAYLOADS * 3)
    ]
    valid = iter(valid_messages(9_000, seed=21))
    messages = [m for b in bad for m in (b, *itertools.islice(valid, 150))] + list(valid)
    placed = send(kafka, topic_name, partitions, messages)
    ends = {p: 1 + max(o for (q, o) in placed if q == p) for p in range(partitions)}

    runs = {}
    for threads in (1, 3):
        group, dlq = f"group-{threads}-{topic_name}", f"{topic_name}.dlq{threads}"
        create_topic(kafka.bootstrap_servers, dlq, 1)
        env = {
            **dlq_env(dlq),
            "STREAMTRAIN_KAFKA__GROUP_ID": group,
            "STREAMTRAIN_BATCHING__BATCH_SIZE": str(4 * MIN_SLICE_EVENTS),
            "STREAMTRAIN_BATCHING__DECODE_THREADS": str(threads),
        }
        worker = start_worker(topic_name, "--until-end", config=DLQ_CONFIG, env=env)
        assert worker.wait(timeout=240) == 0, worker.output()[-3000:]
        assert f"decoding on {threads} thread" in worker.output()
        trained = re.search(r"([\d,]+) events trained", worker.output())
        assert trained is not None, worker.output()[-3000:]
        letters = [dict(m.headers()) for m in read_all(kafka, dlq, 1)]
        runs[threads] = (
            int(trained.group(1).replace(",", "")),
            committed_offsets(kafka, topic_name, group, partitions),
            sorted((h[HEADER_PARTITION], int(h[HEADER_OFFSET]), h[HEADER_REASON]) for h in letters),
        )
    assert runs[1][0] == len(messages) - len(bad) and runs[1][1] == ends
    assert Counter(reason.decode() for _p, _o, reason in runs[1][2]) == Counter(b.reason for b in bad)
    assert runs[3] == runs[1]
