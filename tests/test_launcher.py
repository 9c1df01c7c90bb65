"""Ranks and their launcher (streamtrain/launch.py): the ranks' exit code survives ``--nproc``,
``streamtrain torchrun`` and torchrun's error file; the launcher waits the configured grace, not
torch's 30 s; and ranks, with rank 0's export child, die with a SIGKILLed launcher and commit
nothing after it."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import REPO, SCHEMA, SMALL_CONFIG, committed_offsets
from streamtrain.dev.produce import produce
from streamtrain.exitcodes import ExitCode, most_severe
from streamtrain.launch import PARENT_ENV, record_exit, recorded_exit

PARTITIONS = 4


# --- the codes ------------------------------------------------------------------------------------


def test_several_ranks_codes_give_the_most_severe_permanent_before_transient():
    assert most_severe([ExitCode.FAILED, ExitCode.RESTORE_REFUSED, ExitCode.OK]) == ExitCode.RESTORE_REFUSED
    assert most_severe([ExitCode.KAFKA_UNREACHABLE, ExitCode.CONFIG]) == ExitCode.CONFIG
    assert most_severe([ExitCode.FAILED, ExitCode.KAFKA_UNREACHABLE]) == ExitCode.KAFKA_UNREACHABLE
    assert most_severe([ExitCode.SHUTDOWN_TIMEOUT, ExitCode.FAILED]) == ExitCode.FAILED  # 3: the echo of a stop
    assert most_severe([-signal.SIGKILL, ExitCode.OK]) == ExitCode.FAILED  # killed by a signal
    assert most_severe([]) == ExitCode.OK


def test_a_rank_records_its_code_in_torch_elastics_error_file(tmp_path, monkeypatch):
    error_file = tmp_path / "error.json"
    assert recorded_exit(error_file) is None
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    record_exit(ExitCode.RESTORE_REFUSED)
    record = json.loads(error_file.read_text())["message"]
    assert record["errorCode"] == 7 and "RESTORE_REFUSED" in record["message"]
    assert int(record["extraInfo"]["timestamp"]) > 0  # torch orders failures by it
    assert recorded_exit(error_file) == 7


def unreachable_config(tmp_path: Path) -> Path:
    """The small worker, its brokers at a port nobody listens on: every rank exits 4 once it is built."""
    raw = yaml.safe_load(SMALL_CONFIG.read_text())
    raw["kafka"] = {"bootstrap_servers": "127.0.0.1:1", "topic": "nowhere", "connect_timeout_seconds": 1}
    raw["features"]["schema_path"] = str(SCHEMA)
    path = tmp_path / "unreachable.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.mark.integration
def test_the_failing_ranks_code_survives_nproc_streamtrain_torchrun_and_torchrun(tmp_path):
    config = unreachable_config(tmp_path)
    worker = ["-m", "streamtrain", "worker", "--config", str(config)]
    error_file = tmp_path / "torchrun-error.json"
    one_rank = ["--standalone", "--nproc-per-node", "1", *worker]
    runs = {
        "--nproc": [sys.executable, *worker, "--nproc", "2"],
        "streamtrain torchrun": [sys.executable, "-m", "streamtrain", "torchrun", *one_rank],
        "torchrun": [sys.executable, "-m", "torch.distributed.run", *one_rank],
    }
    started = {
        name: subprocess.Popen(
            command,
            cwd=REPO,
            env={**os.environ, "TORCHELASTIC_ERROR_FILE": str(error_file)} if name == "torchrun" else None,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for name, command in runs.items()
    }
    results = {name: (process.wait(timeout=300), process.stdout.read()) for name, process in started.items()}
    for name in ("--nproc", "streamtrain torchrun"):
        code, output = results[name]
        assert code == ExitCode.KAFKA_UNREACHABLE, f"{name}: {code}\n{output[-3000:]}"
        assert "exit code 4 (KAFKA_UNREACHABLE" in output  # the ranks' records, in torch's failure table
    code, output = results["torchrun"]
    assert code == 1, output[-3000:]  # torchrun's own status says only that a rank failed
    assert json.loads(error_file.read_text())["message"]["errorCode"] == ExitCode.KAFKA_UNREACHABLE


# --- dying with the launcher -----------------------------------------------------------------------


def gone(pid: int) -> bool:
    """Whether ``pid`` has exited (a zombie waiting for its reaper counts as exited)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def descendants(pid: int) -> dict[int, str]:
    """Every process below ``pid``, with its command line."""
    found: dict[int, str] = {}
    pending = [pid]
    while pending:
        parent = pending.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except FileNotFoundError:
                continue
            for child in children:
                try:
                    found[child] = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                except FileNotFoundError:
                    continue
                pending.append(child)
    return found


def test_a_process_dies_with_the_launcher_that_started_it_and_refuses_a_launcher_already_gone(tmp_path):
    # A launcher (here a plain Python) starts a child with its pid declared; SIGKILL the launcher.
    child = "from streamtrain.launch import die_with_parent; die_with_parent(); import time; time.sleep(120)"
    launcher = subprocess.Popen(
        [sys.executable, "-c",
         "import subprocess, sys, time; from streamtrain.launch import child_environment; "
         f"p = subprocess.Popen([sys.executable, '-c', {child!r}], env=child_environment()); "
         "print(p.pid, flush=True); time.sleep(120)"],
        cwd=REPO, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    pid = int(launcher.stdout.readline())
    time.sleep(1.0)  # the child has asked for its death signal by now
    assert not gone(pid)
    launcher.kill()
    launcher.wait(timeout=10)
    deadline = time.monotonic() + 10
    while not gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gone(pid), "the child outlived its launcher"

    # A child whose declared launcher is not its parent (it died before the child could ask) exits at once.
    result = subprocess.run(
        [sys.executable, "-c", child],
        cwd=REPO,
        env={**os.environ, PARENT_ENV: "1"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == ExitCode.FAILED and "the launcher (pid 1) is gone" in result.stderr


def state(root: Path, deltas: Path) -> dict[str, object]:
    """What the ranks commit: the snapshots, ``latest``, the bases and the deltas, by name."""
    return {
        "snapshots": sorted(p.name for p in root.iterdir()),
        "latest": (root / "latest").read_text() if (root / "latest").exists() else None,
        "bases": sorted(p.name for p in (root / "serving").iterdir()) if (root / "serving").exists() else [],
        "deltas": sorted(p.name for p in deltas.iterdir()) if deltas.exists() else [],
    }


@pytest.mark.integration
def test_sigkill_of_the_launchers_group_kills_every_rank_and_export_and_nothing_commits_after(
    kafka, topic_name, start_worker, live_producer, tmp_path
):
    root, deltas = tmp_path / "snapshots", tmp_path / "deltas"
    env = {
        "STREAMTRAIN_CHECKPOINT__PATH": str(root),
        "STREAMTRAIN_CHECKPOINT__INTERVAL_STEPS": "2",
        "STREAMTRAIN_DELIVERY__ENABLED": "true",
        "STREAMTRAIN_DELIVERY__DIRECTORY": str(deltas),
        "STREAMTRAIN_DELIVERY__DELTA_INTERVAL_STEPS": "2",
        "STREAMTRAIN_DELIVERY__BASE_INTERVAL_SECONDS": "1",  # an export child nearly always running
    }
    produce(kafka.bootstrap_servers, topic_name, 1000, partitions=PARTITIONS, seed=70, schema_path=SCHEMA)
    producer = live_producer(kafka.bootstrap_servers, topic_name, 200 * 300, 200, "--seed", "71")
    launcher = start_worker(topic_name, "--nproc", "2", env=env)

    def running() -> dict[int, str] | None:
        below = descendants(launcher.process.pid)
        ranks = [p for p, command in below.items() if " worker " in command]
        exports = [p for p, command in below.items() if " export " in command]
        trained = launcher.total("streamtrain_batches_total") > 0
        return below if len(ranks) == 2 and exports and trained else None

    processes = launcher.wait_for(running, timeout=240, what="2 ranks training and an export child")
    os.killpg(launcher.process.pid, signal.SIGKILL)  # the launcher's group, as a supervisor kills it
    try:
        assert launcher.process.wait(timeout=10) == -signal.SIGKILL
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not all(gone(pid) for pid in processes):
            time.sleep(0.1)
        alive = {pid: command for pid, command in processes.items() if not gone(pid)}
        assert not alive, f"outlived their launcher: {alive}"

        before = state(root, deltas), committed_offsets(kafka, topic_name, f"group-{topic_name}")
        time.sleep(6)  # the live stream goes on: a rank still running would snapshot every 2 steps
        assert producer.running
        assert (state(root, deltas), committed_offsets(kafka, topic_name, f"group-{topic_name}")) == before
    finally:  # the fixture kills a launcher's ranks only while the launcher lives
        for pid in processes:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.integration
def test_a_stop_that_outlasts_the_grace_exits_3_after_the_grace_not_torchs_30s(kafka, topic_name, start_worker):
    grace = 4
    env = {
        "STREAMTRAIN_DISTRIBUTED__SHUTDOWN_GRACE_SECONDS": str(grace),
        "STREAMTRAIN_DISTRIBUTED__TIMEOUT_SECONDS": "120",  # rank 0 waits for its frozen peer, never gives up on it
    }
    produce(kafka.bootstrap_servers, topic_name, 2000, partitions=PARTITIONS, seed=72, schema_path=SCHEMA)
    launcher = start_worker(topic_name, "--nproc", "2", env=env)
    launcher.wait_for(lambda: launcher.total("streamtrain_batches_total"), timeout=180, what="training")
    ranks = [p for p, command in descendants(launcher.process.pid).items() if " worker " in command]
    assert len(ranks) == 2
    os.kill(max(ranks), signal.SIGSTOP)  # a rank that cannot stop: frozen (its peer waits on it)
    stopped = time.monotonic()
    launcher.signal(signal.SIGTERM)
    try:
        assert launcher.wait(timeout=60) == ExitCode.SHUTDOWN_TIMEOUT, launcher.output()[-3000:]
        took = time.monotonic() - stopped
        print(f"the launcher exited {took:.1f}s after SIGTERM, with a grace of {grace}s")
        assert took < 25  # the grace and a margin, not torch's fixed 30 s
        assert all(gone(pid) for pid in ranks)
    finally:
        for pid in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
