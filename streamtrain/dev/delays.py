"""A planted stream whose labels arrive late, written as a joiner writes it (docs/delayed-labels.md).

Over the click stream (or the drifting one), each impression's click and purchase get a delay: a
click's label arrives an exponential delay after its impression (mean ``click_mean`` events), a
purchase's a log-normal delay after its click (median ``buy_median`` events, ``buy_sigma`` the
log-scale's spread: a heavy tail over a longer horizon). A positive whose delay is past its task's
attribution window (``click_window``, ``buy_window``) is no positive, as for a real joiner: its
final label is 0. Delays are drawn for every impression from a generator of their own, so the
impressions of a seed are the stream's whatever the delays.

Delays and windows are counted in events, the stream's own clock. Event times advance at
``stream_rate`` events per second of stream time: impression n is shown at start + n / rate
seconds, and a label that arrives d events later has the time of position n + d. A window of W
events is therefore W / rate seconds, which is what a worker's ``attribution_window_seconds`` is
set to (``Delays.window_seconds``).

``joined_samples`` is the joiner's output: every impression at once (``sample_kind`` impression,
its labels 0: none is known yet), and each positive as a ``label`` sample when it arrives, a copy
of the impression's features with that task's label 1 and the other's null, its event time the
arrival's. The key is the impression id, so an impression and its labels share a partition. With
``wait`` (ES-DFM's elapsed time) the joiner holds each impression that many events and emits it
with the positives that arrived meanwhile, 1 on it; only later ones come as label samples. Its
event time stays the impression's.
"""

from __future__ import annotations

import heapq
import io
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fastavro
import numpy as np

from streamtrain.dev.produce import ClickStream, Truth
from streamtrain.schema import load_schema

TASKS = ("clk", "buy")
# Impression ids of a seed: (seed << 40) + position, distinct across the seeds a test or bench writes.
_ID_BITS = 40


@dataclass(frozen=True)
class Delays:
    """When each task's positives arrive, and until when they count (the ``--delay-*`` and
    ``--window-*`` options of ``streamtrain produce``), in events."""

    click_mean: float = 20_000
    buy_median: float = 60_000  # after the click
    buy_sigma: float = 1.0
    click_window: float = 100_000
    buy_window: float = 400_000
    stream_rate: float = 100.0  # events a second of stream time
    # How long the joiner holds each impression before it emits it, with the labels that arrived
    # meanwhile (ES-DFM's elapsed time); 0: at once, no label known.
    wait: float = 0.0

    def __post_init__(self) -> None:
        for name in ("click_mean", "buy_median", "buy_sigma", "click_window", "buy_window", "stream_rate"):
            if not getattr(self, name) > 0:
                raise ValueError(f"delays: {name} must be above 0, got {getattr(self, name)}")
        if not 0 <= self.wait < min(self.click_window, self.buy_window):
            raise ValueError(f"delays: wait must be at least 0 and below both windows, got {self.wait}")

    def windows(self) -> dict[str, float]:
        """Each task's attribution window, in events."""
        return {"clk": self.click_window, "buy": self.buy_window}

    def window_seconds(self) -> dict[str, float]:
        """Each task's attribution window in seconds of stream time: its worker's attribution_window_seconds."""
        return {task: events / self.stream_rate for task, events in self.windows().items()}

    def attributed(self, draws: int = 1_000_000) -> dict[str, float]:
        """The share of each task's positives that arrive within its window (a fixed Monte Carlo
        draw for the purchase, whose delay is the click's plus its own)."""
        rng = np.random.default_rng(0)
        click = rng.exponential(self.click_mean, draws)
        buy = click + rng.lognormal(math.log(self.buy_median), self.buy_sigma, draws)
        return {"clk": -math.expm1(-self.click_window / self.click_mean), "buy": float((buy <= self.buy_window).mean())}


@dataclass
class Impressions:
    """A chunk of impressions, with what is planted in them: their records carry the final labels
    (a positive within its window); ``*_at`` is the stream position at which each positive's label
    arrives (inf: none comes)."""

    records: list[dict]
    keys: list[bytes]
    ids: np.ndarray
    position: np.ndarray  # int64, from 0
    p_click: np.ndarray
    p_buy: np.ndarray  # given a click
    clk_at: np.ndarray
    buy_at: np.ndarray
    known: np.ndarray  # [n, 2] bool: each task's positive known when the impression is emitted (within the wait)

    def part(self, mask: np.ndarray) -> Impressions:
        """The impressions where ``mask`` holds."""
        return Impressions(
            [r for r, kept in zip(self.records, mask.tolist(), strict=True) if kept],
            [k for k, kept in zip(self.keys, mask.tolist(), strict=True) if kept],
            *(
                getattr(self, name)[mask]
                for name in ("ids", "position", "p_click", "p_buy", "clk_at", "buy_at", "known")
            ),
        )


def impressions(
    stream: ClickStream,
    delays: Delays,
    count: int,
    seed: int,
    encoder: SampleEncoder | None = None,
    chunk_size: int = 4096,
) -> Iterator[Impressions]:
    """``count`` impressions of ``stream`` (built with ``events_per_second=delays.stream_rate``), in
    chunks of ``chunk_size`` (the last shorter), with their delays drawn; with ``encoder``, each
    record's features encoded onto it once (``SampleEncoder.keep_features``)."""
    rng = np.random.default_rng([seed, 4])
    windows = delays.windows()
    done = 0
    while done < count:
        chunk = stream.chunk(chunk_size)
        click_delay = rng.exponential(delays.click_mean, chunk_size)
        buy_delay = click_delay + rng.lognormal(math.log(delays.buy_median), delays.buy_sigma, chunk_size)
        take = min(chunk_size, count - done)
        records = chunk.records[:take]
        position = done + np.arange(take, dtype=np.int64)
        arrivals, known = {}, {}
        for task, delay in (("clk", click_delay[:take]), ("buy", buy_delay[:take])):
            positive = np.array([r[task] for r in records], bool) & (delay <= windows[task])
            known[task] = positive & (delay <= delays.wait)
            arrivals[task] = np.where(positive & ~known[task], position + delay, np.inf)
            for record, final in zip(records, positive.tolist(), strict=True):
                record[task] = int(final)
        if encoder is not None:
            for record in records:
                encoder.keep_features(record)
        ids = (seed << _ID_BITS) + position
        yield Impressions(
            records,
            [b"%d" % i for i in ids.tolist()],
            ids,
            position,
            chunk.click_probability[:take],
            chunk.buy_probability[:take],
            arrivals["clk"],
            arrivals["buy"],
            np.stack([known["clk"], known["buy"]], axis=1),
        )
        done += take


@dataclass(frozen=True)
class Sample:
    """One message of the joiner's output: its key, its record, and the stream position it is emitted at."""

    key: bytes
    record: dict
    position: float


def joined_samples(
    chunks: Iterator[Impressions], start_time_ms: int, stream_rate: float, wait: float = 0.0
) -> Iterator[Sample]:
    """The joiner's output over ``chunks``, in emission order: each impression ``wait`` events after
    its position, with the labels known by then, each later label at its arrival's (what is due
    after the last impression is not emitted: it is still to come)."""
    due: list[tuple[float, int, Sample]] = []  # position, order, sample
    order, position = 0, 0
    for chunk in chunks:
        for i, record in enumerate(chunk.records):
            position = int(chunk.position[i])
            while due and due[0][0] <= position:
                yield heapq.heappop(due)[2]
            impression_id, key = int(chunk.ids[i]), chunk.keys[i]
            known = {task: int(chunk.known[i, t]) for t, task in enumerate(TASKS)}
            samples = [Sample(key, impression_sample(record, impression_id, known), position + wait)]
            for task, arrival in (("clk", chunk.clk_at[i]), ("buy", chunk.buy_at[i])):
                if arrival != np.inf:
                    samples.append(
                        _late_label(float(arrival), task, key, record, impression_id, start_time_ms, stream_rate)
                    )
            for sample in samples:
                heapq.heappush(due, (sample.position, order, sample))
                order += 1
    while due and due[0][0] <= position:
        yield heapq.heappop(due)[2]


def impression_sample(record: dict, impression_id: int, known: dict[str, int] | None = None) -> dict:
    """The impression as the joiner emits it: each label as known then (``known``; none: 0)."""
    return {
        **record,
        **dict.fromkeys(TASKS, 0),
        **(known or {}),
        "sample_kind": "impression",
        "impression_id": impression_id,
        "impression_time": record["event_time"],
    }


def _late_label(
    arrival: float, task: str, key: bytes, record: dict, impression_id: int, start_ms: int, rate: float
) -> Sample:
    label = {
        **record,
        **dict.fromkeys(TASKS, None),
        task: 1,
        "event_time": start_ms + int(arrival * 1000 / rate),
        "sample_kind": "label",
        "impression_id": impression_id,
        "impression_time": record["event_time"],
    }
    return Sample(key, label, arrival)


def joined_events(
    stream: ClickStream, encoder: SampleEncoder, count: int, delays: Delays, seed: int
) -> Iterator[tuple[bytes, bytes, Truth | None]]:
    """(key, value, truth) of the joiner's messages over ``count`` impressions: an impression's
    truth (its final labels), None for a late label."""
    truths: dict[int, Truth] = {}

    def chunks() -> Iterator[Impressions]:
        for chunk in impressions(stream, delays, count, seed, encoder):
            for i, record in enumerate(chunk.records):
                truths[int(chunk.ids[i])] = Truth(
                    float(chunk.p_click[i]), float(chunk.p_buy[i]), record["clk"], record["buy"]
                )
            yield chunk

    for sample in joined_samples(chunks(), stream.start_time_ms, delays.stream_rate, delays.wait):
        truth = truths.pop(sample.record["impression_id"]) if sample.record["sample_kind"] == "impression" else None
        yield sample.key, encoder.encode(sample.record), truth


# The sample schema's fields after an event's features, in order (schemas/click_sample.avsc).
SAMPLE_FIELDS = ("clk", "buy", "sample_kind", "impression_id", "impression_time")


class SampleEncoder:
    """Avro bodies of samples (schemas/click_sample.avsc, or a schema laid out alike: event_time
    first, ``SAMPLE_FIELDS`` last, each a union of null and an int, long or enum), the features in
    between encoded with fastavro once per impression and kept on its record: an impression's
    samples (at once, its late labels, the benchmark's oracle and waiting streams) share them. The
    rest is written here: Avro's zigzag varints and union indexes. ``tests/test_delayed.py`` checks
    the bytes against fastavro's."""

    def __init__(self, schema_path: Path):
        schema = load_schema(schema_path)
        fields = schema["fields"]
        tail = [f["name"] for f in fields[-len(SAMPLE_FIELDS) :]]
        if fields[0]["name"] != "event_time" or tuple(tail) != SAMPLE_FIELDS:
            raise ValueError(f"{schema_path}: a sample schema has event_time first and {SAMPLE_FIELDS} last")
        self.features = fastavro.parse_schema(
            {**schema, "name": "SampleFeatures", "fields": fields[1 : -len(SAMPLE_FIELDS)]}
        )
        self.writers = [_nullable_writer(f["type"]) for f in fields[-len(SAMPLE_FIELDS) :]]
        self.event_time = _nullable_writer(fields[0]["type"])

    def encode(self, record: dict) -> bytes:
        features = record.get(_FEATURES)
        if features is None:
            out = io.BytesIO()
            fastavro.schemaless_writer(out, self.features, record)
            features = out.getvalue()
        tail = b"".join(write(record.get(name)) for write, name in zip(self.writers, SAMPLE_FIELDS, strict=True))
        return self.event_time(record["event_time"]) + features + tail

    def keep_features(self, record: dict) -> None:
        """Encodes ``record``'s features now, onto it: the samples made from it reuse them."""
        out = io.BytesIO()
        fastavro.schemaless_writer(out, self.features, record)
        record[_FEATURES] = out.getvalue()


_FEATURES = "_encoded_features"


def _zigzag(value: int) -> bytes:
    n = (value << 1) ^ (value >> 63)
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _nullable_writer(avro_type: Any) -> Callable[[Any], bytes]:
    """A writer of one value of ``avro_type``: a long or int, an enum, or a union of null and one of them."""
    branches = avro_type if isinstance(avro_type, list) else [avro_type]
    null = branches.index("null") if "null" in branches else None
    (value_type,) = [b for b in branches if b != "null"]
    index = _zigzag(branches.index(value_type)) if isinstance(avro_type, list) else b""
    kind = value_type["type"] if isinstance(value_type, dict) else value_type
    symbols = value_type["symbols"] if kind == "enum" else None
    if kind not in ("int", "long", "enum"):
        raise ValueError(f"a sample field of type {kind} is not written here")

    def write(value: Any) -> bytes:
        if value is None:
            if null is None:
                raise ValueError(f"null for a {kind} that cannot be null")
            return _zigzag(null)
        return index + _zigzag(symbols.index(value) if symbols is not None else int(value))

    return write
