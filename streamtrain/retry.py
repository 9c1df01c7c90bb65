"""Retrying a call that fails for a while: one backoff policy, one loop, for every caller.

    retry(call, Backoff(initial=0.5, maximum=10.0, timeout=30.0), retry_on=OSError, stopping=stop)

calls ``call()`` until it returns, waiting ``initial`` seconds after the first failure, twice as
long after each next one, up to ``maximum``. It gives up by raising the last error: at once if
that error is not a ``retry_on`` one that ``retriable`` accepts, when the next wait would end past
``timeout`` seconds from the start, or when ``stopping`` is set during a wait.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")
E = TypeVar("E", bound=Exception)


@dataclass(frozen=True)
class Backoff:
    """Waits of ``initial`` seconds doubling up to ``maximum`` (equal: fixed waits), for at most
    ``timeout`` seconds in all (None: until a stop)."""

    initial: float
    maximum: float
    timeout: float | None = None

    def waits(self) -> Iterator[float]:
        """The wait after each failed attempt in turn, without end."""
        wait = self.initial
        while True:
            yield wait
            wait = min(wait * 2, self.maximum)


def retry(
    call: Callable[[], T],
    backoff: Backoff,
    *,
    retry_on: type[E],
    retriable: Callable[[E], bool] = lambda error: True,
    on_retry: Callable[[E, int, float], None] = lambda error, attempt, wait: None,
    stopping: threading.Event | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> T:
    """``call()``'s result, retried after each retriable error; ``on_retry(error, attempt, wait)``
    runs before each wait (the attempts count from 1). Raises the last error when giving up."""
    if backoff.timeout is None and stopping is None:
        raise ValueError("a retry needs a timeout or a stop event, or it may never end")
    deadline = None if backoff.timeout is None else clock() + backoff.timeout
    waiting = stopping if stopping is not None else threading.Event()  # never set: a plain sleep
    waits = backoff.waits()
    attempt = 0
    while True:
        attempt += 1
        try:
            return call()
        except retry_on as error:
            wait = next(waits)
            if not retriable(error) or (deadline is not None and clock() + wait > deadline):
                raise
            on_retry(error, attempt, wait)
            if waiting.wait(wait):
                raise
