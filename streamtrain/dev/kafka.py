"""A throwaway single-node Apache Kafka broker (KRaft) for tests, benchmarks and the demo.

It runs the real broker from the jars that ``make setup`` copies out of Maven Central into the
checkout's .cache/, or from the folder STREAMTRAIN_KAFKA_LIBS names (an installed package has no
.cache/), on 127.0.0.1 and free ports, with a fresh log dir. The JVM dies with its parent: it is
stopped on ``close()``, at interpreter exit, and by the kernel (PR_SET_PDEATHSIG) if the parent is killed.
``kill()`` crashes it (SIGKILL) and ``restart()`` brings it back on the same ports and log dir, for
outage tests. ``sasl=(user, password)`` puts SASL_PLAINTEXT with SCRAM-SHA-512 on the client
listener; ``client_config`` then holds what a client needs to log in.
"""

from __future__ import annotations

import atexit
import base64
import contextlib
import ctypes
import fcntl
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

from confluent_kafka.admin import AdminClient, NewTopic

from streamtrain.dev import CHECKOUT

KAFKA_VERSION = "4.1.1"
DEFAULT_LIBS = CHECKOUT / ".cache" / "kafka" / KAFKA_VERSION / "libs"

_LOG4J2 = """\
rootLogger.level = INFO
rootLogger.appenderRef.file.ref = FILE
appender.file.type = File
appender.file.name = FILE
appender.file.fileName = {log}
appender.file.layout.type = PatternLayout
appender.file.layout.pattern = [%d] %p %m (%c)%n
"""


class BrokerError(RuntimeError):
    pass


# Ports handed out on this machine, claimed in a folder that every process asking shares (the
# test suite's pytest-xdist workers, a benchmark beside them): the kernel may offer a just-released
# port again, to this process or another, before the worker given it has bound it, and two workers
# given one port share a log and fight over their metrics port. A claim lapses after an hour.
PORT_CLAIMS = Path(tempfile.gettempdir()) / f"streamtrain-ports-{os.getuid()}"
CLAIM_SECONDS = 3600.0


def _claim(ports: range) -> bool:
    """Claims ``ports`` for the caller, unless any of them was claimed within CLAIM_SECONDS."""
    PORT_CLAIMS.mkdir(exist_ok=True)
    with open(PORT_CLAIMS / "lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        claims = [PORT_CLAIMS / str(port) for port in ports]
        for claim in claims:
            with contextlib.suppress(FileNotFoundError):
                if time.time() - claim.stat().st_mtime < CLAIM_SECONDS:
                    return False
        for claim in claims:
            claim.touch()
        return True


def free_port(count: int = 1) -> int:
    """A port p on 127.0.0.1 such that p, ..., p + count - 1 are free now and were handed to no
    process on this machine within the last hour (a worker's rank r serves metrics on p + r)."""
    for _ in range(1000):
        with contextlib.ExitStack() as held:
            first = held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            first.bind(("127.0.0.1", 0))
            port = first.getsockname()[1]
            try:
                for following in range(port + 1, port + count):
                    held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM)).bind(("127.0.0.1", following))
            except OSError:
                continue
        if _claim(range(port, port + count)):
            return port
    raise BrokerError(f"no {count} adjacent free port(s) on 127.0.0.1 in 1,000 tries")


def _die_with_parent() -> None:
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


class KafkaBroker:
    """``with KafkaBroker() as broker: broker.bootstrap_servers`` -> '127.0.0.1:<port>'."""

    def __init__(
        self,
        libs: Path | None = None,
        port: int | None = None,
        start_timeout: float = 90.0,
        sasl: tuple[str, str] | None = None,
    ):
        self.libs = Path(libs or os.environ.get("STREAMTRAIN_KAFKA_LIBS") or DEFAULT_LIBS)
        self.port = port or free_port()
        self.controller_port = free_port()
        self.start_timeout = start_timeout
        self.workdir = Path(tempfile.mkdtemp(prefix="streamtrain-kafka-"))
        self.log_path = self.workdir / "server.log"
        self.sasl = sasl
        self._process: subprocess.Popen | None = None

    @property
    def bootstrap_servers(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def client_config(self) -> dict[str, str]:
        """librdkafka properties a client needs besides bootstrap.servers: the login in SASL mode."""
        if self.sasl is None:
            return {}
        user, password = self.sasl
        return {
            "security.protocol": "SASL_PLAINTEXT",
            "sasl.mechanism": "SCRAM-SHA-512",
            "sasl.username": user,
            "sasl.password": password,
        }

    def __enter__(self) -> KafkaBroker:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _java(self, main_class: str, *args: str) -> list[str]:
        return [
            "java",
            "-Xms256m",
            "-Xmx512m",
            "-XX:+UseSerialGC",
            "-XX:TieredStopAtLevel=1",
            f"-Dlog4j2.configurationFile={self.workdir / 'log4j2.properties'}",
            "-cp",
            f"{self.libs}/*",
            main_class,
            *args,
        ]

    def start(self) -> None:
        if not any(self.libs.glob("kafka_2.13-*.jar")):
            raise BrokerError(
                f"no Kafka jars in {self.libs}: in a checkout, run `make setup` (it fetches them with mvn); "
                f"elsewhere, set STREAMTRAIN_KAFKA_LIBS to a folder holding Kafka {KAFKA_VERSION}'s broker jars "
                f"(`mvn -f deploy/kafka/pom.xml package -Dlibs.dir=FOLDER` fetches them there)"
            )
        (self.workdir / "log4j2.properties").write_text(_LOG4J2.format(log=self.log_path))
        properties = self.workdir / "server.properties"
        # The listener is named after its protocol; the controller's stays PLAINTEXT.
        listener = "PLAINTEXT" if self.sasl is None else "SASL_PLAINTEXT"
        properties.write_text(
            "\n".join(
                [
                    "process.roles=broker,controller",
                    "node.id=1",
                    f"controller.quorum.voters=1@127.0.0.1:{self.controller_port}",
                    f"listeners={listener}://127.0.0.1:{self.port},CONTROLLER://127.0.0.1:{self.controller_port}",
                    f"advertised.listeners={listener}://127.0.0.1:{self.port}",
                    "controller.listener.names=CONTROLLER",
                    f"inter.broker.listener.name={listener}",
                    f"listener.security.protocol.map=CONTROLLER:PLAINTEXT,{listener}:{listener}",
                    *self._sasl_properties(),
                    f"log.dirs={self.workdir / 'data'}",
                    "num.partitions=1",
                    "offsets.topic.replication.factor=1",
                    "offsets.topic.num.partitions=1",
                    "transaction.state.log.replication.factor=1",
                    "transaction.state.log.min.isr=1",
                    "share.coordinator.state.topic.replication.factor=1",
                    "share.coordinator.state.topic.min.isr=1",
                    "group.initial.rebalance.delay.ms=0",
                    "group.min.session.timeout.ms=1000",
                    "log.cleaner.dedupe.buffer.size=8388608",
                    "auto.create.topics.enable=false",
                    "",
                ]
            )
        )
        # The cluster id is 16 random bytes, URL-safe base64 without padding, not starting with '-'.
        cluster_id = "A" + base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")[1:]
        # In KRaft, SCRAM users are written into the metadata log when the storage is formatted.
        scram = (
            [] if self.sasl is None else ["--add-scram", f"SCRAM-SHA-512=[name={self.sasl[0]},password={self.sasl[1]}]"]
        )
        formatted = subprocess.run(
            self._java("kafka.tools.StorageTool", "format", "-t", cluster_id, "-c", str(properties), "-g", *scram),
            capture_output=True,
            text=True,
            timeout=120,
        )
        if formatted.returncode != 0:
            raise BrokerError(f"formatting Kafka storage failed:\n{formatted.stdout}\n{formatted.stderr}")
        atexit.register(self.close)
        self._launch()

    def _sasl_properties(self) -> list[str]:
        if self.sasl is None:
            return []
        user, password = self.sasl
        # The broker logs in to its own listener as the same user.
        return [
            "sasl.enabled.mechanisms=SCRAM-SHA-512",
            "sasl.mechanism.inter.broker.protocol=SCRAM-SHA-512",
            "listener.name.sasl_plaintext.scram-sha-512.sasl.jaas.config="
            f'org.apache.kafka.common.security.scram.ScramLoginModule required username="{user}" '
            f'password="{password}";',
        ]

    def _launch(self) -> None:
        with open(self.workdir / "stdout.log", "ab") as stdout:  # appended: a restart keeps the crash's output
            self._process = subprocess.Popen(
                self._java("kafka.Kafka", str(self.workdir / "server.properties")),
                stdout=stdout,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                preexec_fn=_die_with_parent,
                start_new_session=True,
            )
        self._wait_until_ready()

    def kill(self) -> None:
        """Crash the broker: SIGKILL, no clean shutdown. Its ports and log dir stay for ``restart()``."""
        if self._process is not None and self._process.poll() is None:
            os.killpg(self._process.pid, signal.SIGKILL)
            self._process.wait(timeout=10)

    def restart(self) -> None:
        """Start the killed broker again on the same ports and log dir, and wait until it answers."""
        if self._process is None or self._process.poll() is None:
            raise BrokerError("restart() needs a broker that was started and then killed")
        self._launch()

    def _wait_until_ready(self) -> None:
        # Connection refusals are expected until the listener is up; keep them out of the output.
        admin = AdminClient(
            {
                "bootstrap.servers": self.bootstrap_servers,
                "broker.address.family": "v4",
                "log_level": 0,
                **self.client_config,
            }
        )
        deadline = time.monotonic() + self.start_timeout
        last_error: Exception | None = None
        process = self._process
        assert process is not None, "a broker is waited for once launched"
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise BrokerError(f"the Kafka broker exited with {process.returncode}:\n{self.log_tail()}")
            try:
                admin.list_topics(timeout=2)
                return
            except Exception as error:  # librdkafka raises KafkaException until the listener is up
                last_error = error
                time.sleep(0.25)
        self.close()
        raise BrokerError(
            f"the Kafka broker did not answer within {self.start_timeout:.0f}s ({last_error}):\n{self.log_tail()}"
        )

    def log_tail(self, lines: int = 40) -> str:
        text = ""
        for path in (self.workdir / "stdout.log", self.log_path):
            if path.exists():
                text += "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) + "\n"
        return text

    @property
    def pid(self) -> int:
        """The broker JVM's process id (also its process group's), while it runs."""
        if self._process is None:
            raise BrokerError("the broker is not running")
        return self._process.pid

    def create_topic(self, topic: str, partitions: int, timeout: float = 30.0) -> None:
        create_topic(self.bootstrap_servers, topic, partitions, timeout, self.client_config)

    def close(self) -> None:
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=10)
        if self.workdir.exists() and process is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)


def create_topic(
    bootstrap_servers: str,
    topic: str,
    partitions: int,
    timeout: float = 30.0,
    client_config: dict[str, str] | None = None,
) -> bool:
    """Create ``topic`` with ``partitions`` partitions; False if it already existed. ``client_config``:
    further librdkafka properties, e.g. a SASL login."""
    admin = AdminClient(
        {"bootstrap.servers": bootstrap_servers, "broker.address.family": "v4", "log_level": 4, **(client_config or {})}
    )
    future = admin.create_topics(
        [NewTopic(topic, num_partitions=partitions, replication_factor=-1)],
        operation_timeout=timeout,
        request_timeout=timeout,
    )[topic]
    try:
        future.result(timeout=timeout)
        return True
    except Exception as error:
        if "TOPIC_ALREADY_EXISTS" in str(error):
            return False
        raise
