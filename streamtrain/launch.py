"""Ranks and the launcher that starts them: ``streamtrain worker --nproc N``, ``streamtrain torchrun``,
or torchrun itself (docs/ranks.md, docs/operating.md).

Two promises, each kept on both sides of the launcher:

- **Exit codes survive the launcher.** torch's launcher reports a failed rank only by raising, and
  a stop on a signal not at all. So each rank records how it ended (``record_exit``) in torch
  elastic's error file, which the launcher names for every rank (``TORCHELASTIC_ERROR_FILE``);
  ``launch`` returns the most severe of its ranks' codes (``streamtrain.exitcodes``): from the
  exit statuses torch gives for failed ranks, and from the records after a stop, where a rank that
  recorded nothing did not stop within its grace (``SHUTDOWN_TIMEOUT``). torchrun itself exits 1
  whatever failed; it prints each rank's code, and copies the first failure's record, code
  included, to its own ``TORCHELASTIC_ERROR_FILE``.
- **A rank dies with its launcher, however the launcher dies.** torch starts each rank in a
  session of its own, so a SIGKILL to the launcher's process group would leave the ranks (and rank
  0's export child) training and committing beside the launcher's replacement. Each such process
  asks the kernel for SIGKILL when its parent dies (``PR_SET_PDEATHSIG``, Linux), then checks
  that its parent is still the launcher that started it: a parent gone before the request was
  made is caught there, one gone after it kills the process, so no window is left. A launcher of
  ours names itself to its children (``PARENT_ENV``); under plain torchrun the parent found at
  start-up is taken for the launcher. ``exit_if_orphaned`` repeats the check before each commit,
  where the kernel cannot help (a platform without prctl).

The kernel sends the signal when the *thread* that started the child ends, so children that must
die with this process are started from its main thread (torch's agent does; so does the worker's
training loop, which starts the exports).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from streamtrain.exitcodes import ExitCode, as_exit_code, most_severe

# The pid of the process that started this one, which it must not outlive.
PARENT_ENV = "STREAMTRAIN_PARENT_PID"
_PR_SET_PDEATHSIG = 1
# How much longer than the ranks' own grace the launcher waits before it SIGKILLs them: the rank's
# watchdog gives up first (exit 3, recorded), unless it cannot run at all.
_KILL_MARGIN_SECONDS = 5

_parent: int | None = None


def die_with_parent() -> None:
    """In a process a launcher started (a rank, an export): be SIGKILLed when the launcher dies, and
    exit now if it already has. Call first thing; the declared parent is not passed on."""
    global _parent
    declared = os.environ.pop(PARENT_ENV, None)
    if declared is not None:
        parent = int(declared)
    elif "TORCHELASTIC_RUN_ID" in os.environ:  # torchrun's agent: the parent found now
        parent = os.getppid()
    else:
        return
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    _parent = parent
    exit_if_orphaned("starting")


def exit_if_orphaned(before: str) -> None:
    """Exit at once, committing nothing, if the launcher that started this process is gone."""
    if _parent is not None and os.getppid() != _parent:
        print(
            f"streamtrain: the launcher (pid {_parent}) is gone; exiting before {before}, committing nothing",
            file=sys.stderr,
            flush=True,
        )
        os._exit(ExitCode.FAILED)


def child_environment() -> dict[str, str]:
    """The environment for a child that must die with this process (``die_with_parent``), with
    this process's error file left out so that the child's end is not taken for this one's."""
    environment = {k: v for k, v in os.environ.items() if k != "TORCHELASTIC_ERROR_FILE"}
    environment[PARENT_ENV] = str(os.getpid())
    return environment


def record_exit(code: int, traceback: str = "") -> None:
    """Record this process's exit code where its launcher reads it: torch elastic's error file, in
    torch's format (``errorCode``, a message, and the traceback of an unexpected error)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    described = f"exit code {code} ({as_exit_code(code).name}: {as_exit_code(code).meaning})"
    record = {
        "message": {
            "message": f"streamtrain exited with {described}",
            "errorCode": code,
            "extraInfo": {"py_callstack": traceback or described, "timestamp": str(int(time.time()))},
        }
    }
    temporary = f"{path}.{os.getpid()}.tmp"
    with contextlib.suppress(OSError):  # a launcher that lost its folder learns the code from the status
        Path(temporary).write_text(json.dumps(record))
        os.replace(temporary, path)


def recorded_exit(path: Path) -> int | None:
    """The code a rank recorded in its error file, None if it recorded none."""
    try:
        return int(json.loads(path.read_text())["message"]["errorCode"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def launch(torchrun_args: Sequence[str], shutdown_grace: float | None = None) -> int:
    """Run torch's elastic launcher (torchrun) with ``torchrun_args``; return the ranks' code, the
    most severe if several failed. ``shutdown_grace``: the ranks' own grace after a stop
    (distributed.shutdown_grace_seconds); the launcher SIGKILLs a rank only a little after it."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    with tempfile.TemporaryDirectory(prefix="streamtrain-launch-") as records:
        options = [f"--log-dir={records}"]
        if shutdown_grace is not None:
            options.append(f"--shutdown-timeout={int(shutdown_grace) + 1 + _KILL_MARGIN_SECONDS}")
        arguments = get_args_parser().parse_args([*options, *torchrun_args])  # the caller's flags win
        os.environ[PARENT_ENV] = str(os.getpid())
        try:
            run(arguments)
        except SignalException as stopped:
            # The launcher has passed the signal to every rank and waited for them to stop.
            codes = _recorded_codes(Path(arguments.log_dir))
            code = most_severe(codes)
            print(
                f"streamtrain: stopped by {signal.Signals(stopped.sigval).name}; the ranks' exit code: {code:d}",
                file=sys.stderr,
            )
            return code
        except ChildFailedError as failed:
            statuses = [failure.exitcode for failure in failed.failures.values()]
            code = most_severe(statuses)
            print(failed, file=sys.stderr)  # torch's table: each failed rank's code and record
            print(f"streamtrain: a rank failed; exit codes {sorted(statuses)} give {code:d}", file=sys.stderr)
            return code
        finally:
            del os.environ[PARENT_ENV]
    return ExitCode.OK


def _recorded_codes(log_dir: Path) -> list[int]:
    """Each started rank's recorded code, from the newest attempt under torch's ``log_dir``; a rank
    that recorded none did not stop by itself (SIGKILLed when its grace ran out, or killed by the
    signal before it could handle it), which counts as a stop that outlasted its grace."""
    attempts = sorted(log_dir.glob("*/attempt_*"), key=lambda p: p.stat().st_mtime)
    if not attempts:
        return []  # stopped before any rank started
    codes = []
    for rank in (p for p in attempts[-1].iterdir() if p.is_dir()):
        recorded = recorded_exit(rank / "error.json")
        codes.append(ExitCode.SHUTDOWN_TIMEOUT if recorded is None else recorded)
    return codes
