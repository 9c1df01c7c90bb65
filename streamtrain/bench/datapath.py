"""datapath: Kafka -> decoded, pinned batches for one rank, with no training, at 1, 2, ... decode
threads (batching.decode_threads), in events/s per rank.

Leg A, the decode stage alone: batches of pre-encoded payloads of the synthetic click stream, held
in memory as a fetch delivers them, decoded at each thread count in alternating rounds; wall-clock
rates, and ``scaling_2_threads``, the median over rounds of the rate at 2 threads over the rate at 1.

Leg B, the whole path: a local broker with a backlog, read from its start by the worker's own
source and prefetch thread (fetch queue, framing, decode, KJT, pinning when the worker would train
on CUDA) at each thread count in turn, timed from the first batch handed over to the last. Beside
its wall-clock rate, the CPU the rank's data-path threads used per event (``/proc``): the prefetch
thread, the decode helpers and librdkafka's threads. A host with more cores and its broker
elsewhere is projected from that CPU, not from this host's wall clock, which waits on a broker
sharing the cores: at ``n`` decode threads the prefetch thread pays its serial rest in full and the
decoding divided by ``n``, and librdkafka's busiest thread is a bound of its
own.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from streamtrain.bench.common import SCHEMA, machine, worker_device
from streamtrain.threads import DECODE, PREFETCH

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
    """Leg B: a broker's backlog through the worker's source and prefetcher at each thread count.

    Beside the wall-clock rate, the CPU each of the rank's data-path threads spent (``/proc``), per
    event: what a host with more cores, and its broker elsewhere, can project from. On this host
    the rate waits on a broker sharing the cores; the CPU is the rank's own work."""
    from streamtrain.dev.kafka import KafkaBroker
    from streamtrain.dev.produce import produce

    with KafkaBroker() as broker:
        topic = "datapath"
        progress(f"leg B: producing a backlog of {events:,} events")
        produce(broker.bootstrap_servers, topic, events, partitions=4, seed=7, schema_path=SCHEMA)
        runs: dict[int, list[BacklogRead]] = {n: [] for n in threads}
        for round_ in range(rounds):
            for n in threads:
                read = read_backlog(config, broker.bootstrap_servers, topic, n, batch_size, device)
                runs[n].append(read)
                progress(
                    f"leg B round {round_ + 1}/{rounds}: {n} thread(s) {read.events / read.seconds:>12,.0f} events/s"
                )
    totals = {n: BacklogRead.summed(legs) for n, legs in runs.items()}
    one = totals[1]
    decoding = one.decoding / one.events
    # The prefetch thread's own work besides decoding: the fetch from librdkafka's queue, the
    # payloads' copy, the KJT and the hand-over. It stays on that one thread at any decode_threads.
    serial = (one.cpu[PREFETCH] - one.decoding) / one.events
    # librdkafka fetches on one thread per broker: a bound of its own, beside the prefetch thread.
    fetch = one.busiest_librdkafka / one.events
    spare = PROJECTED_CORES - 2  # decode_threads' default for a CUDA rank alone on the host
    return {
        "events": events,
        "device": device,
        "events_per_second_by_threads": {str(n): t.events / t.seconds for n, t in totals.items()},
        "events_per_cpu_second_by_threads": {str(n): t.events / sum(t.cpu.values()) for n, t in totals.items()},
        "cpu_seconds_per_event_by_threads": {
            str(n): {group: cpu / t.events for group, cpu in t.cpu.items()} for n, t in totals.items()
        },
        "decode_seconds_per_event": decoding,
        "rest_seconds_per_event": one.seconds / one.events - decoding,
        "serial_cpu_seconds_per_event": serial,
        "librdkafka_thread_cpu_seconds_per_event": fetch,
        "projected_decode_threads": spare,
        "projected_events_per_second": 1 / max(serial + decoding / spare, fetch),
        "ceiling_events_per_second": 1 / max(serial, fetch),
    }


@dataclass
class BacklogRead:
    """One read of the backlog, timed from the first batch handed over to the last."""

    events: int  # handed over after the first batch
    seconds: float
    cpu: dict[str, float]  # CPU-seconds by thread group (DATA_PATH_GROUPS), in the same window
    decoding: float  # CPU-seconds of the prefetch thread's in its decoder calls, at the window's rate
    busiest_librdkafka: float  # CPU-seconds of librdkafka's busiest thread (its broker thread)

    @staticmethod
    def summed(reads: list[BacklogRead]) -> BacklogRead:
        return BacklogRead(
            sum(r.events for r in reads),
            sum(r.seconds for r in reads),
            {group: sum(r.cpu[group] for r in reads) for group in DATA_PATH_GROUPS},
            sum(r.decoding for r in reads),
            sum(r.busiest_librdkafka for r in reads),
        )


# The rank's data-path threads by kernel name (streamtrain.threads; librdkafka's are rdk:*).
DATA_PATH_GROUPS = (PREFETCH, DECODE, "librdkafka")


def _cpu_by_thread() -> dict[int, tuple[str, float]]:
    """{tid: (group, CPU-seconds so far)} of this process's data-path threads, to the nanosecond
    (``schedstat``'s run time: ``stat``'s 10-ms ticks would round a short leg's helpers to 0)."""
    groups = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            name = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
            ran_ns = int(Path(f"/proc/self/task/{tid}/schedstat").read_text().split()[0])
        except OSError:  # the thread ended between the listing and the read
            continue
        group = "librdkafka" if name.startswith("rdk:") else name
        if group in DATA_PATH_GROUPS:
            groups[int(tid)] = (group, ran_ns / 1e9)
    return groups


def read_backlog(config, bootstrap_servers: str, topic: str, threads: int, batch_size: int, device: str) -> BacklogRead:
    """One read of the whole backlog by a fresh source and prefetcher with ``threads`` decode threads."""
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
    decoder = _CpuTimed(AvroBatchDecoder(config.features, tasks=config.tasks(), threads=threads))
    source = KafkaSource(kafka, until_end=True, committed=False)
    # the worker's decoder, its decode calls timed: the Prefetcher calls nothing else of it
    prefetcher = Prefetcher(
        source, cast(AvroBatchDecoder, decoder), batching, metrics, rejections, device=torch.device(device)
    )
    try:
        prefetcher.start()
        first = None
        while first is None:
            first = prefetcher.get(timeout=60)
        started, cpu_before = time.perf_counter(), _cpu_by_thread()
        read = 0
        while (batch := prefetcher.get(timeout=60)) is not None:
            read += batch.size
        seconds, cpu_after = time.perf_counter() - started, _cpu_by_thread()
        if not prefetcher.finished:
            raise RuntimeError("the prefetcher handed nothing over for 60 s before the backlog's end")
    finally:
        prefetcher.join(timeout=30)
        source.close()
    # A thread that started inside the window counts from 0; one that ended in it is not seen after.
    used = {tid: (group, cpu - cpu_before.get(tid, (group, 0.0))[1]) for tid, (group, cpu) in cpu_after.items()}
    cpu = {group: sum(c for g, c in used.values() if g == group) for group in DATA_PATH_GROUPS}
    busiest = max((c for g, c in used.values() if g == "librdkafka"), default=0.0)
    # The prefetch thread ends with the backlog, often before the window's last reading can see
    # it: its CPU comes from its own clock instead, at the window's rate per event.
    events, prefetch_cpu, decoding = decoder.steady_state()
    cpu[PREFETCH] = prefetch_cpu * read / events
    return BacklogRead(read, seconds, cpu, decoding * read / events, busiest)


class _CpuTimed:
    """A decoder that notes when, on its caller's (the prefetch thread's) CPU clock, each call ran."""

    def __init__(self, decoder):
        self.decoder, self.calls = decoder, []

    def decode(self, events):
        started = time.thread_time()
        try:
            return self.decoder.decode(events)
        finally:
            self.calls.append((started, time.thread_time(), len(events)))

    def steady_state(self) -> tuple[int, float, float]:
        """(events, the prefetch thread's CPU-seconds, those of them in decode calls) from the end
        of its first decode call to the end of its last: the consumer's start-up left out."""
        (_, first_ended, _), *rest = self.calls
        return sum(n for *_, n in rest), rest[-1][1] - first_ended, sum(end - began for began, end, _ in rest)


def table(result: dict) -> str:
    decode, whole = result["decode_events_per_second_by_threads"], result["events_per_second_by_threads"]
    per_cpu = result["events_per_cpu_second_by_threads"]
    lines = [
        f"  batches of {result['batch_size']:,}, one rank, no training; whole path on {result['device']}",
        f"  {'decode threads':<16}{'A: decode stage':>18}{'B: Kafka -> batches':>22}{'B per thread':>16}"
        f"{'B per CPU-second':>19}",
    ]
    for n in result["threads"]:
        a, b, c = decode[str(n)], whole[str(n)], per_cpu[str(n)]
        lines.append(f"  {n:<16}{a:>18,.0f}{b:>22,.0f}{b / n:>16,.0f}{c:>19,.0f}")
    ns = {key: f"{1e9 * result[key]:,.0f} ns" for key in result if key.endswith("seconds_per_event")}
    lines += [
        f"  decode stage, 2 threads / 1: {result['scaling_2_threads']:.2f}, the median of rounds "
        f"{', '.join(f'{r:.2f}' for r in result['scaling_2_threads_by_round'])} (goal >= {GOAL_SCALING})",
        f"  one thread, per event: decoding {ns['decode_seconds_per_event']} of CPU; wall-clock rest "
        f"{ns['rest_seconds_per_event']} (mostly waiting on the broker beside it); CPU of the prefetch "
        f"thread's serial rest (fetch, copy, KJT, hand-over) {ns['serial_cpu_seconds_per_event']}; "
        f"librdkafka's busiest thread {ns['librdkafka_thread_cpu_seconds_per_event']}",
        f"  projected from the CPU, {PROJECTED_CORES} cores ({result['projected_decode_threads']} decode threads, "
        f"the broker elsewhere): {result['projected_events_per_second']:,.0f} events/s per rank "
        f"(goal >= {GOAL_PROJECTED:,}); ceiling of the serial threads {result['ceiling_events_per_second']:,.0f}",
    ]
    return "\n".join(lines)
