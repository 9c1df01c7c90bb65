"""Where a leg's CPU-seconds go: every thread of every rank, sampled from ``/proc``, per trained event.

``CpuSampler`` reads ``/proc/<pid>/task/*/stat`` of the ranks (and, apart, of the broker) every
``interval`` seconds while a leg runs. ``cpu_per_event`` then takes the CPU used between the
samples nearest the leg's counted window (``common.throughput``'s: warm-up excluded) over the
events trained between them, split by thread group (``thread_group``). The ranks' threads are
told apart by their kernel names (``streamtrain.threads``): the trainer is each rank's main thread.

Beside the CPU, each thread's time spent runnable but waiting for a core (the scheduler's run
queue, ``/proc/<pid>/task/<tid>/schedstat``): on two cores shared by two ranks, their helper
threads and a broker, a trainer that waits for a core holds up the other rank at the step's next
collective.

And the machine's steal time (``/proc/stat``): CPU time the hypervisor gave to other guests while
this one's cores wanted to run. On a shared host it can take half the cores for minutes, and a
leg that ran then is slower for no reason in the code.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from streamtrain.threads import DECODE, IDMAP, PREFETCH

GROUPS = ("trainer", "prefetch", "librdkafka", "gloo", "other")
_TICK = os.sysconf("SC_CLK_TCK")


def thread_group(pid: int, tid: int, name: str) -> str:
    """Which of ``GROUPS`` a rank's thread belongs to."""
    if tid == pid or name == IDMAP:  # the map's helpers work for the training thread, which waits on them
        return "trainer"
    if name.startswith("rdk:"):  # librdkafka names its threads rdk:main, rdk:broker<id>, ...
        return "librdkafka"
    if name in (PREFETCH, DECODE):  # the data path: the prefetch thread and its decode helpers
        return "prefetch"
    if name.startswith(("gloo", "pt_gloo")):  # torch's names: gloo_tcp_loop, pt_gloo_runloop
        return "gloo"
    return "other"


def thread_times(pid: int) -> dict[int, tuple[str, float, float]]:
    """{tid: (kernel name, user + system CPU seconds, seconds runnable but waiting for a core)} of
    every thread of ``pid`` ({} once it is gone)."""
    times = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return {}
    for tid in tids:
        try:
            text = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
            waited_ns = int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[1])
        except OSError:  # the thread ended between the listing and the read
            continue
        name = text[text.index("(") + 1 : text.rindex(")")]
        fields = text[text.rindex(")") + 2 :].split()
        times[int(tid)] = (name, (int(fields[11]) + int(fields[12])) / _TICK, waited_ns / 1e9)
    return times


def stolen_seconds() -> float:
    """CPU-seconds the hypervisor has taken from this machine's cores since boot, all cores."""
    # The first line: cpu user nice system idle iowait irq softirq steal ...
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    return int(fields[8]) / _TICK


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``, children of any of its threads included."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        try:
            tids = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                children = [int(c) for c in Path(f"/proc/{parent}/task/{tid}/children").read_text().split()]
            except OSError:
                continue
            found.extend(children)
            todo.extend(children)
    return found


@dataclass
class CpuSample:
    wall: float  # time.time(), the run record's clock
    ranks: dict[tuple[int, int], tuple[str, float, float]]  # (pid, tid) -> (group, CPU, run-queue seconds so far)
    broker: float  # the broker's CPU seconds so far (0 without one)
    stolen: float  # stolen_seconds()


@dataclass
class CpuSampler:
    """Samples the threads of ``ranks()`` (asked each time: ranks start and leave) and the broker's
    process until stopped. A thread's last figure is kept after it ends: CPU it used stays counted."""

    ranks: Callable[[], list[int]]
    broker_pid: int | None = None
    interval: float = 0.5
    samples: list[CpuSample] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._seen: dict[tuple[int, int], tuple[str, float, float]] = {}
        self._thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)

    def __enter__(self) -> CpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        while True:
            self.sample()
            if self._stop.wait(self.interval):
                return

    def sample(self) -> None:
        for pid in self.ranks():
            for tid, (name, seconds, waited) in thread_times(pid).items():
                self._seen[(pid, tid)] = (thread_group(pid, tid, name), seconds, waited)
        broker = sum(s for _n, s, _w in thread_times(self.broker_pid).values()) if self.broker_pid else 0.0
        self.samples.append(CpuSample(time.time(), dict(self._seen), broker, stolen_seconds()))


def cpu_per_event(samples: list[CpuSample], step_wall: np.ndarray, step_events: np.ndarray, start: float) -> dict:
    """CPU-seconds per trained event between the first sample at or after ``start`` (the counted
    window's start) and the last sample before the last trained step; by thread group, and the
    broker's apart; and each group's time waiting for a core, per event, with the trainers' share
    of the window spent so (``trainer_waiting_share``); and the share of the machine's cores the
    hypervisor took meanwhile (``stolen_share``). Empty when no two samples fall in the window."""
    inside = [s for s in samples if start <= s.wall <= float(step_wall[-1])]
    if len(inside) < 2:
        return {}
    first, last = inside[0], inside[-1]
    events = int(step_events[(step_wall > first.wall) & (step_wall <= last.wall)].sum())
    if not events:
        return {}
    by_group = dict.fromkeys(GROUPS, 0.0)
    waiting = dict.fromkeys(GROUPS, 0.0)
    for key, (group, seconds, waited) in last.ranks.items():
        _group, seconds_before, waited_before = first.ranks.get(key, (group, 0.0, 0.0))
        by_group[group] += seconds - seconds_before
        waiting[group] += waited - waited_before
    ranks = sum(by_group.values())
    wall = last.wall - first.wall
    trainers = sum(1 for group, _s, _w in last.ranks.values() if group == "trainer")
    return {
        "events": events,
        "seconds": wall,
        "cpu_seconds_per_event": ranks / events,
        "cores_busy": ranks / wall,
        "by_thread": {
            g: {
                "cpu_seconds_per_event": s / events,
                "share": s / ranks if ranks else 0.0,
                "waiting_for_a_core_seconds_per_event": waiting[g] / events,
            }
            for g, s in by_group.items()
        },
        "trainer_waiting_share": waiting["trainer"] / (wall * trainers) if trainers else 0.0,
        "broker_cpu_seconds_per_event": (last.broker - first.broker) / events,
        "broker_cores_busy": (last.broker - first.broker) / wall,
        "stolen_share": (last.stolen - first.stolen) / (wall * (os.cpu_count() or 1)),
    }


def loadavg() -> list[float]:
    """The machine's 1, 5 and 15-minute load averages: how busy it was beside the run."""
    return [float(v) for v in Path("/proc/loadavg").read_text().split()[:3]]
