"""The worker: source -> decode -> batch -> train, with metrics beside them, until the end or a signal."""

from __future__ import annotations

import logging
import math
import os
import signal
import threading
import time
from datetime import timedelta
from typing import Callable

import torch.distributed as dist

from streamtrain.batch import Lockstep, Prefetcher
from streamtrain.config import WorkerConfig
from streamtrain.decode import AvroBatchDecoder
from streamtrain.metrics import WorkerMetrics
from streamtrain.source import KafkaSource
from streamtrain.train import StepResult, Trainer, describe_plan, init_distributed, write_plan_json

log = logging.getLogger(__name__)

SHUTDOWN_GRACE_SECONDS = 30.0


class _Progress:
    """Exports each step's figures; a reporter thread prints a summary line every ``interval`` seconds,
    idle or not, so the gauges and the log stay current while the stream is quiet."""

    def __init__(self, metrics: WorkerMetrics, rank: int, topic: str, interval: float,
                 queue_depth: Callable[[], int]):
        self.metrics = metrics
        self.rank = rank
        self.topic = topic
        self.interval = interval
        self.queue_depth = queue_depth
        self.step = 0
        self.trained = 0
        self.loss_sum = 0.0
        self.last_time = time.monotonic()
        self.last_trained = 0
        self.last_loss_sum = 0.0
        self.first_trained_at = 0.0
        self.last_trained_at = 0.0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._report_until_done, name="streamtrain-progress", daemon=True)

    def __enter__(self) -> "_Progress":
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        self.thread.join(timeout=5)
        self.report()

    def record(self, result: StepResult, global_batch_size: int) -> None:
        batch, metrics = result.batch, self.metrics
        metrics.step_seconds.observe(result.seconds)
        metrics.global_batch_size.set(global_batch_size)
        for partition, span in batch.spans.items():
            if span.events:
                metrics.events_trained.labels(self.topic, str(partition)).inc(span.events)
        metrics.batches.inc()
        metrics.global_step.set(result.step)
        if batch.size:
            metrics.loss.set(result.loss_sum / batch.size)
            metrics.progressive_auc.add(result.logits.float().cpu().numpy(), result.labels.cpu().numpy())
        self.step = result.step
        if batch.size:
            self.first_trained_at = self.first_trained_at or time.monotonic()
            self.last_trained_at = time.monotonic()
        self.trained += batch.size
        self.loss_sum += result.loss_sum

    def summary(self) -> str:
        seconds = self.last_trained_at - self.first_trained_at
        rate = f" in {seconds:.1f}s ({self.trained / seconds:,.0f} events/s)" if seconds > 0 else ""
        return f"{self.trained:,} events trained{rate}"

    def _report_until_done(self) -> None:
        while not self.done.wait(self.interval):
            self.report()

    def report(self) -> None:
        now = time.monotonic()
        trained, loss_sum = self.trained, self.loss_sum
        events = trained - self.last_trained
        rate = events / max(now - self.last_time, 1e-9)
        loss = f"{(loss_sum - self.last_loss_sum) / events:.4f}" if events else "-"
        auc = self.metrics.progressive_auc.value()
        self.metrics.examples_per_second.set(rate)
        if math.isfinite(auc):  # a rank that has seen no events of both classes has no AUC yet
            self.metrics.progressive_auc_gauge.labels("clk").set(auc)
        log.info("rank %d step %d | trained %s events | %s events/s | loss %s | progressive AUC %.4f | queue %d",
                 self.rank, self.step, f"{trained:,}", f"{rate:,.0f}", loss, auc, self.queue_depth())
        self.last_time, self.last_trained, self.last_loss_sum = now, trained, loss_sum


def run_worker(config: WorkerConfig, *, until_end: bool = False, max_events: int | None = None) -> int:
    """Train until the end offsets (``until_end``), ``max_events``, or SIGTERM/SIGINT; returns the exit code.

    Under torchrun every rank runs this; the ranks step in lockstep (see ``Lockstep``).
    """
    env = init_distributed(config.distributed.timeout_seconds)
    metrics = WorkerMetrics(config.metrics.auc_window)
    metrics.info.info({"rank": str(env.rank), "world_size": str(env.world_size), "topic": config.kafka.topic})
    port = metrics.serve(config.metrics.host, config.metrics.port and config.metrics.port + env.local_rank)
    log.info("rank %d/%d: metrics on http://%s:%d/metrics", env.rank, env.world_size, config.metrics.host, port)

    source = KafkaSource(config.kafka, env.rank, env.world_size, until_end=until_end, max_events=max_events)
    trainer = Trainer(config, env)
    if env.rank == 0:
        log.info("sharding plan:\n%s", describe_plan(trainer.plan, config, env.world_size))
        if config.distributed.plan_path:
            write_plan_json(trainer.plan, config, env.world_size, config.distributed.plan_path)
    decoder = AvroBatchDecoder(config.features)
    prefetcher = Prefetcher(source, decoder, config.batching, metrics)
    steps = Lockstep(prefetcher, lambda: decoder.decode([]).batch, env.world_size,
                     # its own group, so the vote never interleaves with the pipeline's collectives
                     dist.new_group(backend="gloo", timeout=timedelta(seconds=config.distributed.timeout_seconds))
                     if env.world_size > 1 else None,
                     flush_after_seconds=config.batching.max_batch_wait_ms / 1000)
    _stop_on_signals(prefetcher)
    progress = _Progress(metrics, env.rank, source.topic, config.metrics.log_interval_seconds, prefetcher.queue.qsize)
    trained_to: dict[int, int] = {}
    last_commit = time.monotonic()
    exit_code = 0
    prefetcher.start()
    try:
        with progress:
            for result in trainer.train(steps):
                progress.record(result, steps.global_batch_size)
                trained_to.update({p: span.next_offset for p, span in result.batch.spans.items()})
                if time.monotonic() - last_commit >= config.metrics.log_interval_seconds:
                    prefetcher.commit_soon(trained_to)
                    last_commit = time.monotonic()
    except RuntimeError as error:
        if not _is_collective_failure(error):
            raise
        log.error("rank %d: a peer rank failed or stopped answering within %.0fs; giving up: %s", env.rank,
                  config.distributed.timeout_seconds, str(error).splitlines()[0] if str(error) else error)
        exit_code = 1
    finally:
        prefetcher.join(timeout=SHUTDOWN_GRACE_SECONDS)
        source.commit(trained_to)  # the prefetch thread has stopped: the consumer is ours now
        source.close()
        metrics.close()
    log.info("rank %d stopped after %d steps, %s; positions %s", env.rank, trainer.step, progress.summary(),
             dict(sorted(trained_to.items())))
    return exit_code


def _is_collective_failure(error: RuntimeError) -> bool:
    """Gloo and NCCL report a dead or stalled peer as a RuntimeError naming the transport."""
    text = str(error)
    return isinstance(error, dist.DistError) or "gloo" in text or "NCCL" in text


def _stop_on_signals(prefetcher: Prefetcher) -> None:
    """SIGTERM/SIGINT: stop consuming, finish the batches in flight, exit; a watchdog bounds the wait."""

    def handle(signum: int, _frame: object) -> None:
        if prefetcher.stopping.is_set():
            return
        log.info("%s received: finishing the batches in flight", signal.Signals(signum).name)
        prefetcher.stop()
        watchdog = threading.Timer(SHUTDOWN_GRACE_SECONDS, _give_up)
        watchdog.daemon = True
        watchdog.start()

    signal.signal(signal.SIGTERM, handle)
    signal.signal(signal.SIGINT, handle)


def _give_up() -> None:
    log.error("shutdown did not finish within %.0fs; exiting without a clean close", SHUTDOWN_GRACE_SECONDS)
    logging.shutdown()
    os._exit(3)
