"""pipeline: TrainPipelineSparseDist (the worker's) against TrainPipelineBase, at --ranks ranks (2).

Two trainers of the configured model on each of the gloo ranks, identical but for the pipeline,
train the same pre-built in-memory batches in alternating legs of --steps steps; the first round
warms up and is not counted. TrainPipelineSparseDist starts batch i+1's input all-to-all before
batch i's forward; TrainPipelineBase runs input distribution, forward and backward in turn.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from streamtrain.bench.common import machine, rate_text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ranks", type=int, default=2, choices=(1, 2), help="ranks (default 2)")
    parser.add_argument("--steps", type=int, default=150, help="steps per leg (default 150)")
    parser.add_argument("--rounds", type=int, default=3, help="counted rounds of both legs (default 3)")


def run(args: argparse.Namespace, progress: Callable[[str], None]) -> dict:
    from streamtrain.bench.ranks import run_ranks

    steps, rounds = (10, 1) if args.quick else (args.steps, args.rounds)
    progress(f"{args.ranks} rank(s), {rounds} counted round(s) of {steps} steps per pipeline, after one warm-up round")
    ranks = run_ranks(
        "streamtrain.bench.pipeline:rank_main",
        {"config": str(args.config), "steps": steps, "rounds": rounds},
        args.ranks,
    )
    legs = {}
    for name in ("base", "sparse_dist"):
        # every rank trains the same number of events; the slowest rank's time is the step time
        seconds = max(sum(r[name]["seconds"]) for r in ranks)
        events = sum(sum(r[name]["events"]) for r in ranks)
        legs[name] = {
            "events": events,
            "seconds": seconds,
            "events_per_second": events / seconds,
            "device": ranks[0]["device"],
            "rounds_events_per_second": [
                sum(r[name]["events"][i] for r in ranks) / max(r[name]["seconds"][i] for r in ranks)
                for i in range(rounds)
            ],
        }
    return {
        "benchmark": "pipeline",
        "machine": machine(),
        "config": str(args.config),
        "ranks": args.ranks,
        "batch_size": ranks[0]["batch_size"],
        "steps_per_leg": steps,
        "rounds": rounds,
        "legs": legs,
        "ratio": legs["sparse_dist"]["events_per_second"] / legs["base"]["events_per_second"],
    }


def rank_main(config: str, steps: int, rounds: int) -> dict:
    from torchrec.distributed.train_pipeline import TrainPipelineBase

    from streamtrain.bench.common import clock, synthetic_batches, train_for
    from streamtrain.config import load_config
    from streamtrain.device import init_distributed
    from streamtrain.train import Trainer

    worker_config = load_config(config)
    env = init_distributed(device=worker_config.distributed.device, threads=worker_config.distributed.intra_op_threads)
    batches = synthetic_batches(worker_config, 16, seed=env.rank)
    trainers = {"sparse_dist": Trainer(worker_config, env), "base": Trainer(worker_config, env)}
    base = trainers["base"]
    result: dict = {
        "batch_size": worker_config.batching.batch_size,
        "device": env.device.type,
        **{name: {"events": [], "seconds": []} for name in trainers},
    }
    for round_ in range(rounds + 1):  # round 0 warms up
        for name, trainer in trainers.items():
            if name == "base":  # TrainPipelineBase does not restart after its iterator ended
                base.pipeline = TrainPipelineBase(base.model, base.optimizer, env.device)
            started = clock(env.device)
            leg = train_for(trainer, batches, steps=steps)
            if round_:
                result[name]["events"].append(leg.events)
                result[name]["seconds"].append(clock(env.device) - started)
    return result


def table(result: dict) -> str:
    legs = result["legs"]
    return "\n".join(
        [
            f"  {result['ranks']} ranks, batch {result['batch_size']} per rank, {result['rounds']} round(s) of "
            f"{result['steps_per_leg']} steps per pipeline, warm-up round excluded",
            f"  TrainPipelineBase        {legs['base']['events_per_second']:>12,.0f} events/s  "
            f"on {legs['base'].get('device', '-')}",
            f"  TrainPipelineSparseDist  {legs['sparse_dist']['events_per_second']:>12,.0f} events/s  "
            f"on {legs['sparse_dist'].get('device', '-')}",
            f"  ratio                    {result['ratio']:>12.2f}",
        ]
    )


def markdown(result: dict) -> str:
    legs = result["legs"]
    return "\n".join(
        [
            f"{result['ranks']} ranks, {result['rounds']} rounds of {result['steps_per_leg']} steps each.\n",
            "| pipeline | events/s | ratio |",
            "|---|---|---|",
            f"| TrainPipelineBase | {rate_text(legs['base']['events_per_second'])} | 1.00 |",
            f"| TrainPipelineSparseDist | {rate_text(legs['sparse_dist']['events_per_second'])} | "
            f"**{result['ratio']:.2f}** |",
        ]
    )
