"""Sums over ranks by all-gather (``device.summed_over_ranks``, the lockstep's vote) and DDP's
gradient averaging by all-gather (``train.gather_small_gradients``) give what gloo's all-reduce
gives, on 2 real gloo ranks, for buckets on both sides of ``GATHER_SUM_MAX_BYTES``."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from streamtrain.dev.kafka import free_port
from streamtrain.device import GATHER_SUM_MAX_BYTES, summed_over_ranks
from streamtrain.train import gather_small_gradients

# Two DDP modules, each with one bucket, under the gather's limit and over it.
SMALL, LARGE = 1_000, GATHER_SUM_MAX_BYTES // 4 + 1_000


def _gradients(rank: int, hooked: bool) -> list[torch.Tensor]:
    torch.manual_seed(0)  # the same weights on both ranks, as DDP starts them
    small, large = nn.Linear(SMALL, 1, bias=False), nn.Linear(1, LARGE, bias=False)
    model = nn.ModuleDict({"small": DistributedDataParallel(small), "large": DistributedDataParallel(large)})
    if hooked:
        gather_small_gradients(model)
        assert [len(ddp._comm_hooks) for ddp in model.values()] == [1, 1]
    inputs = torch.randn(8, SMALL, generator=torch.Generator().manual_seed(rank))  # each rank its own
    model["large"](model["small"](inputs)).square().sum().backward()
    return [small.weight.grad.clone(), large.weight.grad.clone()]


def _rank(rank: int, port: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    votes = torch.tensor([rank + 1, 5, rank, 0, 1], dtype=torch.int64)
    reduced = votes.clone()
    dist.all_reduce(reduced)
    values = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))
    reduced_values = values.clone()
    dist.all_reduce(reduced_values)
    result = {
        "votes": (summed_over_ranks(votes, None), reduced),
        "values": (summed_over_ranks(values, None), reduced_values),
        "hooked": _gradients(rank, hooked=True),
        "plain": _gradients(rank, hooked=False),
    }
    torch.save(result, f"{out}/rank-{rank}.pt")
    dist.destroy_process_group()


def test_sums_and_gradient_averages_by_all_gather_equal_gloos_all_reduce(tmp_path):
    mp.spawn(_rank, args=(free_port(), str(tmp_path)), nprocs=2)
    zero, one = (torch.load(tmp_path / f"rank-{rank}.pt") for rank in range(2))
    for result in (zero, one):
        gathered, reduced = result["votes"]
        assert gathered.dtype == torch.int64 and gathered.tolist() == reduced.tolist() == [3, 10, 1, 0, 2]
        gathered, reduced = result["values"]
        assert gathered.shape == (3, 4)
        torch.testing.assert_close(gathered, reduced, rtol=0, atol=1e-6)
    for hooked, plain in zip(zero["hooked"], zero["plain"], strict=True):
        assert not torch.equal(plain, torch.zeros_like(plain))
        torch.testing.assert_close(hooked, plain, rtol=1e-6, atol=1e-7)
    for mine, theirs in zip(zero["hooked"], one["hooked"], strict=True):  # averaged: equal on every rank
        assert torch.equal(mine, theirs)
