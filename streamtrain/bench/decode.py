"""decode: the compiled batch decoder against fastavro's schemaless_reader plus the Python loop that
builds the KJT (the fallback path, and the decoder before it), in alternating rounds in one
process on the same pre-encoded payloads of the synthetic click stream. Rates are per core: torch
is held to one thread, both decoders run on the calling thread, and its CPU time is the clock (wall
clock rates are reported beside them). numba's JIT compile (timed in a fresh process with an empty
cache) and the first compiled call here (loading it from the on-disk cache) are reported on their
own and left out of the rates."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from streamtrain.bench.common import machine


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--events", type=int, default=200_000, help="payloads decoded per round (default 200,000)")
    parser.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="events per decode call (default: the config's batching.batch_size)",
    )
    parser.add_argument("--rounds", type=int, default=5, help="baseline/compiled pairs (default 5)")


def run(args: argparse.Namespace, progress: Callable[[str], None]) -> dict:
    from streamtrain.config import load_config

    config = load_config(args.config)
    events, rounds = (20_000, 2) if args.quick else (args.events, args.rounds)
    result = bench_decode(config, events, args.batch_size or config.batching.batch_size, rounds, progress)
    progress("timing a JIT compile with an empty numba cache")
    return {**result, "cold_compile_seconds": cold_compile_seconds(args.config)}


def cold_compile_seconds(config_path) -> float:
    """The first decode in a fresh process with an empty numba cache: the whole JIT compile."""
    import os
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory(prefix="streamtrain-numba-") as cache:
        out = subprocess.run(
            [
                sys.executable,
                "-c",
                f"from streamtrain.bench.decode import first_decode_seconds; "
                f"print(first_decode_seconds({str(config_path)!r}))",
            ],
            env={**os.environ, "NUMBA_CACHE_DIR": cache},
            capture_output=True,
            text=True,
            check=True,
        )
    return float(out.stdout.split()[-1])


def first_decode_seconds(config_path: str) -> float:
    from streamtrain.config import load_config
    from streamtrain.decode import AvroBatchDecoder
    from streamtrain.dev.produce import AvroEncoder, ClickStream, encoded_events
    from streamtrain.source import RawEvent

    features = load_config(config_path).features
    encoder = AvroEncoder(features.resolved_schema_path())
    events = [
        RawEvent(0, i, value, 0)
        for i, (_key, value, _p, _clk) in enumerate(encoded_events(ClickStream(0, 0), encoder, 8))
    ]
    decoder = AvroBatchDecoder(features)
    started = time.perf_counter()
    decoder.decode(events)
    return time.perf_counter() - started


def bench_decode(config, events: int, batch_size: int, rounds: int, progress: Callable[[str], None]) -> dict:
    import numpy as np
    import torch

    from streamtrain import avro_program
    from streamtrain.decode import AvroBatchDecoder, FastavroDecoder
    from streamtrain.dev.produce import AvroEncoder, ClickStream, encoded_events
    from streamtrain.source import RawEvent

    torch.set_num_threads(1)
    features = config.features
    progress(f"encoding {events:,} synthetic events")
    encoder = AvroEncoder(features.resolved_schema_path())
    payloads = [
        RawEvent(i % 4, i, value, 0)
        for i, (_key, value, _p, _clk) in enumerate(encoded_events(ClickStream(0, 0), encoder, events))
    ]
    batches = [payloads[i : i + batch_size] for i in range(0, len(payloads), batch_size)]

    started = time.perf_counter()
    compiled = AvroBatchDecoder(features)
    build_seconds = time.perf_counter() - started
    started = time.perf_counter()
    first = compiled.decode(batches[0])
    first_call_seconds = time.perf_counter() - started
    baseline = FastavroDecoder(features, wire_checks=False)
    expected = baseline.decode(batches[0])
    assert not first.rejected and not expected.rejected
    assert torch.equal(first.batch.sparse_features.values(), expected.batch.sparse_features.values()), (
        "the two decoders disagree"
    )
    started = time.perf_counter()
    avro_program.compile_program(compiled.reader, compiled.reader, compiled.plan)
    program_seconds = time.perf_counter() - started

    # CPU seconds of this thread, the one doing all the decoding: on a shared machine, wall time
    # also counts the other processes' turns.
    seconds = {"baseline": 0.0, "compiled": 0.0}
    wall = {"baseline": 0.0, "compiled": 0.0}
    for round_ in range(rounds):
        for name, decoder in (("baseline", baseline), ("compiled", compiled)):
            started, cpu_started = time.perf_counter(), time.thread_time()
            for batch in batches:
                decoder.decode(batch)
            leg = time.thread_time() - cpu_started
            seconds[name] += leg
            wall[name] += time.perf_counter() - started
            progress(f"round {round_ + 1}/{rounds}: {name:<8} {len(payloads) / leg:>12,.0f} events/s per core")
    rate = {name: rounds * len(payloads) / s for name, s in seconds.items()}
    wall_rate = {name: rounds * len(payloads) / s for name, s in wall.items()}
    return {
        "benchmark": "decode",
        "machine": machine(),
        "events": len(payloads),
        "batch_size": batch_size,
        "rounds": rounds,
        "features": len(features.tables) + len(features.dense),
        "payload_bytes_mean": float(np.mean([len(e.value or b"") for e in payloads])),
        "baseline_events_per_second": rate["baseline"],
        "compiled_events_per_second": rate["compiled"],
        "ratio": rate["compiled"] / rate["baseline"],
        "device": "cpu",  # decoding runs on the CPU, wherever the worker trains
        "baseline_wall_events_per_second": wall_rate["baseline"],
        "compiled_wall_events_per_second": wall_rate["compiled"],
        "first_call_seconds": first_call_seconds,
        "decoder_setup_seconds": build_seconds,
        "program_build_seconds": program_seconds,
        "program_instructions": compiled.describe().count("\n") + 1,
    }


def table(result: dict) -> str:
    return "\n".join(
        [
            f"  {result['events']:,} events x {result['rounds']} rounds, batches of {result['batch_size']}, "
            f"{result['features']} features, {result['payload_bytes_mean']:.0f} bytes per payload, one core",
            f"  {'':<35}{'events/s per core':>18}{'(wall clock)':>14}",
            f"  {'fastavro + Python loop (baseline)':<35}{result['baseline_events_per_second']:>18,.0f}"
            f"{result['baseline_wall_events_per_second']:>14,.0f}",
            f"  {'compiled program (numba)':<35}{result['compiled_events_per_second']:>18,.0f}"
            f"{result['compiled_wall_events_per_second']:>14,.0f}",
            f"  {'ratio':<35}{result['ratio']:>18.2f}   (goal >= 5)",
            "  JIT compile (empty numba cache, once per machine) "
            f"{result.get('cold_compile_seconds', float('nan')):.1f}s; "
            f"first call here {result['first_call_seconds']:.2f}s (on-disk cache load); both excluded",
            f"  a program for a new writer schema: {1e6 * result['program_build_seconds']:,.0f} us "
            f"({result['program_instructions']} instructions)",
        ]
    )


def markdown(result: dict) -> str:
    return "\n".join(
        [
            f"{result['events']:,} events x {result['rounds']} rounds, batches of {result['batch_size']}, one core.\n",
            "| decoder | events/s | ratio |",
            "|---|---|---|",
            "| fastavro schemaless_reader + Python loop | "
            f"{result['baseline_events_per_second']:,.0f} per core | 1.00 |",
            f"| compiled program (numba) | {result['compiled_events_per_second']:,.0f} per core | "
            f"**{result['ratio']:.2f}** (goal ≥ 5) |",
            f"\nJIT compile with an empty numba cache {result.get('cold_compile_seconds', float('nan')):.1f} s, first "
            f"call with the cache {result['first_call_seconds']:.2f} s (both excluded); a new writer schema's program "
            f"{1e6 * result['program_build_seconds']:,.0f} µs.",
        ]
    )
