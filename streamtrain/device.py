"""Where a rank trains: the device, chosen from what is installed as well as what is visible; the
process group it joins; and the memory it has there, for the sharding planner. The naive
baseline joins its ranks here too, without importing the worker's stages.

A GPU alone is not enough. PyPI's torch is a CUDA build, so ``torch.cuda.is_available()`` is true
on any GPU host, but the fused embedding kernels come from fbgemm_gpu, whose CPU variant
(``fbgemm-gpu-cpu``) has no CUDA kernels. Tables placed on CUDA with that variant fail at the
first lookup. So ``auto`` picks CUDA only when the CUDA variant is installed *and* a GPU is
visible; ``distributed.device: cuda`` is refused at start when either is missing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.metadata
import importlib.util
import json
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from streamtrain.config import ConfigError

log = logging.getLogger(__name__)

_FIX_VARIANT = (
    "install the CUDA variant in a fresh environment (`make setup-cuda`, or "
    "`pip install -r requirements/cuda.txt`; never beside fbgemm-gpu-cpu)"
)


def fbgemm_variant() -> str | None:
    """The installed fbgemm_gpu's variant: "cpu", "cuda" (or "rocm"), None when it is not installed.

    Read from the package's target file (fbgemm_gpu 1.x writes ``docs/target.default.json.py``,
    which its ``__variant__`` comes from) without importing it: the CUDA variant does not import
    on a host without an NVIDIA driver. Else from the distribution's name."""
    spec = importlib.util.find_spec("fbgemm_gpu")
    if spec is None:
        return None
    for location in spec.submodule_search_locations or ():
        target = Path(location) / "docs" / "target.default.json.py"
        try:
            return str(json.loads(target.read_text())["variant"])
        except (OSError, ValueError, KeyError):
            continue
    for distribution, variant in (("fbgemm-gpu-cpu", "cpu"), ("fbgemm-gpu", "cuda")):
        try:
            importlib.metadata.version(distribution)
            return variant
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def device_type(choice: str = "auto") -> str:
    """The kind of device, cuda or cpu, that ``select_device`` gives for ``choice`` on this host,
    or would, were it not refused."""
    if choice == "auto":
        return "cuda" if fbgemm_variant() == "cuda" and torch.cuda.is_available() else "cpu"
    return choice


def select_device(choice: str = "auto", local_rank: int = 0) -> torch.device:
    """The device a rank trains on, for ``distributed.device`` (auto, cpu or cuda); a request this
    host cannot honour raises ConfigError naming the field and the fix. Changes nothing."""
    if choice == "cpu":
        return torch.device("cpu")
    variant = fbgemm_variant()
    visible = torch.cuda.is_available()
    if choice == "cuda":
        if variant != "cuda":
            raise ConfigError(
                f"distributed.device: cuda needs the CUDA build of fbgemm_gpu, but the installed one is "
                f"{'the ' + variant + ' variant' if variant else 'missing'}: {_FIX_VARIANT}; or set "
                "distributed.device: auto (STREAMTRAIN_DISTRIBUTED__DEVICE=auto) to train on the CPU"
            )
        if not visible:
            raise ConfigError(
                "distributed.device: cuda, but torch sees no GPU (torch.cuda.is_available() is false: no NVIDIA "
                "driver, CUDA_VISIBLE_DEVICES hides them, or a CPU-only torch); run on a GPU host, or set "
                "distributed.device: cpu (STREAMTRAIN_DISTRIBUTED__DEVICE=cpu)"
            )
    if variant == "cuda" and visible:
        count = torch.cuda.device_count()
        if local_rank >= count:
            raise ConfigError(
                f"distributed.device: local rank {local_rank} has no GPU of its own ({count} visible): run at most "
                f"{count} ranks per host (--nproc / torchrun --nproc-per-node)"
            )
        return torch.device("cuda", local_rank)
    if visible and local_rank == 0:
        log.warning(
            "a GPU is visible but fbgemm_gpu is the %s variant: training on the CPU; to train on the GPU, %s",
            variant,
            _FIX_VARIANT,
        )
    return torch.device("cpu")


def device_memory_bytes(device: torch.device) -> int | None:
    """Total memory of a CUDA device (HBM), None for the CPU."""
    if device.type != "cuda":
        return None
    return int(torch.cuda.get_device_properties(device.index or 0).total_memory)


def host_memory_bytes(local_world_size: int) -> int:
    """This host's memory per local rank: physical memory, or the container's cgroup limit if lower,
    divided by the ranks on this host."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            limit = Path(limit_file).read_text().strip()
        except OSError:
            continue
        if limit.isdigit():
            total = min(total, int(limit))
        break
    return total // max(local_world_size, 1)


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device


# On GPUs the default group's NCCL watchdog aborts the process when a collective outlasts the
# group's timeout. It must not fire before the lockstep vote (on its own gloo group, with the
# configured timeout) has reported a dead or frozen peer, so the default group waits twice as long.
NCCL_TIMEOUT_FACTOR = 2


def process_group_options(device: torch.device, timeout_seconds: float) -> tuple[str, timedelta]:
    """The default group's backend and timeout for ranks on ``device``.

    torch applies ``init_process_group``'s one timeout to every backend of the group, so with
    ``cpu:gloo,cuda:nccl`` its gloo half waits as long as NCCL; the lockstep vote and the snapshot
    writes run on gloo groups of their own (``gloo_group``) with ``timeout_seconds``."""
    if device.type == "cuda":  # async checkpoint saves need a CPU backend beside NCCL
        return "cpu:gloo,cuda:nccl", timedelta(seconds=NCCL_TIMEOUT_FACTOR * timeout_seconds)
    return "gloo", timedelta(seconds=timeout_seconds)


def gloo_group(world_size: int, timeout_seconds: float) -> dist.ProcessGroup | None:
    """A gloo group of all ranks beside the default one (None at one rank), for coordination that
    must neither interleave with the pipeline's collectives nor wait on NCCL's longer timeout."""
    if world_size == 1:
        return None
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_seconds))


# Up to this size a sum over gloo ranks is an all-gather and a local sum: at 2 ranks gloo's
# all-reduce took 2-3.7x the wall time and CPU of the all-gather for the vote's 7-10 numbers and
# 1.4-2.9x for 2k-13k floats, and they broke even between 256 KiB and 1 MiB (``bench collectives``,
# on two machines), past which the all-reduce wins; the gather also moves and holds world-size
# times the bytes. Hence the margin.
GATHER_SUM_MAX_BYTES = 256 << 10


# torch 2.13's name for the gather into one tensor; 2.11 (GPU images lag) has only the older
# all_gather_into_tensor, which 2.13 keeps as a deprecated alias of it.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def summed_over_ranks(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``tensor`` summed element-wise over the ranks of ``group``, as an all-reduce would, by an
    all-gather and a local sum (see GATHER_SUM_MAX_BYTES)."""
    return summing_over_ranks(tensor, group).wait()


def summing_over_ranks(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.futures.Future[torch.Tensor]:
    """``summed_over_ranks``, started: its future holds the sum once every rank's part has arrived."""
    return _gathering(tensor, group, lambda gathered: gathered.sum(0))


def gathered_from_ranks(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Every rank's ``tensor`` in ``group``, stacked in rank order: [world size, *tensor.shape]."""
    return _gathering(tensor, group, lambda gathered: gathered).wait()


def _gathering(
    tensor: torch.Tensor, group: dist.ProcessGroup | None, then: Callable[[torch.Tensor], torch.Tensor]
) -> torch.futures.Future[torch.Tensor]:
    world_size = dist.get_world_size(group)
    gathered = tensor.new_empty(world_size * tensor.numel())  # gloo takes the inputs concatenated
    work = _all_gather_single(gathered, tensor.reshape(-1), group=group, async_op=True)
    return work.get_future().then(lambda _: then(gathered.view(world_size, *tensor.shape)))


def intra_op_threads(configured: int | None) -> int:
    """The threads this rank's operators run on (distributed.intra_op_threads): as configured;
    else OMP_NUM_THREADS when it is set (torchrun sets 1 for several ranks on a host); else the
    cores this process may use, shared among the host's ranks, less one.

    The core left over is for the Kafka client, the decoder and the snapshot writer. A trainer
    whose thread pool takes every core stalls whenever any of them runs, since a parallel region
    waits for its slowest thread: on 2 cores, one rank kept 0.79-0.83 of its throughput with a
    snapshot every 3 s at 2 threads, 0.83-1.00 at 1 (CHANGELOG.md, 2026-12-01)."""
    if configured is not None:
        return configured
    if os.environ.get("OMP_NUM_THREADS"):
        return torch.get_num_threads()
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    return max(1, len(os.sched_getaffinity(0)) // ranks_here - 1)


def decode_threads(configured: int | None, device: torch.device) -> int:
    """The threads that decode each of this rank's batches (batching.decode_threads): as configured;
    else 1 for a rank that trains on the CPU, and for a CUDA rank its share of the cores less two
    (at least 1). More threads than a batch has slices of ``MIN_SLICE_EVENTS`` stay idle.

    On the CPU, ``intra_op_threads`` gives the trainer every core but one, and that one is the data
    path's: a second decode thread would take a core from a thread pool whose parallel regions wait
    for their slowest thread. A CUDA rank's training thread needs one core to launch kernels; one more
    is left for librdkafka's fetch threads and the snapshot writer, and the rest decode."""
    if configured is not None:
        return configured
    if device.type != "cuda":
        return 1
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    return max(1, len(os.sched_getaffinity(0)) // ranks_here - 2)


# glibc's mallopt parameters, and what a rank sets them to (``keep_freed_heap``): allocations above
# 32 MiB (glibc's own ceiling for its moving threshold) are mapped and unmapped as before; free heap
# up to 256 MiB stays with the process.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
KEPT_HEAP_BYTES, MAPPED_ABOVE_BYTES = 256 << 20, 32 << 20


def keep_freed_heap() -> bool:
    """Keep the heap a step frees for the next step instead of giving it back to the kernel; True
    when set. A step allocates and frees the same few MiB of scratch (the managed map's, the
    decoder's). glibc trims its heap's free top past a threshold that moves with the largest block
    freed, and the steps after a trim fault every page back in: on a VM about 1.6 us a page, 700
    faults a map step at the scale leg of bench idspace, where each timed map follows the free of
    a copy of the map (docs/ranks.md). Fixed thresholds make a step's cost not depend on what was
    freed before it. Left as it is where the operator tuned malloc (``MALLOC_*_`` or
    ``GLIBC_TUNABLES`` in the environment) and off glibc."""
    if sys.platform != "linux" or "GLIBC_TUNABLES" in os.environ or any(k.startswith("MALLOC_") for k in os.environ):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
    except OSError:
        return False
    if not hasattr(libc, "gnu_get_libc_version"):  # not glibc: its mallopt parameters differ, if any
        return False
    return bool(
        libc.mallopt(_M_MMAP_THRESHOLD, MAPPED_ABOVE_BYTES) and libc.mallopt(_M_TRIM_THRESHOLD, KEPT_HEAP_BYTES)
    )


def init_distributed(timeout_seconds: float = 60.0, device: str = "auto", threads: int | None = None) -> DistEnv:
    """Join the process group torchrun describes in the environment, or form one of size 1, on the
    device ``select_device`` chooses for ``device`` (distributed.device), with ``threads``
    intra-op threads (distributed.intra_op_threads; see ``intra_op_threads``), keeping the heap a
    step frees (``keep_freed_heap``)."""
    torch.set_num_threads(intra_op_threads(threads))
    keep_freed_heap()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    chosen = select_device(device, local_rank)
    if chosen.type == "cuda":
        torch.cuda.set_device(chosen)
    backend, timeout = process_group_options(chosen, timeout_seconds)
    if not dist.is_initialized():
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend, timeout=timeout)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return DistEnv(dist.get_rank(), dist.get_world_size(), local_rank, chosen)
