"""Throwaway Apache Kafka (KRaft) for tests, benchmarks, soaks and the demo: a single-node broker,
and a cluster of three.

It runs the real broker from the jars that ``make setup`` copies out of Maven Central into the
checkout's .cache/, or from the folder STREAMTRAIN_KAFKA_LIBS names (an installed package has no
.cache/), on 127.0.0.1 and free ports, with a fresh log dir per node. Every node is one process,
broker and controller in one (``process.roles=broker,controller``). A JVM dies with its parent:
it is stopped on ``close()``, at interpreter exit, and by the kernel (PR_SET_PDEATHSIG) if the
parent is killed. The kernel sends that signal when the *thread* that started the JVM ends, so
start and restart nodes from a thread that lives as long as they should (the main thread).

- ``KafkaBroker``: one node, replication factor 1. ``kill()`` crashes it (SIGKILL) and
  ``restart()`` brings it back on the same ports and log dir, for outage tests.
  ``sasl=(user, password)`` puts SASL_PLAINTEXT with SCRAM-SHA-512 on the client listener;
  ``client_config`` then holds what a client needs to log in.
- ``KafkaCluster``: three nodes, all three controller voters, default replication factor 3 and
  ``min.insync.replicas`` 2 (the internal topics too), small heaps. Each node can be stopped
  (SIGTERM: a controlled shutdown), killed (SIGKILL), paused (SIGSTOP) and restarted; the
  cluster finds a partition's leader and waits until no partition is under-replicated.
"""

from __future__ import annotations

import atexit
import base64
import collections
import contextlib
import ctypes
import fcntl
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
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


# The lowest port free_port hands out below the ephemeral range: above the registered services
# that a host is likeliest to run (Prometheus 9090, Kafka 9092, ...).
LOWEST_FREE_PORT = 10_000


def _below_ephemeral_ports() -> range | None:
    """The ports between LOWEST_FREE_PORT and the kernel's ephemeral range, if that leaves room."""
    try:
        ephemeral_from = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    below = range(LOWEST_FREE_PORT, ephemeral_from)
    return below if len(below) >= 1000 else None


def free_port(count: int = 1) -> int:
    """A port p on 127.0.0.1 such that p, ..., p + count - 1 are free now and were handed to no
    process on this machine within the last hour (a worker's rank r serves metrics on p + r).

    Taken below the kernel's ephemeral range where it leaves room: a port from that range, free
    now, may become any new connection's source port, or the port of a listener bound to port 0
    (gloo's pairs, torchrun's store), before the process it was meant for binds it. A worker's
    metrics port went that way in a torchrun test: "Address already in use", 9 s after the pick."""
    below = _below_ephemeral_ports()
    for _ in range(1000):
        with contextlib.ExitStack() as held:
            try:
                first = held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
                first.bind(("127.0.0.1", random.randrange(below.start, below.stop - count) if below else 0))
                port = first.getsockname()[1]
                for following in range(port + 1, port + count):
                    held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM)).bind(("127.0.0.1", following))
            except OSError:
                continue
        if _claim(range(port, port + count)):
            return port
    raise BrokerError(f"no {count} adjacent free port(s) on 127.0.0.1 in 1,000 tries")


def die_with_parent() -> None:
    """For ``preexec_fn``: the kernel kills the child (SIGKILL) when the thread that started it ends."""
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _new_cluster_id() -> str:
    # 16 random bytes, URL-safe base64 without padding, not starting with '-'.
    return "A" + base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")[1:]


def _check_jars(libs: Path) -> None:
    if not any(libs.glob("kafka_2.13-*.jar")):
        raise BrokerError(
            f"no Kafka jars in {libs}: in a checkout, run `make setup` (it fetches them with mvn); "
            f"elsewhere, set STREAMTRAIN_KAFKA_LIBS to a folder holding Kafka {KAFKA_VERSION}'s broker jars "
            f"(`mvn -f deploy/kafka/pom.xml package -Dlibs.dir=FOLDER` fetches them there)"
        )


def _replication_properties(replicas: int) -> list[str]:
    """Topics, the internal ones included, get ``replicas`` replicas; with several, a write needs
    two in sync, so one node down loses nothing acknowledged and blocks nothing."""
    in_sync = min(2, replicas)
    return [
        f"default.replication.factor={replicas}",
        f"min.insync.replicas={in_sync}",
        f"offsets.topic.replication.factor={replicas}",
        f"transaction.state.log.replication.factor={replicas}",
        f"transaction.state.log.min.isr={in_sync}",
        f"share.coordinator.state.topic.replication.factor={replicas}",
        f"share.coordinator.state.topic.min.isr={in_sync}",
    ]


def _admin(bootstrap_servers: str, client_config: dict[str, str] | None = None, log_level: int = 4) -> AdminClient:
    return AdminClient(
        {
            "bootstrap.servers": bootstrap_servers,
            "broker.address.family": "v4",
            "log_level": log_level,
            **(client_config or {}),
        }
    )


class KafkaNode:
    """One Kafka process, broker and controller in one, and its life: formatted once, then
    started, stopped (SIGTERM), killed (SIGKILL) and restarted on the same ports and log dir."""

    def __init__(
        self,
        libs: Path | None = None,
        port: int | None = None,
        start_timeout: float = 90.0,
        sasl: tuple[str, str] | None = None,
        node_id: int = 1,
        heap_mb: int = 512,
    ):
        self.libs = Path(libs or os.environ.get("STREAMTRAIN_KAFKA_LIBS") or DEFAULT_LIBS)
        self.node_id = node_id
        self.port = port or free_port()
        self.controller_port = free_port()
        self.start_timeout = start_timeout
        self.heap_mb = heap_mb
        self.workdir = Path(tempfile.mkdtemp(prefix=f"streamtrain-kafka-{node_id}-"))
        atexit.register(self.close)  # the log dir goes at exit, even if the node never started
        self.log_path = self.workdir / "server.log"
        self.sasl = sasl
        self._process: subprocess.Popen | None = None

    @property
    def bootstrap_servers(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def voter(self) -> str:
        """This node as an entry of controller.quorum.voters."""
        return f"{self.node_id}@127.0.0.1:{self.controller_port}"

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

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    @property
    def pid(self) -> int:
        """The broker JVM's process id (also its process group's), while it runs."""
        if self._process is None:
            raise BrokerError("the broker is not running")
        return self._process.pid

    def _java(self, main_class: str, *args: str) -> list[str]:
        return [
            "java",
            f"-Xms{min(256, self.heap_mb)}m",
            f"-Xmx{self.heap_mb}m",
            "-XX:+UseSerialGC",
            "-XX:TieredStopAtLevel=1",
            f"-Dlog4j2.configurationFile={self.workdir / 'log4j2.properties'}",
            "-cp",
            f"{self.libs}/*",
            main_class,
            *args,
        ]

    def format(self, cluster_id: str, voters: list[str], properties: list[str]) -> None:
        """Writes server.properties (this node, the quorum ``voters`` and further ``properties``)
        and formats the log dir for ``cluster_id``."""
        _check_jars(self.libs)
        (self.workdir / "log4j2.properties").write_text(_LOG4J2.format(log=self.log_path))
        path = self.workdir / "server.properties"
        # The listener is named after its protocol; the controller's stays PLAINTEXT.
        listener = "PLAINTEXT" if self.sasl is None else "SASL_PLAINTEXT"
        path.write_text(
            "\n".join(
                [
                    "process.roles=broker,controller",
                    f"node.id={self.node_id}",
                    f"controller.quorum.voters={','.join(voters)}",
                    f"listeners={listener}://127.0.0.1:{self.port},CONTROLLER://127.0.0.1:{self.controller_port}",
                    f"advertised.listeners={listener}://127.0.0.1:{self.port}",
                    "controller.listener.names=CONTROLLER",
                    f"inter.broker.listener.name={listener}",
                    f"listener.security.protocol.map=CONTROLLER:PLAINTEXT,{listener}:{listener}",
                    *self._sasl_properties(),
                    f"log.dirs={self.workdir / 'data'}",
                    "num.partitions=1",
                    "offsets.topic.num.partitions=1",
                    "group.initial.rebalance.delay.ms=0",
                    "group.min.session.timeout.ms=1000",
                    "log.cleaner.dedupe.buffer.size=8388608",
                    "auto.create.topics.enable=false",
                    *properties,
                    "",
                ]
            )
        )
        # In KRaft, SCRAM users are written into the metadata log when the storage is formatted.
        scram = (
            [] if self.sasl is None else ["--add-scram", f"SCRAM-SHA-512=[name={self.sasl[0]},password={self.sasl[1]}]"]
        )
        formatted = subprocess.run(
            self._java("kafka.tools.StorageTool", "format", "-t", cluster_id, "-c", str(path), "-g", *scram),
            capture_output=True,
            text=True,
            timeout=120,
        )
        if formatted.returncode != 0:
            raise BrokerError(f"formatting Kafka storage failed:\n{formatted.stdout}\n{formatted.stderr}")

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

    def spawn(self) -> None:
        """Starts the JVM; ``wait_until_ready`` waits for it to answer."""
        with open(self.workdir / "stdout.log", "ab") as stdout:  # appended: a restart keeps the crash's output
            self._process = subprocess.Popen(
                self._java("kafka.Kafka", str(self.workdir / "server.properties")),
                stdout=stdout,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                preexec_fn=die_with_parent,
                start_new_session=True,
            )

    def wait_until_ready(self) -> None:
        """Until this node's client listener answers a metadata request: a broker opens it once
        it has caught up with the cluster's metadata. A node that exits, or does not answer within
        ``start_timeout``, is closed and raises BrokerError with its log's tail."""
        # Connection refusals are expected until the listener is up; keep them out of the output.
        admin = _admin(self.bootstrap_servers, self.client_config, log_level=0)
        deadline = time.monotonic() + self.start_timeout
        last_error: Exception | None = None
        process = self._process
        assert process is not None, "a node is waited for once spawned"
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise BrokerError(f"Kafka node {self.node_id} exited with {process.returncode}:\n{self.log_tail()}")
            try:
                admin.list_topics(timeout=2)
                return
            except Exception as error:  # librdkafka raises KafkaException until the listener is up
                last_error = error
                time.sleep(0.25)
        tail = self.log_tail()  # before close() removes the log
        self.close()
        raise BrokerError(
            f"Kafka node {self.node_id} did not answer within {self.start_timeout:.0f}s ({last_error}):\n{tail}"
        )

    def kill(self) -> None:
        """Crash the node: SIGKILL, no clean shutdown. Its ports and log dir stay for ``restart()``."""
        if self.running:
            assert self._process is not None
            os.killpg(self._process.pid, signal.SIGKILL)
            self._process.wait(timeout=10)

    def stop(self, timeout: float = 60.0) -> None:
        """A clean shutdown (SIGTERM): leadership moves to the other nodes first. Past ``timeout``
        seconds the node is killed. Its ports and log dir stay for ``restart()``."""
        if not self.running:
            return
        assert self._process is not None
        os.killpg(self._process.pid, signal.SIGTERM)
        os.killpg(self._process.pid, signal.SIGCONT)  # a paused node acts on the SIGTERM once thawed
        try:
            self._process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def pause(self) -> None:
        """Freeze the node (SIGSTOP), as a long GC pause or a stalled VM would: its connections
        stay open and nothing answers on them. ``resume()`` thaws it."""
        if self.running:
            assert self._process is not None
            os.killpg(self._process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.running:
            assert self._process is not None
            os.killpg(self._process.pid, signal.SIGCONT)

    def restart(self) -> None:
        """Start the stopped or killed node again on the same ports and log dir, and wait until it answers."""
        if self._process is None or self.running:
            raise BrokerError("restart() needs a node that was started and then stopped or killed")
        self.spawn()
        self.wait_until_ready()

    def log_tail(self, lines: int = 40) -> str:
        text = ""
        for path in (self.workdir / "stdout.log", self.log_path):
            if path.exists():
                text += "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) + "\n"
        return text

    def close(self, graceful: bool = True) -> None:
        """Ends the process (SIGTERM if ``graceful``, SIGKILL if not or past 20 s) and removes the log dir."""
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            if graceful:
                os.killpg(process.pid, signal.SIGTERM)
                os.killpg(process.pid, signal.SIGCONT)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(timeout=20)
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=10)
        shutil.rmtree(self.workdir, ignore_errors=True)


class KafkaBroker(KafkaNode):
    """``with KafkaBroker() as broker: broker.bootstrap_servers`` -> '127.0.0.1:<port>'."""

    def __init__(
        self,
        libs: Path | None = None,
        port: int | None = None,
        start_timeout: float = 90.0,
        sasl: tuple[str, str] | None = None,
    ):
        super().__init__(libs, port, start_timeout, sasl)

    def __enter__(self) -> KafkaBroker:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        self.format(_new_cluster_id(), [self.voter], _replication_properties(1))
        self.spawn()
        self.wait_until_ready()

    def create_topic(self, topic: str, partitions: int, timeout: float = 30.0) -> None:
        create_topic(self.bootstrap_servers, topic, partitions, timeout, self.client_config)


# What a cluster's nodes add: a node that stops heartbeating is fenced (its partitions led
# elsewhere, it leaves their ISRs) within 6 s, not 9, so a fault test waits less for the failover;
# still long enough that a node paused by a loaded host is not fenced for it.
_CLUSTER_PROPERTIES = ["broker.heartbeat.interval.ms=1000", "broker.session.timeout.ms=6000"]


class KafkaCluster:
    """``with KafkaCluster() as cluster: cluster.bootstrap_servers`` -> three '127.0.0.1:<port>'s.

    Three nodes, each broker and controller, all of them voters, so the cluster serves with any
    one of them down. Nodes are numbered from 1 (Kafka's node ids); ``stop``, ``kill`` and
    ``restart`` take that number. Every wait is bounded, and raises BrokerError past its bound."""

    def __init__(self, nodes: int = 3, libs: Path | None = None, start_timeout: float = 180.0, heap_mb: int = 384):
        self.nodes = [
            KafkaNode(libs, start_timeout=start_timeout, node_id=node_id, heap_mb=heap_mb)
            for node_id in range(1, nodes + 1)
        ]
        self.start_timeout = start_timeout
        self.client_config: dict[str, str] = {}
        self._admin: AdminClient | None = None

    @property
    def bootstrap_servers(self) -> str:
        return ",".join(node.bootstrap_servers for node in self.nodes)

    def __enter__(self) -> KafkaCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        cluster_id, voters = _new_cluster_id(), [node.voter for node in self.nodes]
        properties = _replication_properties(len(self.nodes)) + _CLUSTER_PROPERTIES
        try:
            # Formatting starts a JVM per node: in parallel. The nodes themselves are started from
            # this thread, which the kernel ties their lives to.
            with ThreadPoolExecutor(len(self.nodes)) as pool:
                list(pool.map(lambda node: node.format(cluster_id, voters, properties), self.nodes))
            for node in self.nodes:  # no node answers before a quorum of controllers is up
                node.spawn()
            for node in self.nodes:
                node.wait_until_ready()
            self.wait_until_fully_replicated(self.start_timeout)
        except BaseException:
            self.close()
            raise

    def node(self, node_id: int) -> KafkaNode:
        return self.nodes[node_id - 1]

    def stop(self, node_id: int, timeout: float = 60.0) -> None:
        """A clean shutdown of one node (SIGTERM): its leaderships move first."""
        self.node(node_id).stop(timeout)

    def kill(self, node_id: int) -> None:
        """Crash one node (SIGKILL); the others fence it and elect new leaders within seconds."""
        self.node(node_id).kill()

    def pause(self, node_id: int) -> None:
        """Freeze one node (SIGSTOP) until ``resume(node_id)``: it holds its leaderships and
        answers nothing. Fenced after 6 s; a shorter pause keeps it in the cluster."""
        self.node(node_id).pause()

    def resume(self, node_id: int) -> None:
        self.node(node_id).resume()

    def restart(self, node_id: int) -> None:
        """Start a stopped or killed node again, same ports and log dir, and wait until it answers.
        It is in sync again only later: ``wait_until_fully_replicated``."""
        self.node(node_id).restart()

    def rolling_restart(self, timeout: float = 120.0, while_down: Callable[[int], None] = lambda _node: None) -> None:
        """Each node in turn, as an operator upgrades a cluster: a clean stop, ``while_down(node_id)``,
        a restart, and no next node until every partition is fully replicated again."""
        for node in self.nodes:
            node.stop()
            while_down(node.node_id)
            node.restart()
            self.wait_until_fully_replicated(timeout)

    def heal(self, timeout: float = 120.0) -> None:
        """Every node back: paused ones thawed, stopped or killed ones restarted; then until every
        partition is fully replicated. What a test runs first when the one before may have failed
        in the middle of a fault."""
        for node in self.nodes:
            node.resume()
            if not node.running:
                node.restart()
        self.wait_until_fully_replicated(timeout)

    def admin(self) -> AdminClient:
        if self._admin is None:
            # Refusals from a node that is down are expected here; errors still raise.
            self._admin = _admin(self.bootstrap_servers, log_level=0)
        return self._admin

    def leaders(self, topic: str, timeout: float = 30.0) -> dict[int, int]:
        """{partition: the node id of its leader, -1 while it has none}."""
        metadata = self.admin().list_topics(topic, timeout=timeout).topics[topic]
        if metadata.error is not None:
            raise BrokerError(f"topic {topic}: {metadata.error}")
        return {partition: info.leader for partition, info in metadata.partitions.items()}

    def leader(self, topic: str, partition: int, timeout: float = 30.0) -> int:
        return self.leaders(topic, timeout)[partition]

    def leading_most(self, topic: str) -> int:
        """The node that leads the most partitions of ``topic`` (the lowest id on a tie)."""
        counts = collections.Counter(leader for leader in self.leaders(topic).values() if leader >= 0)
        if not counts:
            raise BrokerError(f"no partition of {topic} has a leader")
        return min(counts, key=lambda node_id: (-counts[node_id], node_id))

    def under_replicated(self) -> list[str]:
        """Partitions (every topic's, the internal ones too) without a leader or whose in-sync
        replicas are fewer than their replicas, as 'topic/partition: why'; and nodes missing."""
        metadata = self.admin().list_topics(timeout=10)
        problems = [
            f"node {node.node_id}: not in the cluster's metadata"
            for node in self.nodes
            if node.node_id not in metadata.brokers
        ]
        for name, topic in metadata.topics.items():
            if topic.error is not None:
                problems.append(f"{name}: {topic.error}")
            for partition, info in topic.partitions.items():
                if info.leader < 0 or sorted(info.isrs) != sorted(info.replicas):
                    problems.append(f"{name}/{partition}: leader {info.leader}, ISR {info.isrs} of {info.replicas}")
        return problems

    def wait_until_fully_replicated(self, timeout: float = 120.0) -> None:
        """Until every node is up and in the metadata and no partition is under-replicated, twice
        in a row half a second apart (a node's metadata may lag the controller's by a moment)."""
        deadline = time.monotonic() + timeout
        problems: list[str] = ["not asked yet"]
        settled = 0
        while time.monotonic() < deadline:
            down = [node.node_id for node in self.nodes if not node.running]
            if down:
                raise BrokerError(f"node(s) {down} are down: restart them before waiting for replication")
            try:
                problems = self.under_replicated()
            except Exception as error:  # a metadata request that timed out while leaders move
                problems = [f"metadata: {error}"]
            settled = 0 if problems else settled + 1
            if settled == 2:
                return
            time.sleep(0.5)
        raise BrokerError(
            f"the cluster was still under-replicated after {timeout:.0f}s: {problems[:5]}\n"
            + "\n".join(f"--- node {node.node_id}\n{node.log_tail(15)}" for node in self.nodes)
        )

    def create_topic(
        self, topic: str, partitions: int, timeout: float = 30.0, config: dict[str, str] | None = None
    ) -> bool:
        """Creates ``topic`` with the cluster's replication factor (3); False if it existed."""
        return create_topic(self.bootstrap_servers, topic, partitions, timeout, config=config)

    def close(self) -> None:
        """Kills every node at once and removes their log dirs: a clean stop of the last two
        nodes would wait for a quorum that is gone."""
        for node in self.nodes:
            node.close(graceful=False)


def create_topic(
    bootstrap_servers: str,
    topic: str,
    partitions: int,
    timeout: float = 30.0,
    client_config: dict[str, str] | None = None,
    config: dict[str, str] | None = None,
) -> bool:
    """Create ``topic`` with ``partitions`` partitions and the cluster's default replication
    factor; False if it already existed. ``client_config``: further librdkafka properties, e.g. a
    SASL login; ``config``: the topic's own settings."""
    admin = _admin(bootstrap_servers, client_config)
    future = admin.create_topics(
        [NewTopic(topic, num_partitions=partitions, replication_factor=-1, config=config or {})],
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
