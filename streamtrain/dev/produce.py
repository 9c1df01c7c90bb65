"""A synthetic Taobao-like click stream with a planted signal, and a tool that writes it to Kafka.

Labels are drawn from fixed hidden logistic models, so a model that learns can beat AUC 0.5 by a
wide margin, and the stream knows its own Bayes-optimal AUC: the AUC of the true probabilities
against the drawn labels. A purchase (``buy``) only follows a click, with a logistic signal of its
own that shares the category with the click's and adds price sensitivity and the user's spending
levels, so its Bayes AUC is reported over all events and over clicks. Ids follow Zipf-like
frequencies, as real traffic does. An ad's category, campaign, advertiser, brand and price are
fixed per ad group, and a user's profile is fixed per user, so the stream is consistent the way a
click log is.
"""

from __future__ import annotations

import functools
import io
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import fastavro
import numpy as np

from streamtrain.metrics import roc_auc
from streamtrain.schema import load_schema

if TYPE_CHECKING:
    from streamtrain.dev.delays import Delays
    from streamtrain.dev.drift import Drift

CARDINALITY = {
    "user_id": 1_141_730,
    "adgroup_id": 846_812,
    "cate_id": 12_961,
    "campaign_id": 423_438,
    "customer": 255_877,
    "brand": 461_498,
}
PIDS = ("430548_1007", "430539_1007")
ZIPF_EXPONENT = 1.05
# A user's profile: each field's levels, [low, high).
PROFILE_LEVELS = {
    "cms_segid": (0, 98),
    "cms_group_id": (0, 13),
    "final_gender_code": (1, 3),
    "age_level": (0, 7),
    "pvalue_level": (0, 4),
    "shopping_level": (1, 4),
    "occupation": (0, 2),
    "new_user_class_level": (0, 5),
}
MAX_RECENT_CATES = 10
BRAND_MISSING_RATE = 0.25


@dataclass(frozen=True)
class ZipfIds:
    """Ids in [0, n) with P(rank k) proportional to 1/(k+1)^s, ranks shuffled over ids."""

    cdf: np.ndarray
    id_of_rank: np.ndarray

    @classmethod
    def shuffled(cls, rng: np.random.Generator, n: int) -> ZipfIds:
        cdf = np.cumsum(1.0 / np.arange(1, n + 1) ** ZIPF_EXPONENT)
        cdf /= cdf[-1]
        return cls(cdf, rng.permutation(n))

    def draw(self, rng: np.random.Generator, size: int) -> np.ndarray:
        n = self.id_of_rank.size
        return self.id_of_rank[np.minimum(np.searchsorted(self.cdf, rng.random(size)), n - 1)]


@dataclass
class EventChunk:
    records: list[dict]
    click_probability: np.ndarray
    keys: list[bytes]
    buy_probability: np.ndarray  # given a click


def bayes_aucs(p_click: np.ndarray, p_buy: np.ndarray, clk: np.ndarray, buy: np.ndarray) -> dict[str, float]:
    """The Bayes-optimal AUC of each label: the true probabilities against the drawn labels; buy's
    over all events (P(click) P(buy | click)) and over the clicks alone (P(buy | click))."""
    clicked = clk == 1
    return {
        "clk": roc_auc(p_click, clk),
        "buy": roc_auc(p_click * p_buy, buy),
        "buy_given_clk": roc_auc(p_buy[clicked], buy[clicked]),
    }


class ClickStream:
    """Deterministic given (seed, start_time_ms): the same events, in the same order."""

    def __init__(self, seed: int = 0, start_time_ms: int | None = None, events_per_second: float | None = None):
        self.rng = np.random.default_rng(seed)
        self.start_time_ms = int(time.time() * 1000) if start_time_ms is None else start_time_ms
        self.events_per_second = events_per_second
        self.emitted = 0
        rng = self.rng
        self.zipf = {name: ZipfIds.shuffled(rng, n) for name, n in CARDINALITY.items()}
        self.draw: dict[str, Callable[[int], np.ndarray]] = {
            name: functools.partial(ids.draw, rng) for name, ids in self.zipf.items()
        }
        n_ads, n_users = CARDINALITY["adgroup_id"], CARDINALITY["user_id"]
        # What an ad is: fixed attributes per ad group.
        self.ad_cate = self.draw["cate_id"](n_ads)
        self.ad_campaign = self.draw["campaign_id"](n_ads)
        self.ad_customer = self.draw["customer"](n_ads)
        self.ad_brand = np.where(rng.random(n_ads) < BRAND_MISSING_RATE, -1, self.draw["brand"](n_ads))
        self.ad_price = np.round(np.exp(rng.normal(4.0, 1.2, n_ads)), 2).astype(np.float32)
        # Who a user is: a fixed profile per user.
        self.user_profile = {
            name: rng.integers(low, high, n_users, dtype=np.int8) for name, (low, high) in PROFILE_LEVELS.items()
        }
        # The hidden model. Its effects sit on features a model can learn from a short stream.
        self.w_cate = rng.normal(0.0, 0.9, CARDINALITY["cate_id"])
        self.w_age = rng.normal(0.0, 0.5, 7)
        self.w_shopping = np.array([0.0, -0.4, 0.0, 0.5])
        self.w_pid = np.array([0.35, -0.35])
        self.w_gender = np.array([0.0, 0.25, -0.25])
        self.w_log_price = -0.35
        self.w_recent_match = 1.3
        self.bias = -1.6
        # The purchase model, from a generator of its own so that the click stream of a seed (ids,
        # clicks, bytes but for buy) stays what it was before purchases had a signal.
        buy_rng = np.random.default_rng([seed, 1])
        self.w_buy_cate = 0.6  # times the click's category effect: shared
        self.w_buy_log_price = -0.7
        self.w_buy_pvalue = buy_rng.normal(0.0, 0.6, 4)
        self.w_buy_shopping = np.array([0.0, -0.6, 0.2, 0.8])
        self.w_buy_age = buy_rng.normal(0.0, 0.4, 7)
        self.w_buy_cate_own = buy_rng.normal(0.0, 0.5, CARDINALITY["cate_id"])
        self.w_buy_bias = -2.8

    def _draw_ids(self, size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The next ``size`` events' users and ads: (user index, ad index) into the per-user and
        per-ad attributes, then (user id, ad id) as the events carry them."""
        users = self.draw["user_id"](size)
        ads = self.draw["adgroup_id"](size)
        return users, ads, users, ads

    def _ad_attributes(self, ads: np.ndarray) -> dict[str, np.ndarray]:
        return {
            "cate": self.ad_cate[ads],
            "price": self.ad_price[ads],
            "campaign": self.ad_campaign[ads],
            "customer": self.ad_customer[ads],
            "brand": self.ad_brand[ads],
        }

    def _profiles(self, users: np.ndarray) -> dict[str, np.ndarray]:
        return {name: values[users] for name, values in self.user_profile.items()}

    def _id_effects(self, users: np.ndarray, ads: np.ndarray) -> np.ndarray | float:
        """What the user and the ad themselves add to the click logit: nothing in this stream, whose
        signal sits on features a model learns from a short stream (the drifting one adds some)."""
        return 0.0

    def chunk(self, size: int) -> EventChunk:
        rng = self.rng
        users, ads, user_ids, ad_ids = self._draw_ids(size)
        pid_index = rng.integers(0, len(PIDS), size)
        ad = self._ad_attributes(ads)
        cate = ad["cate"]
        price = ad["price"]
        n_recent = rng.integers(0, MAX_RECENT_CATES + 1, size)
        recent_flat = self.draw["cate_id"](int(n_recent.sum()))
        # A third of the users with history have recently clicked this ad's category.
        planted = (rng.random(size) < 1 / 3) & (n_recent > 0)
        starts = np.concatenate([[0], np.cumsum(n_recent)[:-1]])
        recent_flat[starts[planted]] = cate[planted]
        recent_match = np.zeros(size, dtype=bool)
        np.logical_or.at(recent_match, np.repeat(np.arange(size), n_recent), recent_flat == np.repeat(cate, n_recent))
        profile = self._profiles(users)
        logit = (
            self.bias
            + self.w_cate[cate]
            + self.w_age[profile["age_level"]]
            + self.w_shopping[profile["shopping_level"]]
            + self.w_gender[profile["final_gender_code"]]
            + self.w_pid[pid_index]
            + self.w_log_price * (np.log1p(price) - 4.0)
            + self.w_recent_match * recent_match
            + self._id_effects(users, ads)
        )
        p_click = 1.0 / (1.0 + np.exp(-logit))
        clk = (rng.random(size) < p_click).astype(np.int64)
        buy_logit = (
            self.w_buy_bias
            + self.w_buy_cate * self.w_cate[cate]
            + self.w_buy_cate_own[cate]
            + self.w_buy_log_price * (np.log1p(price) - 4.0)
            + self.w_buy_pvalue[profile["pvalue_level"]]
            + self.w_buy_shopping[profile["shopping_level"]]
            + self.w_buy_age[profile["age_level"]]
        )
        p_buy = 1.0 / (1.0 + np.exp(-buy_logit))
        buy = clk * (rng.random(size) < p_buy)
        if self.events_per_second:
            index = self.emitted + np.arange(size)
            event_time = self.start_time_ms + (index * 1000 / self.events_per_second).astype(np.int64)
        else:
            event_time = np.full(size, self.start_time_ms, dtype=np.int64)
        self.emitted += size

        recent = np.split(recent_flat, np.cumsum(n_recent)[:-1])
        brand = ad["brand"]
        records = []
        for i in range(size):
            records.append(
                {
                    "event_time": int(event_time[i]),
                    "user_id": int(user_ids[i]),
                    "adgroup_id": int(ad_ids[i]),
                    "cate_id": int(cate[i]),
                    "campaign_id": int(ad["campaign"][i]),
                    "customer": int(ad["customer"][i]),
                    "brand": None if brand[i] < 0 else int(brand[i]),
                    **{name: int(values[i]) for name, values in profile.items()},
                    "pid": PIDS[pid_index[i]],
                    "recent_cate_ids": recent[i].tolist(),
                    "price": float(price[i]),
                    "clk": int(clk[i]),
                    "buy": int(buy[i]),
                }
            )
        keys = [b"%d" % u for u in user_ids]
        return EventChunk(records, p_click, keys, p_buy)


class AvroEncoder:
    """Schemaless Avro bodies for one schema (the worker's ``serialization: raw`` format)."""

    def __init__(self, schema_path: Path):
        self.schema = fastavro.parse_schema(load_schema(schema_path))

    def encode(self, record: dict) -> bytes:
        out = io.BytesIO()
        fastavro.schemaless_writer(out, self.schema, record)
        return out.getvalue()


@dataclass(frozen=True)
class Truth:
    """What the stream knows about one event: its true probabilities and its drawn labels."""

    p_click: float
    p_buy: float  # given a click
    clk: int
    buy: int


# How far a paced sender may fall behind its rate before the pace restarts from now (``produce``).
_MAX_BEHIND_SECONDS = 1.0


def labelled_events(
    stream: ClickStream, encoder: AvroEncoder, count: int, chunk_size: int = 4096
) -> Iterator[tuple[bytes, bytes, Truth]]:
    """(key, value, truth) for ``count`` events.

    Chunks are always ``chunk_size`` long, so the first N events of a seed never depend on ``count``.
    """
    remaining = count
    while remaining > 0:
        chunk = stream.chunk(chunk_size)
        rows = zip(chunk.keys, chunk.records, chunk.click_probability, chunk.buy_probability, strict=True)
        for key, record, p_click, p_buy in list(rows)[:remaining]:
            yield key, encoder.encode(record), Truth(float(p_click), float(p_buy), record["clk"], record["buy"])
        remaining -= chunk_size


def encoded_events(
    stream: ClickStream, encoder: AvroEncoder, count: int, chunk_size: int = 4096
) -> Iterator[tuple[bytes, bytes, float, int]]:
    """(key, value, true click probability, clk) for ``count`` events (see ``labelled_events``)."""
    for key, value, truth in labelled_events(stream, encoder, count, chunk_size):
        yield key, value, truth.p_click, truth.clk


@dataclass
class ProduceReport:
    produced: int
    seconds: float
    bayes_auc: float  # the click's
    click_rate: float
    # per label (clk; buy over all events; buy_given_clk over the clicks), see bayes_aucs
    bayes_aucs: dict[str, float]
    buy_rate: float
    late_labels: int = 0  # with delays: the label samples among the produced messages


def produce(
    bootstrap_servers: str,
    topic: str,
    count: int,
    *,
    partitions: int = 4,
    partition: int | None = None,
    seed: int = 0,
    rate: float | None = None,
    schema_path: Path,
    start_time_ms: int | None = None,
    client_config: dict[str, str] | None = None,
    progress: Callable[[str], None] | None = None,
    should_stop: Callable[[], bool] = lambda: False,
    drift: Drift | None = None,
    delays: Delays | None = None,
) -> ProduceReport:
    """Write ``count`` synthetic events to ``topic`` (created with ``partitions`` if absent).

    ``rate`` (events/s) paces the sends; event times follow the same pace, so they track the
    wall clock. When this machine cannot send at ``rate`` (more than a second behind it), the pace
    and the event times of the chunks still to be made restart from now, so that an event's time
    stays about when it was sent and a freshness read from it is the pipeline's, not the sender's
    shortfall; unless ``start_time_ms`` fixes the times. Keys are user ids, so one user's events
    stay in one partition, unless ``partition`` sends every event to that one partition (a skewed
    stream). ``drift`` writes the drifting stream instead (``streamtrain.dev.drift``). ``delays``
    writes it as a joiner would, its labels late (``streamtrain.dev.delays``; ``schema_path`` must be
    a sample schema such as schemas/click_sample.avsc): ``count`` impressions and the late labels
    that arrive meanwhile, keyed by impression id, their event times the stream's own clock
    (``Delays.stream_rate``), whatever ``rate`` paces the sends.
    """
    from confluent_kafka import Producer

    from streamtrain.dev.kafka import create_topic

    create_topic(bootstrap_servers, topic, partitions, client_config=client_config)
    producer = Producer(
        {
            "bootstrap.servers": bootstrap_servers,
            "linger.ms": 20,
            "compression.type": "lz4",
            "partitioner": "murmur2_random",  # the Java client's partitioner: same key, same partition
            "enable.idempotence": True,
            **(client_config or {}),
        }
    )
    pace = rate if delays is None else delays.stream_rate  # what event times follow
    if drift is None:
        stream = ClickStream(seed, start_time_ms, pace)
    else:
        from streamtrain.dev.drift import DriftingClickStream

        stream = DriftingClickStream(seed, start_time_ms, pace, drift)
    encoder = AvroEncoder(schema_path)
    truths: list[Truth] = []
    failures: list[str] = []

    def delivered(error, _message) -> None:
        if error is not None:
            failures.append(str(error))

    if start_time_ms is None:  # event times start now, when sending starts, not when the stream was built
        stream.start_time_ms = int(time.time() * 1000)
    started = last_report = time.monotonic()
    produced = 0
    behind = False
    if delays is None:
        messages: Iterator[tuple[bytes, bytes, Truth | None]] = labelled_events(stream, encoder, count)
    else:
        from streamtrain.dev.delays import SampleEncoder, joined_events

        messages = joined_events(stream, SampleEncoder(schema_path), count, delays, seed)
    for key, value, truth in messages:
        if should_stop():
            break
        if rate:
            ahead = started + produced / rate - time.monotonic()
            if ahead > 0:
                time.sleep(ahead)
            elif ahead < -_MAX_BEHIND_SECONDS and start_time_ms is None and delays is None:
                if progress and not behind:
                    progress(f"this machine sends fewer than {rate:,.0f} events/s: event times follow the sends")
                behind = True
                started = time.monotonic() - produced / rate
                stream.start_time_ms = int(time.time() * 1000 - stream.emitted * 1000 / rate)
        while True:
            try:
                producer.produce(
                    topic,
                    value=value,
                    key=key,
                    on_delivery=delivered,
                    **({} if partition is None else {"partition": partition}),
                )
                break
            except BufferError:  # the local queue is full: let librdkafka drain it
                producer.poll(0.05)
        if truth is not None:
            truths.append(truth)
        produced += 1
        producer.poll(0)
        now = time.monotonic()
        if progress and now - last_report >= 2.0:
            progress(f"produced {produced:,}/{count:,} events ({produced / (now - started):,.0f}/s)")
            last_report = now
    remaining = producer.flush(60)
    if remaining or failures:
        raise RuntimeError(f"{remaining} events undelivered, {len(failures)} failed: {failures[:3]}")
    seconds = time.monotonic() - started
    p_click, p_buy, clk, buy = np.array([(t.p_click, t.p_buy, t.clk, t.buy) for t in truths]).reshape(-1, 4).T
    aucs = bayes_aucs(p_click, p_buy, clk, buy)
    report = ProduceReport(
        produced,
        seconds,
        aucs["clk"],
        float(clk.mean()) if truths else 0.0,
        aucs,
        float(buy.mean()) if truths else 0.0,
        produced - len(truths),
    )
    if progress:
        progress(
            f"produced {produced:,} events to {topic} in {seconds:.1f}s; click rate "
            f"{report.click_rate:.3f}; Bayes-optimal AUC of this stream {report.bayes_auc:.4f}; "
            f"buy rate {report.buy_rate:.4f}, its Bayes-optimal AUC {aucs['buy']:.4f} over all events "
            f"and {aucs['buy_given_clk']:.4f} over clicks"
        )
        if delays is not None:
            windows = ", ".join(f"{task} {seconds:,.0f} s" for task, seconds in delays.window_seconds().items())
            progress(
                f"delays: {report.late_labels:,} late labels among them, after their {len(truths):,} impressions; "
                f"labels are final within the attribution windows ({windows} of stream time at "
                f"{delays.stream_rate:,g} events/s)"
            )
        if drift is not None:
            progress(
                f"drift: {drift.users:,} users and {drift.ads:,} ads live at any moment, each for "
                f"{drift.lifetime:,} events; {drift.distinct_ids(drift.users, produced):,} users and "
                f"{drift.distinct_ids(drift.ads, produced):,} ads lived during these {produced:,} events"
            )
    return report
