"""Run one function on N local ranks, joined with gloo as torchrun joins them, and collect what each
returns. ``run_ranks("streamtrain.bench.pipeline:rank_main", {...})`` -> one dict per rank."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from streamtrain.bench.common import local_rank_env
from streamtrain.dev import CHECKOUT


class PortTaken(RuntimeError):
    """A rank found the rendezvous port it was given taken: a port found free can be another
    connection's ephemeral port a moment later on a busy host. Starting again takes another."""


def wait_together(processes: list[subprocess.Popen], deadline: float, what: str) -> None:
    """Waits until every rank has exited, or one has failed, whose peers would otherwise wait for
    it in a collective until the process group's timeout; then kills any still running.
    RuntimeError past ``deadline`` (``time.monotonic()``)."""
    try:
        while any(p.poll() is None for p in processes):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not finish in time")
            if any(p.poll() not in (None, 0) for p in processes):
                time.sleep(2.0)  # let the peers fail too, then report
                break
            time.sleep(0.2)
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait(10)


def run_ranks(
    target: str,
    kwargs: dict,
    world_size: int = 2,
    timeout: float = 600.0,
    started: Callable[[list[int]], None] = lambda pids: None,
) -> list[dict]:
    """``started`` is handed the ranks' process ids once they are all started (again, if they
    are started again on another port)."""
    try:
        return _run_ranks_once(target, kwargs, world_size, timeout, started)
    except PortTaken:
        return _run_ranks_once(target, kwargs, world_size, timeout, started)


def _run_ranks_once(
    target: str, kwargs: dict, world_size: int, timeout: float, started: Callable[[list[int]], None]
) -> list[dict]:
    from streamtrain.dev.kafka import free_port

    with tempfile.TemporaryDirectory(prefix="streamtrain-ranks-") as folder:
        port = free_port()
        processes = []
        for rank in range(world_size):
            log = open(Path(folder) / f"rank-{rank}.log", "wb")  # noqa: SIM115 - the rank writes it until it exits
            processes.append(
                (
                    log,
                    subprocess.Popen(
                        [
                            sys.executable,
                            "-m",
                            "streamtrain.bench.ranks",
                            target,
                            json.dumps(kwargs),
                            str(Path(folder) / f"rank-{rank}.json"),
                        ],
                        cwd=CHECKOUT,
                        env={**os.environ, **local_rank_env(rank, world_size, port)},
                        stdout=log,
                        stderr=subprocess.STDOUT,
                    ),
                )
            )
        started([p.pid for _log, p in processes])
        try:
            wait_together([p for _log, p in processes], time.monotonic() + timeout, target)
        finally:
            for log, _process in processes:
                log.close()
        failed = [rank for rank, (_log, p) in enumerate(processes) if p.returncode != 0]
        if failed:
            logs = [(Path(folder) / f"rank-{rank}.log").read_text(errors="replace") for rank in failed]
            raise (PortTaken if any("EADDRINUSE" in log for log in logs) else RuntimeError)(
                f"{target}: rank {failed[0]} exited with {processes[failed[0]][1].returncode}:\n{logs[0][-4000:]}"
            )
        return [json.loads((Path(folder) / f"rank-{rank}.json").read_text()) for rank in range(world_size)]


def _main() -> None:
    import logging
    import warnings

    logging.basicConfig(level=logging.WARNING)
    warnings.filterwarnings("ignore")
    target, kwargs, out = sys.argv[1], json.loads(sys.argv[2]), Path(sys.argv[3])
    module, function = target.split(":")
    result = getattr(importlib.import_module(module), function)(**kwargs)
    out.write_text(json.dumps(result))
    # Leave together, and skip the interpreter's teardown: gloo's threads being destroyed at exit
    # can abort the process ("terminate called without an active exception") after its work is done.
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    _main()
