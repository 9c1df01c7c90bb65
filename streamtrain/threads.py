"""OS thread names, so that ``top -H``, py-spy and ``bench e2e``'s CPU split tell a rank's threads
apart; the ranges a torch profile shows the stages by; and the scheduling policy of a rank's helper
threads.

Python 3.11 names threads for Python only; the kernel's name (``comm``, at most 15 bytes) is what
every tool outside the interpreter sees, and a new native thread inherits its creator's. librdkafka
(``rdk:*``) and torch's gloo (``gloo_tcp_loop``, ``pt_gloo_runloop``) name their own threads.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

PREFETCH = "st-prefetch"
# A rank's helpers decoding slices of the prefetch thread's batches (batching.decode_threads).
DECODE = "st-decode"
# A rank's helpers mapping slices of a step's managed ids (streamtrain/idspace.py).
IDMAP = "st-idmap"
# A rank's thread mapping the managed ids of the batch after the one training (streamtrain/idspace.py).
IDAHEAD = "st-idahead"

_PR_SET_NAME = 15
_NAME_BYTES = 16  # the kernel's limit, the terminating NUL included

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True) if sys.platform == "linux" else None


def name_this_thread(name: str) -> None:
    """Sets the calling thread's kernel name (cut to 15 bytes); does nothing off Linux."""
    if _libc is not None:
        _libc.prctl(_PR_SET_NAME, name.encode()[: _NAME_BYTES - 1], 0, 0, 0)


def yield_wakeups_to_the_trainer() -> None:
    """Runs the calling thread under SCHED_BATCH: the same fair share of the cores, but its wakeups
    do not preempt the thread on a core. A helper thread waking (a queue slot freed, a fetch
    arrived) in the middle of a trainer's step would hold every rank up at the step's next
    collective. Does nothing where the policy is not offered."""
    if hasattr(os, "SCHED_BATCH"):
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))  # 0: this thread, on Linux


def profiled(name: str) -> contextlib.AbstractContextManager[object]:
    """A range named ``name`` in a torch profile, while one records. Otherwise nothing: entering and
    leaving a ``record_function`` are two operator calls that each let go of the GIL, about 17 µs
    of CPU alone and 30 beside a busy training thread, paid on the trainer's and the prefetch
    thread's every step."""
    import torch  # here, not above: a process that only names its threads stays free of torch

    return torch.profiler.record_function(name) if torch._C._autograd._profiler_enabled() else contextlib.nullcontext()


class Slices:
    """Cuts work of ``n`` items into slices of at least ``min_slice`` items, at most one per
    thread, and runs a step over them on ``threads`` threads, the calling thread's among them. The
    helpers carry the kernel name ``name`` and run under SCHED_BATCH. A step that releases the GIL
    (a numba ``nogil`` kernel) runs its slices side by side."""

    def __init__(self, threads: int, min_slice: int, name: str):
        if threads < 1:
            raise ValueError(f"{name} threads must be at least 1, not {threads}")
        self.threads, self.min_slice = threads, min_slice
        self.pool = (
            ThreadPoolExecutor(threads - 1, thread_name_prefix=name, initializer=_helper, initargs=(name,))
            if threads > 1
            else None
        )

    def cut(self, n: int) -> list[slice]:
        count = max(1, min(self.threads, n // self.min_slice))
        return [slice(n * i // count, n * (i + 1) // count) for i in range(count)]

    def map(self, step: Callable[[Any], Any], items: Sequence[Any]) -> list[Any]:
        if self.pool is None or len(items) == 1:
            return [step(item) for item in items]
        futures = [self.pool.submit(step, item) for item in items[1:]]
        try:
            mine = step(items[0])
        finally:  # the helpers write into the caller's arrays: never leave while one still does
            wait(futures)
        return [mine, *(future.result() for future in futures)]


def _helper(name: str) -> None:
    name_this_thread(name)
    yield_wakeups_to_the_trainer()
