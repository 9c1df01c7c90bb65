"""datapath: Kafka -> decoded, pinned batches for one rank, with no training, at 1, 2, ... decode
threads (batching.decode_threads), in events/s per rank.

Leg A, the decode stage alone: batches of pre-encoded payloads of the synthetic click stream, held
in memory as a fetch delivers them, decoded at each thread count in alternating rounds; wall-clock
rates, and ``scaling_2_threads``, the rate at 2 threads over the rate at 1.

Leg B, the whole path: a local broker with a backlog, read from its start by the worker's own
source and prefetch thread (fetch queue, framing, decode, KJT, pinning when the worker would train
on CUDA) at each thread count in turn, timed from the first batch handed over to the last. Its rate
per decode thread, and the split of the one-thread run's time between decoding and the rest (the
fetch, which stays on the prefetch thread), project a host with more cores: at ``n`` decode threads
the serial rest is paid in full and the decoding divided by ``n``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import uuid
from collections.abc import Callable

from streamtrain.bench.common import SCHEMA, machine, worker_device

GOAL_SCALING = 1.8
GOAL_PROJECTED = 4_000_000
PROJECTED_CORES = 16


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--batch-size",
        type=int,
        default=32_768,
        help="events per batch (default 32,768: a GPU's batch; the data path matters where it trains fast)",
    )
    parser.add_argument("--events", type=int, default=2_000_000, help="backlog read per leg B run (default 2M)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds over the thread counts, per leg (default 3)")
    parser.add_argument(
        "--max-threads",
        type=int,
        default=None,
        help="the most decode threads tried (default: the cores this process may use)",
    )


def run(args: argparse.Namespace, progress: Callable[[str], None]) -> dict:
    from streamtrain.config import load_config

    config = load_config(args.config)
    most = args.max_threads or len(os.sched_getaffinity(0))
    threads = list(range(1, max(2, most) + 1))
    batch_size, events, rounds = (8_192, 50_000, 1) if args.quick else (args.batch_size, args.events, args.rounds)
    decode, scaling = bench_decode_stage(
        config, threads, batch_size, max(events // 4, 8 * batch_size), rounds, progress
    )
    whole = bench_whole_path(config, threads, batch_size, events, rounds, worker_device(args.config), progress)
    by_threads = whole["events_per_second_by_threads"]
    top = max(threads)
    return {
        "benchmark": "datapath",
        "machine": machine(),
        "batch_size": batch_size,
        "threads": threads,
        "decode_events_per_second_by_threads": decode,
        "scaling_2_threads": statistics.median(scaling),
        "scaling_2_threads_by_round": scaling,
        **whole,
        "events_per_second_per_thread": by_threads[str(top)] / top,
        "goal_scaling_2_threads": GOAL_SCALING,
        "goal_projected_events_per_second": GOAL_PROJECTED,
    }


def bench_decode_stage(
    config, threads: list[int], batch_size: int, events: int, rounds: int, progress: Callable[[str], None]
) -> tuple[dict[str, float], list[float]]:
    """Leg A: wall-clock events/s of ``AvroBatchDecoder.decode`` at each thread count over all
    rounds, and each round's rate at 2 threads over its rate at 1. A round's two legs run back to
    back, so a neighbour that takes a core for a while spoils a round, not the median."""
    import numpy as np
    import torch

    from streamtrain.decode import AvroBatchDecoder
    from streamtrain.dev.produce import AvroEncoder, ClickStream, encoded_events
    from streamtrain.source import EventBatch

    torch.set_num_threads(1)
    progress(f"leg A: encoding {events:,} synthetic events")
    encoder = AvroEncoder(config.features.resolved_schema_path())
    payloads = [value for _key, value, _p, _clk in encoded_events(ClickStream(0, 0), encoder, events)]
    batches = []
    for first in range(0, len(payloads), batch_size):
        part = payloads[first : first + batch_size]
        offsets = np.arange(first, first + len(part), dtype=np.int64)
        batches.append(EventBatch.of_values(part, offsets % 4, offsets // 4, []))
    decoders = {n: AvroBatchDecoder(config.features, tasks=config.tasks(), threads=n) for n in threads}
    for decoder in decoders.values():
        decoder.decode(batches[0])  # loads the compiled code; no thread count pays for it
    seconds: dict[int, list[float]] = {n: [] for n in threads}
    for round_ in range(rounds):
        for n, decoder in decoders.items():
            started = time.perf_counter()
            for batch in batches:
                decoder.decode(batch)
            seconds[n].append(time.perf_counter() - started)
            progress(
                f"leg A round {round_ + 1}/{rounds}: {n} thread(s) {len(payloads) / seconds[n][-1]:>12,.0f} events/s"
            )
    rates = {str(n): rounds * len(payloads) / sum(legs) for n, legs in seconds.items()}
    return rates, [one / two for one, two in zip(seconds[1], seconds[2], strict=True)]


def bench_whole_path(
    config,
    threads: list[int],
    batch_size: int,
    events: int,
    rounds: int,
    device: str,
    progress: Callable[[str], None],
) -> dict:
    """Leg B: a broker's backlog through the worker's source and prefetcher at each thread count."""
    from streamtrain.dev.kafka import KafkaBroker
    from streamtrain.dev.produce import produce

    with KafkaBroker() as broker:
        topic = "datapath"
        progress(f"leg B: producing a backlog of {events:,} events")
        produce(broker.bootstrap_servers, topic, events, partitions=4, seed=7, schema_path=SCHEMA)
        runs: dict[int, list[tuple[int, float, float]]] = {n: [] for n in threads}
        for round_ in range(rounds):
            for n in threads:
                read, seconds, decoding = read_backlog(config, broker.bootstrap_servers, topic, n, batch_size, device)
                runs[n].append((read, seconds, decoding))
                progress(f"leg B round {round_ + 1}/{rounds}: {n} thread(s) {read / seconds:>12,.0f} events/s")
    rate = {str(n): sum(r for r, _s, _d in legs) / sum(s for _r, s, _d in legs) for n, legs in runs.items()}
    # The one-thread runs' time per event, split into decoding and the rest.
    events_read = sum(leg[0] for leg in runs[1])
    seconds, decoding = sum(leg[1] for leg in runs[1]), sum(leg[2] for leg in runs[1])
    decode_per_event, rest_per_event = decoding / events_read, (seconds - decoding) / events_read
    spare = PROJECTED_CORES - 2  # decode_threads' default for a CUDA rank alone on the host
    return {
        "events": events,
        "device": device,
        "events_per_second_by_threads": rate,
        "decode_seconds_per_event": decode_per_event,
        "rest_seconds_per_event": rest_per_event,
        "projected_decode_threads": spare,
        "projected_events_per_second": 1 / (rest_per_event + decode_per_event / spare),
        "ceiling_events_per_second": 1 / rest_per_event,
    }


def read_backlog(
    config, bootstrap_servers: str, topic: str, threads: int, batch_size: int, device: str
) -> tuple[int, float, float]:
    """(events handed over after the first batch, seconds from the first batch to the last,
    seconds the prefetch thread spent decoding them) for one read of the whole backlog."""
    import torch

    from streamtrain.batch import Prefetcher
    from streamtrain.deadletter import Rejections
    from streamtrain.decode import AvroBatchDecoder
    from streamtrain.metrics import WorkerMetrics
    from streamtrain.source import KafkaSource

    kafka = config.kafka.model_copy(
        update={"bootstrap_servers": bootstrap_servers, "topic": topic, "group_id": f"datapath-{uuid.uuid4().hex}"}
    )
    batching = config.batching.model_copy(update={"batch_size": batch_size, "decode_threads": threads})
    metrics = WorkerMetrics()
    # The backlog holds no bad event; rank 1, since rank 0 would warn an operator that they are lost.
    rejections = Rejections(config.dead_letter.model_copy(update={"enabled": False}), kafka, metrics, rank=1)
    decoder = AvroBatchDecoder(config.features, tasks=config.tasks(), threads=threads)
    source = KafkaSource(kafka, until_end=True, committed=False)
    prefetcher = Prefetcher(source, decoder, batching, metrics, rejections, device=torch.device(device))
    decoded = metrics.registry.get_sample_value
    try:
        prefetcher.start()
        first = None
        while first is None:
            first = prefetcher.get(timeout=60)
        started, decoding_before = time.perf_counter(), decoded("streamtrain_decode_seconds_sum") or 0.0
        read = 0
        while (batch := prefetcher.get(timeout=60)) is not None:
            read += batch.size
        seconds = time.perf_counter() - started
        if not prefetcher.finished:
            raise RuntimeError("the prefetcher handed nothing over for 60 s before the backlog's end")
        return read, seconds, (decoded("streamtrain_decode_seconds_sum") or 0.0) - decoding_before
    finally:
        prefetcher.join(timeout=30)
        source.close()


def table(result: dict) -> str:
    decode, whole = result["decode_events_per_second_by_threads"], result["events_per_second_by_threads"]
    lines = [
        f"  batches of {result['batch_size']:,}, one rank, no training; whole path on {result['device']}",
        f"  {'decode threads':<16}{'A: decode stage':>18}{'B: Kafka -> batches':>22}{'B per thread':>16}",
    ]
    for n in result["threads"]:
        lines.append(f"  {n:<16}{decode[str(n)]:>18,.0f}{whole[str(n)]:>22,.0f}{whole[str(n)] / n:>16,.0f}")
    lines += [
        f"  decode stage, 2 threads / 1: {result['scaling_2_threads']:.2f}, the median of rounds "
        f"{', '.join(f'{r:.2f}' for r in result['scaling_2_threads_by_round'])} (goal >= {GOAL_SCALING})",
        f"  one thread, per event: decoding {1e9 * result['decode_seconds_per_event']:,.0f} ns, "
        f"the rest (fetch, KJT, hand-over) {1e9 * result['rest_seconds_per_event']:,.0f} ns",
        f"  projected, {PROJECTED_CORES} cores ({result['projected_decode_threads']} decode threads): "
        f"{result['projected_events_per_second']:,.0f} events/s per rank (goal >= {GOAL_PROJECTED:,}); "
        f"ceiling of the serial rest {result['ceiling_events_per_second']:,.0f}",
    ]
    return "\n".join(lines)
