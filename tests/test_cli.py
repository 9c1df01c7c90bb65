"""The command line: every command's help works, and the runtime's path loads no development tools."""

import argparse
import subprocess
import sys

import pytest

from conftest import REPO
from streamtrain.bench import BENCHMARKS
from streamtrain.cli import build_parser, main

COMMANDS = next(
    list(action.choices) for action in build_parser()._actions if isinstance(action, argparse._SubParsersAction)
)


def streamtrain(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "streamtrain", *args], cwd=REPO, capture_output=True, text=True, timeout=120
    )


def test_the_worker_and_the_parser_import_no_dev_or_bench_module():
    """A fresh interpreter, as a rank starts: what the worker's path loads, and nothing more."""
    probe = (
        "import sys\n"
        "import streamtrain.worker\n"
        "from streamtrain.cli import main\n"
        "try:\n"
        "    main(['worker', '--help'])\n"
        "except SystemExit as stop:\n"
        "    assert stop.code == 0, stop.code\n"
        "print(sorted(m for m in sys.modules if m.split('.')[:2] in (['streamtrain', 'dev'], "
        "['streamtrain', 'bench'])))\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines()[-1] == "[]"


def test_help_exits_zero():
    result = streamtrain("--help")
    assert result.returncode == 0, result.stderr
    assert all(command in result.stdout for command in COMMANDS)


@pytest.mark.parametrize("command", COMMANDS)
def test_every_commands_help_exits_zero(command):
    result = streamtrain(command, "--help")
    assert result.returncode == 0, result.stderr
    if command == "bench":
        assert all(f"{name}: " in result.stdout for name in BENCHMARKS)


def test_serve_with_the_workers_config_names_a_client_property_it_cannot_use(tmp_path, monkeypatch, capsys):
    """`streamtrain serve --config` follows the delta topic with the worker's client properties:
    a set librdkafka refuses (here a login without its user) is exit 2 naming it, before any poll."""
    monkeypatch.setenv("STREAMTRAIN_KAFKA__CLIENT_CONFIG__SECURITY__PROTOCOL", "SASL_PLAINTEXT")
    monkeypatch.setenv("STREAMTRAIN_KAFKA__CLIENT_CONFIG__SASL__MECHANISM", "SCRAM-SHA-512")
    code = main(["serve", "--config", str(REPO / "deploy" / "worker.yaml"), "--model", str(tmp_path)])
    assert code == 2
    assert "kafka.client_config: librdkafka refuses the client properties: sasl.username" in capsys.readouterr().err
