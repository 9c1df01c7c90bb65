"""The scale leg of ``bench idspace``: the sharded managed map's memory and time per rank at world
sizes 1, 2 and 4 (real ranks, spawned, over gloo), and the map time per step projected to 8 and 64
ranks at 32k events a rank.

Each world size maps the same global steps of one managed table: --scale-ids ids a step (a Zipf
head over a churning tail, so the table fills and evicts), dealt evenly over the ranks. A rank
times ``IdSpace.map_step`` (its ids sent to their buckets' owners, mapped there, the rows back),
and reports the ids it mapped and the map's bytes. The projection takes the per-id cost, the worst
of the world sizes that fit this host's cores (more ranks than cores time the sharing of a core),
times the ids a rank maps at 32k events a rank (its distinct ids, at most 32k, times the busiest
rank's share over the mean), which stays the same however many ranks there are. A replicated map
would cost every rank the 1-rank time of the whole global step instead.

Beside them, one rank maps the same steps on every core of the host (the map's helper threads,
``IdSpace(threads=...)``), against its one-thread run: ``threaded.speedup``. The projection stays
one thread's.

``ids_per_rank_ratio`` counts what a rank maps: each sender's distinct ids of the owner's buckets,
against the global step's ids over the world size.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from streamtrain.bench.common import local_rank_env

WORLD_SIZES = (1, 2, 4)
EVENTS_PER_RANK = 32_768  # the projection's step: 32k events a rank, one id each per table
MEMORY_GOAL, IDS_GOAL, STEP_SECONDS_GOAL = 1.2, 1.3, 0.001


def global_steps(ids_per_step: int, steps: int, seed: int) -> list[np.ndarray]:
    """Each step's raw ids: a Zipf head that recurs and a tail of ids new to the run."""
    rng = np.random.default_rng(seed)
    out = []
    for step in range(steps):
        head = rng.zipf(1.2, ids_per_step // 2) % 5_000_000
        tail = 10_000_000 + step * ids_per_step + rng.permutation(ids_per_step - head.size)
        out.append(rng.permutation(np.concatenate((head, tail))).astype(np.int64))
    return out


def _rank(rank: int, world_size: int, port: int, features_json: str, steps_json: str, out: str, threads: int) -> None:
    os.environ.update(local_rank_env(rank, world_size, port))
    import torch
    import torch.distributed as dist

    from streamtrain.config import FeaturesConfig
    from streamtrain.idspace import IdSpace

    torch.set_num_threads(1)
    features = FeaturesConfig.model_validate_json(features_json)
    ids_per_step, steps, seed, warmup = json.loads(steps_json)
    if world_size > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
    id_space = IdSpace(features, world_size, None, threads=threads)
    name = id_space.tables[0].name
    seconds, mapped = [], []
    for at, ids in enumerate(global_steps(ids_per_step, steps, seed)):
        own = {name: torch.from_numpy(np.array_split(ids, world_size)[rank])}
        started = time.perf_counter()
        id_space.map_step(own, at)
        if at >= warmup:
            seconds.append(time.perf_counter() - started)
            mapped.append(int(id_space.in_flight[-1].steps[name].rows.numel()))
        id_space.before_forward()
        id_space.trained()
    table = id_space.mapping.tables[name]
    result = {
        "seconds_per_step": float(np.mean(seconds)),
        "ids_per_step": float(np.mean(mapped)),
        "memory_bytes": id_space.memory_bytes(),
        "rows": table.capacity,
        "occupied": table.occupied,
    }
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    if world_size > 1:
        dist.destroy_process_group()


def scale_leg(features: object, ids_per_step: int, steps: int, seed: int, progress) -> dict:
    """``features``: a FeaturesConfig with one managed table."""
    import torch.multiprocessing as mp

    from streamtrain.dev.kafka import free_port

    features_json = features.model_dump_json()  # type: ignore[attr-defined]
    steps_json = json.dumps([ids_per_step, steps, seed, max(2, steps // 5)])

    def spawned(world_size: int, threads: int) -> list[dict]:
        with tempfile.TemporaryDirectory() as out:
            mp.spawn(_rank, args=(world_size, free_port(), features_json, steps_json, out, threads), nprocs=world_size)
            return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world_size)]

    per_world: dict[str, list[dict]] = {}
    for world_size in WORLD_SIZES:
        ranks = per_world[str(world_size)] = spawned(world_size, 1)
        progress(
            f"scale: {world_size} rank(s): map {max(r['seconds_per_step'] for r in ranks) * 1e3:.2f} ms a step, "
            f"{max(r['ids_per_step'] for r in ranks):,.0f} ids and {max(r['memory_bytes'] for r in ranks) / 2**20:.1f} "
            "MiB on the busiest rank"
        )
    cores = os.cpu_count() or 1
    alone = spawned(1, cores)[0]["seconds_per_step"]
    speedup = per_world["1"][0]["seconds_per_step"] / alone
    progress(f"scale: 1 rank on {cores} threads: map {alone * 1e3:.2f} ms a step, {speedup:.2f}x one thread's")
    total = per_world["1"][0]["memory_bytes"]
    memory_ratio = max(r["memory_bytes"] / (total / int(w)) for w, ranks in per_world.items() for r in ranks)
    ids_ratio = max(r["ids_per_step"] / (ids_per_step / int(w)) for w, ranks in per_world.items() for r in ranks)
    # the busiest rank over the mean: how evenly the buckets share the distinct ids
    balance = float(
        max(
            max(r["ids_per_step"] for r in ranks) / np.mean([r["ids_per_step"] for r in ranks])
            for ranks in per_world.values()
        )
    )
    step_seconds = {w: max(r["seconds_per_step"] for r in ranks) for w, ranks in per_world.items()}
    per_id = max(
        r["seconds_per_step"] / r["ids_per_step"]
        for w, ranks in per_world.items()
        if int(w) <= cores
        for r in ranks
        if r["ids_per_step"]
    )
    # at 32k events a rank, a rank maps its share of the distinct ids, at most 32k times the imbalance
    projected = per_id * EVENTS_PER_RANK * balance
    return {
        "ids_per_step": ids_per_step,
        "steps": steps,
        "world_sizes": per_world,
        "memory_per_rank_ratio": memory_ratio,
        "ids_per_rank_ratio": ids_ratio,
        "ids_balance": balance,
        "step_seconds_by_world": step_seconds,
        "seconds_per_id": per_id,
        "projected_step_seconds_8x32k": projected,
        "projected_step_seconds_64x32k": projected,
        "threaded": {"threads": cores, "seconds_per_step": alone, "speedup": speedup},
        "goals": {
            "memory_per_rank_ratio": MEMORY_GOAL,
            "ids_per_rank_ratio": IDS_GOAL,
            "projected_step_seconds_8x32k": STEP_SECONDS_GOAL,
            "memory_met": bool(memory_ratio <= MEMORY_GOAL),
            "ids_met": bool(ids_ratio <= IDS_GOAL),
            "step_seconds_met": bool(projected <= STEP_SECONDS_GOAL),
        },
    }


def lines(scale: dict) -> list[str]:
    goals = scale["goals"]
    return [
        f"  scale: map memory per rank / (total / world) {scale['memory_per_rank_ratio']:.3f} (goal <= "
        f"{goals['memory_per_rank_ratio']}), ids per rank / (global / world) {scale['ids_per_rank_ratio']:.3f} "
        f"(goal <= {goals['ids_per_rank_ratio']})",
        f"  scale: {scale['seconds_per_id'] * 1e9:.0f} ns an id; projected map time a step at 8 (and 64) ranks x 32k "
        f"events: {scale['projected_step_seconds_8x32k'] * 1e3:.3f} ms (goal <= "
        f"{goals['projected_step_seconds_8x32k'] * 1e3:.0f} ms)",
        f"  scale: 1 rank on {scale['threaded']['threads']} threads maps a step {scale['threaded']['speedup']:.2f}x as "
        "fast as on one",
    ]
