"""A real install: this checkout built and installed (not editable) into a fresh venv, then run
from a folder outside the checkout, where only the packaged files can be found."""

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from conftest import REPO, SCHEMA, SMALL_CONFIG, committed_offsets, end_offsets
from streamtrain.dev.produce import produce

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("install")
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    site = Path(run(venv, "python", "-c", "import sysconfig; print(sysconfig.get_path('purelib'))").stdout.strip())
    # Nothing is downloaded: torch and the other dependencies, and pip and setuptools for the build
    # (without build isolation), come from this interpreter's site-packages, after the venv's own.
    (site / "dependencies.pth").write_text(
        "\n".join(sorted({sysconfig.get_path("purelib"), sysconfig.get_path("platlib")})) + "\n"
    )
    # Built from a copy: an in-tree build would leave build/ and *.egg-info in the checkout.
    source = root / "source"
    shutil.copytree(REPO / "streamtrain", source / "streamtrain", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    run(
        venv,
        "python",
        "-m",
        "pip",
        "install",
        "--quiet",
        "--no-deps",
        "--no-build-isolation",
        "--no-index",
        str(source),
        timeout=300,
    )
    return venv


@pytest.fixture
def workdir(tmp_path) -> Path:
    """Outside the checkout, with the two configs copied in: their schema_path, schemas/click_event.avsc,
    is not there, so it can only come from the installed package."""
    shutil.copy(REPO / "deploy" / "worker.yaml", tmp_path / "worker.yaml")
    shutil.copy(SMALL_CONFIG, tmp_path / "worker-small.yaml")
    assert not (tmp_path / "schemas").exists()
    return tmp_path


def run(
    venv: Path,
    command: str,
    *args: str,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 120,
) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run(
        [str(venv / "bin" / command), *args],
        cwd=cwd,
        env={**environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, f"{command} {' '.join(args)}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


def test_the_command_runs_from_the_venv_with_its_schema(venv, workdir):
    run(venv, "streamtrain", "worker", "--help", cwd=workdir)
    where = run(venv, "python", "-c", "import streamtrain; print(streamtrain.__file__)", cwd=workdir).stdout
    package = Path(where.strip()).parent
    assert package.is_relative_to(venv) and package.parent.name == "site-packages", package
    assert (package / "schemas" / "click_event.avsc").is_file()


def test_plan_reads_the_bundled_schema(venv, workdir):
    result = run(venv, "streamtrain", "plan", "--config", "worker.yaml", cwd=workdir)
    assert "sharding plan for 1 rank(s) on cpu" in result.stdout


def test_the_installed_worker_trains_a_topic(venv, workdir, kafka, topic_name):
    produce(kafka.bootstrap_servers, topic_name, 2_000, partitions=4, seed=61, schema_path=SCHEMA)
    run(
        venv,
        "streamtrain",
        "worker",
        "--config",
        "worker-small.yaml",
        "--until-end",
        cwd=workdir,
        env={
            "STREAMTRAIN_KAFKA__BOOTSTRAP_SERVERS": kafka.bootstrap_servers,
            "STREAMTRAIN_KAFKA__TOPIC": topic_name,
            "STREAMTRAIN_KAFKA__GROUP_ID": f"group-{topic_name}",
        },
        timeout=300,
    )
    assert committed_offsets(kafka, topic_name, f"group-{topic_name}") == end_offsets(kafka, topic_name)
