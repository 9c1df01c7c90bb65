"""soak: the whole deployment for N minutes under random faults, and what it lost, trained twice,
and how long serve lagged behind.

On a 3-node KRaft cluster (replication factor 3, min.insync.replicas 2), a live stream of
--rate events/s with one malformed payload in every --malformed-every, ``streamtrain worker
--nproc 2`` with deltas every second on a topic and dead letters on theirs, and ``streamtrain
serve`` following the deltas. Every --fault-every seconds on average (0.5x to 1.5x, drawn from
--seed), once the last fault has healed (the worker trains, and serve is ready on the worker's
current delta chain with no delta waiting over 5 s), one fault:

- broker: SIGKILL a node (half the time the one leading most input partitions), down 3-10 s,
  restarted, then every partition back in sync;
- rank: SIGKILL a rank. The worker then exits, and the soak starts it again, as a supervisor
  would (a process still running under the dead worker is killed first, and counted);
- serve: SIGTERM serve and start it again.

The first three faults are one of each kind, in random order. After --minutes, the stream stops,
the worker trains it to its end offsets and is stopped with SIGTERM, and the run is judged from the
topics and the snapshots, never from a process's counters (a worker restored from a snapshot
trains again, and counts again, what it had trained after it: that is not a duplicate in the
model):

- lost, duplicated: each valid event of the input against the final snapshot's lineage (its
  ancestors, gathered as they were committed): between two snapshots the events trained must be
  the offsets read less the malformed among them; more is events trained twice, fewer is events
  lost; events past the final positions are lost too;
- dead letters: every malformed event's (partition, offset) on the dead-letter topic;
- max_stale_seconds: from serve's first ready on, the longest that a delta published whole on the
  delta topic waited before serve served it or a newer state, or that /readyz answered other than
  200 (serve down included); each of the worst episodes names the fault before it;
- serve_matches_export: serve, once at the final snapshot's step, scores held-out events as an
  export of that snapshot does;
- faults by kind, restarts, minutes, and /score checks that failed while /readyz said ready.

A run that lost or duplicated an event, missed a dead letter, or did not end equal to an export is
saved, and the command exits 1. --quick runs one fault of each kind, each as soon as the one
before has healed (minutes, not one: a worker start and a base export each take a while).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import random
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

KINDS = ("broker", "rank", "serve")
STEP_SECONDS = 0.5  # how often the soak looks at its processes
RECOVERY_SECONDS = 600.0  # a fault not healed by then ends the faults, and the run fails
HEALED_STALE_SECONDS = 5.0  # serve lags by a delta interval and an apply when all is well
TOPIC = "soak"


# A small model: the soak is about faults, and shares two cores with three brokers.
DEFAULT_CONFIG = Path("tests") / "worker-small.yaml"
QUICK_HELP = "one fault of each kind, each once the one before has healed (minutes): proves it runs"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--minutes", type=float, default=20.0, help="how long faults go on (default 20; --quick: one of each)"
    )
    parser.add_argument("--seed", type=int, default=0, help="draws the faults, their times and victims (default 0)")
    parser.add_argument("--rate", type=float, default=200.0, help="events/s of the live stream (default 200)")
    parser.add_argument(
        "--malformed-every", type=int, default=100, help="one malformed payload per this many events (default 100)"
    )
    parser.add_argument(
        "--fault-every", type=float, default=60.0, help="mean seconds between faults, after healing (default 60)"
    )
    parser.add_argument("--keep", type=Path, help="keep the run's logs, snapshots and bases in this folder")


# --- how long serve lags ------------------------------------------------------------------------


@dataclass
class StaleEpisode:
    started: float  # seconds since the soak began
    seconds: float
    what: str


class Staleness:
    """How long serve lags what the worker has published. ``published(delta, at)`` as each delta
    is whole on the topic; ``observed(at, ready, position)`` at each look at serve, ``position``
    being the (chain, next sequence) it serves. A delta is served once the position is past it.

    >>> s = Staleness(started=0.0)
    >>> s.published((1, 0), at=10.0)
    >>> s.observed(11.0, ready=True, position=(1, 0))
    >>> s.stale(12.0)
    2.0
    >>> s.observed(13.0, ready=True, position=(1, 1))
    >>> s.observed(20.0, ready=False, position=None)
    >>> s.observed(24.0, ready=True, position=(1, 1))
    >>> s.max_seconds(24.0), [e.what for e in s.worst()]
    (4.0, ['not ready', 'delta 0 of chain 1 waited'])
    """

    def __init__(self, started: float):
        self.started = started
        self.pending: dict[tuple[int, int], float] = {}
        self.not_ready_since: float | None = None
        self.episodes: list[StaleEpisode] = []
        self._lock = threading.Lock()

    def published(self, delta: tuple[int, int], at: float) -> None:
        with self._lock:
            self.pending.setdefault(delta, at)

    def observed(self, at: float, ready: bool, position: tuple[int, int] | None) -> None:
        with self._lock:
            if not ready:
                if self.not_ready_since is None:
                    self.not_ready_since = at
                return
            if self.not_ready_since is not None:
                self._episode(self.not_ready_since, at, "not ready")
                self.not_ready_since = None
            if position is None:
                return
            for delta in [d for d in self.pending if d < position]:
                published = self.pending.pop(delta)
                self._episode(published, at, f"delta {delta[1]} of chain {delta[0]} waited")

    def _episode(self, since: float, until: float, what: str) -> None:
        self.episodes.append(StaleEpisode(since - self.started, until - since, what))
        self.episodes = sorted(self.episodes, key=lambda e: -e.seconds)[:20]

    def stale(self, at: float) -> float:
        """How stale serve is now: its oldest unserved delta's wait, or how long it has been not ready."""
        with self._lock:
            waits = [at - published for published in self.pending.values()]
            if self.not_ready_since is not None:
                waits.append(at - self.not_ready_since)
            return max(waits, default=0.0)

    def max_seconds(self, at: float) -> float:
        return max([e.seconds for e in self.episodes] + [self.stale(at)])

    def worst(self, count: int = 5) -> list[StaleEpisode]:
        return self.episodes[:count]


class ServeWatch:
    """On threads of its own until ``stop()``: reads the delta topic (what the worker published
    whole, when) and looks at serve every ``STEP_SECONDS`` (ready? serving which position?),
    feeding ``staleness``; every few looks it scores a few held-out events, and counts a failure
    while /readyz said ready."""

    SCORE_EVERY = 4  # looks

    def __init__(self, stack: Any, staleness: Staleness, clock: Callable[[], float]):
        from streamtrain.dev.stack import held_out

        self.stack = stack
        self.staleness = staleness
        self.clock = clock
        self.stopping = threading.Event()
        self.score_checks = 0
        self.score_failures: list[str] = []
        self.freshness_max = 0.0
        self.payloads = held_out(4)
        self.threads = [
            threading.Thread(target=self._read_deltas, name="streamtrain-soak-deltas", daemon=True),
            threading.Thread(target=self._look, name="streamtrain-soak-serve", daemon=True),
        ]
        for thread in self.threads:
            thread.start()

    def _read_deltas(self) -> None:
        from confluent_kafka import Consumer, TopicPartition

        from streamtrain.delivery.deltas import Assembler, DeltaFormatError

        consumer = Consumer(
            {
                "bootstrap.servers": self.stack.bootstrap_servers,
                "group.id": f"streamtrain-soak-watch-{os.getpid()}",
                "enable.auto.commit": False,
                "broker.address.family": "v4",
                "fetch.wait.max.ms": 50,
                "log_level": 0,  # the faults make it complain; it reconnects by itself
            }
        )
        assembler = Assembler()
        try:
            consumer.assign([TopicPartition(self.stack.delta_topic, 0, 0)])
            while not self.stopping.is_set():
                for message in consumer.consume(500, 0.2):
                    if message.error() is not None:
                        continue
                    try:
                        delta = assembler.add(message.value() or b"")
                    except DeltaFormatError:
                        continue  # a chunk serve refuses too: its delta never completes, as there
                    if delta is not None:
                        self.staleness.published((delta.id.base_version, delta.id.sequence), self.clock())
        finally:
            consumer.close()

    def _look(self) -> None:
        from streamtrain.dev.stack import ScoreFailed

        looks = 0
        while not self.stopping.wait(STEP_SECONDS):
            serve = self.stack.serve
            ready = serve is not None and serve.running and serve.ready()
            served = serve.served() if ready else None
            now = self.clock()
            self.staleness.observed(now, ready, None if served is None else (served.chain, served.next_sequence))
            looks += 1
            if ready and looks % self.SCORE_EVERY == 0:
                self.score_checks += 1
                try:
                    serve.score(self.payloads)
                except ScoreFailed as error:
                    if serve.ready():  # not a stop that came between the two
                        self.score_failures.append(f"{now:.0f}s: {error}")
            if ready:
                freshness = serve.metrics().get("streamtrain_serve_freshness_seconds", 0.0)
                self.freshness_max = max(self.freshness_max, freshness)

    def stop(self) -> None:
        self.stopping.set()
        for thread in self.threads:
            thread.join(timeout=15)


# --- the run ------------------------------------------------------------------------------------


class SoakFailed(RuntimeError):
    pass


@dataclass
class Fault:
    kind: str
    at: float  # seconds since the soak began
    detail: str
    healed_seconds: float | None = None  # from the fault to ``Soak._healed``


@dataclass
class Soak:
    """The supervisor: starts the worker and serve, injects faults, restarts what a fault ended."""

    stack: Any
    rng: random.Random
    progress: Callable[[str], None]
    began: float = field(default_factory=time.monotonic)
    faults: list[Fault] = field(default_factory=list)
    restarts: dict[str, int] = field(default_factory=lambda: {"worker": 0, "serve": 0})
    worker_exits: list[int | None] = field(default_factory=list)
    outlived: int = 0  # processes still running under a worker that had exited, killed before its restart
    unexpected: list[str] = field(default_factory=list)
    minutes: float = 0.0  # for the progress lines
    staleness: Staleness | None = None
    watch: ServeWatch | None = None
    faults_began: float | None = None
    reported: float = 0.0

    def clock(self) -> float:
        return time.monotonic() - self.began

    def minute(self, at: float) -> float:
        """The minute of the faults' time that the soak's clock ``at`` falls in (negative: before them)."""
        return (at - (self.faults_began or 0.0)) / 60

    def start(self) -> None:
        self.stack.start_worker()
        self.stack.start_serve(base_wait=RECOVERY_SECONDS)
        self.until(self._healed, RECOVERY_SECONDS, "the worker training and serve ready on its chain")
        self.staleness = Staleness(started=0.0)
        self.watch = ServeWatch(self.stack, self.staleness, self.clock)

    def _trained(self) -> int:
        return self.stack.worker.trained() if self.stack.worker is not None else 0

    def _healed(self) -> bool:
        """The worker trains, and serve is ready on the worker's current delta chain (a restarted
        worker starts a new one, which serve takes up once that chain's base is exported) with
        no delta waiting longer than a few seconds."""
        worker, serve = self.stack.worker, self.stack.serve
        if not (worker and worker.running and worker.trained() > 0 and serve and serve.running and serve.ready()):
            return False
        served, chain = serve.served(), self.stack.chain()
        stale = self.staleness.stale(self.clock()) if self.staleness is not None else 0.0
        return served is not None and served.chain == chain and stale < HEALED_STALE_SECONDS

    def until(self, condition: Callable[[], bool], timeout: float, what: str) -> float:
        """Waits for ``condition`` while supervising; its seconds, or SoakFailed past ``timeout``."""
        started = time.monotonic()
        while not condition():
            if time.monotonic() - started > timeout:
                raise SoakFailed(f"{what}: not within {timeout:.0f}s")
            self.supervise()
            time.sleep(STEP_SECONDS)
        return time.monotonic() - started

    def supervise(self) -> None:
        """Restarts a worker or serve that exited by itself, as a supervisor would, and says so;
        a progress line every 15 s."""
        if time.monotonic() - self.reported >= 15:
            self.reported = time.monotonic()
            self.progress(self.line())
        worker, serve = self.stack.worker, self.stack.serve
        if worker is not None:
            worker.watch()
            if not worker.running:
                code = worker.process.poll()
                self.unexpected.append(f"{self.clock():.0f}s: the worker exited with {code}")
                self.progress(f"  the worker exited by itself with {code}:\n{worker.output(1500)}")
                self._restart_worker(worker)
        if serve is not None and not serve.running:
            self.unexpected.append(f"{self.clock():.0f}s: serve exited with {serve.process.poll()}")
            self.progress(f"  serve exited by itself with {serve.process.poll()}:\n{serve.output(1500)}")
            self._restart_serve()

    def line(self) -> str:
        now = self.clock()
        counts = " ".join(f"{kind} {sum(f.kind == kind for f in self.faults)}" for kind in KINDS)
        elapsed = (
            f"{(now - self.faults_began) / 60:.1f}/{self.minutes:g} min" if self.faults_began is not None else "start"
        )
        serve = self.stack.serve
        served = serve.served() if serve is not None else None
        position = f"chain {served.chain} delta {served.next_sequence - 1}" if served else "not answering"
        stale = ""
        if self.staleness is not None:
            stale = f" | stale {self.staleness.stale(now):.1f}s now, {self.staleness.max_seconds(now):.1f}s at most"
        return (
            f"soak {elapsed} | faults {counts} | worker trained {self._trained():,} since it started | "
            f"serve at {position}{stale}"
        )

    def _restart_worker(self, worker: Any) -> None:
        self.worker_exits.append(worker.process.poll())
        self.outlived += worker.kill()
        self.restarts["worker"] += 1
        self.stack.start_worker()

    def _restart_serve(self) -> None:
        self.restarts["serve"] += 1
        self.stack.start_serve(base_wait=RECOVERY_SECONDS)

    def inject(self, kind: str) -> Fault:
        fault = Fault(kind, self.clock(), "")
        self.faults.append(fault)
        started = time.monotonic()
        getattr(self, f"_{kind}_fault")(fault)
        self.progress(f"fault {len(self.faults)} at minute {self.minute(fault.at):.1f}: {fault.detail}")
        fault.healed_seconds = (
            time.monotonic() - started + self.until(self._healed, RECOVERY_SECONDS, f"healing after {fault.detail}")
        )
        self.progress(f"  healed {fault.healed_seconds:.0f}s after it")
        return fault

    def _broker_fault(self, fault: Fault) -> None:
        cluster = self.stack.cluster
        busiest = self.rng.random() < 0.5
        node = cluster.leading_most(self.stack.topic) if busiest else self.rng.choice(cluster.nodes).node_id
        down = self.rng.uniform(3.0, 10.0)
        cluster.kill(node)
        fault.detail = f"SIGKILL of Kafka node {node}{' (leading most input partitions)' if busiest else ''}"
        back_at = time.monotonic() + down
        self.until(lambda: time.monotonic() >= back_at, down + 5, "the outage")
        cluster.restart(node)
        cluster.wait_until_fully_replicated(RECOVERY_SECONDS)
        fault.detail += f", down {down:.0f}s"

    def _rank_fault(self, fault: Fault) -> None:
        worker = self.stack.worker
        rank = self.rng.randrange(2)
        pid = worker.kill_rank(rank)
        code = worker.wait(RECOVERY_SECONDS)
        fault.detail = f"SIGKILL of rank {rank} (pid {pid}); the worker exited with {code}"
        self._restart_worker(worker)

    def _serve_fault(self, fault: Fault) -> None:
        code = self.stack.serve.stop(60)
        fault.detail = f"serve restarted (it exited with {code})"
        self._restart_serve()


def _faults(rng: random.Random) -> Callable[[], str]:
    """The next fault's kind: one of each first, in random order, then any."""
    first = list(KINDS)
    rng.shuffle(first)

    def next_kind() -> str:
        return first.pop(0) if first else rng.choice(KINDS)

    return next_kind


def run(args: argparse.Namespace, progress: Callable[[str], None]) -> dict:
    from streamtrain.bench.common import machine
    from streamtrain.dev.kafka import KafkaCluster
    from streamtrain.dev.stack import Stack

    rng = random.Random(args.seed)
    minutes = 0.0 if args.quick else args.minutes
    load_before = os.getloadavg()
    with contextlib.ExitStack() as scope:
        folder = args.keep or Path(scope.enter_context(tempfile.TemporaryDirectory(prefix="streamtrain-soak-")))
        progress(f"soak: a 3-node Kafka cluster, worker --nproc 2, serve; faults for {minutes:g} min, seed {args.seed}")
        cluster = scope.enter_context(KafkaCluster())
        stack = scope.enter_context(Stack(cluster, TOPIC, Path(folder), args.config))
        stack.create_topics()
        # Bounded: as many events as the soak can use, with an hour to spare for the faults' healing.
        stack.write(int(args.rate * (minutes * 60 + 3600)), args.rate, args.malformed_every, args.seed)
        soak = Soak(stack, rng, progress, minutes=minutes)
        result: dict[str, Any] = {"benchmark": "soak", "machine": machine(), "seed": args.seed}
        try:
            soak.start()
            progress(f"  the worker trains and serve is ready after {soak.clock():.0f}s; faults begin")
            _fault_until(soak, rng, minutes, args.fault_every, args.quick)
        except SoakFailed as error:
            result["failed"] = str(error)
            progress(f"soak: {error}")
        result["minutes"] = round((soak.clock() - (soak.faults_began or soak.clock())) / 60, 2)
        result.update(_judge(soak, stack, Path(folder), progress))
    if "failed" not in result:
        problems = _problems(result)
        if problems:
            result["failed"] = "; ".join(problems)
    result["load_average"] = {"before": list(load_before), "after": list(os.getloadavg())}
    return result


def _reached(soak: Soak, at: float) -> bool:
    return soak.clock() >= at


def _fault_until(soak: Soak, rng: random.Random, minutes: float, every: float, quick: bool) -> None:
    """Faults for ``minutes`` (``quick``: one of each kind), each drawn once the last has healed."""
    next_kind = _faults(rng)
    soak.faults_began = soak.clock()
    end = soak.faults_began + minutes * 60
    while not (quick and len(soak.faults) == len(KINDS)):
        if not quick:
            fault_at = soak.clock() + rng.uniform(0.5, 1.5) * every
            if fault_at >= end:
                soak.until(functools.partial(_reached, soak, end), end - soak.clock() + 60, "the end of the soak")
                return
            soak.until(functools.partial(_reached, soak, fault_at), 1.5 * every + 60, "the time of the next fault")
        soak.inject(next_kind())


def _judge(soak: Soak, stack: Any, folder: Path, progress: Callable[[str], None]) -> dict:
    """Stops the stream, lets the worker train it to the end, stops everything; what it all holds."""
    from streamtrain.dev.stack import ScoreFailed, StackError, export_newest, held_out, model_scores

    judged: dict[str, Any] = {}
    with contextlib.suppress(SoakFailed):
        soak.until(soak._healed, RECOVERY_SECONDS, "the worker and serve back before the end")
    acknowledged = stack.stop_writing()
    contents = stack.contents()
    progress(f"soak: stream stopped; {sum(contents.ends.values()):,} events on the topic, training them to the end")
    reached = stack.wait_until_snapshot_reaches(contents.ends, RECOVERY_SECONDS)
    final_code = stack.worker.stop(120) if stack.worker is not None else None
    if soak.watch is not None:
        soak.watch.stop()
    accounting = stack.account(contents)
    sources = stack.dead_letters()
    missing = contents.malformed - set(sources)
    judged.update(
        lost=accounting.lost,
        duplicated=accounting.duplicated,
        unread=accounting.unread,
        events={
            "on_topic": sum(contents.ends.values()),
            "valid": sum(contents.valid().values()),
            "malformed": len(contents.malformed),
            "acknowledged": acknowledged,
            "trained_in_lineage": sum(accounting.trained.values()),
        },
        lineage={"snapshots": accounting.snapshots, "final_step": accounting.final_step},
        lineage_mismatches=accounting.mismatches[:10],
        dead_letters={
            "malformed": len(contents.malformed),
            "missing": len(missing),
            "repeated": len(sources) - len(set(sources)),
        },
        final_snapshot_at_end_offsets=reached,
        final_worker_exit=final_code,
    )
    now = soak.clock()
    staleness = soak.staleness or Staleness(0.0)
    judged.update(
        max_stale_seconds=round(staleness.max_seconds(now), 2),
        stale_episodes=[
            {
                "at_minute": round(soak.minute(e.started), 2),
                "seconds": round(e.seconds, 2),
                "what": e.what,
                "after": _before(soak, e.started),
            }
            for e in staleness.worst()
        ],
        serve_freshness_max_seconds=round(soak.watch.freshness_max, 2) if soak.watch else None,
        score_checks=soak.watch.score_checks if soak.watch else 0,
        score_failures=len(soak.watch.score_failures) if soak.watch else 0,
        score_failure_examples=soak.watch.score_failures[:3] if soak.watch else [],
        faults={kind: sum(f.kind == kind for f in soak.faults) for kind in KINDS},
        fault_log=[
            {
                "kind": f.kind,
                "at_minute": round(soak.minute(f.at), 2),
                "detail": f.detail,
                "healed_seconds": f.healed_seconds,
            }
            for f in soak.faults
        ],
        restarts=dict(soak.restarts),
        worker_exits=soak.worker_exits,
        outlived_their_worker=soak.outlived,
        unexpected_exits=soak.unexpected,
    )
    serve = stack.serve
    matches: bool | None = None
    try:
        if serve is None or not serve.running:
            raise StackError("serve is not running")
        deadline = time.monotonic() + 120
        while (served := serve.served()) is None or served.step != accounting.final_step:
            if time.monotonic() > deadline:
                raise StackError(f"serve at {served}, not at the final step {accounting.final_step}, after 120s")
            time.sleep(STEP_SECONDS)
        payloads = held_out(200)
        step, base = export_newest(stack.snapshots, folder / "export")
        if step != accounting.final_step:
            raise StackError(f"the newest snapshot is at step {step}, the lineage ends at {accounting.final_step}")
        difference = float(np.abs(serve.score(payloads) - model_scores(base, payloads)).max())
        matches = difference < 1e-6
        judged["serve_export_max_difference"] = difference
    except (StackError, ScoreFailed) as error:
        judged["serve_export_problem"] = str(error)
        matches = False
    judged["serve_matches_export"] = matches
    return judged


def _before(soak: Soak, at: float) -> str | None:
    earlier = [f for f in soak.faults if f.at <= at]
    return f"{earlier[-1].kind} fault at minute {soak.minute(earlier[-1].at):.2f}" if earlier else None


def _problems(result: dict) -> list[str]:
    problems = []
    if result["lost"] or result["duplicated"]:
        problems.append(f"{result['lost']} events lost, {result['duplicated']} trained twice")
    if result["dead_letters"]["missing"]:
        problems.append(f"{result['dead_letters']['missing']} malformed events not dead-lettered")
    if not result["serve_matches_export"]:
        problems.append(f"serve did not end equal to an export: {result.get('serve_export_problem', 'scores differ')}")
    return problems


def table(result: dict) -> str:
    faults = ", ".join(f"{kind} {count}" for kind, count in result.get("faults", {}).items())
    restarts = result.get("restarts", {})
    events = result.get("events", {})
    lines = [
        f"{result.get('minutes', 0):.1f} minutes, seed {result.get('seed')}; faults: {faults}; "
        f"restarts: worker {restarts.get('worker', 0)}, serve {restarts.get('serve', 0)}",
        f"events on the topic {events.get('on_topic', 0):,} ({events.get('malformed', 0):,} malformed); "
        f"trained in the final snapshot's lineage {events.get('trained_in_lineage', 0):,}",
        f"lost {result.get('lost')}   trained twice {result.get('duplicated')}   "
        f"dead letters missing {result.get('dead_letters', {}).get('missing')}",
        f"serve: stale {result.get('max_stale_seconds')}s at most; /score failed {result.get('score_failures')} "
        f"of {result.get('score_checks')} times while ready; "
        f"equal to an export at the end: {result.get('serve_matches_export')}",
    ]
    for episode in result.get("stale_episodes", [])[:3]:
        lines.append(
            f"  stale {episode['seconds']}s at minute {episode['at_minute']}: {episode['what']} ({episode['after']})"
        )
    for fault in result.get("fault_log", []):
        healed = "not healed" if fault["healed_seconds"] is None else f"healed in {fault['healed_seconds']:.0f}s"
        lines.append(f"  minute {fault['at_minute']}: {fault['detail']}; {healed}")
    return "\n".join(lines)
