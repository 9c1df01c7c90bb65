"""collectives: a sum over 2 gloo ranks by all-gather and a local sum (``device.summed_over_ranks``,
what the small DDP buckets use; the lockstep's vote gathers the same way and sums on the host)
against gloo's all-reduce, at the vote's size, at about the reference model's dense gradient
bucket, and up to and past ``GATHER_SUM_MAX_BYTES`` (256 KiB).

Both ranks call each collective back to back, alternating the two in rounds. Per call: the wall
time (the slower rank's) and the CPU time of the whole process (the caller and gloo's threads),
averaged over the ranks. The ratio is all-reduce over all-gather: above 1, the gather is cheaper.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from streamtrain.bench.common import machine

WORLD_SIZE = 2
# (what it stands for, dtype, elements)
SIZES = [
    # held, flush, stop, finished, the two snapshot questions, and STEPS_PER_VOTE batch sizes
    ("the lockstep's vote", "int64", 10),
    ("a data-parallel table's bucket", "float32", 2_048),
    ("the reference model's dense bucket", "float32", 13_137),
    ("GATHER_SUM_MAX_BYTES", "float32", 65_536),
    ("4x past it", "float32", 262_144),
    ("16x past it", "float32", 1_048_576),
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--calls", type=int, default=200, help="calls per collective, size and round (default 200)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of both collectives (default 3)")


def run(args: argparse.Namespace, progress: Callable[[str], None]) -> dict:
    from streamtrain.bench.ranks import run_ranks

    calls, rounds = (10, 1) if args.quick else (args.calls, args.rounds)
    progress(f"{WORLD_SIZE} gloo ranks, {rounds} round(s) of {calls} calls per collective and size")
    ranks = run_ranks("streamtrain.bench.collectives:rank_main", {"calls": calls, "rounds": rounds}, WORLD_SIZE)
    sizes = []
    for i, (what, dtype, elements) in enumerate(SIZES):
        legs = {}
        for leg in ("all_reduce", "all_gather"):
            seconds = [r[i][leg]["seconds"] for r in ranks]
            cpu = [r[i][leg]["cpu_seconds"] for r in ranks]
            n = calls * rounds
            legs[leg] = {"wall_us": max(seconds) / n * 1e6, "cpu_us": sum(cpu) / len(cpu) / n * 1e6}
        sizes.append(
            {
                "what": what,
                "dtype": dtype,
                "elements": elements,
                "bytes": elements * 8 if dtype == "int64" else elements * 4,
                "legs": legs,
                "wall_ratio": legs["all_reduce"]["wall_us"] / legs["all_gather"]["wall_us"],
                "cpu_ratio": legs["all_reduce"]["cpu_us"] / legs["all_gather"]["cpu_us"],
            }
        )
    return {
        "benchmark": "collectives",
        "machine": machine(),
        "ranks": WORLD_SIZE,
        "calls": calls,
        "rounds": rounds,
        "sizes": sizes,
    }


def rank_main(calls: int, rounds: int) -> list[dict]:
    import time

    import torch
    import torch.distributed as dist

    from streamtrain.device import init_distributed, summed_over_ranks

    init_distributed(threads=1)
    result: list[dict] = [
        {leg: {"seconds": 0.0, "cpu_seconds": 0.0} for leg in ("all_reduce", "all_gather")} for _ in SIZES
    ]
    for round_ in range(rounds + 1):  # round 0 warms up
        for i, (_what, dtype, elements) in enumerate(SIZES):
            tensor = torch.ones(elements, dtype=getattr(torch, dtype))
            for leg in ("all_reduce", "all_gather"):
                dist.barrier()
                wall, cpu = time.perf_counter(), time.process_time()
                for _ in range(calls):
                    if leg == "all_reduce":
                        dist.all_reduce(tensor.clone())
                    else:
                        summed_over_ranks(tensor, None)
                if round_:
                    result[i][leg]["seconds"] += time.perf_counter() - wall
                    result[i][leg]["cpu_seconds"] += time.process_time() - cpu
    return result


def table(result: dict) -> str:
    lines = [
        f"  {result['ranks']} gloo ranks, {result['rounds']} round(s) of {result['calls']} calls per collective and "
        "size; per call: wall (slower rank), CPU (whole process, mean of ranks)",
        f"  {'size':<54} {'all-reduce':>20} {'all-gather + sum':>20} {'ratio (wall, CPU)':>18}",
    ]
    for s in result["sizes"]:
        reduce, gather = s["legs"]["all_reduce"], s["legs"]["all_gather"]
        size = f"{s['elements']:,} {s['dtype']} ({s['what']})"
        lines.append(
            f"  {size:<54} {reduce['wall_us']:>8,.0f} / {reduce['cpu_us']:>6,.0f} µs "
            f"{gather['wall_us']:>8,.0f} / {gather['cpu_us']:>6,.0f} µs {s['wall_ratio']:>8.2f} {s['cpu_ratio']:>8.2f}"
        )
    return "\n".join(lines)


def markdown(result: dict) -> str:
    lines = [
        f"{result['ranks']} gloo ranks, {result['rounds']} rounds of {result['calls']} calls per collective and size; "
        "per call, the slower rank's wall time and each process's CPU (gloo's threads included).\n",
        "| size | all-reduce: wall, CPU | all-gather + sum: wall, CPU | ratio: wall, CPU |",
        "|---|---|---|---|",
    ]
    for s in result["sizes"]:
        reduce, gather = s["legs"]["all_reduce"], s["legs"]["all_gather"]
        lines.append(
            f"| {s['elements']:,} {s['dtype']} ({s['what']}) | {reduce['wall_us']:,.0f} µs, {reduce['cpu_us']:,.0f} µs "
            f"| {gather['wall_us']:,.0f} µs, {gather['cpu_us']:,.0f} µs | **{s['wall_ratio']:.2f}**, "
            f"**{s['cpu_ratio']:.2f}** |"
        )
    return "\n".join(lines)
