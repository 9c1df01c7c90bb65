"""The server's Prometheus metrics, on a registry of its own."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class ServeMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.step = Gauge("streamtrain_serve_step", "The training step of the state served", registry=r)
        self.delta_sequence = Gauge(
            "streamtrain_serve_delta_sequence",
            "The sequence of the newest delta applied (-1: the base alone)",
            registry=r,
        )
        self.base_version = Gauge("streamtrain_serve_base_version", "The version of the base loaded", registry=r)
        self.chain = Gauge("streamtrain_serve_chain", "The delta chain the base belongs to", registry=r)
        self.deltas_applied = Counter("streamtrain_serve_deltas_applied_total", "Deltas applied", registry=r)
        self.deltas_failed = Counter(
            "streamtrain_serve_deltas_failed_total",
            "Deltas after a gap that no base covered in time",
            registry=r,
        )
        self.bad_deltas = Counter(
            "streamtrain_serve_bad_deltas_total",
            "Chunks and deltas refused, by reason (not in the format, disagreeing parts, not fitting the base, ...)",
            ["reason"],
            registry=r,
        )
        self.source_retries = Counter(
            "streamtrain_serve_source_retries_total",
            "Retries after the delta source or the bases' folder failed for a while",
            registry=r,
        )
        self.deltas_skipped = Counter(
            "streamtrain_serve_deltas_skipped_total", "Deltas of an older chain or already applied", registry=r
        )
        self.base_loads = Counter(
            "streamtrain_serve_base_loads_total", "Bases loaded, the first one included", registry=r
        )
        self.apply_seconds = Histogram(
            "streamtrain_serve_delta_apply_seconds",
            "Time to write one delta into the served model, waiting for the scores in progress included",
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5),
            registry=r,
        )
        self.freshness = Gauge(
            "streamtrain_serve_freshness_seconds",
            "Now minus the event-time high-water of the state served (its newest delta's, else its base's)",
            registry=r,
        )
        self.score_requests = Counter(
            "streamtrain_serve_score_requests_total", "Score requests, by outcome", ["outcome"], registry=r
        )
        self.score_seconds = Histogram(
            "streamtrain_serve_score_seconds",
            "Score request latency, decoding included",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1),
            registry=r,
        )
        self.scored_events = Counter("streamtrain_serve_scored_events_total", "Events scored", registry=r)
        self.rejected_events = Counter(
            "streamtrain_serve_rejected_events_total", "Events in score requests that could not be scored", registry=r
        )
        self.high_water_ms = 0
        self.freshness.set_function(lambda: time.time() - self.high_water_ms / 1000 if self.high_water_ms else 0.0)
