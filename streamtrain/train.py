"""Stage 4, train: the planner shards the tables, DMP wraps the model, TrainPipelineSparseDist runs it.

Sparse parameters are updated by fbgemm's fused optimizer inside the backward pass
(``apply_optimizer_in_backward``); dense parameters by a torch optimizer behind
``KeyedOptimizerWrapper``. Both sit in one ``CombinedOptimizer`` for the pipeline.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from dataclasses import dataclass
from datetime import timedelta
from typing import Iterable, Iterator

import torch
import torch.distributed as dist
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.optim import RowWiseAdagrad
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

from streamtrain.config import WorkerConfig
from streamtrain.decode import ClickBatch
from streamtrain.model import ClickModel

log = logging.getLogger(__name__)

_SPARSE_OPTIMIZERS = {
    "row_wise_adagrad": RowWiseAdagrad,
    "adagrad": torch.optim.Adagrad,
    "sgd": torch.optim.SGD,
}


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device


def init_distributed(timeout_seconds: float = 60.0) -> DistEnv:
    """Join the process group torchrun describes in the environment, or form one of size 1."""
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        device = torch.device(f"cuda:{local_rank}")
        torch.cuda.set_device(device)
        backend = "cpu:gloo,cuda:nccl"  # async checkpoint saves need a CPU backend beside NCCL
    else:
        local_rank, device, backend = int(os.environ.get("LOCAL_RANK", 0)), torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        timeout = timedelta(seconds=timeout_seconds)
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend, timeout=timeout)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return DistEnv(dist.get_rank(), dist.get_world_size(), local_rank, device)


@dataclass
class StepResult:
    step: int
    batch: ClickBatch
    loss_sum: float
    logits: torch.Tensor
    labels: torch.Tensor
    seconds: float


class Trainer:
    def __init__(self, config: WorkerConfig, env: DistEnv):
        self.env = env
        torch.manual_seed(config.model.seed)
        model = ClickModel(config.features, config.model, env.device)
        apply_optimizer_in_backward(
            _SPARSE_OPTIMIZERS[config.model.sparse_optimizer],
            model.dlrm.sparse_arch.parameters(),
            {"lr": config.model.sparse_learning_rate},
        )
        sharders = [EmbeddingBagCollectionSharder()]
        planner = EmbeddingShardingPlanner(
            topology=Topology(world_size=env.world_size, compute_device=env.device.type,
                              local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", env.world_size))),
        )
        pg = dist.group.WORLD
        self.plan: ShardingPlan = planner.collective_plan(model, sharders, pg)
        self.model = DistributedModelParallel(
            module=model, device=env.device, plan=self.plan, sharders=sharders,
            env=ShardingEnv.from_process_group(pg),
        )
        dense_optimizer = KeyedOptimizerWrapper(
            dict(in_backward_optimizer_filter(self.model.named_parameters())),
            lambda params: torch.optim.Adam(params, lr=config.model.dense_learning_rate),
        )
        self.optimizer = CombinedOptimizer([self.model.fused_optimizer, dense_optimizer])
        self.pipeline = TrainPipelineSparseDist(self.model, self.optimizer, env.device, execute_all_batches=True)
        self.step = 0

    def train(self, batches: Iterable[ClickBatch]) -> Iterator[StepResult]:
        """Train every batch ``batches`` yields, in order; one result per trained batch."""
        # The pipeline holds up to three batches and returns the output of the oldest, so the
        # batches it has taken and not yet returned form a FIFO beside it.
        taken: deque[ClickBatch] = deque()

        def feed() -> Iterator[ClickBatch]:
            for batch in batches:
                taken.append(batch)
                yield batch

        source = feed()
        while True:
            started = time.perf_counter()
            try:
                loss_sum, logits, labels = self.pipeline.progress(source)
            except StopIteration:
                return
            self.step += 1
            yield StepResult(self.step, taken.popleft(), float(loss_sum), logits, labels,
                             time.perf_counter() - started)
