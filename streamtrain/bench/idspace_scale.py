"""The scale leg of ``bench idspace``: the sharded managed map's memory and time per rank at world
sizes 1, 2 and 4 (real ranks, spawned, over gloo), its compute per id on one thread and on every
core, and the map time per step projected to 8 ranks at 32k events a rank.

Each world size maps the same global steps of one managed table: --scale-ids ids a step (a Zipf head
over a churning tail, so the table fills and evicts), dealt evenly over the ranks. A rank times
``IdSpace.map_ids`` (its ids sent to their buckets' owners and mapped there, the step before's rows
back), and reports the ids it mapped and the map's bytes. The projection takes the per-id cost, the
worst of the world sizes that fit this host's cores (more ranks than cores time the sharing of a
core), times the ids a rank maps at 32k events a rank (its distinct ids, at most 32k, times the
busiest rank's share over the mean), which stays the same however many ranks there are. A replicated
map would cost every rank the 1-rank time of the whole global step instead.

Beside them, one rank maps the same steps on every core of the host (the map's helper threads,
``IdSpace(threads=...)``), against its one-thread run: ``threaded.speedup``.

Compute per id, robust to a loaded host: at some steps a rank maps the step ``REPEATS`` more times,
each on a copy of its map as it stood, and keeps the least time: ``ns_per_id_one_thread`` is the
one-thread rank's CPU time of its own thread (what another process's time-slices do not add to),
``ns_per_id_threaded`` the rank on every core's wall time. The projection to 8 ranks x 32k events
(``projected_step_seconds_8x32k``) is then two terms:
  - compute (``projected_compute_seconds``): the threaded time per id times the ids a rank maps, at
    most 32k times the busiest rank's share over the mean;
  - exchange (``projected_exchange_seconds``): the bytes a rank sends in the step's all-to-all (each
    distinct id and its count out, padded to the slot, 1.25x; the row of each it was sent the step
    before back: at most 32k of each) over NCCL's all-to-all bandwidth on 8 H100s over NVLink,
    ``NCCL_ALL_TO_ALL_BUS_GB_S`` of bus bandwidth (nccl-tests' busbw, algbw x (n-1)/n for
    all-to-all). It leaves out each all-to-all's fixed latency, and it is NCCL's: the map's exchange
    goes through gloo on the host today.

``ids_per_rank_ratio`` counts what a rank maps: each sender's distinct ids of the owner's buckets,
against the global step's ids over the world size.
"""

from __future__ import annotations

import copy
import json
import os
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from streamtrain.bench.common import local_rank_env

if TYPE_CHECKING:
    from streamtrain.idspace import TableIds

WORLD_SIZES = (1, 2, 4)
EVENTS_PER_RANK = 32_768  # the projection's step: 32k events a rank, one id each per table
PROJECTED_RANKS = 8
MEMORY_GOAL, IDS_GOAL, STEP_SECONDS_GOAL, NS_PER_ID_GOAL = 1.2, 1.3, 0.002, 40.0
# NCCL's effective NVLink bandwidth on H100 for collectives other than all-reduce (all-to-all among
# them), as nccl-tests reports it (busbw): ~370 GB/s of the 450 GB/s line rate, the rest protocol
# overhead (NCCL's maintainer, NVIDIA/nccl-tests issue 212; docs/benchmarks.md).
NCCL_ALL_TO_ALL_BUS_GB_S = 370.0
# bytes a rank sends a step per id it maps: the id and its count out, in a slot padded 1.25x; its row back
BYTES_PER_ID = 2 * 8 * 1.25 + 8
# how often a timed step is mapped again on a copy of the map, the least time kept
REPEATS = 5


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
    from streamtrain.device import keep_freed_heap
    from streamtrain.idspace import IdSpace

    torch.set_num_threads(1)
    keep_freed_heap()  # as a worker's rank does (init_distributed)
    features = FeaturesConfig.model_validate_json(features_json)
    ids_per_step, steps, seed, warmup, repeats = json.loads(steps_json)
    if world_size > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
    id_space = IdSpace(features, world_size, None, threads=threads)
    name = id_space.tables[0].name
    # one thread's own CPU time where the map runs on one thread; else the wall time
    clock = time.thread_time if threads == 1 else time.perf_counter
    seconds, mapped, least = [], [], []
    for at, ids in enumerate(global_steps(ids_per_step, steps, seed)):
        own = {name: torch.from_numpy(np.array_split(ids, world_size)[rank])}
        if world_size == 1 and at >= warmup and repeats:
            tries = []
            for _ in range(repeats):  # the same step on a copy of the map as it stands
                again = _copy_of(id_space.mapping.tables[name])
                started = clock()
                again.update(own[name], id_space.mapping.step + 1, at)
                tries.append(clock() - started)
            least.append(min(tries))
        started = time.perf_counter()
        came_back = id_space.map_ids(own, at)
        if at >= warmup:
            seconds.append(time.perf_counter() - started)
            mapped.append(int(id_space.in_flight[-1].steps[name].rows.numel()))
        if came_back is not None:
            id_space.before_forward()
            id_space.trained()
    id_space.map_ids(None)  # the last step's rows
    table = id_space.mapping.tables[name]
    result = {
        "seconds_per_step": float(np.mean(seconds)),
        "ids_per_step": float(np.mean(mapped)),
        "memory_bytes": id_space.memory_bytes(),
        "rows": table.capacity,
        "occupied": table.occupied,
    }
    if least:
        result["least_seconds_per_id"] = float(np.sum(least) / np.sum(mapped))
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    if world_size > 1:
        dist.destroy_process_group()


def _copy_of(table: TableIds) -> TableIds:
    """A copy of ``table``'s map to map a step on, sharing its threads."""
    copied = copy.copy(table)
    copied.arrays = table.arrays.copy()
    copied.index = copy.copy(table.index)
    copied.index.ids, copied.index.slots = copied.arrays.ids, table.index.slots.copy()
    copied.sketch_totals = table.sketch_totals.copy()
    copied.free_from, copied.victims_kept = table.free_from.copy(), table.victims_kept.copy()
    copied.victim_rows, copied.victim_steps = table.victim_rows.copy(), table.victim_steps.copy()
    return copied


def scale_leg(features: object, ids_per_step: int, steps: int, seed: int, progress) -> dict:
    """``features``: a FeaturesConfig with one managed table."""
    import torch.multiprocessing as mp

    from streamtrain.dev.kafka import free_port

    features_json = features.model_dump_json()  # type: ignore[attr-defined]

    def spawned(world_size: int, threads: int, repeats: int = 0) -> list[dict]:
        steps_json = json.dumps([ids_per_step, steps, seed, max(2, steps // 5), repeats])
        with tempfile.TemporaryDirectory() as out:
            mp.spawn(_rank, args=(world_size, free_port(), features_json, steps_json, out, threads), nprocs=world_size)
            return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world_size)]

    per_world: dict[str, list[dict]] = {}
    for world_size in WORLD_SIZES:
        ranks = per_world[str(world_size)] = spawned(world_size, 1, REPEATS if world_size == 1 else 0)
        progress(
            f"scale: {world_size} rank(s): map {max(r['seconds_per_step'] for r in ranks) * 1e3:.2f} ms a step, "
            f"{max(r['ids_per_step'] for r in ranks):,.0f} ids and {max(r['memory_bytes'] for r in ranks) / 2**20:.1f} "
            "MiB on the busiest rank"
        )
    cores = os.cpu_count() or 1
    on_cores = spawned(1, cores, REPEATS)[0]
    alone = on_cores["seconds_per_step"]
    speedup = per_world["1"][0]["seconds_per_step"] / alone
    one_thread, threaded = per_world["1"][0]["least_seconds_per_id"], on_cores["least_seconds_per_id"]
    progress(
        f"scale: 1 rank on {cores} threads: map {alone * 1e3:.2f} ms a step, {speedup:.2f}x one thread's; "
        f"compute {one_thread * 1e9:.1f} ns an id on one thread, {threaded * 1e9:.1f} on {cores}"
    )
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
    # the whole step as this host runs it (gloo's exchange between ranks sharing its cores included)
    per_id = max(
        r["seconds_per_step"] / r["ids_per_step"]
        for w, ranks in per_world.items()
        if int(w) <= cores
        for r in ranks
        if r["ids_per_step"]
    )
    # at 32k events a rank, a rank maps its share of the distinct ids, at most 32k times the imbalance
    rank_ids = EVENTS_PER_RANK * balance
    compute = threaded * rank_ids
    # nccl-tests' all-to-all: busbw = algbw x (n-1)/n, algbw = the bytes a rank sends / the time
    exchange = rank_ids * BYTES_PER_ID * (PROJECTED_RANKS - 1) / PROJECTED_RANKS / (NCCL_ALL_TO_ALL_BUS_GB_S * 1e9)
    projected = compute + exchange
    return {
        "ids_per_step": ids_per_step,
        "steps": steps,
        "world_sizes": per_world,
        "memory_per_rank_ratio": memory_ratio,
        "ids_per_rank_ratio": ids_ratio,
        "ids_balance": balance,
        "step_seconds_by_world": step_seconds,
        "seconds_per_id": per_id,
        "ns_per_id_one_thread": one_thread * 1e9,
        "ns_per_id_threaded": threaded * 1e9,
        "projected_compute_seconds": compute,
        "projected_exchange_seconds": exchange,
        "projected_step_seconds_8x32k": projected,
        # the model's other reading: this host's whole per-id step, gloo's exchange included, at 32k ids
        "projected_step_seconds_8x32k_as_measured_here": per_id * rank_ids,
        "nccl_all_to_all_bus_gb_s": NCCL_ALL_TO_ALL_BUS_GB_S,
        "threaded": {"threads": cores, "seconds_per_step": alone, "speedup": speedup},
        "goals": {
            "memory_per_rank_ratio": MEMORY_GOAL,
            "ids_per_rank_ratio": IDS_GOAL,
            "projected_step_seconds_8x32k": STEP_SECONDS_GOAL,
            "ns_per_id_one_thread": NS_PER_ID_GOAL,
            "memory_met": bool(memory_ratio <= MEMORY_GOAL),
            "ids_met": bool(ids_ratio <= IDS_GOAL),
            "step_seconds_met": bool(projected <= STEP_SECONDS_GOAL),
            "ns_per_id_met": bool(one_thread * 1e9 <= NS_PER_ID_GOAL),
        },
    }


def lines(scale: dict) -> list[str]:
    goals = scale["goals"]
    memory = (
        f"  scale: map memory per rank / (total / world) {scale['memory_per_rank_ratio']:.3f} (goal <= "
        f"{goals['memory_per_rank_ratio']}), ids per rank / (global / world) {scale['ids_per_rank_ratio']:.3f} "
        f"(goal <= {goals['ids_per_rank_ratio']})"
    )
    threaded = (
        f"  scale: 1 rank on {scale['threaded']['threads']} threads maps a step {scale['threaded']['speedup']:.2f}x as "
        "fast as on one"
    )
    if "ns_per_id_one_thread" not in scale:  # results written before the projection had its two terms
        return [
            memory,
            f"  scale: {scale['seconds_per_id'] * 1e9:.0f} ns an id; projected map time a step at 8 (and 64) ranks "
            f"x 32k events: {scale['projected_step_seconds_8x32k'] * 1e3:.3f} ms (goal <= "
            f"{goals['projected_step_seconds_8x32k'] * 1e3:.0f} ms)",
            threaded,
        ]
    projected, here = scale["projected_step_seconds_8x32k"], scale["projected_step_seconds_8x32k_as_measured_here"]
    return [
        memory,
        f"  scale: map compute {scale['ns_per_id_one_thread']:.1f} ns an id on one thread (goal <= "
        f"{goals['ns_per_id_one_thread']:.0f}: {'met' if goals['ns_per_id_met'] else 'missed'}), "
        f"{scale['ns_per_id_threaded']:.1f} on {scale['threaded']['threads']}",
        f"  scale: projected map time a step at 8 ranks x 32k events: {projected * 1e3:.3f} ms = compute "
        f"{scale['projected_compute_seconds'] * 1e3:.3f} + exchange over NCCL "
        f"{scale['projected_exchange_seconds'] * 1e3:.4f} (goal <= {goals['projected_step_seconds_8x32k'] * 1e3:.0f} "
        f"ms: {'met' if goals['step_seconds_met'] else 'missed'}); as this host maps a step, gloo's exchange "
        f"included, {scale['seconds_per_id'] * 1e9:.0f} ns an id: {here * 1e3:.2f} ms",
        threaded,
    ]
