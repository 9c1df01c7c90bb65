"""The shipped Prometheus config, alert rules and Grafana dashboard, checked against a live
Prometheus scraping a real worker on the real broker; and the health endpoints."""

from __future__ import annotations

import base64
import json
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml
from confluent_kafka import Producer

from conftest import REPO, SCHEMA, prometheus_tool
from delivery_states import held_out
from streamtrain.cli import _serving_sources, build_parser
from streamtrain.config import parse_config
from streamtrain.delivery.serve import DirectoryDeltas, KafkaDeltas, ScoringServer
from streamtrain.dev.kafka import create_topic, free_port
from streamtrain.dev.produce import produce

DEPLOY = REPO / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "streamtrain.json"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"


def dashboard_queries() -> list[str]:
    """Every panel's query, with each template variable at its "All" value, as Grafana sends it."""
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v["allValue"] for v in dashboard["templating"]["list"]}
    queries = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    for name, value in sorted(variables.items(), key=lambda item: -len(item[0])):
        queries = [q.replace(f"${name}", value) for q in queries]
    return queries


def test_every_dashboard_variable_is_known_and_quality_panels_repeat_per_task():
    assert all("$" not in query for query in dashboard_queries())
    panels = json.loads(DASHBOARD.read_text())["panels"]
    quality = [p for p in panels if "streamtrain_progressive_" in json.dumps(p["targets"])]
    assert quality and all(p.get("repeat") == "task" for p in quality)
    assert all("by (task)" in r["expr"] for r in alert_rules() if "progressive_auc" in r["expr"])


def alert_rules() -> list[dict]:
    return [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]


def test_promtool_accepts_the_shipped_config_and_rules():
    promtool = prometheus_tool("promtool")
    for args in (["check", "config", str(DEPLOY / "prometheus" / "prometheus.yml")], ["check", "rules", str(ALERTS)]):
        result = subprocess.run([promtool, *args], capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stdout + result.stderr


def test_alerts_cover_what_operators_need():
    names = {r["alert"] for r in alert_rules()}
    assert names == {
        "StreamtrainLagGrowing",
        "StreamtrainNotTraining",
        "StreamtrainCheckpointStale",
        "StreamtrainBadEventRate",
        "StreamtrainAUCBelowFloor",
        "StreamtrainAUCFalling",
        "StreamtrainRankDown",
        "StreamtrainDeadLetterBlocked",
        "StreamtrainConsumptionPaused",
        "StreamtrainDeltasStalled",
        "StreamtrainServingStale",
    }
    operating = (REPO / "docs" / "operating.md").read_text()
    assert all(name in operating for name in names), "docs/operating.md explains every alert"


def test_compose_and_kubernetes_files_hold_together(tmp_path):
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"kafka", "topic-init", "producer", "worker", "serve", "prometheus", "grafana"} <= set(services)
    assert services["kafka"]["image"].startswith("apache/kafka:")
    assert "--nproc" in services["worker"]["command"]
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        result = subprocess.run(
            [docker, "compose", "-f", str(DEPLOY / "docker-compose.yml"), "config", "-q"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 0, result.stderr
    kinds = [doc["kind"] for doc in yaml.safe_load_all((DEPLOY / "k8s" / "streamtrain.yaml").read_text())]
    assert {"StatefulSet", "Service", "ConfigMap", "Secret", "PersistentVolumeClaim", "ServiceMonitor"} <= set(kinds)
    # The server reads what the workers write, where they write it: the compose file's delta topic
    # and volume, the Kubernetes ConfigMap's delta directory and claim.
    worker_config = parse_config(yaml.safe_load((DEPLOY / "worker.yaml").read_text()), {})
    serve = services["serve"]["command"]
    assert serve[serve.index("--deltas") + 1] == worker_config.delivery.resolved_topic(worker_config.kafka.topic)
    checkpoint_path = services["worker"]["environment"]["STREAMTRAIN_CHECKPOINT__PATH"]
    assert serve[serve.index("--model") + 1] == worker_config.delivery.resolved_path(checkpoint_path)
    assert services["serve"]["volumes"][0].split(":")[0] == services["worker"]["volumes"][0].split(":")[0]
    k8s = {d["kind"]: d for d in yaml.safe_load_all((DEPLOY / "k8s" / "streamtrain.yaml").read_text())}
    k8s_config = parse_config(yaml.safe_load(k8s["ConfigMap"]["data"]["worker.yaml"]), {})
    serving = {d["kind"]: d for d in yaml.safe_load_all((DEPLOY / "k8s" / "serve.yaml").read_text())}
    pod = serving["Deployment"]["spec"]["template"]["spec"]
    args = pod["containers"][0]["args"]
    config_mount = next(m["mountPath"] for m in pod["containers"][0]["volumeMounts"] if m["name"] == "config")
    assert args[args.index("--config") + 1] == f"{config_mount}/worker.yaml"
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["config"]["configMap"]["name"] == k8s["ConfigMap"]["metadata"]["name"]
    claim = k8s["PersistentVolumeClaim"]["metadata"]["name"]
    assert volumes["snapshots"]["persistentVolumeClaim"]["claimName"] == claim
    # what serve makes of those args with the workers' ConfigMap: their bases and their delta folder
    (tmp_path / "worker.yaml").write_text(k8s["ConfigMap"]["data"]["worker.yaml"])
    parsed = build_parser().parse_args([*args[: args.index("--config") + 1], str(tmp_path / "worker.yaml")])
    model, deltas = _serving_sources(parsed)
    assert model == Path(k8s_config.delivery.resolved_path(k8s_config.checkpoint.path or ""))
    assert isinstance(deltas, DirectoryDeltas) and deltas.path == Path(k8s_config.delivery.directory or "")


def http_get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()
    except OSError:
        return 0, ""


class Prometheus:
    def __init__(self, tmp_path: Path, targets: list[str], serve_targets: list[str] | None = None):
        self.port = free_port()
        config = tmp_path / "prometheus.yml"
        config.write_text(
            yaml.safe_dump(
                {
                    "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                    "rule_files": [str(ALERTS)],
                    "scrape_configs": [
                        {"job_name": "streamtrain", "static_configs": [{"targets": targets}]},
                        {"job_name": "streamtrain-serve", "static_configs": [{"targets": serve_targets or []}]},
                    ],
                }
            )
        )
        self.log = open(tmp_path / "prometheus.log", "wb")  # noqa: SIM115 - Prometheus writes it until stopped
        self.process = subprocess.Popen(
            [
                prometheus_tool("prometheus"),
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    def api(self, path: str, **params: str) -> dict:
        query = urllib.parse.urlencode(params)
        status, body = http_get(f"http://127.0.0.1:{self.port}/api/v1/{path}?{query}")
        assert status in (200, 400, 422), (status, body)
        return json.loads(body)

    def close(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)
        self.log.close()


@pytest.mark.integration
def test_every_dashboard_query_and_alert_works_on_a_live_prometheus(kafka, topic_name, start_worker, tmp_path):
    prometheus_tool("prometheus")
    produce(kafka.bootstrap_servers, topic_name, 20_000, partitions=4, seed=51, schema_path=SCHEMA)
    create_topic(kafka.bootstrap_servers, topic_name + ".dlq", 1)  # where the undecodable payloads go
    garbage = Producer({"bootstrap.servers": kafka.bootstrap_servers})
    for i in range(20):  # undecodable payloads, so the error panels have something to show
        garbage.produce(topic_name, value=b"\xff" * (i + 1), partition=i % 4)
    assert garbage.flush(30) == 0
    worker = start_worker(
        topic_name,
        env={
            "STREAMTRAIN_CHECKPOINT__PATH": str(tmp_path / "snapshots"),
            "STREAMTRAIN_CHECKPOINT__INTERVAL_SECONDS": "2",
            "STREAMTRAIN_METRICS__LAG_REFRESH_SECONDS": "1",
            # a managed table, so the id-space panels have something to show
            "STREAMTRAIN_FEATURES__TABLES__0__ID_MAPPING": "managed",
            "STREAMTRAIN_FEATURES__TABLES__0__ROWS": "2000",
            "STREAMTRAIN_FEATURES__TABLES__0__NUM_EMBEDDINGS": "2000",
            "STREAMTRAIN_DELIVERY__ENABLED": "true",
            "STREAMTRAIN_DELIVERY__DELTA_INTERVAL_SECONDS": "1",
        },
    )
    # The delivery panels show the server's metrics too: it follows the worker's bases and deltas.
    server = ScoringServer(
        tmp_path / "snapshots" / "serving",
        KafkaDeltas(kafka.bootstrap_servers, f"{topic_name}.model", {"broker.address.family": "v4"}),
        port=free_port(),
        start_timeout_seconds=180,
    )
    prometheus = Prometheus(tmp_path, [f"127.0.0.1:{worker.metrics_port}"], [f"127.0.0.1:{server.port}"])
    try:
        worker.wait_for(
            lambda: worker.total("streamtrain_events_trained_total") >= 20_000, timeout=180, what="the stream trained"
        )
        server.start()
        payloads, _records = held_out(20)
        request = urllib.request.Request(
            f"http://127.0.0.1:{server.port}/score",
            json.dumps({"events": [base64.b64encode(p).decode() for p in payloads]}).encode(),
            {"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=30) as reply:
            assert all("probabilities" in r for r in json.loads(reply.read())["results"])
        produce(kafka.bootstrap_servers, topic_name, 5_000, partitions=4, seed=52, rate=1000, schema_path=SCHEMA)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            up = prometheus.api("query", query="up").get("data", {}).get("result", [])
            if len(up) == 2 and all(u["value"][1] == "1" for u in up):
                break
            time.sleep(0.5)
        results = {}
        for expr in dashboard_queries():
            answer = prometheus.api("query", query=expr)
            assert answer["status"] == "success", (expr, answer)
            results[expr] = answer["data"]["result"]
            assert results[expr], f"no data for dashboard query: {expr}"
        for rule in alert_rules():
            answer = prometheus.api("query", query=rule["expr"])
            assert answer["status"] == "success", (rule["alert"], answer)
        stalled = next(r["expr"] for r in alert_rules() if r["alert"] == "StreamtrainDeltasStalled")
        assert prometheus.api("query", query=stalled)["data"]["result"] == [], "deltas flow: not stalled"
        rules = prometheus.api("rules")["data"]["groups"][0]["rules"]
        assert all(r["health"] in ("ok", "unknown") for r in rules), [(r["name"], r.get("lastError")) for r in rules]
        auc = prometheus.api("query", query='streamtrain_progressive_auc{window="window"}')["data"]["result"]
        assert float(auc[0]["value"][1]) > 0.6
        (tmp_path / "checked-queries.json").write_text(
            json.dumps({expr: [(r["metric"], r["value"][1]) for r in res] for expr, res in results.items()}, indent=2)
        )
        print(
            f"\nchecked {len(results)} dashboard queries and {len(alert_rules())} alert rules; "
            f"results in {tmp_path / 'checked-queries.json'}"
        )
    finally:
        prometheus.close()
        server.stop()
        worker.signal(signal.SIGTERM)
    assert worker.wait(timeout=60) == 0


@pytest.mark.integration
def test_readyz_waits_for_restore_and_healthz_catches_a_stalled_loop(kafka, topic_name, start_ranks, tmp_path):
    produce(kafka.bootstrap_servers, topic_name, 2_000, partitions=4, seed=53, schema_path=SCHEMA)
    ranks = start_ranks(
        topic_name,
        2,
        env={
            "STREAMTRAIN_METRICS__STALL_SECONDS": "2",
            "STREAMTRAIN_DISTRIBUTED__TIMEOUT_SECONDS": "60",
            "STREAMTRAIN_CHECKPOINT__PATH": str(tmp_path / "snapshots"),
        },
    )
    base = f"http://127.0.0.1:{ranks[0].metrics_port}"
    seen = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (not seen or seen[-1] != 200):
        status, _ = http_get(base + "/readyz")
        if status and (not seen or seen[-1] != status):
            seen.append(status)
        time.sleep(0.02)
    assert seen == [503, 200], f"/readyz answered {seen}: 503 while restoring, then 200"
    ranks[0].wait_for(lambda: http_get(base + "/healthz")[0] == 200, timeout=60, what="a healthy loop")

    ranks[1].signal(signal.SIGSTOP)  # rank 0 now waits in the step's collective: its loop is stuck
    try:
        ranks[0].wait_for(lambda: http_get(base + "/healthz")[0] == 503, timeout=30, what="/healthz to fail")
        status, body = http_get(base + "/healthz")
        assert "stalled" in body
    finally:
        ranks[1].signal(signal.SIGCONT)
    ranks[0].wait_for(lambda: http_get(base + "/healthz")[0] == 200, timeout=30, what="/healthz to recover")
    ranks[0].signal(signal.SIGTERM)
    assert [r.wait(timeout=60) for r in ranks] == [0, 0]
