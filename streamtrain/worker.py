"""The worker: source -> decode -> batch -> train, with metrics beside them, until the end or a signal."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np
import torch.distributed as dist

from streamtrain.batch import Prefetcher
from streamtrain.checkpoint import Checkpointer, RestoreRefused, SnapshotsFailing
from streamtrain.config import WorkerConfig
from streamtrain.deadletter import Rejections, dead_letter_topic
from streamtrain.decode import AvroBatchDecoder
from streamtrain.delayed import LateLabelWatch
from streamtrain.delivery.artifact import check_exportable
from streamtrain.delivery.publisher import Publisher, delta_topic
from streamtrain.device import decode_threads, gloo_group, init_distributed
from streamtrain.exitcodes import ExitCode
from streamtrain.launch import record_exit
from streamtrain.lockstep import Lockstep, SnapshotSchedule
from streamtrain.metrics import Health, WorkerMetrics
from streamtrain.registry import schema_source
from streamtrain.source import KafkaSource
from streamtrain.topics import OutputTopicMissing, ensure_topics_on_every_rank
from streamtrain.train import StepResult, Trainer, describe_plan, write_plan_json

log = logging.getLogger(__name__)


class StepObserver(Protocol):
    """Something the worker is handed that watches every step that trained events, e.g. a
    benchmark's run record."""

    def step_trained(self, applied: float, freshness: np.ndarray, seconds: float, data_wait: float, step: int) -> None:
        """At wall time ``applied`` the update of step ``step`` (this process's trainer's count) was
        applied: ``freshness`` holds seconds from each of its events' time to then; the step took
        ``seconds``, ``data_wait`` of it waiting."""

    def close(self) -> None:
        """The worker stopped."""


class _Progress:
    """Exports each step's figures; a reporter thread prints a summary line every ``interval`` seconds,
    idle or not, so the gauges and the log stay current while the stream is quiet."""

    def __init__(
        self,
        metrics: WorkerMetrics,
        rank: int,
        topic: str,
        interval: float,
        queue_depth: Callable[[], int],
        observers: Sequence[StepObserver],
        lag: Callable[[], int | None] = lambda: None,
        event_time_bound: Callable[[float], float] = lambda _now: math.inf,
        late: LateLabelWatch | None = None,
    ):
        """``event_time_bound``: the latest event time (ms) believed at a wall time (s); later ones
        are clamped to it for freshness, and counted. ``late``: with delayed_labels, what is
        reported of them, the matured quality among it."""
        self.metrics = metrics
        self.rank = rank
        self.topic = topic
        self.interval = interval
        self.queue_depth = queue_depth
        self.lag = lag
        self.event_time_bound = event_time_bound
        self.late = late
        self.step = 0
        self.trained = 0
        self.loss_sum = 0.0
        self.loss_events = 0  # events whose loss has been read: the steps before the unread one
        self.unread: StepResult | None = None
        self.last_time = time.monotonic()
        self.last_trained = 0
        self.last_loss_sum = 0.0
        self.last_loss_events = 0
        self.first_trained_at = 0.0
        self.last_trained_at = 0.0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._report_until_done, name="streamtrain-progress", daemon=True)
        self.observers = observers

    def __enter__(self) -> _Progress:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        self.thread.join(timeout=5)
        if exc[0] is None:  # after a failure the last step's values may never reach the host
            self._read(self.unread)
            self.unread = None
        self.report()

    def record(self, result: StepResult) -> None:
        batch, metrics = result.batch, self.metrics
        metrics.step_seconds.observe(result.seconds)
        metrics.data_wait_seconds.observe(result.data_wait_seconds)
        metrics.compute_seconds.observe(max(result.seconds - result.data_wait_seconds, 0.0))
        metrics.batch_events.observe(batch.size)
        metrics.global_batch_size.set(batch.global_batch_size)
        for partition, span in batch.spans.items():
            if span.events:
                metrics.events_trained.labels(self.topic, str(partition)).inc(span.events)
        metrics.batches.inc()
        if self.late is not None:
            self.late.trained(batch)
        if batch.size:
            applied = time.time()
            times = batch.event_time_ms.cpu().numpy()
            bound = self.event_time_bound(applied)
            if clamped := int((times > bound).sum()):
                metrics.event_times_clamped.inc(clamped)
                times = np.minimum(times, bound)
            freshness = applied - times / 1000.0
            metrics.freshness.observe_many(freshness)
            for observer in self.observers:
                observer.step_trained(applied, freshness, result.seconds, result.data_wait_seconds, result.step)
        self.step = result.step
        if batch.size:
            self.first_trained_at = self.first_trained_at or time.monotonic()
            self.last_trained_at = time.monotonic()
        self.trained += batch.size
        # The loss and logits are read one step late: the last step's copies to the host are done
        # by now, while this step's would make the host wait for the step's end (StepReadout).
        self._read(self.unread)
        self.unread = result

    def _read(self, result: StepResult | None) -> None:
        if result is None:
            return
        batch, loss_sum = result.batch, result.loss_sum
        if batch.size:
            self.metrics.loss.set(loss_sum / batch.size)
            self.metrics.task_quality.add(result.logits.numpy(), batch.labels.numpy())
            if self.late is not None:
                self.late.matured.add(result.logits.numpy(), batch)
        self.loss_sum += loss_sum
        self.loss_events += batch.size

    def summary(self) -> str:
        seconds = self.last_trained_at - self.first_trained_at
        rate = f" in {seconds:.1f}s ({self.trained / seconds:,.0f} events/s)" if seconds > 0 else ""
        return f"{self.trained:,} events trained{rate}"

    def _report_until_done(self) -> None:
        while not self.done.wait(self.interval):
            self.report()

    def report(self) -> None:
        now = time.monotonic()
        trained, loss_sum, loss_events = self.trained, self.loss_sum, self.loss_events
        events = trained - self.last_trained
        rate = events / max(now - self.last_time, 1e-9)
        read = loss_events - self.last_loss_events
        loss = f"{(loss_sum - self.last_loss_sum) / read:.4f}" if read else "-"
        qualities = self.metrics.task_quality.compute()
        self.metrics.examples_per_second.set(rate)
        by_maturity = {"provisional": qualities}
        if self.late is not None:
            by_maturity["matured"] = self.late.matured.compute()
        for maturity, figures in by_maturity.items():
            for task, quality in figures.items():
                for window, values in quality.items():
                    for name, value in values.items():
                        if math.isfinite(value):  # a rank that has seen no positives yet has no figures yet
                            self.metrics.quality_gauges[name].labels(task, window, maturity).set(value)
        aucs = [(task, f"{quality['window']['auc']:.4f}") for task, quality in qualities.items()]
        # One task: the single-label line as it always was; several: each task's, by name.
        auc = aucs[0][1] if len(aucs) == 1 else ", ".join(f"{task} {value}" for task, value in aucs)
        lag = self.lag()
        # The lag is this rank's events behind the end offsets: flat, the worker keeps up.
        log.info(
            "rank %d step %d | trained %s events | %s events/s | loss %s | progressive AUC %s | queue %d | lag %s",
            self.rank,
            self.step,
            f"{trained:,}",
            f"{rate:,.0f}",
            loss,
            auc,
            self.queue_depth(),
            "-" if lag is None else f"{lag:,}",
        )
        self.last_time, self.last_trained, self.last_loss_sum = now, trained, loss_sum
        self.last_loss_events = loss_events


def run_worker(
    config: WorkerConfig,
    *,
    until_end: bool = False,
    max_events: int | None = None,
    allow_partial_restore: bool = False,
    fresh_start: bool = False,
    observers: Sequence[StepObserver] = (),
) -> int:
    """Train until the end offsets (``until_end``), ``max_events``, or SIGTERM/SIGINT; returns the exit code.

    Under torchrun every rank runs this; the ranks step in lockstep (see ``Lockstep``). Each of
    ``observers`` sees every step that trained events, and is closed at the end. ``fresh_start``
    moves checkpoint.path's snapshots aside first. What it opens it closes, in reverse, however it
    ends: a failure at start-up too, within distributed.shutdown_grace_seconds.
    """
    if config.delivery.enabled:
        config.checkpoint_path_for_delivery()  # refused before anything starts
    config.check_clients()  # so are client properties librdkafka or the registry client refuse
    shutdown = _Shutdown(config.distributed.shutdown_grace_seconds)
    signals = _Signals(shutdown)
    outcome = _Outcome()
    with contextlib.ExitStack() as resources:
        resources.callback(shutdown.end)  # last: the watchdog bounds every close before it
        try:
            outcome.exit_code = _run(
                config, resources, shutdown, signals, outcome, until_end, max_events, allow_partial_restore,
                fresh_start, observers,
            )  # fmt: skip
        except RestoreRefused as error:  # raised on every rank
            log.error("%s", error)
            outcome.exit_code = ExitCode.RESTORE_REFUSED
        except OutputTopicMissing as error:  # raised on every rank
            log.error("%s; exiting with code %d", error, error.exit_code)
            outcome.exit_code = error.exit_code
        finally:
            shutdown.begin()  # a signal or the end of training began it already; else a failure
    for observer in observers:
        observer.close()
    return outcome.exit_code


class _Outcome:
    """How the run ended, read by the closes registered before it was known."""

    exit_code = 0
    clean = False


def _run(
    config: WorkerConfig,
    resources: contextlib.ExitStack,
    shutdown: _Shutdown,
    signals: _Signals,
    outcome: _Outcome,
    until_end: bool,
    max_events: int | None,
    allow_partial_restore: bool,
    fresh_start: bool,
    observers: Sequence[StepObserver],
) -> int:
    env = init_distributed(
        config.distributed.timeout_seconds, config.distributed.device, config.distributed.intra_op_threads
    )
    metrics = WorkerMetrics(config.metrics.auc_window, [t.name for t in config.tasks()])
    metrics.info.info({"rank": str(env.rank), "world_size": str(env.world_size), "topic": config.kafka.topic})
    health = Health(config.metrics.stall_seconds)
    port = metrics.serve(config.metrics.host, config.metrics.port and config.metrics.port + env.local_rank, health)
    resources.callback(metrics.close)
    log.info("rank %d/%d: metrics on http://%s:%d/metrics", env.rank, env.world_size, config.metrics.host, port)

    if config.model.module is not None:  # a user's model is refused here, before any table is planned
        check_exportable(config.features, config.model, config.tasks())
    trainer = Trainer(config, env, metrics.idspace)
    if env.rank == 0:
        log.info("sharding plan:\n%s", describe_plan(trainer.plan, config, env.world_size))
        if config.distributed.plan_path:
            write_plan_json(trainer.plan, config, env.world_size, config.distributed.plan_path)

    def own_group() -> dist.ProcessGroup | None:
        # The lockstep vote and the background checkpoint writes each get a gloo group of their own,
        # so they never interleave with the pipeline's collectives or with each other.
        return gloo_group(env.world_size, config.distributed.timeout_seconds)

    checkpointer, restored = None, None
    if config.checkpoint.path:
        checkpointer = Checkpointer(
            config.checkpoint,
            config,
            trainer.model,
            trainer.optimizer,
            env.rank,
            env.world_size,
            own_group(),
            metrics,
            trainer.id_space,
        )
        if fresh_start:
            checkpointer.set_aside()
        restored = checkpointer.restore(allow_partial_restore)
        if restored is None and config.checkpoint.init_from:
            checkpointer.warm_start(
                config.checkpoint.init_from, config.checkpoint.init_optimizer, allow_partial_restore
            )
        elif restored is None:
            log.info("no snapshot under %s: starting at kafka.start_at", config.checkpoint.path)
        elif config.checkpoint.init_from:
            log.info(
                "checkpoint.path has snapshots of its own: checkpoint.init_from %s is ignored",
                config.checkpoint.init_from,
            )
    source = KafkaSource(
        config.kafka,
        env.rank,
        env.world_size,
        until_end=until_end,
        max_events=max_events,
        start_offsets=restored.next_offsets if restored else None,
        committed=checkpointer is None,
        metadata_timeout=config.kafka.connect_timeout_seconds,
        on_error=lambda code: metrics.kafka_errors.labels(code).inc(),
    )
    resources.callback(source.close)
    # Before anything is trained: a topic the worker writes that cannot be made is refused now, not
    # at the first dead letter or delta, hours later.
    output_topics = [dead_letter_topic(config.dead_letter, config.kafka)] if config.dead_letter.enabled else []
    if config.delivery.enabled and not config.delivery.directory:
        output_topics.append(delta_topic(config.delivery, config.kafka))
    ensure_topics_on_every_rank(
        config.kafka, output_topics, config.kafka.connect_timeout_seconds, env.rank, env.world_size, own_group()
    )
    health.ready = True  # the state is restored and the broker answered the source's metadata request
    health.not_ready_reason = "the Kafka brokers are down"
    if trainer.late_share is not None:  # each rank's share from its partitions' counts at the cut
        trainer.late_share.restore(restored.positives if restored else {}, source.partitions)
    decoder = AvroBatchDecoder(
        config.features,
        schema_source(config.features),
        config.tasks(),
        threads=decode_threads(config.batching.decode_threads, env.device),
        delayed=config.delayed_labels,
    )
    log.info("rank %d decoding on %d thread(s) (batching.decode_threads)", env.rank, decoder.slices.threads)
    rejections = Rejections(config.dead_letter, config.kafka, metrics, env.rank)
    resources.callback(rejections.close)
    # A rank blocked on a dead-letter write serves no consumer callbacks: its producer speaks for it.
    health.readiness = lambda: not (source.brokers_down or (rejections.writer and rejections.writer.brokers_down))
    prefetcher = Prefetcher(
        source, decoder, config.batching, metrics, rejections, config.metrics.lag_refresh_seconds, device=env.device
    )
    snapshots = SnapshotSchedule(config, checkpointer, restored, source.next_offset, commit=prefetcher.commits.offer)
    publisher = None
    if checkpointer and config.delivery.enabled:
        publisher = Publisher(
            config, trainer.model, trainer.plan, env.rank, env.world_size, own_group(), own_group(),
            snapshots.state, lambda: checkpointer.last_saved_step, checkpointer.pinned, metrics,
            id_space=trainer.id_space,
        )  # fmt: skip
        resources.callback(lambda: publisher.close(outcome.clean, shutdown.remaining()))
        publisher.begin_chain(restored)
    start_snapshot = restored.step if restored else None
    if checkpointer and restored is None and (config.checkpoint.init_from or publisher):
        # The warm start becomes this run's step 0: a restart before the first snapshot resumes
        # from it, not from init_from, which may have moved on meanwhile. Delivery exports its
        # first base from it.
        saved = checkpointer.save(snapshots.state.copy())
        start_snapshot = saved.step if saved else None
    if publisher:
        publisher.publish_start_base(start_snapshot)
    steps = Lockstep(
        prefetcher,
        lambda: prefetcher.prepare(decoder.decode([]).batch),
        env.world_size,
        own_group(),
        flush_after_seconds=config.batching.max_batch_wait_ms / 1000,
        questions={**snapshots.questions(), **(publisher.questions() if publisher else {})},
        heartbeat=health.beat,
        max_events=max_events,
        lookahead=trainer.lookahead,
    )
    signals.started(prefetcher, snapshots.request)
    progress = _Progress(
        metrics,
        env.rank,
        source.topic,
        config.metrics.log_interval_seconds,
        prefetcher.queue.qsize,
        observers,
        lag=lambda: prefetcher.lag.total,
        event_time_bound=config.features.event_time_bound_ms,
        late=None
        if config.delayed_labels is None
        else LateLabelWatch(
            config.tasks(), config.metrics.auc_window, config.delayed_labels.matured_max_pending, metrics.late
        ),
    )
    exit_code = ExitCode.OK
    prefetcher.start()
    try:
        with progress:
            for result in trainer.train(steps):
                health.beat()
                progress.record(result)
                snapshots.record(result.step, result.batch)
                metrics.global_step.set(snapshots.state.step)  # continues from a restored snapshot's step
                agreed = steps.take_agreed()
                if publisher:
                    publisher.record(result.batch.sparse_features)
                    publisher.act(agreed)  # first: a snapshot at this step records the delta cut at it
                snapshots.act(agreed)
    except SnapshotsFailing as error:  # raised on every rank at the same step
        log.error("rank %d: %s", env.rank, error)
        exit_code = ExitCode.SNAPSHOTS_FAILING
    except RuntimeError as error:
        if not _is_collective_failure(error):
            raise
        log.error(
            "rank %d: a peer rank failed or stopped answering within %.0fs; giving up: %s",
            env.rank,
            config.distributed.timeout_seconds,
            str(error).splitlines()[0] if str(error) else error,
        )
        exit_code = ExitCode.FAILED
    finally:
        shutdown.begin()  # a signal began it already; else the end of the stream, max_events or a peer's stop
        prefetcher.join(timeout=shutdown.remaining())
        outcome.clean = exit_code == 0 and sys.exc_info()[0] is None
        if publisher:
            publisher.stop_deltas(outcome.clean, shutdown.remaining() / 3)
        # The prefetch thread has stopped: the consumer is called directly.
        snapshots.close(clean=outcome.clean, commit=source.commit)
    log.info(
        "rank %d stopped after %d steps, %s; positions %s",
        env.rank,
        trainer.step,
        progress.summary(),
        dict(sorted(snapshots.state.next_offsets.items())),
    )
    return exit_code


# Where a plain RuntimeError comes from when it is a collective's failure. The backward pass's
# collectives (DDP's gradient all-reduce, run in C++ by the autograd engine) raise from the engine's
# Python entry point, torch.autograd.graph: a peer that died mid-backward surfaces there (seen with
# two torchrun nodes, one killed). A local error in a C++ backward kernel would be reported as a
# peer's too; it exits 1 either way, with its message in the log.
_COLLECTIVE_MODULES = ("torch.distributed.", "torchrec.distributed.", "torch.autograd.graph")


def _is_collective_failure(error: RuntimeError) -> bool:
    """Whether ``error`` is a peer that died or stopped answering. NCCL and the rendezvous store
    raise ``DistError`` subclasses. torch 2.13's gloo raises a plain RuntimeError (checked with two
    gloo processes, one killed, one stopped: "Connection closed by peer", "Timed out waiting"), so
    that type is told apart by where it was raised: inside torch.distributed or TorchRec's
    distributed modules, which wait on the collectives."""
    if isinstance(error, dist.DistError):
        return True
    if type(error) is not RuntimeError or error.__traceback__ is None:
        return False
    innermost = error.__traceback__
    while innermost.tb_next is not None:
        innermost = innermost.tb_next
    return str(innermost.tb_frame.f_globals.get("__name__", "")).startswith(_COLLECTIVE_MODULES)


class _Shutdown:
    """Bounds a stop: from ``begin()`` (a signal, or the end of training) to ``end()``, the final
    snapshot included, at most ``grace`` seconds; past it ``give_up`` runs (the process exits 3).

    A thread polls instead of a Timer so that ``begin()`` is a plain assignment, safe in a signal
    handler and idempotent."""

    def __init__(self, grace: float, give_up: Callable[[float], None] | None = None):
        self.grace = grace
        self.give_up = give_up or _give_up
        self.began_at: float | None = None
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="streamtrain-shutdown-watchdog", daemon=True)
        self.thread.start()

    def begin(self) -> None:
        self.began_at = self.began_at or time.monotonic()

    def remaining(self) -> float:
        began = self.began_at or time.monotonic()
        return max(self.grace - (time.monotonic() - began), 0.0)

    def end(self) -> None:
        self.done.set()

    def _watch(self) -> None:
        while not self.done.wait(min(0.2, self.grace / 4)):
            if self.began_at is not None and time.monotonic() - self.began_at > self.grace:
                self.give_up(self.grace)
                return


class _Signals:
    """SIGTERM/SIGINT: stop consuming, finish the batches in flight, exit, within the shutdown's
    grace. SIGUSR1: take a snapshot now.

    Installed before anything starts, so a signal that comes while the worker starts (the health
    probe may already say ready while the first base is exported) is remembered and carried out
    once it trains, instead of killing the process with the signal's default action."""

    def __init__(self, shutdown: _Shutdown):
        self.shutdown = shutdown
        self.prefetcher: Prefetcher | None = None
        self.request_snapshot: Callable[[], None] | None = None
        self.stop_requested = False
        self.snapshot_requested = False
        signal.signal(signal.SIGUSR1, self._snapshot)
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, self._stop)

    def started(self, prefetcher: Prefetcher, request_snapshot: Callable[[], None]) -> None:
        """The worker is about to train: what was asked for meanwhile happens now."""
        self.prefetcher, self.request_snapshot = prefetcher, request_snapshot
        if self.snapshot_requested:
            request_snapshot()
        if self.stop_requested:
            prefetcher.stop()

    def _stop(self, signum: int, _frame: object) -> None:
        if self.stop_requested or (self.prefetcher is not None and self.prefetcher.stopping.is_set()):
            return
        self.stop_requested = True
        log.info(
            "%s received: %s",
            signal.Signals(signum).name,
            "finishing the batches in flight" if self.prefetcher else "stopping as soon as the worker has started",
        )
        self.shutdown.begin()
        if self.prefetcher is not None:
            self.prefetcher.stop()

    def _snapshot(self, _signum: int, _frame: object) -> None:
        if self.request_snapshot is not None:
            self.request_snapshot()
        else:
            self.snapshot_requested = True


def _give_up(grace: float) -> None:
    log.error(
        "shutdown did not finish within %gs (distributed.shutdown_grace_seconds); exiting without a clean close", grace
    )
    logging.shutdown()
    record_exit(ExitCode.SHUTDOWN_TIMEOUT)
    os._exit(ExitCode.SHUTDOWN_TIMEOUT)
