"""Stage 4, train: the planner shards the tables, DMP wraps the model, TrainPipelineSparseDist runs it.

Sparse parameters are updated by fbgemm's fused optimizer inside the backward pass
(``apply_optimizer_in_backward``); dense parameters by a torch optimizer behind
``KeyedOptimizerWrapper``, which skips a step in which no rank trained an event. Both sit in one
``CombinedOptimizer`` for the pipeline.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel
from torchrec import EmbeddingBagCollection, JaggedTensor, KeyedJaggedTensor
from torchrec.distributed import DistributedModelParallel, comm_ops
from torchrec.distributed import embedding as torchrec_embedding
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embedding_types import KJTList
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.planner.types import HardwareConfig, KernelConfig, TopologyFactory, TrainerConfig
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.optim import RowWiseAdagrad
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

from streamtrain.config import ConfigError, WorkerConfig
from streamtrain.decode import ClickBatch
from streamtrain.delayed import LateShare
from streamtrain.device import (
    GATHER_SUM_MAX_BYTES,
    DistEnv,
    device_memory_bytes,
    gloo_group,
    host_memory_bytes,
    summing_over_ranks,
)
from streamtrain.idspace import IdSpace, RowResetter, managed_tables
from streamtrain.lockstep import PIPELINE_LOOKAHEAD
from streamtrain.metrics import IdSpaceMetrics
from streamtrain.model import ClickModel
from streamtrain.models.base import table_weights
from streamtrain.threads import profiled

log = logging.getLogger(__name__)

_SPARSE_OPTIMIZERS = {
    "row_wise_adagrad": RowWiseAdagrad,
    "adagrad": torch.optim.Adagrad,
    "sgd": torch.optim.SGD,
}


def dense_adam(params: Iterable[torch.Tensor], learning_rate: float) -> torch.optim.Adam:
    """Adam for the dense layers and the data-parallel tables: torch's fused kernel steps every
    tensor in one call, where the default steps them one by one in Python, four times as long at the
    reference model's sizes (about a thirtieth of a CPU step). The same update, to rounding, and the same state."""
    return torch.optim.Adam(params, lr=learning_rate, fused=True)


class StepReadout:
    """A step's summed loss and logits, on their way to the host.

    Reading a GPU value at once makes the host wait for the whole step it comes from. On CUDA the
    values are copied without blocking into pinned host memory right after the step is launched,
    and an event marks the copy's end; read one step later, the copy is long done. On CPU they are
    the values themselves, and nothing waits.
    """

    def __init__(self, loss_sum: torch.Tensor, logits: torch.Tensor):
        loss_sum, logits = loss_sum.detach(), logits.detach()
        self._ready: torch.cuda.Event | None = None
        if loss_sum.is_cuda:
            self._loss_sum = torch.empty((), dtype=torch.float32, pin_memory=True)
            self._logits = torch.empty(logits.shape, dtype=torch.float32, pin_memory=True)
            self._loss_sum.copy_(loss_sum, non_blocking=True)
            self._logits.copy_(logits, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:
            self._loss_sum, self._logits = loss_sum.float(), logits.float()

    def loss_sum(self) -> float:
        """The step's summed (unscaled) loss; on CUDA, waits for its copy."""
        self._wait()
        return float(self._loss_sum)

    def logits(self) -> torch.Tensor:
        """The step's logits as float32 on the host; on CUDA, waits for their copy."""
        self._wait()
        return self._logits

    def _wait(self) -> None:
        if self._ready is not None:
            self._ready.synchronize()


@dataclass
class StepResult:
    step: int
    batch: ClickBatch  # the host batch, as the lockstep handed it over; its labels are the step's
    readout: StepReadout
    seconds: float  # the whole step
    data_wait_seconds: float  # of which waiting for the next batch (and the ranks' vote)

    @property
    def loss_sum(self) -> float:
        """Blocks on CUDA until the step is done; the worker reads it one step late instead."""
        return self.readout.loss_sum()

    @property
    def logits(self) -> torch.Tensor:
        return self.readout.logits()

    @property
    def labels(self) -> torch.Tensor:
        return self.batch.labels


_GIB = 2**30


def sharders() -> list:
    """The sharders of every kind of collection a model may hold: pooled tables and unpooled (a sequence's)."""
    return [EmbeddingBagCollectionSharder(), EmbeddingCollectionSharder()]


# TorchRec's sharded EmbeddingCollection sizes its ids' lengths by ``view(-1, stride)``, which a
# batch of no events (stride 0) cannot size: a rank with no events trains one, and at 1 rank so
# does the whole step. Such a batch goes through it as one event without ids, and leaves as none.


def _one_event_without_ids(features: KeyedJaggedTensor) -> KeyedJaggedTensor:
    lengths = torch.zeros(len(features.keys()), dtype=features.lengths().dtype, device=features.lengths().device)
    return KeyedJaggedTensor(keys=features.keys(), values=features.values(), lengths=lengths, stride=1)


_compute_and_output_dist = torchrec_embedding.ShardedEmbeddingCollection.compute_and_output_dist


def _compute_and_output_dist_of_any_batch(self: Any, ctx: Any, features: KJTList) -> Any:
    sized = KJTList([_one_event_without_ids(f) if f.stride() == 0 else f for f in features])
    return _compute_and_output_dist(self, ctx, sized)


_construct_jagged_tensors = torchrec_embedding.construct_jagged_tensors


def _construct_jagged_tensors_of_any_batch(
    embeddings: torch.Tensor, features: KeyedJaggedTensor, *args: Any, **kwargs: Any
) -> dict[str, JaggedTensor]:
    original = kwargs.get("original_features")
    if (original if original is not None else features).stride() != 0 or kwargs.get("seq_vbe_ctx") is not None:
        return _construct_jagged_tensors(embeddings, features, *args, **kwargs)
    if original is not None:
        kwargs["original_features"] = _one_event_without_ids(original)
    else:
        features = _one_event_without_ids(features)
    built = _construct_jagged_tensors(embeddings, features, *args, **kwargs)
    return {key: JaggedTensor(values=jt.values(), lengths=jt.lengths()[:0]) for key, jt in built.items()}


torchrec_embedding.ShardedEmbeddingCollection.compute_and_output_dist = _compute_and_output_dist_of_any_batch
torchrec_embedding.construct_jagged_tensors = _construct_jagged_tensors_of_any_batch


def topology(
    config: WorkerConfig,
    world_size: int,
    compute_device: str,
    local_world_size: int | None = None,
    device: torch.device | None = None,
    dry_run: bool = False,
) -> Topology:
    """The planner's view of the ranks, with the memory each really has.

    Each rank's GPU memory is ``device``'s (none on the CPU) and its host memory this host's divided
    by ``local_world_size`` (default LOCAL_WORLD_SIZE, else ``world_size``); ``distributed.hbm_gb``
    and ``distributed.ddr_gb`` override them. In a dry run (``streamtrain plan``, planning for
    other machines) they replace what this host has; unknown GPU memory (planning for cuda on a
    host without one) stays at TorchRec's default of 32 GiB."""
    local = local_world_size or int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    hbm, ddr = (None if gb is None else int(gb * _GIB) for gb in (config.distributed.hbm_gb, config.distributed.ddr_gb))
    detected = device_memory_bytes(device) if device is not None and compute_device == "cuda" else None
    return TopologyFactory.create_topology(
        trainer_config=TrainerConfig(
            world_size=world_size,
            local_world_size=local,
            hbm_cap_bytes=hbm,
            ddr_cap_bytes=ddr,
            is_dry_run=dry_run,
            dry_run_hbm_bytes=hbm if dry_run else None,
            dry_run_ddr_bytes=ddr if dry_run else None,
        ),
        hardware_config=HardwareConfig(hbm_cap_bytes=detected, ddr_cap_bytes=host_memory_bytes(local)),
        kernel_config=KernelConfig(compute_device=compute_device),
    )


def describe_topology(topology: Topology) -> str:
    storage = topology.devices[0].storage
    hbm = f"GPU memory {storage.hbm / _GIB:,.1f} GiB, " if topology.compute_device == "cuda" else ""
    return f"the planner's memory per rank: {hbm}host memory {storage.ddr / _GIB:,.1f} GiB"


def plan_sharding(
    config: WorkerConfig,
    world_size: int,
    compute_device: str,
    pg: dist.ProcessGroup | None = None,
    dense_device: torch.device | None = None,
    planner_topology: Topology | None = None,
) -> tuple[ClickModel, ShardingPlan]:
    """The model (tables on the meta device) and the planner's plan for ``world_size`` ranks.

    With ``pg`` the ranks plan collectively and agree on one plan; without it this is a dry run,
    and the dense layers stay on the meta device too. ``planner_topology`` defaults to
    ``topology(config, world_size, compute_device, device=dense_device)``.
    """
    model = ClickModel(config.features, config.model, config.tasks(), dense_device or torch.device("meta"))
    apply_optimizer_in_backward(
        _SPARSE_OPTIMIZERS[config.model.sparse_optimizer],
        [p for name, p in model.named_parameters() if name in set(table_weights(model).values())],
        {"lr": config.model.sparse_learning_rate * config.learning_rate_scales(world_size)[0]},
    )
    planner = EmbeddingShardingPlanner(
        topology=planner_topology or topology(config, world_size, compute_device, device=dense_device),
        constraints=_constraints(config),
    )
    plan = planner.collective_plan(model, sharders(), pg) if pg is not None else planner.plan(model, sharders())
    refuse_unbuildable_shards(model, plan, config)
    return model, plan


# fbgemm's table-batched kernels take only shards whose width is a multiple of 4: TorchRec 1.8
# asserts it (``_assert_local_cols_divisible_by_4``) when it builds a pooled table on any kernel but
# dense (fused, fused_uvm and fused_uvm_caching are one fbgemm kernel), and an unpooled one on a
# key-value kernel; its unpooled fused kernel has no such rule. A shard is the table's whole width
# (table_wise, row_wise, table_row_wise) or the planner's column cut (column_wise,
# table_column_wise); data_parallel replicas run on the dense kernel.
_KEY_VALUE_KERNELS = {"key_value", "ssd_virtual_table", "dram_virtual_table", "dram_ssd_virtual_table"}


def refuse_unbuildable_shards(model: torch.nn.Module, plan: ShardingPlan, config: WorkerConfig) -> None:
    """Refuses, as a bad config (exit 2) and before any rank builds it, a plan that puts a shard
    TorchRec cannot build on its kernel: one whose width is not a multiple of 4 on fbgemm's kernels.
    It would pass the planner and fail at start-up with an AssertionError (exit 1)."""
    index = {t.name: i for i, t in enumerate(config.features.tables)}
    problems = []
    for path, tables in plan.plan.items():
        pooled = isinstance(model.get_submodule(path), EmbeddingBagCollection)
        for name, sharding in tables.items():
            kernel = sharding.compute_kernel
            if not ((pooled and kernel != "dense") or kernel in _KEY_VALUE_KERNELS):
                continue
            table = config.features.tables[index[name]]
            spec = sharding.sharding_spec
            widths = [s.shard_sizes[1] for s in spec.shards] if spec is not None else [table.embedding_dim]
            if all(width % 4 == 0 for width in widths):
                continue
            dense = (
                "" if table.id_mapping == "managed" else ", or keep it on the dense kernel (compute_kernels: [dense])"
            )
            field, variable = f"features.tables.{index[name]}.embedding_dim", f"TABLES__{index[name]}__EMBEDDING_DIM"
            problems.append(
                f"{field}: {name} is {table.embedding_dim} wide, and the planner put it {sharding.sharding_type} on "
                f"fbgemm's {kernel} kernel in shards {widths} wide, which that kernel takes only in multiples of 4; "
                f"set embedding_dim to a multiple of 4{dense} (STREAMTRAIN_FEATURES__{variable})"
            )
    if problems:
        raise ConfigError("invalid worker configuration:\n  " + "\n  ".join(problems))


# A managed table's evicted rows are reset inside fbgemm's fused kernels (idspace.RowResetter):
# never data_parallel, whose replicas are torch parameters with an optimizer of their own. Nor, by
# default, column_wise or table_column_wise. Denied data_parallel, the planner often picks
# column_wise for a small table (one shard at 16 columns, so no memory is spread), which makes a
# sharding of its own beside the table_wise tables, with its own input dist, kernel and output dist:
# bench idspace's managed / hash throughput 0.84 against 0.88-0.89. TorchRec 1.8 fails to build
# table_column_wise at 2 CPU ranks with DTensor state ("Found shape:None, stride:..."). A table's
# sharding_types opts in to either.
_MANAGED_SHARDING = ["table_wise", "row_wise", "table_row_wise"]


def _constraints(config: WorkerConfig) -> dict[str, ParameterConstraints]:
    constraints = {}
    for t in config.features.tables:
        managed = t.id_mapping == "managed"
        if t.sharding_types or t.compute_kernels or managed:
            constraints[t.name] = ParameterConstraints(
                sharding_types=t.sharding_types or (_MANAGED_SHARDING if managed else None),
                compute_kernels=t.compute_kernels or (["fused"] if managed else None),
            )
    return constraints


_OPTIMIZER_STATE_PER_ROW = {"row_wise_adagrad": lambda dim: 1, "adagrad": lambda dim: dim, "sgd": lambda dim: 0}


def plan_table(plan: ShardingPlan, config: WorkerConfig, world_size: int) -> list[dict]:
    """One row per table: how it is sharded, where its shards live, and bytes per rank (fp32
    weights plus the sparse optimizer's state)."""
    rows = []
    state_per_row = _OPTIMIZER_STATE_PER_ROW[config.model.sparse_optimizer]
    shardings = {name: sharding for tables in plan.plan.values() for name, sharding in tables.items()}
    for table in config.features.owned_tables():
        sharding = shardings[table.name]
        shards: list[dict[str, Any]]  # rank, offsets, sizes; then bytes
        if sharding.sharding_spec is None:  # data parallel: a full replica on every rank
            shards = [
                {"rank": r, "offsets": [0, 0], "sizes": [table.num_embeddings, table.embedding_dim]}
                for r in range(world_size)
            ]
        else:
            shards = [
                {"rank": s.placement.rank(), "offsets": list(s.shard_offsets), "sizes": list(s.shard_sizes)}
                for s in sharding.sharding_spec.shards
            ]
        for shard in shards:
            rows_, dim = shard["sizes"]
            shard["bytes"] = 4 * rows_ * (dim + state_per_row(dim))
        rows.append(
            {
                "table": table.name,
                "rows": table.num_embeddings,
                "dim": table.embedding_dim,
                "sharding_type": sharding.sharding_type,
                "compute_kernel": sharding.compute_kernel,
                "shards": shards,
            }
        )
    return rows


def describe_plan(plan: ShardingPlan, config: WorkerConfig, world_size: int) -> str:
    """The plan as a readable table, with the memory each rank needs for its embeddings."""
    tables = plan_table(plan, config, world_size)
    lines = [f"{'table':<22} {'rows x dim':>16}  {'sharding':<18} {'kernel':<17} ranks"]
    per_rank = [0] * world_size
    for t in tables:
        ranks = sorted({s["rank"] for s in t["shards"]})
        for s in t["shards"]:
            per_rank[s["rank"]] += s["bytes"]
        shown = ",".join(map(str, ranks)) if len(ranks) <= 8 else f"{ranks[0]}..{ranks[-1]} ({len(ranks)})"
        lines.append(
            f"{t['table']:<22} {t['rows']:>9,} x {t['dim']:<4}  {t['sharding_type']:<18} "
            f"{t['compute_kernel']:<17} {shown}"
        )
    lines.append("embedding memory per rank (fp32 weights + optimizer state):")
    lines += [f"  rank {r}: {b / 2**20:,.1f} MiB" for r, b in enumerate(per_rank)]
    return "\n".join(lines)


def write_plan_json(plan: ShardingPlan, config: WorkerConfig, world_size: int, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"world_size": world_size, "tables": plan_table(plan, config, world_size)}, indent=2))


def gather_small_gradients(model: torch.nn.Module) -> None:
    """Have each of ``model``'s DDP modules on gloo (DMP's, over the dense layers) average a
    gradient bucket of up to GATHER_SUM_MAX_BYTES by an all-gather and a local sum rather than
    gloo's all-reduce, which costs several times as much at this model's bucket sizes. NCCL keeps
    DDP's own all-reduce.

    The DDP TorchRec wraps a sharded collection's data-parallel tables in keeps gloo's all-reduce:
    TorchRec holds it in a plain list (``ShardedEmbeddingBagCollection._lookups``), which
    ``modules()`` does not walk. Hooked as well, the 2-rank step measured no faster (36.07 ms a
    step against 35.85, 10 rounds alternating in one run, 2026-12-03)."""
    for ddp in model.modules():
        if isinstance(ddp, DistributedDataParallel) and dist.get_backend(ddp.process_group) == "gloo":
            # DDP checks a hook's annotations against the classes, which this module's postponed
            # annotations turn into strings: an unannotated lambda passes.
            ddp.register_comm_hook(ddp.process_group, lambda group, bucket: _gathered_mean(group, bucket))


def _gathered_mean(group: dist.ProcessGroup, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    gradients = bucket.buffer()
    if dist.get_world_size(group) == 1:
        # The mean of one rank's gradients is themselves. A gloo gather of one still costs a
        # collective's round trip through gloo's thread; at 1 rank and 64 events a step it was about
        # a seventh of the step (cProfile, 2026-12-04).
        alone: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        alone.set_result(gradients)
        return alone
    if gradients.numel() * gradients.element_size() > GATHER_SUM_MAX_BYTES:
        return default_hooks.allreduce_hook(group, bucket)
    world_size = dist.get_world_size(group)
    return summing_over_ranks(gradients, group).then(lambda summed: summed.value().div_(world_size))


class DenseOptimizer(KeyedOptimizerWrapper):
    """The dense layers' and data-parallel tables' optimizer, which skips a step in which no rank
    trained an event. Adam moves every parameter with momentum left even where its gradient is zero,
    so the steps of empty batches on every rank (the lockstep's flushes, or its votes on a quiet
    stream) would otherwise go on changing the model with no data. Every rank sees the same global
    batch size, so all skip the same steps."""

    def __init__(self, params: dict[str, torch.Tensor], learning_rate: float, trains_events: Callable[[], bool]):
        super().__init__(params, lambda tensors: dense_adam(tensors, learning_rate))
        self.trains_events = trains_events

    def step(self, closure: Any = None) -> None:
        if self.trains_events():
            super().step(closure)


# Python's collector runs whenever 700 more container objects were made than freed, whichever
# thread made them: the prefetch thread's Kafka messages set it off every batch or so, at a
# different moment on each rank, and the other rank waits out the pause at the step's next
# collective. While training, automatic collection is off and the ranks collect together, every
# GC_INTERVAL_STEPS steps (TorchTitan's ``gc_freq`` does the same), in full every GC_FULL_EVERY-th
# time, for the cycles that outlived two collections.
GC_INTERVAL_STEPS = 50
GC_FULL_EVERY = 100


@contextmanager
def collecting_only_between_steps() -> Iterator[None]:
    """Python's automatic collection off; the training loop collects at its chosen steps."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class Trainer:
    def __init__(self, config: WorkerConfig, env: DistEnv, id_space_metrics: IdSpaceMetrics | None = None):
        self.env = env
        # The loss is scaled by world size over the global batch, which is right only if the
        # sharded tables' all-to-all backward divides their gradients by the world size (as DDP
        # does for data-parallel tables). It is TorchRec's default, a process-wide switch: pin it.
        comm_ops.set_gradient_division(True)
        torch.manual_seed(config.model.seed)
        planner_topology = topology(config, env.world_size, env.device.type, device=env.device)
        if env.rank == 0:
            log.info(
                "training on %s with %d intra-op thread(s) per rank; %s",
                env.device.type,
                torch.get_num_threads(),
                describe_topology(planner_topology),
            )
        model, self.plan = plan_sharding(
            config, env.world_size, env.device.type, dist.group.WORLD, env.device, planner_topology
        )
        self.model = DistributedModelParallel(
            module=model,
            device=env.device,
            plan=self.plan,
            sharders=sharders(),
            # DTensor state lets dcp.async_save stage the sharded tables (ShardedTensor cannot).
            env=ShardingEnv(env.world_size, env.rank, dist.group.WORLD, output_dtensor=True),
        )
        gather_small_gradients(self.model)
        # The batches the pipeline has taken and not yet returned, oldest (the one it trains) first.
        self.taken: deque[ClickBatch] = deque()
        dense_optimizer = DenseOptimizer(
            dict(in_backward_optimizer_filter(self.model.named_parameters())),
            config.model.dense_learning_rate * config.learning_rate_scales(env.world_size)[1],
            # No batch in the pipeline: the zero-gradient step KeyedOptimizer.init_state takes to
            # create the state a restore fills, which must go ahead.
            lambda: not self.taken or self.taken[0].global_batch_size > 0,
        )
        self.optimizer = CombinedOptimizer([self.model.fused_optimizer, dense_optimizer])
        self.pipeline = TrainPipelineSparseDist(
            self.model,
            self.optimizer,
            env.device,
            execute_all_batches=True,
            # Batch i's forward is launched before batch i+2 is fetched: the lockstep's vote and the
            # queue wait then run while the GPU computes, not before it starts.
            enqueue_batch_after_forward=True,
        )
        self.step = 0
        # es_dfm's late share, attached to each batch as the pipeline takes it (restored by the worker)
        self.late_share = LateShare(len(config.tasks())) if config.delayed_labels is not None else None
        # Managed tables get rows from the id space before the pipeline takes each batch, at several
        # ranks once the next batch's exchange brought them, on a thread of its own one batch earlier
        # still with batching.map_ahead; the rows a batch's step gave away start fresh just before
        # that batch's forward pass.
        self.id_space: IdSpace | None = None
        self.map_ahead = False
        # how many batches the trainer takes ahead of the one it trains
        self.lookahead = PIPELINE_LOOKAHEAD
        if managed_tables(config.features):
            group = gloo_group(env.world_size, config.distributed.timeout_seconds)
            # the map runs on this thread between the step's operators: it may take their threads' cores
            threads = torch.get_num_threads()
            id_space = self.id_space = IdSpace(config.features, env.world_size, group, id_space_metrics, threads)
            id_space.resetter = RowResetter(self.model, managed_tables(config.features), config.model.seed)
            self.model.module.register_forward_pre_hook(lambda _module, _args: id_space.before_forward())
            ahead = config.batching.map_ahead
            self.map_ahead = env.device.type == "cuda" if ahead is None else ahead
            self.lookahead += id_space.batches_held(self.map_ahead)

    def train(self, batches: Iterable[ClickBatch]) -> Iterator[StepResult]:
        """Train every batch ``batches`` yields, in order; one result per trained batch."""
        # The pipeline holds up to three batches and returns the output of the oldest, so the
        # batches it has taken and not yet returned form a FIFO beside it.
        taken = self.taken
        taken.clear()
        waited = 0.0

        def waited_for() -> Iterator[ClickBatch]:
            """``batches``, timing the wait for each (the map's time is its own: the id space's metrics)."""
            nonlocal waited
            upstream = iter(batches)
            while True:
                asked = time.perf_counter()
                batch = next(upstream, None)
                waited += time.perf_counter() - asked
                if batch is None:
                    return
                yield batch

        def feed() -> Iterator[ClickBatch]:
            upstream = waited_for()
            if self.id_space is not None:
                upstream = self.id_space.translated(upstream, self.map_ahead)
            for batch in upstream:
                if self.late_share is not None:
                    batch = self.late_share.attach(batch)
                taken.append(batch)
                yield batch

        source = feed()
        with collecting_only_between_steps():
            while True:
                started, waited = time.perf_counter(), 0.0
                try:
                    with profiled("streamtrain.step"):
                        loss_sum, logits, _labels = self.pipeline.progress(source)
                except StopIteration:
                    return
                self.step += 1
                if self.id_space is not None:
                    self.id_space.trained()
                if self.step % GC_INTERVAL_STEPS == 0:
                    gc.collect(2 if self.step % (GC_INTERVAL_STEPS * GC_FULL_EVERY) == 0 else 1)
                readout = StepReadout(loss_sum, logits)
                yield StepResult(self.step, taken.popleft(), readout, time.perf_counter() - started, waited)
