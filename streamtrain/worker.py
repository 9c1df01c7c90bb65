"""The worker: source -> decode -> batch -> train, with metrics beside them, until the end or a signal."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Callable

from streamtrain.batch import Prefetcher
from streamtrain.config import WorkerConfig
from streamtrain.decode import AvroBatchDecoder
from streamtrain.metrics import WorkerMetrics
from streamtrain.source import KafkaSource
from streamtrain.train import StepResult, Trainer, init_distributed

log = logging.getLogger(__name__)

SHUTDOWN_GRACE_SECONDS = 30.0


class _Progress:
    """Exports each step's figures; a reporter thread prints a summary line every ``interval`` seconds,
    idle or not, so the gauges and the log stay current while the stream is quiet."""

    def __init__(self, metrics: WorkerMetrics, topic: str, interval: float, queue_depth: Callable[[], int]):
        self.metrics = metrics
        self.topic = topic
        self.interval = interval
        self.queue_depth = queue_depth
        self.step = 0
        self.trained = 0
        self.loss_sum = 0.0
        self.last_time = time.monotonic()
        self.last_trained = 0
        self.last_loss_sum = 0.0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._report_until_done, name="streamtrain-progress", daemon=True)

    def __enter__(self) -> "_Progress":
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        self.thread.join(timeout=5)
        self.report()

    def record(self, result: StepResult) -> None:
        batch, metrics = result.batch, self.metrics
        for partition, span in batch.spans.items():
            if span.events:
                metrics.events_trained.labels(self.topic, str(partition)).inc(span.events)
        metrics.batches.inc()
        metrics.global_step.set(result.step)
        if batch.size:
            metrics.loss.set(result.loss_sum / batch.size)
            metrics.progressive_auc.add(result.logits.float().cpu().numpy(), result.labels.cpu().numpy())
        self.step = result.step
        self.trained += batch.size
        self.loss_sum += result.loss_sum

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
        self.metrics.progressive_auc_gauge.labels("clk").set(auc)
        log.info("step %d | trained %s events | %s events/s | loss %s | progressive AUC %.4f | queue %d",
                 self.step, f"{trained:,}", f"{rate:,.0f}", loss, auc, self.queue_depth())
        self.last_time, self.last_trained, self.last_loss_sum = now, trained, loss_sum


def run_worker(config: WorkerConfig, *, until_end: bool = False, max_events: int | None = None) -> int:
    """Train until the end offsets (``until_end``), ``max_events``, or SIGTERM/SIGINT; returns the exit code."""
    env = init_distributed()
    metrics = WorkerMetrics(config.metrics.auc_window)
    metrics.info.info({"rank": str(env.rank), "world_size": str(env.world_size), "topic": config.kafka.topic})
    port = metrics.serve(config.metrics.host, config.metrics.port and config.metrics.port + env.local_rank)
    log.info("metrics on http://%s:%d/metrics", config.metrics.host, port)

    source = KafkaSource(config.kafka, env.rank, env.world_size, until_end=until_end, max_events=max_events)
    trainer = Trainer(config, env)
    log.info("sharding plan:\n%s", trainer.plan)
    prefetcher = Prefetcher(source, AvroBatchDecoder(config.features), config.batching, metrics)
    _stop_on_signals(prefetcher)
    progress = _Progress(metrics, source.topic, config.metrics.log_interval_seconds, prefetcher.queue.qsize)
    trained_to: dict[int, int] = {}
    last_commit = time.monotonic()
    prefetcher.start()
    try:
        with progress:
            for result in trainer.train(prefetcher):
                progress.record(result)
                trained_to.update({p: span.next_offset for p, span in result.batch.spans.items()})
                if time.monotonic() - last_commit >= config.metrics.log_interval_seconds:
                    source.commit(trained_to)
                    last_commit = time.monotonic()
    finally:
        prefetcher.join(timeout=SHUTDOWN_GRACE_SECONDS)
        source.commit(trained_to)
        source.close()
        metrics.close()
    log.info("stopped after %d steps, %s events trained; positions %s", trainer.step,
             f"{progress.trained:,}", trained_to)
    return 0


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
