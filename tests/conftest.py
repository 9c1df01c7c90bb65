"""Shared fixtures and helpers: one real Kafka broker per test session, workers run against it, the
topic's offsets, and a writer-schema source for the decoder tests."""

from __future__ import annotations

import contextlib
import inspect
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch.distributed as dist
from confluent_kafka import Consumer, TopicPartition

from streamtrain.bench.common import cpu_seconds, scrape  # noqa: F401 (cpu_seconds: for the tests)
from streamtrain.dev.kafka import KafkaBroker, free_port

REPO = Path(__file__).resolve().parent.parent
SMALL_CONFIG = REPO / "tests" / "worker-small.yaml"
SCHEMA = REPO / "schemas" / "click_event.avsc"


# What makes a test integration (`make test-fast` runs the others): a fixture that starts a Kafka
# broker, a worker process or a producer; or a test, one of its fixtures, or a helper of its module
# they call, that starts a broker of its own, several ranks or a benchmark. Marked here, so that a
# new test is sorted without anyone marking it.
BROKER_FIXTURES = {"kafka", "sasl_kafka", "start_worker", "start_ranks", "live_producer"}
STARTS_PROCESSES = re.compile(
    r"\bmp\.spawn\(|\btrain_states\(|\bKafkaBroker\(|\bstart_processes\(|\"-m\", \"streamtrain\", \"bench\""
)
CALLED = re.compile(r"\b([A-Za-z_]\w*)\(")


def _starts_processes(function, seen: set | None = None) -> bool:
    """Whether ``function``, or a function of its module that it calls (to any depth), starts them."""
    seen = set() if seen is None else seen
    if function in seen:
        return False
    seen.add(function)
    try:
        source = inspect.getsource(function)
    except (OSError, TypeError):
        return False
    if STARTS_PROCESSES.search(source):
        return True
    module = inspect.getmodule(function)
    helpers = [getattr(module, name, None) for name in set(CALLED.findall(source))]
    return any(_starts_processes(h, seen) for h in helpers if inspect.isfunction(h) and inspect.getmodule(h) is module)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        fixtures = getattr(item, "_fixtureinfo", None)
        functions = [getattr(item, "function", None)]
        functions += [d.func for defs in (fixtures.name2fixturedefs.values() if fixtures else ()) for d in defs]
        if BROKER_FIXTURES & set(getattr(item, "fixturenames", ())) or any(
            _starts_processes(f) for f in functions if f is not None
        ):
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="session")
def kafka():
    with KafkaBroker() as broker:
        yield broker


def end_offsets(kafka: KafkaBroker, topic: str, partitions: int = 4) -> dict[int, int]:
    consumer = Consumer({"bootstrap.servers": kafka.bootstrap_servers, "group.id": "inspector"})
    try:
        return {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in range(partitions)}
    finally:
        consumer.close()


def committed_offsets(kafka: KafkaBroker, topic: str, group: str, partitions: int = 4) -> dict[int, int]:
    consumer = Consumer({"bootstrap.servers": kafka.bootstrap_servers, "group.id": group})
    try:
        return {
            tp.partition: tp.offset
            for tp in consumer.committed([TopicPartition(topic, p) for p in range(partitions)], timeout=10)
        }
    finally:
        consumer.close()


class Schemas:
    """A schema source from a dict, as tests/test_wire_format.py's registry would answer."""

    def __init__(self, schemas: dict[int, dict]):
        self.schemas = schemas

    def writer_schema(self, schema_id: int) -> dict | None:
        return self.schemas.get(schema_id)


def prometheus_tool(name: str) -> str:
    """The path of a binary of Debian's prometheus package. Missing, it skips on a developer's
    machine but fails under CI, whose `make test` installs it: there a skip would hide that the
    scraping and alert tests never ran."""
    path = shutil.which(name)
    if path is None:
        message = (
            f"{name}: Debian's prometheus package is not installed (make setup installs it with apt-get when it can)"
        )
        (pytest.fail if os.environ.get("CI") else pytest.skip)(message)
    return path


def join_as_spawned_rank(rank: int, world_size: int, port: int) -> None:
    """Sets the environment torchrun would give a rank of a single-node run on 127.0.0.1:``port``."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )


def leave_spawned_rank() -> None:
    """Ends a spawned test rank once its results are written, skipping the C++ destructors at
    interpreter exit: a rank holding a Trainer once aborted there in CI ("terminate called without
    an active exception") after its work was done, which fails the spawn for no fault of the test."""
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class LiveProducer:
    """``streamtrain produce`` at ``rate`` events/s in the background, bounded by ``count`` events,
    until ``stop()``. Its output goes to a file: a pipe that nobody reads while it runs could fill up
    (librdkafka complains through a broker outage) and stall it."""

    def __init__(self, bootstrap_servers: str, topic: str, count: int, rate: float, log_path: Path, *args: str):
        self.log_path = log_path
        with open(log_path, "wb") as log:  # the child keeps its own descriptor
            self.process = subprocess.Popen(
                [sys.executable, "-m", "streamtrain", "produce", "--bootstrap-servers", bootstrap_servers,
                 "--topic", topic, "--count", str(count), "--rate", str(rate), *args],
                cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip

    @property
    def running(self) -> bool:
        return self.process.poll() is None

    def stop(self, timeout: float = 90.0) -> None:
        """SIGTERM: the producer flushes what it sent, reports and exits."""
        if self.running:
            self.process.send_signal(signal.SIGTERM)
        self.process.wait(timeout=timeout)

    def produced(self) -> int:
        """How many events it produced, from its final report; fails the test unless it exited cleanly."""
        output = self.log_path.read_text(errors="replace")
        assert self.process.returncode == 0, output[-3000:]
        return int(re.search(r"produced ([\d,]+) events to", output)[1].replace(",", ""))


@pytest.fixture
def live_producer(tmp_path):
    """Starts ``LiveProducer``s; any still running at the end of the test is killed."""
    started: list[LiveProducer] = []

    def start(bootstrap_servers: str, topic: str, count: int, rate: float, *args: str) -> LiveProducer:
        producer = LiveProducer(bootstrap_servers, topic, count, rate, tmp_path / f"producer-{len(started)}.log", *args)
        started.append(producer)
        return producer

    yield start
    for producer in started:
        if producer.running:
            producer.process.kill()
            producer.process.wait(timeout=10)


@pytest.fixture
def topic_name(request) -> str:
    return re.sub(r"[^a-zA-Z0-9]", "-", request.node.name)[:80] + "-" + uuid.uuid4().hex[:6]


class WorkerProcess:
    """``python -m streamtrain worker`` in a subprocess, its metrics on a known port. ``launcher``
    goes between the interpreter and ``-m streamtrain``, e.g. ``["-m", "torch.distributed.run", ...]``."""

    def __init__(
        self,
        kafka: KafkaBroker,
        topic: str,
        *args: str,
        config: Path = SMALL_CONFIG,
        env: dict[str, str] | None = None,
        local_rank: int = 0,
        launcher: Sequence[str] = (),
        cwd: Path = REPO,
    ):
        self.metrics_port = free_port()
        self.log_path = Path(f"/tmp/streamtrain-test-{topic}-{self.metrics_port}.log")
        environ = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "STREAMTRAIN_KAFKA__BOOTSTRAP_SERVERS": kafka.bootstrap_servers,
            "STREAMTRAIN_KAFKA__TOPIC": topic,
            "STREAMTRAIN_KAFKA__GROUP_ID": f"group-{topic}",
            # each rank serves base port + local rank
            "STREAMTRAIN_METRICS__PORT": str(self.metrics_port - local_rank),
            **(env or {}),
        }
        self.log = open(self.log_path, "wb")  # noqa: SIM115 - the worker writes it until it is killed
        self.process = subprocess.Popen(
            [sys.executable, *launcher, "-m", "streamtrain", "worker", "--config", str(config), *args],
            cwd=cwd,
            env=environ,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def output(self) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")

    def scrape(self) -> dict[str, float]:
        """The metrics endpoint's samples as {'name{labels}': value}; empty if it is not up."""
        return scrape(self.metrics_port)

    def total(self, metric: str, samples: dict[str, float] | None = None) -> float:
        samples = self.scrape() if samples is None else samples
        return sum(v for k, v in samples.items() if k == metric or k.startswith(metric + "{"))

    def wait_for(self, condition, timeout: float, what: str):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = condition()
            if value:
                return value
            if self.process.poll() is not None:
                pytest.fail(
                    f"worker exited with {self.process.returncode} while waiting for {what}:\n{self.output()[-4000:]}"
                )
            time.sleep(0.25)
        pytest.fail(f"timed out after {timeout}s waiting for {what}:\n{self.output()[-4000:]}\n{self.stacks()}")

    def stacks(self) -> str:
        """The worker's Python stacks, when py-spy is installed: what a hang was waiting for."""
        try:
            return subprocess.run(
                ["py-spy", "dump", "--native", "--pid", str(self.process.pid)],
                capture_output=True,
                text=True,
                timeout=30,
            ).stdout
        except (OSError, subprocess.TimeoutExpired):
            return ""

    def signal(self, signum: int = signal.SIGTERM) -> None:
        self.process.send_signal(signum)

    def wait(self, timeout: float) -> int:
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"worker still running after {timeout}s:\n{self.output()[-4000:]}\n{self.stacks()}")

    def kill(self) -> None:
        """SIGKILL the process group, and under a launcher its ranks too: torchrun starts each rank in
        a session of its own, where a rank outlives its killed torchrun."""
        if self.process.poll() is None:
            for child in Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children").read_text().split():
                with contextlib.suppress(ProcessLookupError):  # not a group leader: it dies with the group below
                    os.killpg(int(child), signal.SIGKILL)
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)
        self.log.close()


@pytest.fixture
def start_worker(request):
    """Starts workers on the session broker, or on ``broker`` (a test's own); killed at the end."""
    started: list[WorkerProcess] = []

    def start(topic: str, *args: str, broker: KafkaBroker | None = None, **kwargs) -> WorkerProcess:
        worker = WorkerProcess(broker or request.getfixturevalue("kafka"), topic, *args, **kwargs)
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.kill()


@pytest.fixture
def start_ranks(start_worker):
    """``world_size`` worker processes joined as torchrun would join them (RANK, WORLD_SIZE, MASTER_*)."""

    def start(
        topic: str,
        world_size: int,
        *args: str,
        env: dict[str, str] | None = None,
        broker: KafkaBroker | None = None,
        config: Path = SMALL_CONFIG,
    ) -> list[WorkerProcess]:
        master_port = str(free_port())
        return [
            start_worker(
                topic,
                *args,
                broker=broker,
                config=config,
                local_rank=rank,
                env={
                    "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": master_port,
                    "RANK": str(rank),
                    "WORLD_SIZE": str(world_size),
                    "LOCAL_RANK": str(rank),
                    "LOCAL_WORLD_SIZE": str(world_size),
                    **(env or {}),
                },
            )
            for rank in range(world_size)
        ]

    return start
