"""``streamtrain bench``: contender and baseline side by side in one run, reported as a ratio.

Absolute times on shared machines are noise; the ratio of two runs interleaved on the same data
and the same process is the figure. Each benchmark prints a table and writes JSON under
``results/``.
"""

from __future__ import annotations

import itertools
import json
import platform
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from streamtrain.checkpoint import Checkpointer, StreamState
from streamtrain.config import PACKAGE_ROOT, WorkerConfig
from streamtrain.decode import AvroBatchDecoder, ClickBatch
from streamtrain.produce import AvroEncoder, ClickStream, encoded_events
from streamtrain.source import RawEvent
from streamtrain.train import Trainer, init_distributed

RESULTS = PACKAGE_ROOT / "results"


def machine() -> dict:
    import os

    from streamtrain.checkpoint import _version

    return {"cores": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
            "torchrec": _version("torchrec"), "fbgemm_gpu": _version("fbgemm_gpu"),
            "device": "cuda" if torch.cuda.is_available() else "cpu"}


def synthetic_batches(config: WorkerConfig, count: int, seed: int = 0) -> list[ClickBatch]:
    decoder = AvroBatchDecoder(config.features)
    size = config.batching.batch_size
    events = [RawEvent(0, i, value, 0) for i, (_key, value, _p, _clk) in enumerate(
        encoded_events(ClickStream(seed, 0), AvroEncoder(config.features.resolved_schema_path()), count * size))]
    return [decoder.decode(events[i:i + size]).batch for i in range(0, len(events), size)]


@dataclass
class Leg:
    events: int = 0
    seconds: float = 0.0
    snapshots: list[float] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return self.events / self.seconds if self.seconds else 0.0


def _train_for(trainer: Trainer, batches: list[ClickBatch], seconds: float,
               after_step: Callable[[int], None] = lambda step: None) -> Leg:
    deadline = time.perf_counter() + seconds

    def until_deadline() -> Iterator[ClickBatch]:
        for batch in itertools.cycle(batches):
            if time.perf_counter() >= deadline:
                return
            yield batch

    leg = Leg()
    started = time.perf_counter()
    for result in trainer.train(until_deadline()):
        leg.events += result.batch.size
        after_step(result.step)
    leg.seconds = time.perf_counter() - started
    return leg


def bench_checkpoint(config: WorkerConfig, seconds: float, rounds: int, interval_seconds: float,
                     progress: Callable[[str], None]) -> dict:
    """Training throughput with an async snapshot every ``interval_seconds`` against none,
    in alternating legs on one trainer and the same batches."""
    env = init_distributed()
    trainer = Trainer(config, env)
    batches = synthetic_batches(config, 32)
    _train_for(trainer, batches, 3.0)  # warm-up, excluded
    with tempfile.TemporaryDirectory(prefix="streamtrain-bench-") as root:
        checkpoint = config.checkpoint.model_copy(update={"path": root, "keep_last": 1})
        checkpointer = Checkpointer(checkpoint, config, trainer.model, trainer.optimizer, 0, 1, None)
        baseline, contender = Leg(), Leg()
        for round_ in range(rounds):
            leg = _train_for(trainer, batches, seconds)
            baseline.events += leg.events
            baseline.seconds += leg.seconds
            progress(f"round {round_ + 1}/{rounds}: no snapshots   {leg.rate:>10,.0f} events/s")

            last = time.perf_counter() - interval_seconds

            def snapshot_when_due(step: int) -> None:
                nonlocal last
                if checkpointer.save_done():
                    contender.snapshots.append(time.perf_counter() - checkpointer.in_flight[3])
                    checkpointer.finish_save()
                if not checkpointer.save_in_flight and time.perf_counter() - last >= interval_seconds:
                    last = time.perf_counter()
                    checkpointer.start_save(StreamState(step=step))

            leg = _train_for(trainer, batches, seconds, snapshot_when_due)
            if checkpointer.save_in_flight:
                checkpointer.finish_save()
            contender.events += leg.events
            contender.seconds += leg.seconds
            progress(f"round {round_ + 1}/{rounds}: async snapshots {leg.rate:>10,.0f} events/s")
        snapshot_bytes = sum(p.stat().st_size for p in Path(root).rglob("*") if p.is_file())
    return {
        "benchmark": "checkpoint",
        "machine": machine(),
        "batch_size": config.batching.batch_size,
        "tables": len(config.features.tables),
        "interval_seconds": interval_seconds,
        "legs_seconds": seconds,
        "rounds": rounds,
        "baseline_events_per_second": baseline.rate,
        "async_snapshot_events_per_second": contender.rate,
        "ratio": contender.rate / baseline.rate,
        "snapshots": len(contender.snapshots),
        "snapshot_seconds_mean": sum(contender.snapshots) / max(len(contender.snapshots), 1),
        "snapshot_bytes": snapshot_bytes,
    }


@dataclass(frozen=True)
class StepSize:
    batch: int
    features: int
    dim: int
    rows: int

    def __str__(self) -> str:
        return f"B={self.batch} F={self.features} D={self.dim} rows={self.rows:,}"


TRAIN_STEP_SIZES = [StepSize(1024, 8, 16, 100_000), StepSize(4096, 16, 16, 100_000),
                    StepSize(4096, 16, 64, 100_000), StepSize(4096, 16, 16, 1_000_000)]


def _step_inputs(size: StepSize, steps: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(ids [features, batch], labels [batch]) per step; ids Zipf-like, one id per feature and event."""
    generator = torch.Generator().manual_seed(seed)
    inputs = []
    for _ in range(steps):
        ranks = torch.rand(size.features, size.batch, generator=generator).pow(4.0)  # skewed to small ids
        inputs.append(((ranks * size.rows).long().clamp_(max=size.rows - 1),
                       (torch.rand(size.batch, generator=generator) < 0.3).float()))
    return inputs


class _PerFeatureModel(torch.nn.Module):
    """The baseline: one nn.EmbeddingBag per feature with sparse gradients, then the same MLP."""

    def __init__(self, size: StepSize):
        super().__init__()
        self.tables = torch.nn.ModuleList(
            torch.nn.EmbeddingBag(size.rows, size.dim, mode="sum", sparse=True) for _ in range(size.features))
        self.top = torch.nn.Sequential(torch.nn.Linear(size.features * size.dim, 64), torch.nn.ReLU(),
                                       torch.nn.Linear(64, 1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        offsets = torch.arange(ids.shape[1])
        pooled = [table(ids[f], offsets) for f, table in enumerate(self.tables)]
        return self.top(torch.cat(pooled, dim=1)).squeeze(-1)


class _FusedModel(torch.nn.Module):
    """The contender: an EmbeddingBagCollection (fbgemm TBE under DMP, fused Adagrad), same MLP."""

    def __init__(self, size: StepSize):
        from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

        super().__init__()
        self.keys = [f"f{i}" for i in range(size.features)]
        self.ebc = EmbeddingBagCollection(tables=[
            EmbeddingBagConfig(name=k, feature_names=[k], num_embeddings=size.rows, embedding_dim=size.dim)
            for k in self.keys], device=torch.device("meta"))
        self.top = torch.nn.Sequential(torch.nn.Linear(size.features * size.dim, 64), torch.nn.ReLU(),
                                       torch.nn.Linear(64, 1))

    def forward(self, features) -> torch.Tensor:
        return self.top(self.ebc(features).values()).squeeze(-1)


def bench_train_step(sizes: list[StepSize], seconds: float, progress: Callable[[str], None]) -> dict:
    """Per-feature nn.EmbeddingBag with torch's sparse Adagrad against the fused TBE path (EBC
    under DMP, Adagrad applied in backward), same batches and same dense layers, per size."""
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    init_distributed()
    rows = []
    for size in sizes:
        inputs = _step_inputs(size, 16, seed=size.rows + size.dim)
        baseline = _PerFeatureModel(size)
        sparse = torch.optim.Adagrad([p for t in baseline.tables for p in t.parameters()], lr=0.05)
        dense = torch.optim.Adam(baseline.top.parameters(), lr=1e-3)

        def baseline_step(ids: torch.Tensor, labels: torch.Tensor) -> None:
            sparse.zero_grad()
            dense.zero_grad()
            torch.nn.functional.binary_cross_entropy_with_logits(baseline(ids), labels).backward()
            sparse.step()
            dense.step()

        fused = _FusedModel(size)
        apply_optimizer_in_backward(torch.optim.Adagrad, fused.ebc.parameters(), {"lr": 0.05})
        fused = DistributedModelParallel(fused, device=torch.device("cpu"),
                                         env=ShardingEnv.from_process_group(dist.group.WORLD))
        fused_dense = torch.optim.Adam(fused.module.top.parameters(), lr=1e-3)
        lengths = torch.ones(size.features * size.batch, dtype=torch.int32)
        kjts = [KeyedJaggedTensor(keys=fused.module.keys, values=ids.reshape(-1), lengths=lengths)
                for ids, _labels in inputs]

        def fused_step(index: int) -> None:
            fused_dense.zero_grad()
            logits = fused(kjts[index])
            torch.nn.functional.binary_cross_entropy_with_logits(logits, inputs[index][1]).backward()
            fused_dense.step()

        legs = {"per_feature": 0.0, "fused": 0.0}
        steps = {"per_feature": 0, "fused": 0}
        for round_ in range(3):  # round 0 warms up and is not counted
            for name, step in (("per_feature", lambda i: baseline_step(*inputs[i])), ("fused", fused_step)):
                started, count = time.perf_counter(), 0
                while time.perf_counter() - started < seconds / 2:
                    step(count % len(inputs))
                    count += 1
                if round_:
                    legs[name] += time.perf_counter() - started
                    steps[name] += count
        rate = {name: steps[name] * size.batch / legs[name] for name in legs}
        rows.append({"size": str(size), "batch": size.batch, "features": size.features, "dim": size.dim,
                     "rows": size.rows, "per_feature_events_per_second": rate["per_feature"],
                     "fused_events_per_second": rate["fused"], "ratio": rate["fused"] / rate["per_feature"]})
        progress(f"{size}: per-feature {rate['per_feature']:,.0f}/s, fused {rate['fused']:,.0f}/s, "
                 f"ratio {rows[-1]['ratio']:.2f}")
    return {"benchmark": "train-step", "machine": machine(), "leg_seconds": seconds / 2, "sizes": rows}


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _wait_until_training(port: int, worker, timeout: float = 180.0) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and worker.poll() is None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as reply:
                if any(line.startswith("streamtrain_events_trained_total{") and not line.endswith(" 0.0")
                       for line in reply.read().decode().splitlines()):
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError("the worker did not start training")


def bench_memory(config_path: Path, seconds: float, backlog_events: int, progress: Callable[[str], None]) -> dict:
    """The worker's RSS while a backlog far larger than it can train in ``seconds`` waits in Kafka:
    flat memory means the prefetch queue and the client's fetch buffers bound what the worker holds."""
    import os
    import signal
    import subprocess
    import sys

    from streamtrain.devkafka import KafkaBroker, free_port
    from streamtrain.produce import produce

    with KafkaBroker() as broker:
        progress(f"writing a backlog of {backlog_events:,} events")
        produce(broker.bootstrap_servers, "memory", backlog_events, partitions=4, seed=7,
                schema_path=PACKAGE_ROOT / "schemas" / "click_event.avsc")
        environ = {**os.environ, "STREAMTRAIN_KAFKA__BOOTSTRAP_SERVERS": broker.bootstrap_servers,
                   "STREAMTRAIN_KAFKA__TOPIC": "memory", "STREAMTRAIN_METRICS__PORT": str(free_port())}
        worker = subprocess.Popen([sys.executable, "-m", "streamtrain", "worker", "--config", str(config_path)],
                                  env=environ, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        samples: list[tuple[float, int]] = []
        try:
            _wait_until_training(int(environ["STREAMTRAIN_METRICS__PORT"]), worker)
            started = time.monotonic()
            while time.monotonic() - started < seconds and worker.poll() is None:
                samples.append((time.monotonic() - started, _rss_bytes(worker.pid)))
                if len(samples) % 10 == 0:
                    progress(f"{samples[-1][0]:5.0f}s  RSS {samples[-1][1] / 2**20:,.0f} MiB")
                time.sleep(1.0)
        finally:
            worker.send_signal(signal.SIGTERM)
            _out, log_text = worker.communicate(timeout=120)
    trained = [line for line in log_text.splitlines() if "stopped after" in line]
    # Warm-up, excluded: the first 10 s of training or the first fifth of the run, whichever is longer.
    warm_up = max(1, sum(1 for t, _rss in samples if t < max(10.0, seconds / 5)))
    warm = samples[warm_up - 1][1]
    peak_after = max(rss for _t, rss in samples[warm_up - 1:])
    return {"benchmark": "memory", "machine": machine(), "seconds": seconds, "backlog_events": backlog_events,
            "warm_up_seconds": samples[warm_up - 1][0],
            "rss_after_warm_up_bytes": warm, "rss_peak_after_warm_up_bytes": peak_after,
            "rss_final_bytes": samples[-1][1], "growth_after_warm_up": (peak_after - warm) / warm,
            "samples": samples, "worker_summary": trained[-1] if trained else log_text[-2000:]}


def report(result: dict) -> str:
    lines = [f"{result['benchmark']} benchmark on {result['machine']['cores']} cores "
             f"({result['machine']['device']}, torch {result['machine']['torch']}, torchrec "
             f"{result['machine']['torchrec']})"]
    if result["benchmark"] == "checkpoint":
        lines += [
            f"  without snapshots            {result['baseline_events_per_second']:>12,.0f} events/s",
            f"  async snapshot every {result['interval_seconds']:>4.0f}s  "
            f"{result['async_snapshot_events_per_second']:>12,.0f} events/s",
            f"  ratio                        {result['ratio']:>12.3f}   (goal >= 0.8)",
            f"  snapshots: {result['snapshots']}, {result['snapshot_bytes'] / 2**20:,.1f} MiB each, "
            f"{result['snapshot_seconds_mean']:.2f}s from start to commit on average",
        ]
    if result["benchmark"] == "memory":
        lines += [
            f"  backlog in Kafka: {result['backlog_events']:,} events; worker ran {result['seconds']:.0f}s, "
            f"warm-up ({result['warm_up_seconds']:.0f}s) excluded",
            f"  RSS after warm-up        {result['rss_after_warm_up_bytes'] / 2**20:>8,.0f} MiB",
            f"  peak RSS after warm-up   {result['rss_peak_after_warm_up_bytes'] / 2**20:>8,.0f} MiB",
            f"  growth                   {100 * result['growth_after_warm_up']:>8.1f} %   (goal < 10%)",
            f"  {result['worker_summary'].split('INFO ')[-1]}",
        ]
    if result["benchmark"] == "train-step":
        lines.append(f"  {'size':<36} {'per-feature':>14} {'fused (TBE)':>14} {'ratio':>7}")
        for row in result["sizes"]:
            lines.append(f"  {row['size']:<36} {row['per_feature_events_per_second']:>12,.0f}/s "
                         f"{row['fused_events_per_second']:>12,.0f}/s {row['ratio']:>7.2f}")
    return "\n".join(lines)


def save(result: dict) -> Path:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{result['benchmark']}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(result, indent=2))
    return path
