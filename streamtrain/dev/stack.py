"""The whole deployment on one host, for the cluster fault tests and ``streamtrain bench soak``.

A ``Stack`` holds, on a ``KafkaCluster``: the input and dead-letter topics (the delta topic is
its caller's to create, or the worker's); a stream writer (the synthetic click stream, with
malformed payloads among it); ``streamtrain worker --nproc 2`` with delivery to the delta topic;
and ``streamtrain serve`` following it. Its processes are killed on ``close()``, the ranks and
their children included, however they were started; and the launcher and serve die with the
thread that started them (PR_SET_PDEATHSIG), as the brokers do.

And the checks that judge a run, from what is on the topics and in the snapshots, never from a
process's own counters (a rank restarted from a snapshot trains again, and counts again, what it
trained after that snapshot: that is not a duplicate in the model):

- ``read_topic``: what the input topic holds, its malformed payloads picked out by their bytes;
- ``Lineage``: the final snapshot's line of ancestors, from the snapshots' markers; between each
  two, the events trained must be the offsets read less the malformed among them. An excess is
  events trained twice, a shortfall events lost;
- ``dead_letter_sources``: the (partition, offset) of each dead letter, from its headers;
- ``ServeRun.score`` against ``model_scores`` of ``export_newest``: the served model against an
  export of the newest snapshot.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from streamtrain.bench.common import listening, scrape
from streamtrain.config import PACKAGE_DIR
from streamtrain.dev import CHECKOUT
from streamtrain.dev.kafka import KafkaCluster, die_with_parent, free_port

SCHEMA = PACKAGE_DIR / "schemas" / "click_event.avsc"
# Payloads no decoder accepts, each with its own reason: an empty one, and a varint that never ends.
MALFORMED = (b"", b"\xff" * 11 + b"\x01")
WORLD_SIZE = 2
HELD_OUT_SEED = 99  # the synthetic stream's seed for scoring: training never sees it


class StackError(RuntimeError):
    pass


# --- processes ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Process:
    """A process, told apart from a later one given the same pid by its start time."""

    pid: int
    started: int

    @classmethod
    def of(cls, pid: int) -> _Process | None:
        stat = _stat(pid)
        return None if stat is None else cls(pid, int(stat[19]))

    def alive(self) -> bool:
        stat = _stat(self.pid)
        return stat is not None and int(stat[19]) == self.started and stat[0] != "Z"

    def kill(self) -> None:
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)


def _stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat's fields after the command name (state first); None once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _children(pid: int) -> list[int]:
    children: list[int] = []
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                children += [int(child) for child in (task / "children").read_text().split()]
    return children


def _environment(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    pairs = (entry.split(b"=", 1) for entry in raw.split(b"\0") if b"=" in entry)
    return {key.decode(errors="replace"): value.decode(errors="replace") for key, value in pairs}


def _get(port: int, path: str, timeout: float = 2.0) -> tuple[int, bytes]:
    """The status and body of a GET on 127.0.0.1; status 0 if nothing answered, or nothing listens
    there yet (``bench.common.listening`` says why that is asked first)."""
    if not listening(port):
        return 0, b""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()
    except (OSError, http.client.HTTPException):
        return 0, b""


class WorkerRun:
    """``streamtrain worker --nproc 2``: the launcher and the ranks it starts. Each rank runs in a
    session of its own (torch's launcher starts it so) and may start children (a base export), so
    every process under the launcher is remembered as it is seen, and ``kill()`` ends them all,
    the ones that outlived the launcher too."""

    def __init__(self, config: Path, environment: dict[str, str], log_path: Path, metrics_port: int, *args: str):
        self.metrics_port = metrics_port
        self.log_path = log_path
        with open(log_path, "ab") as log:  # the launcher keeps its own descriptor
            self.process = subprocess.Popen(
                [sys.executable, "-m", "streamtrain", "worker", "--config", str(config)]
                + ["--nproc", str(WORLD_SIZE), *args],
                cwd=CHECKOUT,
                env=environment,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )
        self.started_at = time.time()
        self.seen: set[_Process] = set()
        self.watch()

    def watch(self) -> None:
        """Remembers every process now under the launcher, or under one remembered before."""
        roots = [self.process.pid] + [p.pid for p in self.seen if p.alive()]
        while roots:
            pid = roots.pop()
            for child in _children(pid):
                process = _Process.of(child)
                if process is not None and process not in self.seen:
                    self.seen.add(process)
                    roots.append(child)

    def ranks(self) -> dict[int, int]:
        """{rank: pid} of the ranks running now."""
        ranks = {}
        for child in _children(self.process.pid):
            rank = _environment(child).get("RANK")
            if rank is not None:
                ranks[int(rank)] = child
        return ranks

    @property
    def running(self) -> bool:
        return self.process.poll() is None

    def metrics(self, rank: int) -> dict[str, float]:
        """A rank's metrics as {'name{labels}': value}; empty while it does not answer."""
        return scrape(self.metrics_port + rank)

    def trained(self) -> int:
        """Events this run's ranks have trained since they started (not the model's lineage)."""
        return int(
            sum(
                value
                for rank in range(WORLD_SIZE)
                for key, value in self.metrics(rank).items()
                if key.startswith("streamtrain_events_trained_total{")
            )
        )

    def kill_rank(self, rank: int) -> int:
        """SIGKILLs one rank; its pid."""
        self.watch()
        pid = self.ranks().get(rank)
        if pid is None:
            raise StackError(f"rank {rank} is not running")
        os.kill(pid, signal.SIGKILL)
        return pid

    def wait(self, timeout: float) -> int | None:
        """The launcher's exit code, or None if it still runs after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while self.running and time.monotonic() < deadline:
            self.watch()
            time.sleep(0.2)
        return self.process.poll()

    def stop(self, grace_seconds: float) -> int | None:
        """SIGTERM, as an operator stops it (a final snapshot, delta and base); killed past the
        grace. The exit code (None: it had to be killed)."""
        if self.running:
            self.process.send_signal(signal.SIGTERM)
        code = self.wait(grace_seconds)
        self.kill()
        return code

    def kill(self) -> int:
        """SIGKILLs the launcher and every process ever seen under it that still runs; how many
        of those outlived the launcher (strays a supervisor would otherwise leave behind)."""
        self.watch()
        outlived = 0 if self.running else sum(p.alive() for p in self.seen)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        for _ in range(10):  # children started meanwhile are seen on the next round
            self.watch()
            alive = [p for p in self.seen if p.alive()]
            if not alive:
                break
            for process in alive:
                process.kill()
            time.sleep(0.1)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=10)
        return outlived

    def output(self, characters: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-characters:]


@dataclass(frozen=True)
class Served:
    """Where serve stands: the chain of the base it loaded, the next delta sequence it wants, the step."""

    chain: int
    next_sequence: int
    step: int


class ScoreFailed(RuntimeError):
    pass


class ServeRun:
    """``streamtrain serve`` on a free port, following the bases' folder and the delta topic."""

    def __init__(self, bases: Path, delta_topic: str, bootstrap_servers: str, log_path: Path, base_wait: float):
        self.port = free_port()
        self.log_path = log_path
        with open(log_path, "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "streamtrain", "serve", "--model", str(bases), "--deltas", delta_topic]
                + ["--bootstrap-servers", bootstrap_servers, "--port", str(self.port)]
                + ["--base-wait-seconds", str(base_wait), "--threads", "1"],
                cwd=CHECKOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )

    @property
    def running(self) -> bool:
        return self.process.poll() is None

    def ready(self) -> bool:
        return _get(self.port, "/readyz")[0] == 200

    def metrics(self) -> dict[str, float]:
        """serve's metrics as {'name{labels}': value}; empty while it does not answer."""
        return scrape(self.port)

    def served(self) -> Served | None:
        samples = self.metrics()
        if not samples:
            return None
        return Served(
            int(samples["streamtrain_serve_chain"]),
            int(samples["streamtrain_serve_delta_sequence"]) + 1,
            int(samples["streamtrain_serve_step"]),
        )

    def score(self, payloads: list[bytes], timeout: float = 30.0) -> np.ndarray:
        """Each payload's probabilities from /score; ScoreFailed with the reason otherwise."""
        body = json.dumps({"events": [base64.b64encode(p).decode() for p in payloads]}).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/score", body, {"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout) as reply:
                results = json.loads(reply.read())["results"]
        except urllib.error.HTTPError as error:
            raise ScoreFailed(f"/score answered {error.code}: {error.read()[:300]!r}") from None
        except (OSError, http.client.HTTPException) as error:
            raise ScoreFailed(f"/score: {error}") from None
        failed = [r for r in results if "probabilities" not in r]
        if failed:
            raise ScoreFailed(f"{len(failed)} of {len(results)} events not scored: {failed[:2]}")
        return np.array([r["probabilities"] for r in results], dtype=np.float32)

    def wait_ready(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.running:
            if self.ready():
                return True
            time.sleep(0.25)
        return False

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM; killed past ``timeout``. The exit code (None: it had to be killed)."""
        if self.running:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return None

    def kill(self) -> None:
        if self.running:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=10)

    def output(self, characters: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-characters:]


class StreamWriter:
    """The stream a run trains on, written from two threads until ``stop()``: the synthetic click
    stream (``streamtrain produce``'s) at ``rate`` events/s, at most ``count`` events, and beside
    it one malformed payload for every ``malformed_every`` events, spread over the partitions.
    Both producers are idempotent with acks=all, and wait out a broker's absence."""

    def __init__(
        self,
        bootstrap_servers: str,
        topic: str,
        partitions: int,
        count: int,
        rate: float,
        malformed_every: int,
        seed: int,
    ):
        self.stopping = threading.Event()
        self.errors: list[str] = []
        self.valid = 0  # acknowledged, once stopped
        self.malformed = 0
        self._threads = [
            threading.Thread(
                target=self._guarded,
                args=(self._write_valid, bootstrap_servers, topic, partitions, count, rate, seed),
                name="streamtrain-stack-events",
                daemon=True,
            ),
            threading.Thread(
                target=self._guarded,
                args=(self._write_malformed, bootstrap_servers, topic, partitions, count // malformed_every)
                + (rate / malformed_every,),
                name="streamtrain-stack-malformed",
                daemon=True,
            ),
        ]
        for thread in self._threads:
            thread.start()

    def _guarded(self, write: Any, *args: Any) -> None:
        try:
            write(*args)
        except Exception as error:
            self.errors.append(f"{type(error).__name__}: {error}")

    def _write_valid(self, bootstrap_servers: str, topic: str, partitions: int, count: int, rate: float, seed: int):
        from streamtrain.dev.produce import produce

        report = produce(
            bootstrap_servers,
            topic,
            count,
            partitions=partitions,
            seed=seed,
            rate=rate,
            schema_path=SCHEMA,
            should_stop=self.stopping.is_set,
        )
        self.valid = report.produced

    def _write_malformed(self, bootstrap_servers: str, topic: str, partitions: int, count: int, rate: float) -> None:
        from confluent_kafka import KafkaError, KafkaException, Producer

        # Partitions added to the topic reach a fresh producer's metadata a moment later: refreshed
        # each second, and a send to one it does not know yet waits for the refresh.
        producer = Producer(
            {
                "bootstrap.servers": bootstrap_servers,
                "enable.idempotence": True,
                "linger.ms": 5,
                "topic.metadata.refresh.interval.ms": 1000,
            }
        )
        failures: list[str] = []

        def delivered(error: Any, _message: Any) -> None:
            if error is not None:
                failures.append(str(error))

        sent = 0
        started = time.monotonic()
        while sent < count and not self.stopping.wait(max(started + sent / rate - time.monotonic(), 0.0)):
            unknown_since = time.monotonic()
            while True:
                try:
                    producer.produce(
                        topic, MALFORMED[sent % len(MALFORMED)], partition=sent % partitions, on_delivery=delivered
                    )
                    break
                except KafkaException as error:
                    if error.args[0].code() != KafkaError._UNKNOWN_PARTITION or time.monotonic() - unknown_since > 60:
                        raise
                    producer.poll(0.2)
            producer.poll(0)
            sent += 1
        if producer.flush(120) or failures:
            raise StackError(f"malformed payloads undelivered: {failures[:3]}")
        self.malformed = sent

    def stop(self, timeout: float = 180.0) -> None:
        """Stops both writers once every event sent is acknowledged; StackError if one failed."""
        self.stopping.set()
        for thread in self._threads:
            thread.join(timeout)
        if any(thread.is_alive() for thread in self._threads) or self.errors:
            raise StackError(f"the stream writer failed: {self.errors or 'still flushing after the timeout'}")


# --- what the topics and snapshots hold -----------------------------------------------------------


@dataclass
class TopicContents:
    """A topic read back from its start: each partition's end offset, and where its malformed payloads are."""

    ends: dict[int, int]
    malformed: set[tuple[int, int]]

    def valid(self) -> dict[int, int]:
        """Events per partition that a worker should train: all but the malformed."""
        bad = {p: sum(1 for q, _o in self.malformed if q == p) for p in self.ends}
        return {p: end - bad[p] for p, end in self.ends.items()}

    def malformed_between(self, partition: int, start: int, end: int) -> int:
        return sum(1 for p, o in self.malformed if p == partition and start <= o < end)


def _reader(bootstrap_servers: str) -> Any:
    from confluent_kafka import Consumer

    return Consumer(
        {
            "bootstrap.servers": bootstrap_servers,
            "group.id": f"streamtrain-stack-reader-{time.monotonic_ns()}",
            "enable.auto.commit": False,
            "broker.address.family": "v4",
            "fetch.wait.max.ms": 50,
        }
    )


def _read_all(bootstrap_servers: str, topic: str, partitions: int, timeout: float) -> tuple[dict[int, int], list]:
    """Every message of ``topic`` from its start to the end offsets found first; StackError if
    they do not all arrive within ``timeout`` seconds."""
    from confluent_kafka import TopicPartition

    consumer = _reader(bootstrap_servers)
    try:
        ends = {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=30)[1] for p in range(partitions)}
        consumer.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
        messages: list = []
        deadline = time.monotonic() + timeout
        while len(messages) < sum(ends.values()):
            if time.monotonic() > deadline:
                raise StackError(f"read {len(messages):,} of {sum(ends.values()):,} messages of {topic} in {timeout}s")
            for message in consumer.consume(1000, 0.5):
                if message.error() is None and message.offset() < ends[message.partition()]:
                    messages.append(message)
        return ends, messages
    finally:
        consumer.close()


def read_messages(bootstrap_servers: str, topic: str, partitions: int, timeout: float = 120.0) -> list:
    """Every message of ``topic``, from its start to its end offsets now."""
    return _read_all(bootstrap_servers, topic, partitions, timeout)[1]


def read_topic(bootstrap_servers: str, topic: str, partitions: int, timeout: float = 120.0) -> TopicContents:
    ends, messages = _read_all(bootstrap_servers, topic, partitions, timeout)
    return TopicContents(ends, {(m.partition(), m.offset()) for m in messages if (m.value() or b"") in MALFORMED})


def dead_letter_sources(bootstrap_servers: str, topic: str, timeout: float = 60.0) -> list[tuple[int, int]]:
    """The source (partition, offset) of every dead letter on ``topic`` (one partition), repeats kept."""
    from streamtrain.deadletter import HEADER_OFFSET, HEADER_PARTITION

    _ends, messages = _read_all(bootstrap_servers, topic, 1, timeout)
    sources = []
    for message in messages:
        headers = dict(message.headers() or [])
        sources.append((int(headers[HEADER_PARTITION]), int(headers[HEADER_OFFSET])))
    return sources


@dataclass
class Accounting:
    """Every event of the input against the final snapshot's lineage. ``lost``: valid events
    below the final positions that the lineage did not train, plus those past them (unread);
    ``duplicated``: events the lineage trained more than once."""

    lost: int
    duplicated: int
    unread: int
    final_step: int
    trained: dict[int, int]
    next_offsets: dict[int, int]
    snapshots: int  # in the lineage
    mismatches: list[str] = field(default_factory=list)


class Lineage:
    """The snapshots' markers, gathered as they appear (``collect``), so that retention removing a
    snapshot later loses nothing; ``account`` follows the final snapshot's line of ancestors."""

    def __init__(self, root: Path):
        self.root = root
        self.markers: dict[str, dict] = {}  # by folder, a replayed step's new cut replacing the old
        self._lock = threading.Lock()

    def collect(self) -> None:
        from streamtrain.checkpoint import MARKER

        with self._lock:
            for path in self.root.glob(f"step-*/{MARKER}"):
                with contextlib.suppress(OSError, ValueError):
                    marker = json.loads(path.read_text())
                    known = self.markers.get(path.parent.name)
                    if known is None or known.get("commit", 0) < marker.get("commit", 0):
                        self.markers[path.parent.name] = marker

    def collect_every(self, seconds: float, stop: threading.Event) -> threading.Thread:
        """Collects on a thread of its own until ``stop``: retention keeps only the newest few."""

        def run() -> None:
            while not stop.wait(seconds):
                self.collect()

        thread = threading.Thread(target=run, name="streamtrain-stack-lineage", daemon=True)
        thread.start()
        return thread

    def line(self) -> list[dict]:
        """The final snapshot and its ancestors, oldest first: in commit order, a snapshot whose
        step is not past the one before it was cut by a run restored from an earlier one, so the
        snapshots after that earlier one are not its ancestors."""
        line: list[dict] = []
        with self._lock:
            markers = list(self.markers.values())
        for marker in sorted(markers, key=lambda m: (m.get("commit", 0), m["wall_time"])):
            while line and line[-1]["stream"]["step"] >= marker["stream"]["step"]:
                line.pop()
            line.append(marker)
        return line

    def account(self, contents: TopicContents) -> Accounting:
        line = self.line()
        if not line:
            raise StackError(f"no committed snapshot under {self.root}")
        lost = duplicated = 0
        mismatches = []
        before: dict[str, Any] = {"step": -1, "next_offsets": {}, "trained": {}}
        for marker in line:
            stream = marker["stream"]
            for p in contents.ends:
                start, end = int(before["next_offsets"].get(str(p), 0)), int(stream["next_offsets"].get(str(p), 0))
                expected = end - start - contents.malformed_between(p, start, end)
                trained = int(stream["trained"].get(str(p), 0)) - int(before["trained"].get(str(p), 0))
                if trained != expected:
                    mismatches.append(
                        f"partition {p}, steps {before['step']}..{stream['step']}: offsets {start}..{end} hold "
                        f"{expected} valid events, {trained} trained"
                    )
                    lost += max(expected - trained, 0)
                    duplicated += max(trained - expected, 0)
            before = stream
        final = {int(p): int(o) for p, o in before["next_offsets"].items()}
        unread = sum(
            end - final.get(p, 0) - contents.malformed_between(p, final.get(p, 0), end)
            for p, end in contents.ends.items()
        )
        return Accounting(
            lost + unread,
            duplicated,
            unread,
            int(before["step"]),
            {int(p): int(n) for p, n in before["trained"].items()},
            final,
            len(line),
            mismatches,
        )


def held_out(count: int) -> list[bytes]:
    """Avro payloads of events from a seed training never sees, for scoring."""
    from streamtrain.dev.produce import AvroEncoder, ClickStream

    stream, encoder = ClickStream(HELD_OUT_SEED, 0), AvroEncoder(SCHEMA)
    return [encoder.encode(record) for record in stream.chunk(max(count, 1)).records[:count]]


def model_scores(base: Path, payloads: list[bytes]) -> np.ndarray:
    """The probabilities the base in ``base`` gives ``payloads``, scored in this process."""
    from streamtrain.decode import AvroBatchDecoder
    from streamtrain.delivery.artifact import ServableModel
    from streamtrain.registry import schema_source
    from streamtrain.source import RawEvent

    model = ServableModel(base)
    tasks = [task.model_copy(update={"required": False}) for task in model.tasks]
    decoder = AvroBatchDecoder(model.features, schema_source(model.features), tasks)
    decoded = decoder.decode([RawEvent(0, i, payload, -1) for i, payload in enumerate(payloads)])
    if decoded.rejected:
        raise StackError(f"held-out events rejected: {decoded.rejected[:2]}")
    return model.score(decoded.batch)


def export_newest(snapshots: Path, scratch: Path) -> tuple[int, Path]:
    """The newest committed snapshot, copied under ``scratch`` (retention may remove it meanwhile)
    and exported there on its own, no delta involved: its step and the base's folder."""
    from streamtrain.checkpoint import MARKER
    from streamtrain.delivery.artifact import export_snapshot

    for _ in range(10):  # one removed by retention while it is copied: the next newest
        committed = sorted(snapshots.glob(f"step-*[0-9]/{MARKER}"), reverse=True)
        if not committed:
            raise StackError(f"no committed snapshot under {snapshots}")
        folder = committed[0].parent
        copy = scratch / "snapshots" / folder.name
        shutil.rmtree(copy, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError, shutil.Error):
            shutil.copytree(folder, copy)
            step = int(json.loads((copy / MARKER).read_text())["stream"]["step"])
            return step, export_snapshot(copy.parent, step, scratch / "bases", version=1_000_000 + step)
    raise StackError(f"the newest snapshot under {snapshots} kept being removed while it was copied")


# --- the stack ------------------------------------------------------------------------------------


class Stack:
    """A run's topics and processes on ``cluster``, its files under ``workdir``."""

    def __init__(
        self,
        cluster: KafkaCluster,
        topic: str,
        workdir: Path,
        config: Path,
        partitions: int = 4,
        environment: dict[str, str] | None = None,
    ):
        self.cluster = cluster
        self.topic = topic
        self.dead_letter_topic = f"{topic}.dlq"
        self.delta_topic = f"{topic}.model"
        self.workdir = workdir
        self.config = config
        self.partitions = partitions
        self.snapshots = workdir / "snapshots"
        self.bases = workdir / "serving"
        self.environment = environment or {}
        self.lineage = Lineage(self.snapshots)
        self.worker: WorkerRun | None = None
        self.serve: ServeRun | None = None
        self.writer: StreamWriter | None = None
        self.starts = {"worker": 0, "serve": 0}
        self.acknowledged = {"valid": 0, "malformed": 0}
        self.closing = threading.Event()
        workdir.mkdir(parents=True, exist_ok=True)
        self.lineage.collect_every(0.5, self.closing)

    @property
    def bootstrap_servers(self) -> str:
        return self.cluster.bootstrap_servers

    def create_topics(self) -> None:
        """The input topic; the worker creates the topics it writes (dead letters, deltas)."""
        self.cluster.create_topic(self.topic, self.partitions)

    def worker_environment(self, metrics_port: int) -> dict[str, str]:
        """The worker's settings, as STREAMTRAIN_SECTION__FIELD: snapshots every 3 s, a delta every
        second to the delta topic, dead letters to theirs; then the stack's own ``environment``."""
        return {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1",
            "STREAMTRAIN_KAFKA__BOOTSTRAP_SERVERS": self.bootstrap_servers,
            "STREAMTRAIN_KAFKA__TOPIC": self.topic,
            "STREAMTRAIN_KAFKA__GROUP_ID": f"streamtrain-{self.topic}",
            "STREAMTRAIN_METRICS__PORT": str(metrics_port),
            "STREAMTRAIN_CHECKPOINT__PATH": str(self.snapshots),
            "STREAMTRAIN_CHECKPOINT__INTERVAL_SECONDS": "3",
            "STREAMTRAIN_DEAD_LETTER__ENABLED": "true",
            "STREAMTRAIN_DEAD_LETTER__TOPIC": self.dead_letter_topic,
            "STREAMTRAIN_DEAD_LETTER__DELIVERY_TIMEOUT_SECONDS": "10",
            "STREAMTRAIN_DEAD_LETTER__RETRY_BACKOFF_MAX_SECONDS": "2",
            "STREAMTRAIN_DELIVERY__ENABLED": "true",
            "STREAMTRAIN_DELIVERY__TOPIC": self.delta_topic,
            "STREAMTRAIN_DELIVERY__PATH": str(self.bases),
            "STREAMTRAIN_DELIVERY__DELTA_INTERVAL_SECONDS": "1",
            "STREAMTRAIN_DELIVERY__BASE_INTERVAL_SECONDS": "3600",
            "STREAMTRAIN_DELIVERY__DELIVERY_TIMEOUT_SECONDS": "10",
            "STREAMTRAIN_DISTRIBUTED__TIMEOUT_SECONDS": "30",
            "STREAMTRAIN_DISTRIBUTED__SHUTDOWN_GRACE_SECONDS": "60",
            **self.environment,
        }

    def write(self, count: int, rate: float, malformed_every: int = 100, seed: int = 0) -> StreamWriter:
        if self.writer is not None:
            raise StackError("one stream writer at a time")
        self.writer = StreamWriter(
            self.bootstrap_servers, self.topic, self.partitions, count, rate, malformed_every, seed
        )
        return self.writer

    def stop_writing(self) -> dict[str, int]:
        """Stops the stream writer; the events acknowledged by every writer so far, by kind."""
        writer, self.writer = self.writer, None
        if writer is None:
            raise StackError("no stream writer runs")
        writer.stop()
        self.acknowledged["valid"] += writer.valid
        self.acknowledged["malformed"] += writer.malformed
        return dict(self.acknowledged)

    def start_worker(self, *args: str) -> WorkerRun:
        if self.worker is not None and self.worker.running:
            raise StackError("the worker runs already")
        port = free_port(WORLD_SIZE)
        log = self.workdir / "worker.log"
        self.starts["worker"] += 1
        with open(log, "ab") as out:
            out.write(f"\n=== start {self.starts['worker']} at {time.strftime('%H:%M:%S')}\n".encode())
        self.worker = WorkerRun(self.config, self.worker_environment(port), log, port, *args)
        return self.worker

    def wait_for_base(self, timeout: float) -> None:
        """Until the worker has published a base for serve to start from."""
        deadline = time.monotonic() + timeout
        while not (self.bases / "current.json").exists():
            if time.monotonic() > deadline:
                raise StackError(f"no base under {self.bases} after {timeout:.0f}s")
            if self.worker is not None and not self.worker.running:
                raise StackError(f"the worker exited with {self.worker.process.poll()}:\n{self.worker.output()}")
            time.sleep(0.25)

    def start_serve(self, base_wait: float = 60.0) -> ServeRun:
        if self.serve is not None and self.serve.running:
            raise StackError("serve runs already")
        log = self.workdir / "serve.log"
        self.starts["serve"] += 1
        with open(log, "ab") as out:
            out.write(f"\n=== start {self.starts['serve']} at {time.strftime('%H:%M:%S')}\n".encode())
        self.serve = ServeRun(self.bases, self.delta_topic, self.bootstrap_servers, log, base_wait)
        return self.serve

    def wait_until_snapshot_reaches(self, ends: dict[int, int], timeout: float) -> bool:
        """Until a committed snapshot's positions are ``ends``: everything there read and trained."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.lineage.collect()
            line = self.lineage.line()
            if line and {int(p): o for p, o in line[-1]["stream"]["next_offsets"].items()} == ends:
                return True
            if self.worker is not None:
                self.worker.watch()
            time.sleep(0.5)
        return False

    def chain(self) -> int | None:
        """The running worker's delta chain, from the first snapshot it commits (every start begins
        a chain); None before then."""
        self.lineage.collect()
        line = self.lineage.line()
        if not line or self.worker is None or line[-1]["wall_time"] < self.worker.started_at:
            return None
        delivery = line[-1]["stream"].get("delivery")
        return int(delivery["chain"]) if delivery else None

    def contents(self) -> TopicContents:
        return read_topic(self.bootstrap_servers, self.topic, self.partitions)

    def account(self, contents: TopicContents) -> Accounting:
        self.lineage.collect()
        return self.lineage.account(contents)

    def dead_letters(self) -> list[tuple[int, int]]:
        return dead_letter_sources(self.bootstrap_servers, self.dead_letter_topic)

    def close(self) -> None:
        """Kills whatever still runs: the writer's threads end with their next pause."""
        self.closing.set()
        if self.writer is not None:
            self.writer.stopping.set()
        if self.serve is not None:
            self.serve.kill()
        if self.worker is not None:
            self.worker.kill()

    def __enter__(self) -> Stack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
