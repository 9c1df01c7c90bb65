"""The 2-rank leg of ``bench idspace``: the hash and managed legs' events/s at 2 real ranks (spawned
like torchrun's, over gloo), on the plain drifting stream, in alternated rounds.

Both ranks build both legs (the managed leg at the rows the 1-rank legs fitted to the hash leg's
memory), then train the stream a tenth at a time, each tenth by both legs in turn, the order
alternating: a round is one tenth, and its ratio is the hash leg's seconds over the managed
leg's. A global step is 2 x batch_size events, dealt evenly over the ranks; a rank's seconds are
its decoding and training, and a round's are the slower rank's. The first round warms up and is
not counted. ``throughput_ratio_2_ranks`` is the median of the rounds' ratios.

Where the managed leg's time goes, from its id-space metrics (``streamtrain_idspace_*``), per step
and averaged over the ranks, after the warm-up: ``map_seconds_per_step_2_ranks``, the whole map
(exchange included), and ``exchange_seconds_per_step_2_ranks``, its all-to-alls alone; beside
``seconds_per_step_2_ranks``, each leg's decoding and training a step (the slower rank's).
"""

from __future__ import annotations

import pickle
import statistics
import tempfile
import time
from pathlib import Path

from prometheus_client import CollectorRegistry

from streamtrain.bench.ranks import run_ranks

WORLD_SIZE = 2


def two_rank_ratio(legs: dict[str, dict], payloads: list[bytes], rounds: int, progress) -> dict:
    """``legs``: each leg's ``leg_config`` arguments past the raw config (``raw``, the worker
    config as YAML gives it, in each); ``payloads``: the stream's events."""
    with tempfile.TemporaryDirectory(prefix="streamtrain-idspace-") as folder:
        stream = Path(folder, "stream.pickle")
        stream.write_bytes(pickle.dumps(payloads))
        started = time.perf_counter()
        ranks = run_ranks(
            "streamtrain.bench.idspace_ranks:rank_main",
            {"legs": legs, "stream": str(stream), "rounds": rounds},
            world_size=WORLD_SIZE,
            timeout=3600.0,
        )
    seconds = {name: [max(r["seconds"][name][at] for r in ranks) for at in range(rounds)] for name in legs}
    by_round = [hashed / managed for hashed, managed in zip(seconds["hash"][1:], seconds["managed"][1:], strict=True)]
    ratio = statistics.median(by_round)
    steps = sum(ranks[0]["steps"][1:])  # after the warm-up round
    per_step = {name: sum(times[1:]) / steps for name, times in seconds.items()}
    mapping, exchange = (statistics.mean(sum(r[key][1:]) / steps for r in ranks) for key in ("map", "exchange"))
    progress(
        f"2 ranks: managed / hash events/s {ratio:.3f} (median of {len(by_round)} rounds, "
        f"{min(by_round):.3f}-{max(by_round):.3f}) in {time.perf_counter() - started:.0f}s; the map "
        f"{mapping * 1e3:.2f} ms a step, {exchange * 1e3:.2f} ms of it in its all-to-alls"
    )
    events = len(payloads) - len(payloads) // rounds  # after the warm-up round
    return {
        "throughput_ratio_2_ranks": ratio,
        "throughput_ratio_2_ranks_by_round": by_round,
        "events_per_second_2_ranks": {name: events / sum(times[1:]) for name, times in seconds.items()},
        "seconds_per_step_2_ranks": per_step,
        "map_seconds_per_step_2_ranks": mapping,
        "exchange_seconds_per_step_2_ranks": exchange,
    }


def map_seconds(registry: CollectorRegistry) -> tuple[float, float]:
    """The seconds an id space with metrics in ``registry`` has spent so far mapping steps, and in
    its exchanges' all-to-alls (0 without managed tables)."""
    return (
        registry.get_sample_value("streamtrain_idspace_step_seconds_sum") or 0.0,
        registry.get_sample_value("streamtrain_idspace_exchange_seconds_sum") or 0.0,
    )


def rank_main(legs: dict[str, dict], stream: str, rounds: int) -> dict:
    import numpy as np

    from streamtrain.bench.idspace import leg_config
    from streamtrain.decode import AvroBatchDecoder
    from streamtrain.device import init_distributed
    from streamtrain.metrics import IdSpaceMetrics
    from streamtrain.source import RawEvent
    from streamtrain.train import Trainer

    env = init_distributed(device="cpu")
    payloads: list[bytes] = pickle.loads(Path(stream).read_bytes())
    events = [RawEvent(0, offset, value, 0) for offset, value in enumerate(payloads)]
    trainers, decoders, registries = {}, {}, {}
    for name, arguments in legs.items():
        config = leg_config(**arguments)
        registries[name] = CollectorRegistry()
        trainers[name] = Trainer(config, env, IdSpaceMetrics(registries[name]))
        decoders[name] = AvroBatchDecoder(config.features, tasks=config.tasks())
    size = WORLD_SIZE * leg_config(**legs["hash"]).batching.batch_size
    bounds = np.linspace(0, len(events), rounds + 1).astype(int)
    seconds: dict[str, list[float]] = {name: [] for name in legs}
    # the managed leg's, per round
    taken: dict[str, list[float]] = {"steps": [], "map": [], "exchange": []}
    names = list(legs)
    for at in range(rounds):
        part = events[bounds[at] : bounds[at + 1]]
        for turn in range(len(names)):
            name = names[(at + turn) % len(names)]
            before = map_seconds(registries[name])
            started = time.perf_counter()
            steps = [part[i : i + size] for i in range(0, len(part), size)]
            batches = [
                decoders[name].decode(step[env.rank :: WORLD_SIZE]).batch.in_global_step(len(step), WORLD_SIZE)
                for step in steps
            ]
            for _result in trainers[name].train(batches):
                pass
            seconds[name].append(time.perf_counter() - started)
            if name == "managed":
                after = map_seconds(registries[name])
                taken["steps"].append(len(steps))
                taken["map"].append(after[0] - before[0])
                taken["exchange"].append(after[1] - before[1])
    return {"seconds": seconds, **taken}
