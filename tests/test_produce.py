"""The synthetic stream: deterministic under a seed, Zipf-like ids, a planted signal with a known Bayes AUC."""

from pathlib import Path

import numpy as np

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
