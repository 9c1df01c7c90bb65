"""Two torchrun "nodes" on one host, joined by a c10d rendezvous on 127.0.0.1, as docs/ranks.md
documents for a multi-node job: a stop to either node, a dead node, and a restart
from the snapshot they wrote together, exactly once."""

from __future__ import annotations

import re
import signal
import time
import uuid

import pytest

from conftest import SCHEMA
from streamtrain.dev.kafka import free_port
from streamtrain.dev.produce import produce
from test_checkpoint import final_stream
from test_worker_kafka import committed_offsets, end_offsets

pytestmark = pytest.mark.integration

PARTITIONS = 4
TIMEOUT_SECONDS = 10  # distributed.timeout_seconds: how long a node waits for a dead peer


def start_nodes(start_worker, topic: str, *args: str, env: dict[str, str]) -> list:
    """Two single-rank nodes, each a torchrun of its own with its own metrics port (both ranks
    have LOCAL_RANK 0); which one gets global rank 0 is the rendezvous' choice."""
    endpoint, rdzv_id = f"127.0.0.1:{free_port()}", f"nnodes-{uuid.uuid4().hex[:8]}"
    launcher = [
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        endpoint,
        "--rdzv-id",
        rdzv_id,
        "--local-addr",
        "127.0.0.1",
    ]
    return [start_worker(topic, *args, launcher=launcher, env=env) for _node in range(2)]


def trained(nodes) -> float:
    return sum(node.total("streamtrain_events_trained_total") for node in nodes)


def test_nnodes_stop_together_fail_together_and_restore_exactly_once(kafka, topic_name, start_worker, tmp_path):
    root = tmp_path / "snapshots"
    env = {
        "STREAMTRAIN_CHECKPOINT__PATH": str(root),
        "STREAMTRAIN_CHECKPOINT__INTERVAL_STEPS": "2",
        "STREAMTRAIN_DISTRIBUTED__TIMEOUT_SECONDS": str(TIMEOUT_SECONDS),
        "LOGLEVEL": "INFO",
    }
    produce(kafka.bootstrap_servers, topic_name, 3000, partitions=PARTITIONS, seed=60, schema_path=SCHEMA)

    # A SIGTERM to one node's torchrun reaches its rank, and the lockstep vote stops the other.
    nodes = start_nodes(start_worker, topic_name, env=env)
    nodes[0].wait_for(lambda: trained(nodes) >= 3000, timeout=180, what="both nodes training the backlog")
    assert all(node.total("streamtrain_events_trained_total") > 0 for node in nodes)  # both trained
    nodes[1].signal(signal.SIGTERM)
    stopped = [
        node.wait_for(
            lambda node=node: re.search(r"rank \d stopped after (\d+) steps", node.output()),
            timeout=60,
            what="its rank to stop",
        )
        for node in nodes
    ]
    assert stopped[0][1] == stopped[1][1]  # at the same step
    assert nodes[1].wait(timeout=60) != 0  # torchrun re-raises the signal it was stopped by
    # The other torchrun saw its rank exit 0. It may then wait up to 300 s in torchrun's exit
    # barrier for the signalled agent, which never comes, deaf to signals (docs/ranks.md); nothing is left
    # to lose by killing it. Which torchrun hosts the rendezvous store is a race at start: where the
    # signalled one did, the other's agent loses the store before it sees its rank succeed, and
    # exits 1 on torch's RendezvousConnectionError, its rank stopped cleanly all the same (above).
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and nodes[0].process.poll() is None:
        if "Local worker group finished (WorkerState.SUCCEEDED)" in nodes[0].output():
            break
        time.sleep(0.2)
    else:
        assert "The connection to the C10d store has failed" in nodes[0].output(), nodes[0].output()[-4000:]
    nodes[0].kill()
    assert committed_offsets(kafka, topic_name, f"group-{topic_name}") == end_offsets(kafka, topic_name)

    # A node killed outright (its torchrun and its rank): the other gives up within the timeout.
    produce(kafka.bootstrap_servers, topic_name, 3000, partitions=PARTITIONS, seed=61, schema_path=SCHEMA)
    nodes = start_nodes(start_worker, topic_name, env=env)
    nodes[0].wait_for(
        lambda: all(n.total("streamtrain_events_trained_total") > 0 for n in nodes),
        timeout=180,
        what="both nodes training again",
    )
    killed = time.monotonic()
    nodes[0].kill()  # torchrun and its rank, as when a host or container dies
    assert nodes[1].wait(timeout=TIMEOUT_SECONDS + 50) != 0
    print(f"the surviving node exited {time.monotonic() - killed:.1f}s after its peer was killed")
    assert time.monotonic() - killed < TIMEOUT_SECONDS + 30
    # Its rank notices the dead peer in a collective, or its torchrun notices first that the c10d
    # store (hosted by whichever node's torchrun came first) is gone, and stops it.
    assert re.search("a peer rank failed or stopped answering|RendezvousConnectionError", nodes[1].output())

    # Both restarted: the same snapshot restored on both, every event trained once.
    nodes = start_nodes(start_worker, topic_name, "--until-end", env=env)
    assert [node.wait(timeout=180) for node in nodes] == [0, 0], "\n".join(n.output()[-3000:] for n in nodes)
    restored = [re.search(r"restored (\S+): step", node.output()) for node in nodes]
    assert restored[0] and restored[1] and restored[0][1] == restored[1][1]
    stream = final_stream(root)["stream"]
    expected = end_offsets(kafka, topic_name)
    assert sum(expected.values()) == 6000
    assert {int(p): n for p, n in stream["trained"].items()} == expected
    assert {int(p): o for p, o in stream["next_offsets"].items()} == expected
