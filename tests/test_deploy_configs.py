"""Every worker config in deploy/ runs as it is against the real broker, or fails at once naming
the field to set: deploy/worker.yaml (the reference config getting-started says to start from),
it again with the worker's environment in docker-compose.yml, the ConfigMaps of the Kubernetes
manifests, and worker.yaml with each model section of deploy/models/ in place of its own. The
brokers, the topics and the paths are overridden from the environment, as an operator pointing a
config at this cluster would; nothing else is, but for the model sections, which start with
delivery off: they are about the model, and worker.yaml's case exports its first base. A clean start
is a worker that is ready (its state restored, the broker answering), then stops on SIGTERM with
exit code 0. Each case is one worker start (a minute on a loaded 2-core host; the reference
config's 3.6M rows are most of it), two of them about 15 s to an exit 2."""

from __future__ import annotations

import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from conftest import REPO

pytestmark = pytest.mark.integration

DEPLOY = REPO / "deploy"
MODELS = sorted((DEPLOY / "models").glob("*.yaml"))


@dataclass(frozen=True)
class DeployConfig:
    """A worker config from deploy/, and what running it here must do: start cleanly (``refused``
    None), or exit 2 at once naming ``refused``."""

    name: str
    text: str
    env: dict[str, str] = field(default_factory=dict)
    refused: str | None = None
    first_base: bool = False  # wait for delivery's first base before the stop


def compose_worker_env() -> dict[str, str]:
    """The environment docker-compose.yml gives its worker service."""
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    return {k: str(v) for k, v in compose["services"]["worker"]["environment"].items()}


def configmap(manifest: str) -> str:
    documents = yaml.safe_load_all((DEPLOY / "k8s" / manifest).read_text())
    return next(d for d in documents if d["kind"] == "ConfigMap")["data"]["worker.yaml"]


def with_model(example: Path) -> str:
    raw = yaml.safe_load((DEPLOY / "worker.yaml").read_text())
    raw["model"] = yaml.safe_load(example.read_text())["model"]
    return yaml.safe_dump(raw, sort_keys=False)


def cases() -> list[DeployConfig]:
    reference = (DEPLOY / "worker.yaml").read_text()
    # The Kubernetes configs log in with a password mounted from a Secret; outside the pod it is
    # not there, and the worker names the property to point at it.
    secret = "kafka.client_config_files.sasl.password: cannot read /run/secrets/kafka/password"
    return [
        DeployConfig("worker.yaml", reference, first_base=True),
        DeployConfig("docker-compose.yml", reference, compose_worker_env()),
        DeployConfig("k8s/streamtrain.yaml", configmap("streamtrain.yaml"), refused=secret),
        DeployConfig("k8s/streamtrain-gpu.yaml", configmap("streamtrain-gpu.yaml"), refused=secret),
        *(DeployConfig(f"models/{m.name}", with_model(m), {"STREAMTRAIN_DELIVERY__ENABLED": "false"}) for m in MODELS),
    ]


def ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as reply:
            return reply.status == 200
    except OSError:
        return False


@pytest.mark.parametrize("case", cases(), ids=lambda c: c.name)
def test_deploy_configs_start_as_they_are_or_name_the_field_to_set(case, kafka, topic_name, start_worker, tmp_path):
    config = tmp_path / "worker.yaml"
    config.write_text(case.text)
    env = {
        **case.env,
        # what an operator points at this cluster and this host: the brokers, the topics, the paths
        "STREAMTRAIN_KAFKA__BOOTSTRAP_SERVERS": kafka.bootstrap_servers,
        "STREAMTRAIN_DEAD_LETTER__TOPIC": f"{topic_name}.dlq",
        "STREAMTRAIN_DELIVERY__TOPIC": f"{topic_name}.model",
        "PYTHONPATH": str(REPO),  # this checkout's streamtrain, run from another folder
    }
    if "STREAMTRAIN_CHECKPOINT__PATH" in env:  # the deployment's volume, here a folder of the test's
        env["STREAMTRAIN_CHECKPOINT__PATH"] = str(tmp_path / "volume" / "snapshots")
    kafka.create_topic(topic_name, 2)
    kafka.create_topic(f"{topic_name}.dlq", 1)
    # From a folder of its own: a relative checkpoint.path lands there, as in an operator's.
    worker = start_worker(topic_name, config=config, env=env, cwd=tmp_path)
    if case.refused is not None:
        assert worker.wait(timeout=120) == 2, worker.output()[-3000:]
        assert case.refused in worker.output(), worker.output()[-3000:]
        return
    worker.wait_for(lambda: ready(worker.metrics_port), timeout=300, what="/readyz")
    # The first progress line comes once the loop runs, its SIGTERM handler installed: /readyz says
    # ready a moment before, and a SIGTERM in between ends the process without a clean close.
    worker.wait_for(lambda: "rank 0 step " in worker.output(), timeout=120, what="the first progress line")
    if case.first_base:
        snapshots = tmp_path / yaml.safe_load(case.text)["checkpoint"]["path"]
        worker.wait_for(lambda: (snapshots / "serving" / "current.json").exists(), timeout=300, what="the first base")
    worker.signal()
    assert worker.wait(timeout=180) == 0, worker.output()[-3000:]
    assert "stopped after" in worker.output()
    assert not (REPO / "snapshots").exists(), "a relative checkpoint.path was written into the checkout"
