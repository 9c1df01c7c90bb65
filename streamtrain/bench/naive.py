"""The naive baseline of ``bench e2e``: what one writes first, with the same model arithmetic.

Each rank consumes its partitions (``p % world_size == rank``, assigned explicitly, as the worker
does) in the training loop itself: no prefetch thread, no overlap of reading, decoding and
training. Every record is decoded on its own with ``fastavro.schemaless_reader``; features are
gathered into Python lists and turned into tensors per batch. The model is the worker's DLRM
(torchrec's DenseArch and OverArch, the worker's interaction, the same sizes) over one
``nn.EmbeddingBag(sparse=True)`` per table. The dense layers are in DDP; the tables' sparse
gradients are averaged over the ranks by all-gathering the rows each rank touched. torch's Adagrad
updates the tables and the worker's Adam (``dense_adam``) the dense layers. It trains on the
worker's device (``init_distributed`` with the config's ``distributed.device``), and reads the
clock only after the device's work is done.

Ranks stay in step: before each step they all-reduce (events held, finished); a rank without a
batch trains an empty one, so no collective waits forever, and all stop when every rank is done.

Run by ``bench e2e`` as ``python -m streamtrain.bench.naive`` in one process per rank, with
torchrun's environment; it writes ``<record>/rank-<N>.npz`` with ``RunRecorder``, as the worker does.
"""

from __future__ import annotations

import argparse
import io
import time
from pathlib import Path

import fastavro
import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torchrec.models.dlrm import DenseArch, OverArch, choose

from streamtrain.bench.common import clock
from streamtrain.bench.record import RunRecorder
from streamtrain.config import FeaturesConfig, ModelConfig, load_config
from streamtrain.decode import _as_id_array, map_ids
from streamtrain.device import init_distributed
from streamtrain.models.dlrm import FlatInteractionArch
from streamtrain.schema import load_schema, without_logical_types
from streamtrain.train import dense_adam


class NaiveDLRM(nn.Module):
    """torchrec's DLRM arithmetic with one nn.EmbeddingBag per table in place of the EBC."""

    def __init__(self, features: FeaturesConfig, model: ModelConfig):
        super().__init__()
        dim = features.tables[0].embedding_dim
        owned = features.owned_tables()
        self.tables = nn.ModuleList(
            nn.EmbeddingBag(t.num_embeddings, t.embedding_dim, mode=t.pooling, sparse=True) for t in owned
        )
        # Each feature's table: its own, or the one it shares_table_with, as the worker's EBC has it.
        index = {t.name: i for i, t in enumerate(owned)}
        self.table_of_feature = [index[t.shares_table_with or t.name] for t in features.tables]
        for table in self.tables:  # torchrec's default initialisation of EBC tables
            bound = (1.0 / table.num_embeddings) ** 0.5
            nn.init.uniform_(table.weight, -bound, bound)
        n = len(features.tables)
        self.dense_arch = DenseArch(len(features.dense), list(model.dense_arch_layer_sizes))
        self.inter_arch = FlatInteractionArch(num_sparse_features=n)
        self.over_arch = OverArch(dim + choose(n, 2) + n, list(model.over_arch_layer_sizes))

    def forward(self, dense: torch.Tensor, ids: list[torch.Tensor], offsets: list[torch.Tensor]) -> torch.Tensor:
        lookups = zip(self.table_of_feature, ids, offsets, strict=True)
        pooled = torch.stack([self.tables[t](i, o) for t, i, o in lookups], dim=1)
        return self.over_arch(self.inter_arch(self.dense_arch(dense), pooled)).squeeze(-1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--bootstrap-servers", required=True)
    parser.add_argument("--topic", required=True)
    parser.add_argument("--record", type=Path, required=True, help="folder for rank-<N>.npz")
    args = parser.parse_args()

    from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, TopicPartition

    config = load_config(args.config)
    env = init_distributed(
        config.distributed.timeout_seconds, config.distributed.device, config.distributed.intra_op_threads
    )
    rank, world, device = env.rank, env.world_size, env.device
    features, batch_size = config.features, config.batching.batch_size
    schema = fastavro.parse_schema(without_logical_types(load_schema(features.resolved_schema_path())))

    consumer = Consumer(
        {
            "bootstrap.servers": args.bootstrap_servers,
            "group.id": f"naive-{args.topic}",
            "enable.auto.commit": False,
            "enable.partition.eof": True,
            "auto.offset.reset": "earliest",
            "broker.address.family": "v4",
            "fetch.wait.max.ms": 50,
        }
    )
    topic = consumer.list_topics(args.topic, timeout=30).topics[args.topic]
    partitions = [p for p in sorted(topic.partitions) if p % world == rank]
    end = {
        p: consumer.get_watermark_offsets(TopicPartition(args.topic, p), timeout=30, cached=False)[1]
        for p in partitions
    }
    done = {p: end[p] == 0 for p in partitions}
    consumer.assign([TopicPartition(args.topic, p, OFFSET_BEGINNING) for p in partitions])

    torch.manual_seed(config.model.seed)
    naive_model = NaiveDLRM(features, config.model).to(device)
    nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
        naive_model, [name for name, _p in naive_model.named_parameters() if name.startswith("tables.")]
    )
    model = nn.parallel.DistributedDataParallel(
        naive_model, device_ids=[device.index] if device.type == "cuda" else None
    )
    tables = [p for name, p in model.named_parameters() if ".tables." in name]
    dense_params = [p for name, p in model.named_parameters() if ".tables." not in name]
    sparse_optimizer = torch.optim.Adagrad(tables, lr=config.model.sparse_learning_rate)
    dense_optimizer = dense_adam(dense_params, config.model.dense_learning_rate)

    args.record.mkdir(parents=True, exist_ok=True)
    record = RunRecorder(args.record, rank)
    while True:
        # consume up to a batch, or what arrives within max_batch_wait_ms, in the training loop itself
        records: list[dict] = []
        deadline = time.monotonic() + config.batching.max_batch_wait_ms / 1000
        while len(records) < batch_size and not all(done.values()) and time.monotonic() < deadline:
            for message in consume(consumer, batch_size - len(records)):
                partition, offset = message.partition(), message.offset()
                if message.error() is not None:
                    if message.error().code() == KafkaError._PARTITION_EOF and offset >= end[partition]:
                        done[partition] = True
                    continue
                if offset >= end[partition]:  # written after the start: not this run's
                    done[partition] = True
                    continue
                done[partition] = done[partition] or offset == end[partition] - 1
                records.append(decode_record(message.value(), schema))
        votes = torch.tensor([len(records), all(done.values())], dtype=torch.int64)
        dist.all_reduce(votes)
        global_size, finished = votes.tolist()
        if global_size == 0:
            if finished == world:
                break
            continue

        dense, ids, offsets, labels, times = to_tensors(records, features, device)

        sparse_optimizer.zero_grad()
        dense_optimizer.zero_grad()
        logits = model(dense, ids, offsets)
        # the worker's loss: a sum scaled by world size over the global batch (DDP averages over ranks)
        loss = F.binary_cross_entropy_with_logits(logits, labels, reduction="sum") * (world / global_size)
        loss.backward()
        average_sparse_gradients(naive_model.tables, world)
        sparse_optimizer.step()
        dense_optimizer.step()
        applied = clock(device, time.time)
        if not record.step_wall:  # for `bench e2e --profile`: sampling starts after the warm-up
            (args.record / f"rank-{rank}.started").touch()
        record.step_trained(applied, applied - times / 1000.0)

    consumer.close()
    record.close()
    print(
        f"naive rank {rank} stopped after {len(record.step_wall)} steps, {sum(record.step_events):,} events trained "
        f"on {device.type}",
        flush=True,
    )
    dist.destroy_process_group()


def average_sparse_gradients(tables: nn.ModuleList, world: int) -> None:
    """Each table's sparse gradient becomes its mean over the ranks, as DDP would make it: the
    (table, row) keys and gradient rows of every rank are all-gathered, padded to the longest.

    Not DDP's own sparse all-reduce: with gloo it crashed a rank (heap corruption or a segfault in
    backward) in about 1 of 30 quick e2e runs."""
    grads = [table.weight.grad.coalesce() for table in tables]
    keys = torch.cat(
        [torch.stack([torch.full_like(g.indices()[0], t), g.indices()[0]], dim=1) for t, g in enumerate(grads)]
    )
    values = torch.cat([g.values() for g in grads])
    counts = [torch.zeros(1, dtype=torch.int64, device=keys.device) for _ in range(world)]
    dist.all_gather(counts, torch.tensor([len(keys)], device=keys.device))
    longest = max(max(int(c) for c in counts), 1)

    def gather(local: torch.Tensor) -> torch.Tensor:
        padded = local.new_zeros((longest, *local.shape[1:]))
        padded[: len(local)] = local
        out = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(out, padded)
        return torch.cat([o[: int(c)] for o, c in zip(out, counts, strict=True)])

    keys, values = gather(keys), gather(values) / world
    for t, table in enumerate(tables):
        mine = keys[:, 0] == t
        table.weight.grad = torch.sparse_coo_tensor(
            keys[mine, 1].unsqueeze(0), values[mine], table.weight.shape
        ).coalesce()


def consume(consumer, count: int) -> list:
    return consumer.consume(count, timeout=0.1)


def decode_record(value: bytes, schema) -> dict:
    return fastavro.schemaless_reader(io.BytesIO(value), schema, None)


def to_tensors(records: list[dict], features: FeaturesConfig, device: torch.device | None = None):
    """Python lists -> tensors on ``device``: per table the ids and bag offsets, then dense features,
    labels, times (a numpy array)."""
    ids, offsets = [], []
    for table in features.tables:
        flat: list[int] = []
        starts: list[int] = []
        for record in records:
            starts.append(len(flat))
            value = record.get(table.field)
            if isinstance(value, list):
                flat.extend(value)
            elif value is not None:
                flat.append(value)
        ids.append(torch.from_numpy(map_ids(_as_id_array(flat), table)) if flat else torch.zeros(0, dtype=torch.int64))
        offsets.append(torch.tensor(starts, dtype=torch.int64))
    dense = torch.tensor(
        [[_dense(r.get(d.field), d.transform) for d in features.dense] for r in records], dtype=torch.float32
    ).reshape(len(records), len(features.dense))
    labels = torch.tensor([float(r[features.label]) for r in records], dtype=torch.float32)
    times = np.array([r.get(features.event_time) or 0 for r in records], dtype=np.float64)
    if device is not None:
        dense, labels = dense.to(device), labels.to(device)
        ids, offsets = [i.to(device) for i in ids], [o.to(device) for o in offsets]
    return dense, ids, offsets, labels, times


def _dense(value, transform: str) -> float:
    value = 0.0 if value is None else float(value)
    return float(np.log1p(value)) if transform == "log1p" else value


if __name__ == "__main__":
    main()
