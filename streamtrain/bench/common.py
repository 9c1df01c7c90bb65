"""What the benchmarks share: the machine description, results files, in-memory batches, timed
training legs, local ranks and throughput windows. Run records are in ``streamtrain.bench.record``."""

from __future__ import annotations

import itertools
import json
import os
import platform
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from streamtrain.config import PACKAGE_DIR
from streamtrain.dev import CHECKOUT

if TYPE_CHECKING:
    import torch

    from streamtrain.config import WorkerConfig
    from streamtrain.decode import ClickBatch
    from streamtrain.train import Trainer

# STREAMTRAIN_BENCH_RESULTS moves them (the tests' quick runs go to a temporary folder)
RESULTS = Path(os.environ.get("STREAMTRAIN_BENCH_RESULTS") or CHECKOUT / "results")
SCHEMA = PACKAGE_DIR / "schemas" / "click_event.avsc"


def machine() -> dict:
    import torch

    from streamtrain.checkpoint import _version
    from streamtrain.device import fbgemm_variant, select_device

    return {
        "cores": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchrec": _version("torchrec"),
        "fbgemm_gpu": _version("fbgemm_gpu"),
        "fbgemm_variant": fbgemm_variant(),
        "gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        # what the worker trains on with distributed.device: auto; each leg records its own
        "device": select_device("auto").type,
    }


def clock(device: torch.device, read: Callable[[], float] = time.perf_counter) -> float:
    """``read()`` once ``device`` has finished the work queued on it. CUDA kernels run after their
    launch returns: a clock read without torch.cuda.synchronize() would time the launches."""
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)
    return read()


def worker_device(config: Path) -> str:
    """The device a worker (or the naive baseline) started on this host with ``config`` trains on:
    what ``select_device`` picks for its distributed.device, environment overrides included."""
    from streamtrain.config import load_config
    from streamtrain.device import select_device

    return select_device(load_config(config).distributed.device).type


def describe_machine(m: dict) -> str:
    return (
        f"{m['cores']} cores, {m['device']}, torch {m['torch']}, torchrec {m['torchrec']}, fbgemm_gpu {m['fbgemm_gpu']}"
    )


def rate_text(events_per_second: float) -> str:
    return f"{events_per_second:,.0f} events/s"


def save(result: dict) -> Path:
    RESULTS.mkdir(exist_ok=True)
    result = {**result, "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    path = RESULTS / f"{result['benchmark']}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(result, indent=2))
    return path


def latest(benchmark: str, results: Path = RESULTS) -> dict | None:
    """The newest full-size result of ``benchmark`` under ``results``, else the newest quick one, else None."""
    found = [json.loads(p.read_text()) for p in sorted(results.glob(f"{benchmark}-[0-9]*.json"))]
    full = [r for r in found if not r.get("quick")]
    return (full or found or [None])[-1]


def synthetic_batches(config: WorkerConfig, count: int, seed: int = 0) -> list[ClickBatch]:
    """``count`` decoded batches of ``batching.batch_size`` events from the synthetic stream."""
    from streamtrain.decode import AvroBatchDecoder
    from streamtrain.dev.produce import AvroEncoder, ClickStream, encoded_events
    from streamtrain.source import RawEvent

    decoder = AvroBatchDecoder(config.features, tasks=config.tasks())
    size = config.batching.batch_size
    events = [
        RawEvent(0, i, value, 0)
        for i, (_key, value, _p, _clk) in enumerate(
            encoded_events(ClickStream(seed, 0), AvroEncoder(config.features.resolved_schema_path()), count * size)
        )
    ]
    return [decoder.decode(events[i : i + size]).batch for i in range(0, len(events), size)]


@dataclass
class Leg:
    events: int = 0
    seconds: float = 0.0
    snapshots: list[float] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return self.events / self.seconds if self.seconds else 0.0


def train_for(
    trainer: Trainer,
    batches: list[ClickBatch],
    seconds: float | None = None,
    after_step: Callable[[int], None] = lambda step: None,
    steps: int | None = None,
) -> Leg:
    """Train ``batches`` round and round for ``seconds`` (one rank) or exactly ``steps`` batches
    (several ranks must agree on when to stop, so they count steps)."""
    deadline = time.perf_counter() + seconds if seconds is not None else None

    def feed() -> Iterator[ClickBatch]:
        for index, batch in enumerate(itertools.cycle(batches)):
            if (deadline is not None and time.perf_counter() >= deadline) or (steps is not None and index >= steps):
                return
            yield batch

    leg = Leg()
    started = clock(trainer.env.device)
    for result in trainer.train(feed()):
        leg.events += result.batch.size
        after_step(result.step)
    leg.seconds = clock(trainer.env.device) - started
    return leg


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time a process has used so far (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def listening(port: int) -> bool:
    """Whether a socket on this host listens on TCP ``port``. Ask before connecting to a port a
    process is still to bind: a connection to a port nobody listens on may get that very port as
    its own (the kernel hands out the same range), connect to itself, and hold the port, so that
    the process then fails to bind it ("Address already in use")."""
    hex_port = f":{port:04X}"
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 3 and fields[1].endswith(hex_port) and fields[3] == "0A":  # 0A: LISTEN
                return True
    return False


def scrape(port: int, timeout: float = 2.0) -> dict[str, float]:
    """A metrics endpoint's samples as {'name{labels}': value}; empty if it does not answer (or
    listens not yet: ``listening``)."""
    import http.client
    import urllib.request

    if not listening(port):
        return {}
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as reply:
            text = reply.read().decode()
    except (OSError, http.client.HTTPException):
        return {}
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def trained_in(samples: dict[str, float]) -> float:
    """Events trained, all partitions together, in one rank's scraped ``samples``."""
    return sum(v for k, v in samples.items() if k.startswith("streamtrain_events_trained_total{"))


def wait_until_training(port: int, process, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        if trained_in(scrape(port)) > 0:
            return
        time.sleep(0.5)
    raise RuntimeError("the worker did not start training")


def trained_events(ports: Sequence[int]) -> float:
    """Events the ranks serving metrics on ``ports`` have trained, all partitions together."""
    return sum(trained_in(scrape(port)) for port in ports)


def wait_until_trained(ports: Sequence[int], events: int, timeout: float) -> bool:
    """Until the ranks serving metrics on ``ports`` have trained ``events`` in all, for at most
    ``timeout`` seconds; whether they did. A run that settles after sending waits only as long as
    its ranks need, not a fixed time sized for a slow machine."""
    deadline = time.monotonic() + timeout
    while True:
        if trained_events(ports) >= events:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)


def wait_until_ready(port: int, process, timeout: float = 180.0) -> None:
    """Until /readyz answers 200: the worker has planned, built its model and reached the broker."""
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as reply:
                if reply.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"the worker was not ready within {timeout:.0f}s (exit code {process.poll()})")


def stop_worker(process: subprocess.Popen, grace_seconds: float) -> int | None:
    """Stops a benchmark's worker as an operator would (SIGTERM: a final snapshot, delta and base),
    killing it past ``grace_seconds``; its exit code."""
    process.send_signal(signal.SIGTERM)
    try:
        return process.wait(grace_seconds)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait(10)


def throughput(step_wall: np.ndarray, step_events: np.ndarray, warm_up_seconds: float) -> dict:
    """Events trained after the warm-up over the time from the warm-up's end to the last trained event.

    The warm-up is the first ``warm_up_seconds`` after the first trained event; the window starts
    at the last step inside it (so the events of the steps after it are exactly those trained in
    the window)."""
    trained = step_events > 0
    wall, events = step_wall[trained], step_events[trained]
    if wall.size < 2:
        return {
            "events": int(events.sum()),
            "seconds": 0.0,
            "events_per_second": 0.0,
            "warm_up_seconds": warm_up_seconds,
            "total_events": int(events.sum()),
        }
    first = wall[0]
    inside = wall <= first + warm_up_seconds
    start = wall[inside][-1] if inside.any() else first
    if (wall > start).sum() < 2:  # a run shorter than its warm-up (a quick run): count it all, and say so
        start = first
    after = wall > start
    seconds = float(wall[-1] - start)
    counted = int(events[after].sum())
    return {
        "events": counted,
        "seconds": seconds,
        "events_per_second": counted / seconds if seconds > 0 else 0.0,
        "warm_up_seconds": float(start - first),
        "warm_up_events": int(events[~after].sum()),
        "total_events": int(events.sum()),
        "first_to_last_seconds": float(wall[-1] - first),
    }


def quantiles(values: np.ndarray, qs: tuple[float, ...] = (0.5, 0.9, 0.99, 0.999)) -> dict[str, float]:
    if values.size == 0:
        return {f"p{q * 100:g}": float("nan") for q in qs}
    return {f"p{q * 100:g}": float(np.quantile(values, q)) for q in qs}


def cdf_points(values: np.ndarray, points: int = 200) -> list[list[float]]:
    """[[seconds, fraction <= seconds]], ``points`` of them, for plotting a CDF without every event."""
    if values.size == 0:
        return []
    qs = np.linspace(0.0, 1.0, points)
    return [[float(v), float(q)] for v, q in zip(np.quantile(values, qs), qs, strict=True)]


def local_rank_env(rank: int, world_size: int, master_port: int) -> dict[str, str]:
    """The environment torchrun gives a local rank."""
    return {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(master_port),
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world_size),
        "OMP_NUM_THREADS": "1",
    }
