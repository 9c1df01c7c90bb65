"""GPU readiness checked on a CPU host: the device the worker picks from what is installed, the
process groups' timeouts, and the memory the sharding planner is told each rank has.

Nothing here has run on a GPU: the GPU side is simulated by patching torch.cuda."""

import importlib.metadata
import json
import logging
import os
import subprocess
import sys
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import yaml

from conftest import REPO, SMALL_CONFIG
from streamtrain import device as device_module
from streamtrain.cli import _LIBRARY_NOISE, main
from streamtrain.config import ConfigError, load_config
from streamtrain.device import (
    NCCL_TIMEOUT_FACTOR,
    fbgemm_variant,
    host_memory_bytes,
    intra_op_threads,
    process_group_options,
    select_device,
)
from streamtrain.train import topology

GIB = 2**30


@pytest.fixture
def gpu_visible(monkeypatch):
    """torch sees two GPUs (none are there)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


@pytest.fixture
def cpu_fbgemm(monkeypatch):
    """fbgemm_gpu is the CPU variant, whichever this host has installed (a GPU host has the CUDA one)."""
    monkeypatch.setattr(device_module, "fbgemm_variant", lambda: "cpu")


def _installed_distribution(name: str) -> bool:
    try:
        importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def test_device_variant_of_the_installed_fbgemm_is_the_installed_distributions():
    # this checkout's .venv: fbgemm-gpu-cpu; a GPU host's: fbgemm-gpu, the CUDA variant
    expected = "cpu" if _installed_distribution("fbgemm-gpu-cpu") else "cuda"
    assert fbgemm_variant() == expected


def test_device_auto_stays_on_cpu_with_the_cpu_fbgemm_even_when_a_gpu_is_visible(cpu_fbgemm, gpu_visible, caplog):
    with caplog.at_level(logging.WARNING, logger="streamtrain.device"):
        assert select_device("auto") == torch.device("cpu")
    assert "make setup-cuda" in caplog.text
    assert select_device("cpu") == torch.device("cpu")


def test_device_cuda_is_refused_with_the_cpu_fbgemm(cpu_fbgemm, gpu_visible):
    with pytest.raises(ConfigError) as refused:
        select_device("cuda")
    message = str(refused.value)
    assert "distributed.device" in message and "the cpu variant" in message
    assert "make setup-cuda" in message and "requirements/cuda.txt" in message


def test_device_cuda_is_refused_without_a_visible_gpu(monkeypatch):
    monkeypatch.setattr(device_module, "fbgemm_variant", lambda: "cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"distributed\.device: cuda, but torch sees no GPU"):
        select_device("cuda")
    assert select_device("auto") == torch.device("cpu")


def test_device_cuda_with_the_cuda_fbgemm_gives_each_local_rank_its_gpu(monkeypatch, gpu_visible):
    monkeypatch.setattr(device_module, "fbgemm_variant", lambda: "cuda")
    assert select_device("auto", local_rank=1) == torch.device("cuda", 1)
    assert select_device("cuda", local_rank=0) == torch.device("cuda", 0)
    with pytest.raises(ConfigError, match="local rank 2 has no GPU of its own"):
        select_device("auto", local_rank=2)


def test_device_cuda_refused_by_the_worker_command_before_any_rank_starts(monkeypatch, cpu_fbgemm, gpu_visible, capsys):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setenv("STREAMTRAIN_DISTRIBUTED__DEVICE", "cuda")
    assert main(["worker", "--config", str(SMALL_CONFIG), "--nproc", "2"]) == 2
    assert "distributed.device: cuda needs the CUDA build of fbgemm_gpu" in capsys.readouterr().err


def test_device_field_is_validated_like_every_field(monkeypatch):
    monkeypatch.setenv("STREAMTRAIN_DISTRIBUTED__DEVICE", "gpu")
    with pytest.raises(ConfigError, match=r"distributed\.device: Input should be 'auto', 'cpu' or 'cuda'"):
        load_config(SMALL_CONFIG)


def test_intra_op_threads_leave_a_core_beside_the_hosts_ranks(monkeypatch):
    """The auto count leaves one core for the data path and the snapshot writer; torchrun's
    OMP_NUM_THREADS and the config each win over it."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(device_module.os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert intra_op_threads(None) == 7
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert intra_op_threads(None) == 3
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert intra_op_threads(None) == 1  # never none
    assert intra_op_threads(5) == 5
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert intra_op_threads(None) == 2
    assert intra_op_threads(5) == 5


def test_intra_op_threads_field_is_validated(monkeypatch):
    monkeypatch.setenv("STREAMTRAIN_DISTRIBUTED__INTRA_OP_THREADS", "0")
    with pytest.raises(ConfigError, match=r"distributed\.intra_op_threads"):
        load_config(SMALL_CONFIG)


def test_cuda_default_group_waits_longer_than_the_gloo_groups():
    backend, timeout = process_group_options(torch.device("cuda", 0), 120)
    assert backend == "cpu:gloo,cuda:nccl" and timeout == timedelta(seconds=NCCL_TIMEOUT_FACTOR * 120)
    assert NCCL_TIMEOUT_FACTOR > 1
    assert process_group_options(torch.device("cpu"), 120) == ("gloo", timedelta(seconds=120))


def test_cuda_init_distributed_passes_the_nccl_timeout_to_the_default_group(monkeypatch):
    """init_distributed on a (simulated) GPU rank: the arguments it hands torch."""
    calls = []
    monkeypatch.setattr(device_module, "select_device", lambda choice, local_rank: torch.device("cuda", local_rank))
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("set_device", device)))
    monkeypatch.setattr(device_module.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(device_module.dist, "init_process_group", lambda backend, **kw: calls.append((backend, kw)))
    monkeypatch.setattr(device_module.dist, "get_rank", lambda: 1)
    monkeypatch.setattr(device_module.dist, "get_world_size", lambda: 2)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    env = device_module.init_distributed(30, "cuda")
    assert env.device == torch.device("cuda", 1)
    assert calls == [
        ("set_device", torch.device("cuda", 1)),
        ("cpu:gloo,cuda:nccl", {"timeout": timedelta(seconds=60)}),
    ]


def test_device_gloo_groups_are_created_with_the_configured_timeout():
    """On a real (CPU) process group: the default group and the side gloo groups of the lockstep
    vote and the snapshot writes, read back from torch."""
    script = """
import json, torch, torch.distributed as dist
from streamtrain.device import gloo_group, init_distributed
init_distributed(45)
side = gloo_group(2, 45)  # as for 2 ranks; this process is the whole world
cpu = torch.device("cpu")
print(json.dumps([g._get_backend(cpu).options._timeout.total_seconds() for g in (dist.group.WORLD, side)]))
"""
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120, check=True
    )
    assert json.loads(result.stdout.splitlines()[-1]) == [45.0, 45.0]


def test_worker_creates_its_side_groups_through_gloo_group():
    source = (REPO / "streamtrain" / "worker.py").read_text()
    assert "gloo_group(env.world_size, config.distributed.timeout_seconds)" in source
    assert "new_group(" not in source


def test_topology_takes_gpu_memory_from_the_device_and_host_memory_per_local_rank(monkeypatch):
    asked = []

    def properties(index):
        asked.append(index)
        return SimpleNamespace(total_memory=80 * GIB)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    config = load_config(SMALL_CONFIG)
    planned = topology(config, world_size=8, compute_device="cuda", local_world_size=4, device=torch.device("cuda", 1))
    assert asked == [1]
    assert {d.storage.hbm for d in planned.devices} == {80 * GIB}
    assert {d.storage.ddr for d in planned.devices} == {host_memory_bytes(4)}
    assert planned.local_world_size == 4 and planned.world_size == 8


def test_topology_caps_from_the_config_win_and_cpu_ranks_have_no_gpu_memory(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: SimpleNamespace(total_memory=80 * GIB))
    monkeypatch.setenv("STREAMTRAIN_DISTRIBUTED__HBM_GB", "12")
    monkeypatch.setenv("STREAMTRAIN_DISTRIBUTED__DDR_GB", "20.5")
    config = load_config(SMALL_CONFIG)
    on_gpu = topology(config, 2, "cuda", device=torch.device("cuda", 0))
    assert on_gpu.devices[0].storage.hbm == 12 * GIB and on_gpu.devices[0].storage.ddr == int(20.5 * GIB)
    on_cpu = topology(config, 2, "cpu", device=torch.device("cpu"))
    assert on_cpu.devices[0].storage.hbm == 0 and on_cpu.devices[0].storage.ddr == int(20.5 * GIB)


def test_topology_warning_is_no_longer_hidden_and_no_longer_raised(caplog):
    assert not any("topology" in noise for noise in _LIBRARY_NOISE)
    with caplog.at_level(logging.WARNING):
        topology(load_config(SMALL_CONFIG), 2, "cpu")
    assert "constructed directly" not in caplog.text


def test_plan_topology_hbm_cap_moves_a_table_too_big_for_the_gpu_off_it(tmp_path, capsys):
    """40M rows x 8 dims is 1.3 GiB with its optimizer state: planned for 1 GiB GPUs, TorchRec keeps
    it in host memory behind a GPU cache (fused_uvm_caching) instead of in GPU memory (fused)."""
    raw = yaml.safe_load(SMALL_CONFIG.read_text())
    raw["features"]["tables"][0]["num_embeddings"] = 40_000_000
    config = tmp_path / "big.yaml"
    config.write_text(yaml.safe_dump(raw))

    def kernels(*flags: str) -> tuple[str, dict[str, str]]:
        out = tmp_path / "plan.json"
        assert main(["plan", "--config", str(config), "--compute-device", "cuda", "--json", str(out), *flags]) == 0
        printed = capsys.readouterr().out
        return printed, {t["table"]: t["compute_kernel"] for t in json.loads(out.read_text())["tables"]}

    printed, default = kernels()
    assert "GPU memory 32.0 GiB" in printed  # TorchRec's default: no GPU here, no --hbm-gb
    assert default["user_id"] == "fused"
    printed, capped = kernels("--hbm-gb", "1", "--ddr-gb", "64", "--local-world-size", "8")
    assert "GPU memory 1.0 GiB, host memory 64.0 GiB" in printed
    assert capped["user_id"] in ("fused_uvm_caching", "fused_uvm")


_STEPS_FAULTS = """
import resource, sys
import numpy as np
from streamtrain.device import keep_freed_heap
print(keep_freed_heap() if sys.argv[1] == "keep" else False)
def step():  # a step's scratch: a few MiB allocated, written and freed
    return sum(int(a[-1]) for a in [np.ones(1 << 20, np.int64) for _ in range(3)])
step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's malloc")
def test_a_rank_keeps_the_heap_a_step_frees_instead_of_faulting_it_back_in_each_step():
    """With glibc's defaults, freeing a step's scratch trims the heap, and the next step faults every
    page back in (20k faults over these 20 steps). A rank keeps it (init_distributed); an operator's
    own malloc tuning in the environment is left alone."""

    def run(mode: str, **env: str) -> tuple[str, int]:
        environ = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
        out = subprocess.run(
            [sys.executable, "-c", _STEPS_FAULTS, mode], cwd=REPO, env={**environ, **env},
            capture_output=True, text=True, timeout=60, check=True,
        ).stdout.split()  # fmt: skip
        return out[0], int(out[1])

    default, kept = run("default"), run("keep")
    assert default[1] > 10_000, default  # what a step costs with glibc's defaults
    assert kept[0] == "True" and kept[1] < default[1] // 100, (default, kept)
    assert run("keep", MALLOC_TRIM_THRESHOLD_="0")[0] == "False"  # the operator's setting stands
