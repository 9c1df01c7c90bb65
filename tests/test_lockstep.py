"""Coordination in-process: the lockstep's vote, its empty-batch filler and flush, and the snapshot
triggers, with a fake prefetcher and a fake clock; then the vote itself on 2 real gloo ranks."""

from __future__ import annotations

import threading
from collections import deque
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import yaml
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from streamtrain import lockstep
from streamtrain.checkpoint import StreamState
from streamtrain.config import parse_config
from streamtrain.decode import ClickBatch, PartitionSpan
from streamtrain.dev.kafka import free_port
from streamtrain.lockstep import Lockstep, SnapshotSchedule

REPO = Path(__file__).resolve().parent.parent
FLUSH_AFTER = 0.2


def click_batch(events: int, partition: int = 0, next_offset: int = 0) -> ClickBatch:
    """A decoded batch of ``events`` events with one id each, as the decoder makes it."""
    return ClickBatch(
        dense_features=torch.ones(events, 1),
        sparse_features=KeyedJaggedTensor(
            keys=["t"], values=torch.arange(events), lengths=torch.ones(events, dtype=torch.int64)
        ),
        labels=torch.zeros(events),
        event_time_ms=torch.full((events,), 1_000, dtype=torch.int64),
        loss_scale=torch.tensor(1.0 / max(events, 1)),
        spans={partition: PartitionSpan(events, next_offset)} if events else {},
        global_batch_size=events,
    )


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeQueue:
    """A prefetcher's hand-over: ``get`` returns the next scripted item (None: nothing arrived)
    and lets the fake clock run for the time it would have waited; past the script it stops."""

    def __init__(self, script: list[ClickBatch | None], clock: FakeClock, finish: bool = False, pace: float = 1.0):
        self.script = deque(script)
        self.clock = clock
        self.pace = pace  # how fast this rank's clock runs while it waits
        self.finish = finish
        self.stopping = threading.Event()
        self.finished = False
        self.waits: list[float] = []
        self.peeks = 0  # calls of ``waiting``: votes at which this rank held a batch

    def get(self, timeout: float) -> ClickBatch | None:
        self.waits.append(timeout)
        if not self.script:
            if self.finish:
                self.finished = True
            else:
                self.stopping.set()
            return None
        item = self.script.popleft()
        if item is None:
            self.clock.now += timeout * self.pace
        return item

    def waiting(self, limit: int) -> list[int]:
        self.peeks += 1
        sizes = []
        for item in list(self.script)[:limit]:
            if item is None:
                break
            sizes.append(item.size)
        return sizes


def run(script: list[ClickBatch | None], *, questions=None, finish: bool = False) -> tuple[list[ClickBatch], Lockstep]:
    clock = FakeClock()
    steps = Lockstep(
        FakeQueue(script, clock, finish),
        lambda: click_batch(0),
        world_size=1,
        group=None,
        flush_after_seconds=FLUSH_AFTER,
        questions=questions,
        clock=clock,
    )
    return list(steps), steps


def test_a_held_batch_is_stepped_as_a_new_batch_that_knows_its_global_size():
    decoded = click_batch(4)
    (stepped,), _steps = run([decoded])
    assert stepped is not decoded
    assert stepped.global_batch_size == 4 and stepped.size == 4
    assert float(stepped.loss_scale) == pytest.approx(1 / 4)  # world size 1 over the global batch
    assert stepped.spans == decoded.spans


def test_a_quiet_stream_is_flushed_by_two_empty_steps_after_the_wait_then_idles():
    # The pipeline trains batch i once it holds batch i+2: two empty steps release the real batch.
    idle = [None] * 20
    stepped, _steps = run([click_batch(3), *idle])
    assert [b.size for b in stepped] == [3, 0, 0]
    assert all(b.global_batch_size == 0 and float(b.loss_scale) == 1.0 for b in stepped[1:])


def test_a_quiet_stream_is_flushed_by_as_many_empty_steps_as_the_trainer_holds_ahead():
    # A trainer mapping managed ids one batch ahead holds batch i+3 before it trains batch i.
    clock = FakeClock()
    steps = Lockstep(
        FakeQueue([click_batch(3), *[None] * 20], clock),
        lambda: click_batch(0),
        world_size=1,
        group=None,
        flush_after_seconds=FLUSH_AFTER,
        clock=clock,
        lookahead=3,
    )
    assert [b.size for b in steps] == [3, 0, 0, 0]


def test_no_flush_before_max_batch_wait():
    clock = FakeClock()
    queue = FakeQueue([click_batch(3), None], clock)  # one idle wait of 0.005 s, far below FLUSH_AFTER
    steps = Lockstep(
        queue, lambda: click_batch(0), world_size=1, group=None, flush_after_seconds=FLUSH_AFTER, clock=clock
    )
    assert [b.size for b in steps] == [3]


def test_waits_are_short_while_busy_and_bounded_while_idle():
    _stepped, steps = run([click_batch(2), click_batch(2), None, None])
    waits = steps.batches.waits
    assert waits[:3] == [Lockstep.IDLE_WAIT_SECONDS, Lockstep.BUSY_WAIT_SECONDS, Lockstep.BUSY_WAIT_SECONDS]
    assert max(waits) == Lockstep.IDLE_WAIT_SECONDS


def test_nobody_steps_on_an_idle_stream_until_a_question_is_agreed():
    answers = iter([False, False, True] + [False] * 10)
    stepped, _steps = run([None, None, None, None], questions={"checkpoint": (lambda: next(answers), "any")})
    assert [b.size for b in stepped] == [0]  # the agreed question's step, though no rank has data


def test_agreed_answers_are_handed_out_once():
    seen = []
    clock = FakeClock()
    steps = Lockstep(
        FakeQueue([click_batch(1), click_batch(1)], clock),
        lambda: click_batch(0),
        1,
        None,
        FLUSH_AFTER,
        questions={"saved": (lambda: True, "all")},
        clock=clock,
    )
    for _batch in steps:
        seen.append(steps.take_agreed())
        seen.append(steps.take_agreed())
    assert seen[0] == {"saved": True} and seen[1] == {"saved": False}


def test_one_vote_settles_the_batches_held_up_to_its_limit():
    stepped, steps = run([click_batch(size) for size in range(1, 7)], finish=True)
    assert [b.global_batch_size for b in stepped] == [1, 2, 3, 4, 5, 6]
    assert steps.batches.peeks == 2  # steps 1-4 (STEPS_PER_VOTE), then 5-6
    assert Lockstep.STEPS_PER_VOTE == 4


def test_the_end_of_the_stream_ends_the_iteration():
    stepped, _steps = run([click_batch(2)], finish=True)
    assert [b.size for b in stepped] == [2]


def test_max_events_ends_the_iteration_at_the_first_step_that_reaches_it():
    clock = FakeClock()
    steps = Lockstep(
        FakeQueue([click_batch(2)] * 5, clock),
        lambda: click_batch(0),
        world_size=1,
        group=None,
        flush_after_seconds=FLUSH_AFTER,
        clock=clock,
        max_events=5,
    )
    assert [b.size for b in steps] == [2, 2, 2]  # a batch is never split: 6, not 5


# --- snapshot triggers -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def config():
    raw = yaml.safe_load((REPO / "tests" / "worker-small.yaml").read_text())
    raw["kafka"] = {"bootstrap_servers": "unused:9092", "topic": "unused"}
    raw["checkpoint"] = {"path": "/unused", "interval_seconds": 10, "interval_steps": 5}
    raw["metrics"] = {"log_interval_seconds": 2}
    return parse_config(raw, environ={})


class FakeCheckpointer:
    """The Checkpointer's side of the schedule: a save in flight, finished when told to."""

    def __init__(self, clock: FakeClock):
        self.clock = clock
        self.last_attempt_at = clock()
        self.last_saved_step = self.last_attempt_step = 0
        self.failing = False
        self.in_flight: StreamState | None = None
        self.written = False
        self.saved: list[StreamState] = []

    @property
    def save_in_flight(self) -> bool:
        return self.in_flight is not None

    def save_done(self) -> bool:
        return self.in_flight is not None and self.written

    def start_save(self, state: StreamState) -> None:
        self.in_flight, self.written = state, False
        self.last_attempt_at, self.last_attempt_step = self.clock(), state.step

    def finish_save(self) -> StreamState:
        assert self.in_flight is not None
        state, self.in_flight = self.in_flight, None
        self.last_saved_step = state.step
        self.saved.append(state)
        return state

    def save(self, state: StreamState) -> StreamState:
        self.start_save(state)
        return self.finish_save()


def schedule(config, checkpointer=None, restored=None):
    clock = FakeClock()
    checkpointer = checkpointer(clock) if checkpointer else None
    commits: list[dict[int, int]] = []
    plan = SnapshotSchedule(
        config,
        checkpointer,
        restored,
        start_offsets={0: 100, 2: 7},
        commit=commits.append,
        clock=clock,
    )
    return plan, clock, checkpointer, commits


def test_a_snapshot_is_due_after_its_interval_its_steps_or_a_request(config):
    plan, clock, checkpointer, _commits = schedule(config, FakeCheckpointer)
    assert not plan.due()
    clock.now = 10.0
    assert plan.due()
    checkpointer.last_attempt_at = 10.0
    assert not plan.due()
    plan.record(5, click_batch(1))  # interval_steps: 5
    assert plan.due()
    checkpointer.last_attempt_step = 5
    assert not plan.due()
    plan.request()
    assert plan.due()
    plan.act({"checkpoint": True, "saved": False})
    assert checkpointer.save_in_flight and not plan.requested.is_set()
    clock.now = 100.0
    assert not plan.due()  # one save in flight at a time


def test_a_snapshot_records_the_stream_at_its_step_and_commits_only_once_written_everywhere(config):
    restored = StreamState(step=40, next_offsets={0: 90}, trained={0: 500, 2: 3}, event_time_high_water_ms=5)
    plan, _clock, checkpointer, commits = schedule(config, FakeCheckpointer, restored)
    plan.record(1, click_batch(4, partition=0, next_offset=104))
    plan.act({"checkpoint": True, "saved": False})
    plan.record(2, click_batch(2, partition=2, next_offset=9))  # trained after the cut: not in it
    cut = checkpointer.in_flight
    assert cut == StreamState(
        step=41, next_offsets={0: 104, 2: 7}, trained={0: 504, 2: 3}, event_time_high_water_ms=1_000
    )
    checkpointer.written = True
    plan.act({"checkpoint": False, "saved": False})  # written here, not yet on every rank
    assert commits == [] and checkpointer.save_in_flight
    plan.act({"checkpoint": False, "saved": True})
    assert commits == [{0: 104, 2: 7}]


def test_partitions_picked_up_while_running_enter_the_cut_and_the_groups_commits(config):
    # Partition 5 was trained before the restored snapshot, but the start-up metadata missed it.
    restored = StreamState(step=40, next_offsets={0: 90, 5: 12}, trained={0: 500, 5: 12})
    plan, _clock, checkpointer, commits = schedule(config, FakeCheckpointer, restored)
    plan.record(1, click_batch(3, partition=4, next_offset=3))  # added to the topic, read from its beginning
    plan.record(2, click_batch(2, partition=5, next_offset=14))
    plan.act({"checkpoint": True, "saved": False})
    assert checkpointer.in_flight == StreamState(
        step=42, next_offsets={0: 100, 2: 7, 4: 3, 5: 14}, trained={0: 500, 2: 0, 4: 3, 5: 14},
        event_time_high_water_ms=1_000,
    )  # fmt: skip
    checkpointer.written = True
    plan.act({"checkpoint": False, "saved": True})
    assert commits == [{0: 100, 2: 7, 4: 3, 5: 14}]


def test_close_finishes_the_save_in_flight_and_takes_a_last_snapshot(config):
    plan, _clock, checkpointer, _commits = schedule(config, FakeCheckpointer)
    plan.record(1, click_batch(1, next_offset=101))
    plan.act({"checkpoint": True})
    plan.record(2, click_batch(1, next_offset=102))
    direct: list[dict[int, int]] = []
    plan.close(clean=True, commit=direct.append)
    assert [s.step for s in checkpointer.saved] == [1, 2]
    assert direct == [{0: 101, 2: 7}, {0: 102, 2: 7}]


def test_an_unclean_close_commits_nothing_it_has_not_snapshotted(config):
    plan, _clock, checkpointer, _commits = schedule(config, FakeCheckpointer)
    plan.record(1, click_batch(1, next_offset=101))
    direct: list[dict[int, int]] = []
    plan.close(clean=False, commit=direct.append)
    assert direct == [] and checkpointer.saved == []


def test_without_checkpoints_trained_positions_are_committed_every_log_interval(config):
    plan, clock, _checkpointer, commits = schedule(config)
    assert plan.questions() == {}
    plan.record(1, click_batch(1, next_offset=101))
    plan.act({})
    assert commits == []
    clock.now = 2.0
    plan.act({})
    assert commits == [{0: 101, 2: 7}]
    direct: list[dict[int, int]] = []
    plan.close(clean=False, commit=direct.append)
    assert direct == [{0: 101, 2: 7}]


# --- the vote on 2 real ranks ------------------------------------------------------------------


def _count_votes() -> list[int]:
    """From now on, this process's votes (the lockstep's all-gathers) are counted in the list's one item."""
    votes = [0]
    gathered = lockstep.gathered_from_ranks

    def counted(tensor, group):
        votes[0] += 1
        return gathered(tensor, group)

    lockstep.gathered_from_ranks = counted
    return votes


def _vote_rank(rank: int, port: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    votes = _count_votes()
    clock = FakeClock()
    # Rank 0 holds two batches then idles; rank 1 has nothing and stops after 30 polls. Their clocks
    # run at different paces, so each would see the flush due at a different vote.
    script = [click_batch(3), click_batch(5), *[None] * 40] if rank == 0 else [None] * 30
    queue = FakeQueue(script, clock, pace=1.0 if rank == 0 else 0.3)
    due = iter([rank == 1] + [False] * 100)
    steps = Lockstep(
        queue,
        lambda: click_batch(0),
        world_size=2,
        group=dist.new_group(backend="gloo"),
        flush_after_seconds=FLUSH_AFTER,
        questions={"due": (lambda: next(due), "any")},
        clock=clock,
    )
    stepped, agreed = [], []
    for batch in steps:
        stepped.append((batch.size, batch.global_batch_size, float(batch.loss_scale), votes[0]))
        agreed.append(steps.take_agreed()["due"])
    torch.save({"stepped": stepped, "agreed": agreed}, f"{out}/rank-{rank}.pt")
    dist.destroy_process_group()


def test_two_ranks_step_together_when_one_has_data(tmp_path):
    mp.spawn(_vote_rank, args=(free_port(), str(tmp_path)), nprocs=2)
    zero, one = (torch.load(tmp_path / f"rank-{rank}.pt") for rank in range(2))
    # the same steps at the same votes on both ranks; the idle rank contributes empty batches, and
    # is waited for at each vote: its next batch may be a moment away
    assert [s[3] for s in zero["stepped"]] == [s[3] for s in one["stepped"]]
    assert [s[3] for s in zero["stepped"]][:2] == [1, 2]
    assert [s[1] for s in zero["stepped"]] == [s[1] for s in one["stepped"]] == [3, 5, 0, 0]
    assert [s[0] for s in zero["stepped"]] == [3, 5, 0, 0]
    assert [s[0] for s in one["stepped"]] == [0, 0, 0, 0]
    assert [s[2] for s in one["stepped"]] == pytest.approx([2 / 3, 2 / 5, 2.0, 2.0])
    # rank 1 alone asked "due" at the first vote; "any" makes it agreed on both
    assert zero["agreed"][0] and one["agreed"][0] and not any(zero["agreed"][1:])


def _settling_rank(rank: int, port: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    votes = _count_votes()
    clock = FakeClock()
    # Six batches each, then rank 0's stream ends and rank 1 holds three more after a pause.
    sizes = [1, 2, 3, 4, 5, 6] if rank == 0 else [10, 20, 30, 40, 50, 60]
    tail = [] if rank == 0 else [None, *(click_batch(s) for s in (70, 80, 90)), *[None] * 20]
    script = [click_batch(s) for s in sizes] + tail
    steps = Lockstep(
        FakeQueue(script, clock, finish=rank == 0),
        lambda: click_batch(0),
        world_size=2,
        group=dist.new_group(backend="gloo"),
        flush_after_seconds=FLUSH_AFTER,
        clock=clock,
    )
    stepped = [(batch.size, batch.global_batch_size, float(batch.loss_scale), votes[0]) for batch in steps]
    torch.save(stepped, f"{out}/rank-{rank}.pt")
    dist.destroy_process_group()


def test_one_vote_settles_the_steps_every_rank_with_a_stream_holds(tmp_path):
    mp.spawn(_settling_rank, args=(free_port(), str(tmp_path)), nprocs=2)
    zero, one = (torch.load(tmp_path / f"rank-{rank}.pt") for rank in range(2))
    assert [s[1] for s in zero] == [s[1] for s in one] == [11, 22, 33, 44, 55, 66, 70, 80, 90, 0, 0]
    assert [s[0] for s in zero] == [1, 2, 3, 4, 5, 6, 0, 0, 0, 0, 0]
    assert [s[2] for s in one] == pytest.approx([2 / g for g in (11, 22, 33, 44, 55, 66, 70, 80, 90)] + [2.0, 2.0])
    # steps 1-4 at the first vote, 5-6 at the second, 7-9 at one more (rank 0, its stream ended,
    # stepping empty batches); the flush's steps have a vote each
    assert [s[3] for s in zero] == [s[3] for s in one]
    votes = [s[3] for s in zero]
    assert votes[:6] == [1, 1, 1, 1, 2, 2] and votes[6] == votes[7] == votes[8] < votes[9] < votes[10]
