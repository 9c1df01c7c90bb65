"""Real ranks train a model through several states, each a committed snapshot, and score held-out
events with their own (sharded) forward at each state: what the delivery tests compare against.

State k is trained by a fresh ``Trainer`` restored from state k-1's snapshot, whose plain DMP
forward (before its pipeline takes over the forward) first scores the held-out events at state
k-1; one more restore scores the last state.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import torch.multiprocessing as mp
import yaml

from conftest import REPO, SCHEMA, join_as_spawned_rank, leave_spawned_rank
from streamtrain.checkpoint import Checkpointer, StreamState, list_snapshots
from streamtrain.config import parse_config
from streamtrain.decode import AvroBatchDecoder
from streamtrain.dev.kafka import free_port
from streamtrain.dev.produce import AvroEncoder, ClickStream, labelled_events
from streamtrain.device import init_distributed
from streamtrain.source import RawEvent
from streamtrain.train import Trainer

GLOBAL_BATCH = 256
HELD_OUT_SEED = 99


def small_config(sharding: dict[str, str] | None = None, tasks: bool = False) -> dict:
    raw = yaml.safe_load((REPO / "tests" / "worker-small.yaml").read_text())
    raw["kafka"] = {"bootstrap_servers": "unused:9092", "topic": "clicks"}
    for table in raw["features"]["tables"]:
        if sharding and table["name"] in sharding:
            table["sharding_types"] = [sharding[table["name"]]]
    if tasks:  # two tasks under mmoe: the heads are exported too
        del raw["features"]["label"]
        raw["model"] |= {
            "tasks": [{"name": "clk", "label": "clk"}, {"name": "buy", "label": "buy", "required": False}],
            "multitask": "mmoe",
            "num_experts": 2,
            "expert_layer_sizes": [16],
        }
    return raw


def held_out(count: int) -> tuple[list[bytes], list[dict]]:
    """Avro payloads and their records, from a seed training never sees."""
    stream, encoder = ClickStream(HELD_OUT_SEED, 0), AvroEncoder(SCHEMA)
    chunk = stream.chunk(4096)
    records = chunk.records[:count]
    return [encoder.encode(r) for r in records], records


def _rank(rank: int, world_size: int, port: int, raw: dict, root: str, batches: list[int], eval_sizes: list[int]):
    join_as_spawned_rank(rank, world_size, port)
    config = parse_config(raw, environ={})
    env = init_distributed()
    decoder = AvroBatchDecoder(config.features, tasks=config.tasks())
    total = sum(batches) * GLOBAL_BATCH
    events = [v for _k, v, _t in labelled_events(ClickStream(7, 0), AvroEncoder(SCHEMA), total)]
    payloads, _records = held_out(max(eval_sizes))
    local = GLOBAL_BATCH // world_size
    step, high_water = 0, 0

    def score(trainer: Trainer, state: int) -> None:
        # rank 0 scores every held-out event; the other ranks take part in the collectives with none
        for size in eval_sizes:
            raw_events = [RawEvent(0, i, p, 0) for i, p in enumerate(payloads[:size])] if rank == 0 else []
            with torch.no_grad():
                _loss, (_sum, logits, _labels) = trainer.model(decoder.decode(raw_events).batch)
            if rank == 0:
                probabilities = torch.sigmoid(logits).reshape(size, -1).numpy()
                np.save(f"{root}/scores-{state}-{size}.npy", probabilities)

    for state, count in enumerate(batches):
        trainer = Trainer(config, env)
        checkpointer = Checkpointer(config.checkpoint, config, trainer.model, trainer.optimizer, rank, world_size, None)
        if state > 0:
            checkpointer.restore()
            score(trainer, state - 1)
        mine = []
        for b in range(step, step + count):
            start = b * GLOBAL_BATCH + rank * local
            raw_events = [RawEvent(0, start + i, v, 0) for i, v in enumerate(events[start : start + local])]
            batch = decoder.decode(raw_events).batch
            high_water = max(high_water, int(batch.event_time_ms.max()))
            mine.append(batch.in_global_step(GLOBAL_BATCH, world_size))
        assert len(list(trainer.train(iter(mine)))) == count
        step += count
        saved = checkpointer.save(StreamState(step, {0: step * GLOBAL_BATCH}, {0: step * GLOBAL_BATCH}, high_water))
        assert saved is not None
    trainer = Trainer(config, env)
    Checkpointer(config.checkpoint, config, trainer.model, trainer.optimizer, rank, world_size, None).restore()
    score(trainer, len(batches) - 1)
    leave_spawned_rank()


def train_states(
    root: Path, world_size: int, raw: dict, batches: list[int], eval_sizes: list[int], keep: int = 10
) -> list[Path]:
    """Trains ``batches[k]`` global batches into state k, each a snapshot under ``root``; returns
    the snapshots' folders, oldest first. ``root/scores-<k>-<size>.npy``: the ranks' probabilities
    for the first ``size`` held-out events at state k."""
    raw = {**raw, "checkpoint": {"path": str(root), "keep_last": keep}}
    mp.spawn(_rank, args=(world_size, free_port(), raw, str(root), batches, eval_sizes), nprocs=world_size)
    snapshots = sorted((Path(s.path) for s in list_snapshots(str(root)) if s.complete), key=lambda p: p.name)
    assert len(snapshots) == len(batches)
    return snapshots


def ranks_scores(root: Path, state: int, size: int) -> np.ndarray:
    return np.load(root / f"scores-{state}-{size}.npy")


def set_delivery(snapshot: Path, chain: int, next_sequence: int) -> None:
    """Writes the ``delivery`` entry a worker with delivery on keeps in a snapshot's stream state."""
    marker = json.loads((snapshot / "streamtrain.json").read_text())
    marker["stream"]["delivery"] = {"chain": chain, "next_sequence": next_sequence}
    (snapshot / "streamtrain.json").write_text(json.dumps(marker))
