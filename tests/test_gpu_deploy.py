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
