"""Coordination: when every rank steps, stops and snapshots, decided together.

A stream is uneven: one rank's partitions may be idle while another's are flooded, yet every rank
must enter every collective of a step. ``Lockstep`` holds a small vote each step on a gloo group of
its own and turns each rank's queue of decoded batches into the batches it trains, in step with
the others. ``SnapshotSchedule`` asks the vote's extra questions (is a snapshot due? is the one in
flight written everywhere?) and tracks the stream state a snapshot records.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Literal, Protocol

import torch
import torch.distributed as dist

from streamtrain.checkpoint import Checkpointer, SnapshotsFailing, StreamState
from streamtrain.config import WorkerConfig
from streamtrain.decode import ClickBatch
from streamtrain.device import gathered_from_ranks
from streamtrain.threads import profiled

# How many batches TrainPipelineSparseDist takes ahead of the one it trains.
PIPELINE_LOOKAHEAD = 2


class BatchQueue(Protocol):
    """What the lockstep needs of a rank's prefetcher."""

    stopping: threading.Event

    @property
    def finished(self) -> bool:
        """True once the source is exhausted and every batch has been handed over."""

    def get(self, timeout: float) -> ClickBatch | None:
        """The next decoded batch, or None if none arrived within ``timeout`` seconds."""

    def waiting(self, limit: int) -> list[int]:
        """The sizes of up to ``limit`` batches that ``get`` would hand over next, in order."""


# A question put to every rank at each vote, and how the answers combine: "any" rank, or "all".
Question = tuple[Callable[[], bool], Literal["any", "all"]]


class Lockstep:
    """The batches one rank trains, in step with every other rank.

    The ranks vote on ``group``, by all-gather: each says how many batches it holds (the one it
    took and those waiting behind it, up to ``STEPS_PER_VOTE``) and their sizes, whether a flush is
    due, a stop requested, its stream finished, and its answers to ``questions``. A step is taken
    when any rank holds a batch; a rank without one contributes an empty batch, so every rank
    enters every collective of the step. When every rank holds several, the vote settles as many
    steps as the fewest held, with their global sizes: a busy stream votes once every few steps,
    and a stop or a question waits at most that many. A rank whose stream has ended (``--until-end``)
    does not count, and steps empty batches meanwhile. Nobody steps when no rank has data: each
    waits on its own queue for a bounded time and asks again; once ``flush_after_seconds`` have
    passed since a step that held events, empty steps release the batches the pipeline still
    holds. A stop (a signal to any rank) or the end of every rank's stream ends the iteration on
    all ranks at the same step. The iterator never yields None, which TrainPipelineSparseDist
    would take for the end of the stream.

    With ``max_events`` (each rank's source reads at most that many itself), the iteration ends on
    all ranks at the first step at which the events stepped over all ranks reach it, or once any
    rank has handed over all it may read (fewer were stepped when some could not be decoded). One
    busy rank therefore trains exactly ``max_events``; several can overshoot it by less than the
    last step's global batch, since a batch is never split.

    Every batch yielded is a new ``ClickBatch`` that knows its step's global size, and whose loss
    scale is world size over it.
    """

    BUSY_WAIT_SECONDS = 0.005
    IDLE_WAIT_SECONDS = 0.1
    # The vote's all-gather and its wait cost a busy rank about 1 ms of CPU a step (trainer and
    # gloo threads, 2 ranks on 2 cores); the prefetcher's queue usually holds this many.
    STEPS_PER_VOTE = 4

    def __init__(
        self,
        batches: BatchQueue,
        empty_batch: Callable[[], ClickBatch],
        world_size: int,
        group: dist.ProcessGroup | None,
        flush_after_seconds: float,
        questions: dict[str, Question] | None = None,
        heartbeat: Callable[[], None] = lambda: None,
        clock: Callable[[], float] = time.monotonic,
        max_events: int | None = None,
        lookahead: int = PIPELINE_LOOKAHEAD,
    ):
        """An agreed question (``take_agreed()``) is a reason to step even when no rank has data,
        so that e.g. a due snapshot is taken on an idle stream. ``lookahead``: how many batches the
        trainer takes ahead of the one it trains (``Trainer.lookahead``), so how many empty steps
        finish the real ones it holds when the stream pauses."""
        self.batches = batches
        self.empty_batch = empty_batch
        self.world_size = world_size
        self.group = group
        self.flush_after = flush_after_seconds
        self.questions = questions or {}
        self.heartbeat = heartbeat  # the loop turns at least every IDLE_WAIT_SECONDS unless it hangs
        self.clock = clock
        self.max_events = max_events
        self.lookahead = lookahead
        self.agreed: dict[str, bool] = dict.fromkeys(self.questions, False)

    def take_agreed(self) -> dict[str, bool]:
        """What the ranks agreed at the last vote; each answer is handed out once."""
        agreed, self.agreed = self.agreed, dict.fromkeys(self.questions, False)
        return agreed

    def __iter__(self) -> Iterator[ClickBatch]:
        # TrainPipelineSparseDist trains batch i once it has taken batch i+2 (later with managed ids at
        # several ranks or mapped ahead: IdSpace.batches_held). When the stream pauses, empty steps let it
        # finish the real batches it holds instead of waiting for traffic. The global sizes of the last
        # steps are the same on every rank.
        recent_global_sizes: deque[int] = deque([0] * self.lookahead, maxlen=self.lookahead)
        busy = False
        last_step = self.clock()
        stepped = 0  # events over all ranks: the same on every rank
        settled: deque[int] = deque()  # the global sizes of steps the last vote settled, not yet taken
        holding = False  # whether this rank held batches at the last vote; else its stream has ended
        while True:
            if self.max_events is not None and stepped >= self.max_events:
                return
            self.heartbeat()
            batch: ClickBatch | None
            if settled:
                global_size = settled.popleft()
                batch = self._settled_batch() if holding else self.empty_batch()
            else:
                batch = self.batches.get(self.BUSY_WAIT_SECONDS if busy else self.IDLE_WAIT_SECONDS)
                flush = any(recent_global_sizes) and self.clock() - last_step >= self.flush_after
                with profiled("streamtrain.vote"):
                    global_sizes, step, stop = self._vote(batch, flush)
                if stop:
                    return
                holding = batch is not None
                if batch is None and step:
                    batch = self.empty_batch()
                if batch is None:
                    busy = False
                    continue
                global_size, *later = global_sizes
                settled.extend(later)
            recent_global_sizes.append(global_size)
            stepped += global_size
            busy = True
            yield batch.in_global_step(global_size, self.world_size)
            last_step = self.clock()

    def _settled_batch(self) -> ClickBatch:
        """A batch the last vote counted as waiting: only this thread takes from the queue."""
        batch = self.batches.get(self.BUSY_WAIT_SECONDS)
        if batch is None:
            raise RuntimeError("a batch the vote counted as waiting was not handed over")
        return batch

    def _vote(self, batch: ClickBatch | None, flush: bool) -> tuple[list[int], bool, bool]:
        """Gathers every rank's state and keeps the agreed answers. Returns the global sizes of the
        steps settled (at least one), whether to step, and whether to stop.

        Whether to flush is voted too: each rank's clock says it at a slightly different moment,
        and a rank stepping alone would wait in the pipeline's collectives for ever."""
        sizes = [0] * self.STEPS_PER_VOTE
        held = 0
        if batch is not None:
            waiting = self.batches.waiting(self.STEPS_PER_VOTE - 1)
            held = 1 + len(waiting)
            sizes[:held] = [batch.size, *waiting]
        votes = torch.tensor(
            [
                held,
                flush,
                self.batches.stopping.is_set(),
                self.batches.finished,
                *(bool(ask()) for ask, _mode in self.questions.values()),
                *sizes,
            ],
            dtype=torch.int64,
        )
        ranks = gathered_from_ranks(votes, self.group).tolist() if self.world_size > 1 else [votes.tolist()]
        # A rank whose stream has ended steps empty batches meanwhile, rather than make the busy ones
        # vote every step. One that merely holds none now may be a moment behind: it is waited for.
        settles = max(min((held for held, _flush, _stop, ended, *_ in ranks if held or not ended), default=1), 1)
        batches_held, flushes, stops, finished, *rest = (sum(column) for column in zip(*ranks, strict=True))
        answers, global_sizes = rest[: len(self.questions)], rest[len(self.questions) :][:settles]
        self.agreed = {
            name: count > 0 if mode == "any" else count == self.world_size
            for (name, (_ask, mode)), count in zip(self.questions.items(), answers, strict=True)
        }
        step = bool(batches_held or flushes or any(self.agreed.values()))
        # Under max_events a finished rank has read its whole allowance: the others stop with it.
        ended = finished == self.world_size or (self.max_events is not None and finished > 0)
        return global_sizes, step, bool(stops) or ended


class SnapshotSchedule:
    """When to snapshot, and the stream state a snapshot records, for one rank.

    Triggers: ``checkpoint.interval_seconds`` since the last snapshot, ``interval_steps`` steps,
    or ``request()`` (SIGUSR1). A snapshot starts at the step every rank's vote says one is due
    ("any"), and commits at the step every rank says its writes are done ("all"), so all ranks
    take the same cut. Without ``checkpoint.path`` it only tracks positions, and commits the
    trained ones to the consumer group every ``metrics.log_interval_seconds``; with it, the group
    only ever hears positions that are durable in a committed snapshot.
    """

    def __init__(
        self,
        config: WorkerConfig,
        checkpointer: Checkpointer | None,
        restored: StreamState | None,
        start_offsets: dict[int, int],
        commit: Callable[[dict[int, int]], None],
        clock: Callable[[], float] = time.monotonic,
    ):
        """``start_offsets``: where this rank's partitions start. Partitions it picks up later enter
        the state with their first trained batch; a snapshot that does not know a partition makes
        a restored worker read it from its beginning. ``commit`` hands positions to the consumer
        group from the training thread (the prefetcher forwards them); ``close`` takes the direct
        commit once that thread has stopped."""
        self.config = config
        self.checkpointer = checkpointer
        self.commit = commit
        self.clock = clock
        base = restored or StreamState()
        self.base_step = base.step
        self.base_trained = base.trained
        self.base_positives = base.positives  # a partition picked up later continues its counts
        self.state = StreamState(
            step=base.step,
            next_offsets=dict(start_offsets),
            trained={p: base.trained.get(p, 0) for p in start_offsets},
            event_time_high_water_ms=base.event_time_high_water_ms,
            positives={p: list(base.positives[p]) for p in start_offsets if p in base.positives},
        )
        self.requested = threading.Event()  # set from a signal handler
        self.last_commit = clock()

    def request(self) -> None:
        """Take a snapshot at the next step every rank can agree on."""
        self.requested.set()

    def questions(self) -> dict[str, Question]:
        if self.checkpointer is None:
            return {}
        return {"checkpoint": (self.due, "any"), "saved": (self.checkpointer.save_done, "all")}

    def due(self) -> bool:
        checkpointer, interval = self.checkpointer, self.config.checkpoint
        if checkpointer is None or checkpointer.save_in_flight:
            return False
        return (
            self.requested.is_set()
            or self.clock() - checkpointer.last_attempt_at >= interval.interval_seconds
            or bool(
                interval.interval_steps and self.state.step - checkpointer.last_attempt_step >= interval.interval_steps
            )
        )

    def record(self, step: int, batch: ClickBatch) -> None:
        """The trainer applied ``batch`` as its ``step``-th step since this process started."""
        state = self.state
        state.step = self.base_step + step
        for partition, span in batch.spans.items():
            state.next_offsets[partition] = span.next_offset
            state.trained[partition] = state.trained.get(partition, self.base_trained.get(partition, 0)) + span.events
        if batch.size:
            newest = min(int(batch.event_time_ms.max()), self.config.features.event_time_bound_ms())
            state.event_time_high_water_ms = max(state.event_time_high_water_ms, newest)
        if batch.samples is not None:
            for partition, counts in batch.samples.positives.items():
                held = state.positives.get(partition, self.base_positives.get(partition))
                state.positives[partition] = (counts.ravel() + (held or 0)).tolist()

    def act(self, agreed: dict[str, bool]) -> None:
        """After a step: commit a finished snapshot, or start one, as every rank agreed. Raises
        ``SnapshotsFailing`` on every rank at once when too many snapshots in a row failed."""
        checkpointer = self.checkpointer
        if checkpointer is None:
            if self.clock() - self.last_commit >= self.config.metrics.log_interval_seconds:
                self.commit(self.state.next_offsets)
                self.last_commit = self.clock()
        elif agreed.get("saved") and checkpointer.save_in_flight:
            self._committed(checkpointer.finish_save(), self.commit)
            if checkpointer.failing:
                raise SnapshotsFailing(checkpointer.failing_message())
        elif agreed.get("checkpoint") and not checkpointer.save_in_flight:
            self.requested.clear()
            checkpointer.start_save(self.state.copy())

    def close(self, clean: bool, commit: Callable[[dict[int, int]], None]) -> None:
        """At the end: with every rank here (``clean``), finish the save in flight and take a last
        snapshot; then tell the consumer group the durable positions through ``commit``."""
        checkpointer = self.checkpointer
        if checkpointer is None:
            commit(self.state.next_offsets)
            return
        if not clean:
            return
        if checkpointer.save_in_flight:
            self._committed(checkpointer.finish_save(), commit)
        if self.state.step > checkpointer.last_saved_step:
            self._committed(checkpointer.save(self.state.copy()), commit)

    def _committed(self, stream: StreamState | None, commit: Callable[[dict[int, int]], None]) -> None:
        if stream is None:  # the save failed: the group hears nothing new
            return
        # The snapshot holds every rank's partitions; this rank's are those of its own state.
        commit({p: o for p, o in stream.next_offsets.items() if p in self.state.next_offsets})
