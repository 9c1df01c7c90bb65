"""The follower: keeps the served state at the newest base plus the deltas of its chain, in order.

It loads the base ``current.json`` points to (``artifact.ServableModel``), then applies the deltas
of that base's chain in order from its ``delta_sequence`` (docs/delivery-format.md is the format,
docs/delivery.md the design):

- a delta of an older chain, or one already applied, is skipped;
- a gap in the sequence, or a delta of a newer chain, makes it look (``base_wait_seconds`` at
  most, reading on meanwhile) for a base past what it serves, load it, and replay the delta source
  from that base on. Without one in time, the delta is counted failed and the server keeps what it
  serves, until a later delta tries again;
- a chunk or delta that is not in the format, or does not fit the base, is refused whole before
  any of it is written, counted by reason, and leaves a gap like a lost delta; so is one that
  fails in a way nobody foresaw, each chunk on its own: the rest of a poll goes on;
- a source that cannot be read (brokers down, a folder unreadable, a time lookup that failed) is
  retried until it can, and /readyz says so meanwhile.

Replaying a Kafka delta topic (one partition) starts at the first message whose timestamp is at
or after the base's cut (the snapshot's wall time less its save time, ``cut_wall_time_ms``) less
``REPLAY_MARGIN_MS``, found with ``offsets_for_times``: a delta cut after the snapshot was produced
after it, and what the margin adds is skipped as already applied. Chunks may come in any order
and repeat (the producer's retries); ``Assembler`` makes whole deltas of them.

A score sees one whole delta or none: the forward pass holds the state lock shared, applying a
delta holds it alone. A base is loaded whole, its scorer included (``Served``): once it serves,
nothing of it is read from its folder again, which retention may remove.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TypeVar

from streamtrain.delivery.artifact import DeltaMismatch, ServableModel
from streamtrain.delivery.deltas import Assembler, Delta, DeltaFormatError, DeltaId
from streamtrain.delivery.serve.metrics import ServeMetrics
from streamtrain.delivery.serve.scorer import Scorer
from streamtrain.delivery.serve.sources import DeltaSource
from streamtrain.delivery.spec import FormatError, Manifest, read_current, read_manifest
from streamtrain.retry import Backoff, retry

log = logging.getLogger(__name__)

T = TypeVar("T")
REPLAY_MARGIN_MS = 60_000
# Incomplete deltas may hold this many times the served model's bytes (a delta of every row and
# parameter, its ids and headers, and the next one starting), plus a floor for small models.
PENDING_MODEL_MULTIPLE = 4
PENDING_FLOOR_BYTES = 64 * 2**20
# A delta source or the bases' folder that fails is tried again after 0.5 s, doubling to 5 s, until a stop.
SOURCE_BACKOFF = Backoff(initial=0.5, maximum=5.0)


class StateLock:
    """Guards the served state: scores read it together, a delta writes it alone. A waiting writer
    holds off new readers, so a delta waits for the forward passes already running, no more."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._readers = 0
        self._writers = 0  # waiting or writing
        self._writing = False

    @contextmanager
    def read(self) -> Iterator[None]:
        with self._changed:
            self._changed.wait_for(lambda: self._writers == 0)
            self._readers += 1
        try:
            yield
        finally:
            with self._changed:
                self._readers -= 1
                self._changed.notify_all()

    @contextmanager
    def write(self) -> Iterator[None]:
        with self._changed:
            self._writers += 1
            self._changed.wait_for(lambda: self._readers == 0 and not self._writing)
            self._writing = True
        try:
            yield
        finally:
            with self._changed:
                self._writing = False
                self._writers -= 1
                self._changed.notify_all()


@dataclass(frozen=True)
class Served:
    """What a score sees: the model, its scorer and where in its chain it is. Replaced whole, under
    the write lock."""

    model: ServableModel
    scorer: Scorer
    step: int
    next_sequence: int


class Follower:
    """Keeps ``model`` at the newest base plus the deltas of its chain, in order. It never stops on
    bad input: a chunk or delta that is not in the format, or does not fit the base, is counted by
    reason and skipped whole (it is validated before any of it is written), and the gap it leaves
    waits for a newer base, as a lost delta does. A source that cannot be read is retried."""

    def __init__(
        self,
        model_dir: Path,
        source: DeltaSource | None,
        metrics: ServeMetrics,
        base_wait_seconds: float,
        on_delta_applied: Callable[[DeltaId, float], None] | None = None,
    ):
        self.model_dir = model_dir
        self.source = source
        self.metrics = metrics
        self.base_wait_seconds = base_wait_seconds
        self.on_delta_applied = on_delta_applied
        self.lock = StateLock()  # apply writes, score reads: a score sees a whole delta or none
        self.served: Served | None = None
        self.loads = 0
        self.assembler = Assembler()
        self.ready = threading.Event()
        self.stopping = threading.Event()
        # Why the served state is not current (None: it is): /readyz says it.
        self.behind: str | None = None
        # The first delta past a gap, and until when a base past it is waited for.
        self._gap: tuple[int, int] | None = None
        self._gap_deadline = 0.0
        self._logged: set[str] = set()

    @property
    def model(self) -> ServableModel:
        assert self.served is not None, "a base is loaded before the follower runs"
        return self.served.model

    @property
    def manifest(self) -> Manifest:
        return self.model.manifest

    @property
    def next_sequence(self) -> int:
        assert self.served is not None
        return self.served.next_sequence

    @property
    def step(self) -> int:
        assert self.served is not None
        return self.served.step

    def load(self, base_dir: Path, source_timeout: float | None = None) -> None:
        """Serves the base in ``base_dir`` and rewinds the source to it, retrying a source that
        fails (for ``source_timeout`` seconds at most; None: until a stop)."""
        # Outside the lock: scores go on from the old base meanwhile.
        model = ServableModel(base_dir)
        scorer = Scorer(model)
        manifest = model.manifest
        with self.lock.write():
            self.served = Served(model, scorer, manifest.step, manifest.delta_sequence)
            self.loads += 1
        self.metrics.base_loads.inc()
        self.metrics.base_version.set(manifest.base_version)
        self.metrics.chain.set(manifest.chain)
        self.metrics.step.set(manifest.step)
        self.metrics.delta_sequence.set(manifest.delta_sequence - 1)
        self.metrics.high_water_ms = manifest.event_time_high_water_ms
        self.assembler = Assembler(max_bytes=PENDING_MODEL_MULTIPLE * model.nbytes + PENDING_FLOOR_BYTES)
        self._gap, self.behind = None, None
        log.info(
            "serving base %s (step %d, chain %d, deltas from %d)",
            base_dir.name,
            manifest.step,
            manifest.chain,
            manifest.delta_sequence,
        )
        if self.source is not None:
            since = manifest.cut_wall_time_ms - REPLAY_MARGIN_MS
            source = self.source
            self._retrying("rewinding the delta source", lambda: source.rewind(since), source_timeout)

    def _retrying(self, what: str, call: Callable[[], T], timeout: float | None = None) -> T:
        """``call()``, retried while it fails for a while (until a stop); meanwhile /readyz says so."""

        def waiting(error: OSError, attempt: int, wait: float) -> None:
            self.metrics.source_retries.inc()
            self.behind = f"{what} failed: {error}"
            log.warning("%s failed (attempt %d, again in %.1fs): %s", what, attempt, wait, error)

        backoff = Backoff(SOURCE_BACKOFF.initial, SOURCE_BACKOFF.maximum, timeout)
        result = retry(call, backoff, retry_on=OSError, on_retry=waiting, stopping=self.stopping)
        if self.behind is not None and self.behind.startswith(what):
            self.behind = None
        return result

    def newest_base(self) -> Path | None:
        current = read_current(self.model_dir)
        return None if current is None else self.model_dir / current["path"]

    def run(self) -> None:
        """The follower thread: until ``stopping``, read chunks and apply whole deltas. An error
        it does not expect is logged and counted, and it goes on: the state served is whole."""
        while not self.stopping.is_set():
            try:
                self._follow()
            except Exception as error:
                if self.stopping.is_set():
                    break
                self._refuse("error", f"the delta follower failed, and goes on: {error!r}")
                self.stopping.wait(1.0)

    def _follow(self) -> None:
        if self.source is None:
            self.ready.set()
            self.stopping.wait(1.0)
            return
        source = self.source
        loads = self.loads
        for chunk in self._retrying("reading the delta source", lambda: source.poll(0.2)):
            if self.loads != loads:  # a base was loaded and the source rewound: the rest is read again
                return
            self._take(chunk)
        if self._gap is not None:
            self._look_for_base()
        if not self.ready.is_set() and source.caught_up():
            self.ready.set()
            log.info("ready: the deltas present at start are applied (sequence %d next)", self.next_sequence)

    def _refuse(self, reason: str, message: str) -> None:
        """Counts a refused chunk or delta; logs the first of each reason (the metric counts the rest)."""
        self.metrics.bad_deltas.labels(reason).inc()
        if reason not in self._logged:
            self._logged.add(reason)
            log.error(
                "%s (further ones of reason %r are counted in streamtrain_serve_bad_deltas_total)", message, reason
            )

    def _take(self, chunk: bytes) -> None:
        """One chunk, and its delta once whole. Whatever fails is this chunk's or this delta's
        refusal, counted; the poll's other chunks go on."""
        try:
            delta = self.assembler.add(chunk)
            if delta is not None:
                self.offer(delta)
        except DeltaFormatError as error:
            self._refuse(error.reason, f"skipping a delta chunk: {error}")
        except Exception as error:
            self._refuse("error", f"skipping a delta chunk, or the delta it completed, that failed: {error!r:.500}")

    def offer(self, delta: Delta) -> None:
        manifest = self.manifest
        chain, sequence = delta.id.base_version, delta.id.sequence
        if delta.id.model_id != manifest.model_id:
            self.metrics.deltas_skipped.inc()
            log.warning("skipping a delta of model %r; this base is %r", delta.id.model_id, manifest.model_id)
            return
        if (chain, sequence) < (manifest.chain, self.next_sequence):
            self.metrics.deltas_skipped.inc()
            return
        if chain == manifest.chain and sequence == self.next_sequence:
            self._apply(delta)
            return
        if self._gap is None or (chain, sequence) < self._gap:
            if self._gap is None:
                self._gap_deadline = time.monotonic() + self.base_wait_seconds
                log.warning(
                    "delta %d of chain %d while %d of chain %d is next: waiting up to %.0fs for a newer base",
                    sequence,
                    chain,
                    self.next_sequence,
                    manifest.chain,
                    self.base_wait_seconds,
                )
            self._gap = (chain, sequence)
            self.behind = f"waiting for a base past delta {self.next_sequence} of chain {manifest.chain}"
        self._look_for_base()

    def _apply(self, delta: Delta) -> None:
        served = self.served
        assert served is not None
        started = time.perf_counter()
        try:
            with self.lock.write():
                served.model.apply(delta)  # all or nothing: a refused or failed one changes nothing
                self.served = replace(served, step=delta.id.step, next_sequence=delta.id.sequence + 1)
        except DeltaMismatch as error:
            self._refuse(
                "mismatch", f"delta {delta.id.sequence} of chain {delta.id.base_version} does not fit: {error}"
            )
            return
        self.metrics.apply_seconds.observe(time.perf_counter() - started)
        self.metrics.deltas_applied.inc()
        self.metrics.step.set(delta.id.step)
        self.metrics.delta_sequence.set(delta.id.sequence)
        self.metrics.high_water_ms = delta.id.event_time_high_water_ms
        self.assembler.forget_before(delta.id.base_version, delta.id.sequence + 1)
        self._gap = None
        if self.behind is not None and self.behind.startswith("waiting for a base"):
            self.behind = None
        if self.on_delta_applied is not None:
            self.on_delta_applied(delta.id, time.time())

    def _look_for_base(self) -> None:
        """Loads the newest base if it is past what is served; gives up waiting, and counts the
        delta failed, once ``base_wait_seconds`` have passed since the gap was found."""
        assert self._gap is not None
        path = self._retrying("reading current.json", self._newest_readable_base)
        if path is not None and path != self.model.path:
            try:
                manifest = read_manifest(path)
            except (OSError, FormatError) as error:
                log.warning("base %s is not readable yet: %s", path, error)
            else:
                if (manifest.chain, manifest.delta_sequence) > (self.manifest.chain, self.next_sequence):
                    try:
                        self.load(path)
                        return
                    except Exception as error:  # removed meanwhile, or not a base: keep serving, look again
                        self._refuse("base", f"base {path} cannot be loaded: {error}")
        if time.monotonic() >= self._gap_deadline:
            chain, sequence = self._gap
            log.error(
                "delta %d of chain %d: no base past the gap appeared within %.0fs; serving what is loaded",
                sequence,
                chain,
                self.base_wait_seconds,
            )
            self.metrics.deltas_failed.inc()
            self._gap = None
            self.behind = f"a gap before delta {sequence} of chain {chain}: no newer base yet"

    def _newest_readable_base(self) -> Path | None:
        try:
            return self.newest_base()
        except FormatError as error:  # a current.json naming no base folder: as if none were published
            self._refuse(error.reason, str(error))
            return None
