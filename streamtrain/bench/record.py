"""The run record: every trained step of every rank, which the benchmarks measure runs by.

Its format is defined here once. ``RunRecorder`` writes it: the worker is handed one when
STREAMTRAIN_RUN_RECORD names a folder (the CLI does this, so the worker never imports the
benchmarks), and the naive baseline writes its own with the same class. ``RunRecord`` reads the
folder back, all ranks merged. Each rank writes ``<folder>/rank-<N>.npz`` with

  - ``step_wall``: [steps] float64, ``time.time()`` when the step's update was applied;
  - ``step_events``: [steps] int64, events that rank trained in that step;
  - ``freshness``: [events] float32, seconds from each trained event's time to its update;
  - ``step_seconds``, ``step_wait``: [steps], the step's duration and its data wait, when every
    step was timed (the worker's; the naive loop records none);
  - ``step_number``: [steps] int64, the trainer's step count since the process started (the
    stream's step on a fresh start, which a delta names), when every step has one (the worker's).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from streamtrain.bench.common import throughput


class RunRecorder:
    """Collects one rank's steps, and writes them when closed. Beyond ``MAX_EVENTS`` freshness
    values it stops recording, so a long run cannot exhaust memory."""

    MAX_EVENTS = 50_000_000

    def __init__(self, folder: Path, rank: int):
        self.path = Path(folder) / f"rank-{rank}.npz"
        self.step_wall: list[float] = []
        self.step_events: list[int] = []
        self.step_seconds: list[float | None] = []
        self.step_wait: list[float | None] = []
        self.step_number: list[int | None] = []
        self.freshness: list[np.ndarray] = []
        self.kept = 0

    def step_trained(
        self,
        applied: float,
        freshness: np.ndarray,
        seconds: float | None = None,
        data_wait: float | None = None,
        step: int | None = None,
    ) -> None:
        if self.kept + freshness.size > self.MAX_EVENTS:
            return
        self.step_wall.append(applied)
        self.step_events.append(int(freshness.size))
        self.step_seconds.append(seconds)
        self.step_wait.append(data_wait)
        self.step_number.append(step)
        self.freshness.append(freshness.astype(np.float32))
        self.kept += freshness.size

    def close(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        arrays: dict[str, Any] = {
            "step_wall": np.array(self.step_wall, dtype=np.float64),
            "step_events": np.array(self.step_events, dtype=np.int64),
            "freshness": np.concatenate(self.freshness) if self.freshness else np.zeros(0, np.float32),
        }
        if all(s is not None for s in self.step_seconds + self.step_wait):
            arrays["step_seconds"] = np.array(self.step_seconds, dtype=np.float64)
            arrays["step_wait"] = np.array(self.step_wait, dtype=np.float64)
        if all(s is not None for s in self.step_number):
            arrays["step_number"] = np.array(self.step_number, dtype=np.int64)
        np.savez(self.path, **arrays)


@dataclass
class RunRecord:
    """Every step of every rank: wall time and events trained, and each trained event's freshness."""

    step_wall: np.ndarray  # [steps] time.time() when the step's update was applied
    step_events: np.ndarray  # [steps] events trained by that rank in that step
    freshness: np.ndarray  # [events] seconds from event_time to the update, in training order
    fresh_wall: np.ndarray  # [events] the step_wall of each freshness value
    ranks: int
    # the worker's step durations and data waits, in step order (the naive loop records none)
    step_seconds: np.ndarray | None = None
    step_wait: np.ndarray | None = None
    # the worker's step numbers: of each step, and of each freshness value's step
    step_number: np.ndarray | None = None
    fresh_step: np.ndarray | None = None

    @classmethod
    def load(cls, folder: Path) -> RunRecord:
        parts = [np.load(path) for path in sorted(Path(folder).glob("rank-*.npz"))]
        if not parts:
            raise RuntimeError(f"no run record under {folder}: did the worker exit cleanly?")
        wall = np.concatenate([p["step_wall"] for p in parts])
        events = np.concatenate([p["step_events"] for p in parts])
        # freshness values in step order, per rank; a step's events share its wall time
        fresh_wall = np.concatenate([np.repeat(p["step_wall"], p["step_events"]) for p in parts])
        fresh = np.concatenate([p["freshness"] for p in parts])
        order = np.argsort(wall, kind="stable")
        fresh_order = np.argsort(fresh_wall, kind="stable")
        timed = all("step_seconds" in p for p in parts)
        numbered = all("step_number" in p for p in parts)
        fresh_step = (
            np.concatenate([np.repeat(p["step_number"], p["step_events"]) for p in parts])[fresh_order]
            if numbered
            else None
        )
        return cls(
            wall[order],
            events[order],
            fresh[fresh_order],
            fresh_wall[fresh_order],
            len(parts),
            np.concatenate([p["step_seconds"] for p in parts])[order] if timed else None,
            np.concatenate([p["step_wait"] for p in parts])[order] if timed else None,
            np.concatenate([p["step_number"] for p in parts])[order] if numbered else None,
            fresh_step,
        )

    def data_wait_share(self, warm_up_seconds: float) -> float | None:
        """Of the trainer's step time after the warm-up, the share spent waiting for the next batch
        and the ranks' vote: near 0, training is the limit; large, the data path is."""
        if self.step_seconds is None or self.step_wait is None:
            return None
        trained = self.step_events > 0
        after = self.step_wall >= self.step_wall[trained][0] + warm_up_seconds if trained.any() else trained
        total = float(self.step_seconds[after].sum())
        return float(self.step_wait[after].sum()) / total if total else None

    def window(self, warm_up_seconds: float) -> dict:
        """Events/s from the first step ``warm_up_seconds`` after the first trained event to the last
        trained event, over all ranks."""
        return throughput(self.step_wall, self.step_events, warm_up_seconds)
