"""The synthetic stream: deterministic under a seed, Zipf-like ids, a planted signal with a known Bayes AUC;
and the drifting stream, whose users and ads are born and retire."""

import io
import re
import subprocess
import sys
import time
from pathlib import Path

import fastavro
import numpy as np
import pytest

from conftest import REPO
from streamtrain.dev.produce import AvroEncoder, ClickStream, encoded_events

SCHEMA = Path(__file__).resolve().parent.parent / "schemas" / "click_event.avsc"


def payloads(seed: int, count: int, start_time_ms: int = 1_700_000_000_000) -> list[tuple]:
    return list(encoded_events(ClickStream(seed, start_time_ms), AvroEncoder(SCHEMA), count))


def test_same_seed_same_bytes_whatever_the_count():
    first = payloads(seed=5, count=5000)
    assert first == payloads(seed=5, count=5000)
    assert first[:100] == payloads(seed=5, count=100)
    assert [e[1] for e in first[:50]] != [e[1] for e in payloads(seed=6, count=50)]


def test_rate_paces_event_times():
    stream = ClickStream(1, start_time_ms=1_000_000, events_per_second=1000)
    records = stream.chunk(3000).records
    assert records[0]["event_time"] == 1_000_000
    assert records[-1]["event_time"] == 1_000_000 + 2999


def test_ids_are_zipf_like_not_uniform():
    stream = ClickStream(2, 0)
    ids = np.concatenate([np.array([r["user_id"] for r in stream.chunk(4096).records]) for _ in range(10)])
    _, counts = np.unique(ids, return_counts=True)
    top = np.sort(counts)[::-1]
    # Under uniform draws over 1.1M users, 40k events almost never repeat a user.
    assert top[0] > 100
    assert top[:100].sum() > 0.1 * ids.size


def test_planted_signal_has_a_high_bayes_auc():
    from streamtrain.metrics import roc_auc

    events = payloads(seed=0, count=20_000)
    p = np.array([e[2] for e in events])
    clicks = np.array([e[3] for e in events])
    assert 0.1 < clicks.mean() < 0.5
    assert roc_auc(p, clicks) >= 0.75


def test_buy_follows_a_click_with_its_own_signal_and_each_label_knows_its_bayes_auc():
    from streamtrain.dev.produce import bayes_aucs, labelled_events

    truths = [t for _k, _v, t in labelled_events(ClickStream(0, 0), AvroEncoder(SCHEMA), 20_000)]
    p_click, p_buy, clk, buy = np.array([(t.p_click, t.p_buy, t.clk, t.buy) for t in truths]).T
    assert set(buy[clk == 0]) == {0.0}, "no purchase without a click"
    assert 0.05 < buy[clk == 1].mean() < 0.25
    aucs = bayes_aucs(p_click, p_buy, clk, buy)
    assert aucs["clk"] >= 0.75 and aucs["buy"] > aucs["clk"] and aucs["buy_given_clk"] >= 0.7
    # its own signal: over clicks, P(buy | click) ranks purchases far better than P(click) does
    from streamtrain.metrics import roc_auc

    assert roc_auc(p_buy[clk == 1], buy[clk == 1]) > roc_auc(p_click[clk == 1], buy[clk == 1]) + 0.1


def _drifting(seed: int, count: int, **drift) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(user ids, ad ids, true click probabilities, clicks) of the first ``count`` drifting events."""
    from streamtrain.dev.drift import Drift, DriftingClickStream

    stream = DriftingClickStream(seed, 0, drift=Drift(**drift))
    chunks = [stream.chunk(4096) for _ in range(-(-count // 4096))]
    records = [r for c in chunks for r in c.records][:count]
    users = np.array([r["user_id"] for r in records])
    ads = np.array([r["adgroup_id"] for r in records])
    p = np.concatenate([c.click_probability for c in chunks])[:count]
    return users, ads, p, np.array([r["clk"] for r in records])


def test_drifting_ids_are_born_and_retire_at_steady_rates():
    users_live, lifetime, count = 500, 5_000, 40_000
    users, ads, _p, _clk = _drifting(1, count, users=users_live, ads=300, lifetime=lifetime)
    # Retired for good: a lifetime after them, no id of the first 1,000 events is drawn again (events
    # from 6,000 on draw only users born after the last of those was).
    early = set(users[:1000])
    assert not early & set(users[lifetime + 1000 :]) and not set(ads[:1000]) & set(ads[lifetime + 1000 :])
    # Never more live at once than the population: 1,000 events span 100 births.
    assert all(len(set(users[i : i + 1000])) <= users_live + 100 for i in range(0, count, 1000))
    # Born at a steady rate: once the first population has been seen, every 5,000 events bring about
    # the 500 users born in them (less the few too unpopular to be drawn yet), none far from the mean.
    first_seen = np.unique(users, return_index=True)[1]
    new_per_window = np.bincount(first_seen[first_seen >= 2 * lifetime] // lifetime)[2:]
    assert new_per_window.size == count // lifetime - 2
    assert (np.abs(new_per_window - new_per_window.mean()) < 0.2 * new_per_window.mean()).all()
    assert 0.7 * users_live < new_per_window.mean() <= 1.1 * users_live
    # The id space is open-ended: over the run, distinct ids far exceed what lives at once.
    assert len(set(users)) > 6 * users_live and len(set(ads)) > 6 * 300


def test_drifting_ids_are_distinct_non_negative_64_bit_and_deterministic():
    from streamtrain.dev.drift import scattered

    ordinals = np.arange(200_000)
    ids = scattered(ordinals, 0)
    assert np.unique(ids).size == ordinals.size and (ids >= 0).all() and ids.max() > 2**60
    first = _drifting(3, 5_000, users=200, ads=100, lifetime=2_000)
    again = _drifting(3, 5_000, users=200, ads=100, lifetime=2_000)
    assert all((a == b).all() for a, b in zip(first, again, strict=True))


def test_each_drifting_id_has_an_effect_of_its_own_that_collisions_blur():
    from streamtrain.metrics import roc_auc

    drift = {"users": 1_000, "ads": 1_000, "lifetime": 20_000}
    users, _ads, p, clk = _drifting(2, 40_000, **drift)
    _u, _a, p_without, clk_without = _drifting(2, 40_000, **drift, id_effect=0.0)
    bayes, bayes_without = roc_auc(p, clk), roc_auc(p_without, clk_without)
    assert bayes > bayes_without + 0.03, (bayes, bayes_without)
    # The click logit over its ids: an id's events share its effect, so the logit varies less within
    # an id than across all events by about the effects' variance (0.8^2 per kind).
    logit = np.log(p / (1 - p))
    within = np.mean([logit[users == u].var() for u in np.unique(users[:2000])[:200] if (users == u).sum() > 5])
    assert logit.var() - within > 0.5


def test_a_one_off_tail_puts_that_share_of_events_on_ids_seen_once_and_changes_nothing_else():
    share, count, drift = 1 / 3, 24_000, {"users": 300, "ads": 300, "lifetime": 1_700}
    users, ads, p, clk = _drifting(5, count, **drift)
    tailed_users, tailed_ads, tailed_p, tailed_clk = _drifting(5, count, **drift, one_off=share)
    for plain, tailed in ((users, tailed_users), (ads, tailed_ads)):
        replaced = plain != tailed
        # binomial: 3 standard deviations of the share over 24,000 events is 0.009
        assert abs(replaced.mean() - share) < 0.01, replaced.mean()
        # each replacement is an id seen in that event alone, and never a live id
        seen = dict(zip(*np.unique(tailed, return_counts=True), strict=True))
        assert all(seen[i] == 1 for i in tailed[replaced]) and not set(tailed[replaced]) & set(plain)
        assert (tailed >= 0).all()
    untouched = (users == tailed_users) & (ads == tailed_ads)
    assert (p[untouched] == tailed_p[untouched]).all() and (clk[untouched] == tailed_clk[untouched]).all()
    # a one-off has an effect of its own on the click, as any id
    assert not np.allclose(p[~untouched], tailed_p[~untouched])


def test_the_default_stream_is_unchanged_by_the_drift_mode():
    """The bytes and truths of a seed, as they were before drift existed (a digest of 20,000 events;
    978c928~1's code gives it). The truths count to 9 digits: numpy's exp takes other SIMD paths on
    other hosts and may differ in the last bit, which changed the full repr's digest (an AMD host
    without AVX-512 after Intel ones) and, on 2026-12-06, the 12-digit one (an Intel host with
    AVX-512). A last-bit difference (about 1e-16) crosses a 9th-digit rounding boundary (1e-9)
    with odds under 1% over the 40,000 truths."""
    import hashlib

    from streamtrain.dev.produce import labelled_events

    digest = hashlib.sha256()
    for key, value, truth in labelled_events(ClickStream(7, 1_700_000_000_000, 1000.0), AvroEncoder(SCHEMA), 20_000):
        digest.update(key + value + f"{truth.p_click:.9g} {truth.p_buy:.9g}".encode())
    assert digest.hexdigest() == "e4c5cb5787be929617df725c82e972d5217f25dc0f61bb7fe48cb9d6ba06d14f"


def _read_topic(bootstrap_servers: str, topic: str, count: int) -> list:
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer({"bootstrap.servers": bootstrap_servers, "group.id": "inspector", "enable.auto.commit": False})
    try:
        consumer.assign([TopicPartition(topic, p, 0) for p in range(4)])
        messages, deadline = [], time.monotonic() + 60
        while len(messages) < count and time.monotonic() < deadline:
            message = consumer.poll(0.5)
            if message is not None and message.error() is None:
                messages.append(message)
        return messages
    finally:
        consumer.close()


@pytest.mark.integration
def test_produce_drift_writes_the_drifting_stream_to_kafka_and_prints_its_bayes_auc(kafka, topic_name):
    from streamtrain.metrics import roc_auc
    from streamtrain.schema import load_schema

    drift = ["--drift-users", "300", "--drift-ads", "200", "--drift-lifetime", "1000"]
    result = subprocess.run(
        [sys.executable, "-m", "streamtrain", "produce", "--bootstrap-servers", kafka.bootstrap_servers,
         "--topic", topic_name, "--count", "6000", "--seed", "4", "--drift", *drift],
        cwd=REPO, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    users, ads, p, clk = _drifting(4, 6000, users=300, ads=200, lifetime=1000)
    printed = float(re.search(r"Bayes-optimal AUC of this stream ([\d.]+)", result.stderr)[1])
    assert printed == pytest.approx(roc_auc(p, clk), abs=1e-4) and printed > 0.8
    # 300 + 5,999 * 300 // 1,000 users, 200 + 5,999 * 200 // 1,000 ads
    assert (
        "drift: 300 users and 200 ads live at any moment, each for 1,000 events; "
        "2,099 users and 1,399 ads lived during these 6,000 events" in result.stderr
    )
    schema = fastavro.parse_schema(load_schema(SCHEMA))
    messages = _read_topic(kafka.bootstrap_servers, topic_name, 6000)
    records = [fastavro.schemaless_reader(io.BytesIO(m.value()), schema, None) for m in messages]
    assert len(records) == 6000
    assert sorted(r["user_id"] for r in records) == sorted(users.tolist())
    assert sorted(r["adgroup_id"] for r in records) == sorted(ads.tolist())
    assert all(m.key() == b"%d" % r["user_id"] for m, r in zip(messages, records, strict=True))


@pytest.mark.integration
def test_a_sender_behind_its_rate_stamps_events_with_the_time_it_sends_them(kafka, topic_name):
    """At a rate this machine cannot send, the event times restart from the send time whenever
    the sender is over a second behind; paced from the start alone, 200,000 events at 10 million
    a second would all be stamped within 20 ms of the first. 200,000, so that even a fast host
    sends for over 2 s (60,000 took 1.85 s on 2026-12-06's)."""
    from streamtrain.dev.produce import produce
    from streamtrain.schema import load_schema, without_logical_types

    said: list[str] = []
    before_ms = time.time() * 1000
    produce(kafka.bootstrap_servers, topic_name, 200_000, rate=10_000_000, schema_path=SCHEMA, progress=said.append)
    after_ms = time.time() * 1000
    schema = fastavro.parse_schema(without_logical_types(load_schema(SCHEMA)))  # event_time in ms
    times = [
        fastavro.schemaless_reader(io.BytesIO(m.value()), schema, None)["event_time"]
        for m in _read_topic(kafka.bootstrap_servers, topic_name, 200_000)
    ]
    assert after_ms - before_ms > 2_000  # the sender was behind: this test means something
    assert before_ms - 1_000 <= min(times) and max(times) <= after_ms
    # The times kept up with the sends: they span at least half the sending, where paced from the
    # start alone they would span 20 ms. Half, not all less a margin: on a loaded host the start
    # (imports, the producer's connection) and the final flush take seconds no event is stamped in.
    assert max(times) - min(times) >= (after_ms - before_ms) / 2
    assert any("event times follow the sends" in line for line in said)


def test_produce_refuses_drift_options_without_drift_and_names_the_fix():
    def produce(*args: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "streamtrain", "produce", "--bootstrap-servers", "127.0.0.1:1", *args]
        return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=60)

    alone = produce("--drift-users", "10")
    assert alone.returncode == 2 and "--drift-users: only the drifting stream takes these; add --drift" in alone.stderr
    empty = produce("--drift", "--drift-lifetime", "0")
    assert empty.returncode == 2 and "drift lifetime must be at least 1 (--drift-lifetime), got 0" in empty.stderr
