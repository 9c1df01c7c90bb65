"""Benchmarks run in quick mode once, to prove they work; their figures are judged by people, not here."""

import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from conftest import REPO, SMALL_CONFIG
from streamtrain.bench.cpu import GROUPS, CpuSample, CpuSampler, cpu_per_event, stolen_seconds


@pytest.fixture(autouse=True)
def results_in_tmp(tmp_path, monkeypatch):
    """Quick runs write their JSON to a temporary folder, never over the results a report shows."""
    monkeypatch.setenv("STREAMTRAIN_BENCH_RESULTS", str(tmp_path / "results"))


def _run_bench(*args: str, timeout: float = 300) -> tuple[dict, str]:
    """``streamtrain bench ARGS``, which must succeed: the JSON it saved, and what it printed."""
    result = subprocess.run(
        [sys.executable, "-m", "streamtrain", "bench", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(Path(result.stdout.split("results: ")[1].strip()).read_text()), result.stdout


def _bench(*args: str, timeout: float = 300) -> dict:
    return _run_bench(*args, timeout=timeout)[0]


def test_checkpoint_benchmark_runs_and_reports_a_ratio_and_its_device(tmp_path):
    saved, printed = _run_bench("checkpoint", "--quick", "--config", str(SMALL_CONFIG))
    assert "ratio" in printed
    assert saved["snapshots"] >= 1 and saved["baseline_events_per_second"] > 0 and saved["ratio"] > 0
    assert saved["device"] == "cpu" and "both legs on cpu" in printed
    assert saved["intra_op_threads"] >= 1 and f"{saved['intra_op_threads']} intra-op thread(s)" in printed


def test_train_step_benchmark_runs_both_paths_on_the_workers_device_and_reports_a_ratio():
    saved, printed = _run_bench("train-step", "--quick")
    (row,) = saved["sizes"]
    assert row["per_feature_events_per_second"] > 0 and row["fused_events_per_second"] > 0
    assert row["ratio"] == row["fused_events_per_second"] / row["per_feature_events_per_second"]
    assert row["device"] == "cpu" and saved["machine"]["device"] == "cpu"  # fbgemm-gpu-cpu: CPU, GPU or not
    assert re.search(r"B=512 F=4 D=8 rows=10,000 +cpu ", printed)


def test_kernels_benchmark_times_each_kernel_against_the_default_it_replaces():
    saved, printed = _run_bench("kernels", "--quick")
    assert set(saved["kernels"]) == {"interaction", "sharded_order", "dense_adam"}
    for kernel in saved["kernels"].values():
        assert kernel["default_us"] > 0 and kernel["ours_us"] > 0
        assert kernel["ratio"] == kernel["default_us"] / kernel["ours_us"]
    assert "torchrec InteractionArch" in printed and "FlatInteractionArch" in printed
    assert "torchrec SparseArch, InteractionArch" in printed and "KeyedSparseArch, KeyedInteractionArch" in printed


def test_collectives_benchmark_times_both_sums_at_every_size_on_two_ranks():
    saved, printed = _run_bench("collectives", "--quick")
    assert saved["ranks"] == 2
    assert saved["sizes"][0]["elements"] == 10  # the vote's size leads
    for size in saved["sizes"]:
        for leg in ("all_reduce", "all_gather"):
            assert size["legs"][leg]["wall_us"] > 0 and size["legs"][leg]["cpu_us"] > 0
        assert size["wall_ratio"] > 0 and size["cpu_ratio"] > 0
    assert "the lockstep's vote" in printed


@pytest.mark.integration  # starts its own broker
def test_memory_benchmark_samples_the_workers_rss(tmp_path):
    """Its worker snapshots into a folder of the run's own: under the config's checkpoint.path, the
    next run would resume from this run's positions in the topic of the same name."""
    raw = yaml.safe_load(SMALL_CONFIG.read_text())
    raw["checkpoint"] = {"path": str(tmp_path / "configured"), "interval_steps": 5}
    config = tmp_path / "worker.yaml"
    config.write_text(yaml.safe_dump(raw))
    saved = _bench("memory", "--quick", "--config", str(config))
    assert len(saved["samples"]) >= 10 and all(rss > 0 for _t, rss in saved["samples"])
    assert "events trained" in saved["worker_summary"]
    assert not (tmp_path / "configured").exists()


@pytest.mark.integration  # starts its own broker
def test_e2e_benchmark_trains_the_topic_with_the_worker_the_naive_loop_and_the_limit_on_one_device():
    saved = _bench("e2e", "--quick", "--config", str(SMALL_CONFIG))
    legs = saved["legs"]
    assert len(saved["rounds"]) == 1 and saved["rounds"][0]["legs"]["worker"]["total_events"] == saved["events"]
    assert set(legs) == {"worker", "naive", "limit"}
    for name in ("worker", "naive"):  # both trained every event of the topic
        assert legs[name]["total_events"] == saved["events"], (name, legs[name])
    assert all(leg["events_per_second"] > 0 and leg["events"] > 0 for leg in legs.values())
    assert saved["worker_over_naive"] > 0 and saved["worker_over_limit"] > 0
    # the limit's ranks train the shares the topic's partitions hold, not equal ones
    assert sum(saved["rank_events"]) == saved["events"] and len(set(saved["rank_events"])) == 2
    assert {leg["device"] for leg in legs.values()} == {"cpu"}
    assert saved["machine"]["cores"] and saved["machine"]["torchrec"]
    # CPU per trained event, every thread of both ranks, split by thread; the broker apart
    worker, limit = legs["worker"]["cpu"], legs["limit"]["cpu"]
    assert saved["rounds"][0]["cpu_per_event_ratio"] == worker["cpu_seconds_per_event"] / limit["cpu_seconds_per_event"]
    for cpu in (worker, limit):
        assert set(cpu["by_thread"]) == set(GROUPS)
        assert cpu["cpu_seconds_per_event"] == pytest.approx(
            sum(g["cpu_seconds_per_event"] for g in cpu["by_thread"].values())
        )
        assert cpu["by_thread"]["trainer"]["cpu_seconds_per_event"] > 0
        assert 0 <= cpu["trainer_waiting_share"] < 1
    assert worker["by_thread"]["prefetch"]["cpu_seconds_per_event"] > 0
    assert worker["broker_cpu_seconds_per_event"] > 0  # the broker served the worker's fetches
    assert limit["by_thread"]["librdkafka"]["cpu_seconds_per_event"] == 0  # no Kafka in the limit
    assert len(saved["loadavg"]["before"]) == len(saved["loadavg"]["after"]) == 3


def test_e2e_rounds_report_each_rounds_ratios_and_their_median():
    """``bench e2e --rounds N`` (not run here: three legs a round cost CI a minute): each round's
    ratios from its legs, their median on top, each round listed in the table and the markdown."""
    from streamtrain.bench.common import spread
    from streamtrain.bench.e2e import RATIOS, _median, markdown, ratios, table

    def leg(rate: float, cpu_us: float) -> dict:
        by_thread = {
            g: {"cpu_seconds_per_event": cpu_us * 1e-6 / len(GROUPS), "share": 1 / len(GROUPS),
                "waiting_for_a_core_seconds_per_event": 1e-6}
            for g in GROUPS
        }  # fmt: skip
        cpu = {"cpu_seconds_per_event": cpu_us * 1e-6, "cores_busy": 1.5, "by_thread": by_thread,
               "broker_cpu_seconds_per_event": 1e-6, "broker_cores_busy": 0.1,
               "trainer_waiting_share": 0.07}  # fmt: skip
        return {"events_per_second": rate, "events": 1, "seconds": 1.0, "total_events": 10, "device": "cpu", "cpu": cpu}

    rounds = [
        ratios({"worker": leg(w, wc), "naive": leg(n, 60), "limit": leg(lim, 30)})
        for w, wc, n, lim in [(40, 36, 20, 50), (60, 33, 40, 70), (30, 39, 18, 40)]
    ]
    assert [r["worker_over_naive"] for r in rounds] == [2.0, 1.5, 30 / 18]
    assert [r["cpu_per_event_ratio"] for r in rounds] == pytest.approx([1.2, 1.1, 1.3])
    result = {
        "events": 30, "partitions": 4, "ranks": 2, "warm_up_seconds": 5, "rank_events": [10, 20],
        "legs": {"worker": leg(40, 36), "naive": leg(20, 60), "limit": leg(50, 30)}, "rounds": rounds,
        **{key: _median([r[key] for r in rounds]) for key in RATIOS},
        "spread": {key: spread([r[key] for r in rounds]) for key in RATIOS},
    }  # fmt: skip
    assert result["worker_over_limit"] == 0.8 and result["cpu_per_event_ratio"] == pytest.approx(1.2)
    assert _median([1.0, None]) is None  # a round without the leg: no ratio, not a median of the others
    printed = table(result)
    assert "round 3: worker / naive 1.67, worker / limit 0.75" in printed
    assert "worker / naive = 1.67   (goal >= 2: missed)   median of 3 rounds, 1.50-2.00, IQR 1.58-1.83" in printed
    assert "worker / limit = 0.80   (goal >= 0.8: met)" in printed
    shown_as_the_goal = table({**result, "worker_over_limit": 0.797, "cpu_per_event_ratio": 1.204})
    assert "worker / limit = 0.80   (goal >= 0.8: missed)" in shown_as_the_goal
    assert "CPU per event, worker / limit = 1.20   (goal <= 1.2: missed)" in shown_as_the_goal
    assert "(goal <= 1.2: met)" in table({**result, "cpu_per_event_ratio": 1.1})
    assert "2.00 x naive, 0.80 of the limit, CPU 1.20; 1.50 x naive" in markdown(result)
    assert "Worker ÷ naive: median of 3 rounds, 1.50-2.00, IQR 1.58-1.83." in markdown(result)
    assert "the trainers waited for a core 7% of the time" in printed
    models = {"dcn_v2": {"events_per_second": 20.0, "over_dlrm": 0.5}}
    assert "worker with dcn_v2: 20 events/s = 0.50 x DLRM's" in table({**result, "models": models})
    assert "| trainers runnable, waiting for a core (share of the time) | 7% | 7% | 7% |" in markdown(result)


def test_rounds_alternate_the_legs_order_and_their_ratios_median_comes_with_its_spread():
    from streamtrain.bench.common import alternated, spread, spread_text
    from streamtrain.bench.report import _ratio

    assert alternated(("with", "without"), 3) == [["with", "without"], ["without", "with"], ["with", "without"]]
    assert alternated(("worker", "naive", "limit"), 2)[1] == ["limit", "naive", "worker"]
    figures = spread([0.95, 0.80, 0.90, 0.91, 0.60])
    assert figures == {"median": 0.90, "min": 0.60, "max": 0.95, "q25": 0.80, "q75": 0.91, "rounds": 5}
    assert spread_text(figures) == "median of 5 rounds, 0.60-0.95, IQR 0.80-0.91"
    assert spread_text(spread([0.7])) == "1 round: no spread"
    # the report quotes the spread beside the median, for the delivery's ratio as for e2e's
    read = _ratio("throughput_ratio", "goal ≥ 0.9", 0.9)
    quoted = read({"throughput_ratio": 0.90, "throughput_ratio_spread": figures})
    assert quoted == "**0.90** (goal ≥ 0.9: met), 5 rounds 0.60-0.95 (IQR 0.80-0.91)"
    assert read({"throughput_ratio": 0.6}) == "**0.60** (goal ≥ 0.9: missed)"  # results saved before the spread


def test_cpu_sampler_splits_a_process_by_its_threads_kernel_names_and_sees_them_wait_for_a_core():
    """A real process with named busy threads: their CPU lands in their group, per event. Three of
    them pinned to one core, hashing outside the GIL, take turns on it, so each waits for it about
    two thirds of the time."""
    busy = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import hashlib, os, threading, time\n"
            "from streamtrain.threads import PREFETCH, name_this_thread\n"
            "os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})\n"
            "block = bytes(1 << 20)\n"
            "def spin():\n"  # hashing a large block releases the GIL: the threads contend for the core
            "    name_this_thread(PREFETCH)\n"
            "    end = time.monotonic() + 3\n"
            "    while time.monotonic() < end: hashlib.sha256(block).digest()\n"
            "ts = [threading.Thread(target=spin) for _ in range(3)]\n"
            "[t.start() for t in ts]; [t.join() for t in ts]\n",
        ],
        cwd=REPO,
    )
    try:
        with CpuSampler(lambda: [busy.pid], interval=0.2) as sampler:
            busy.wait(30)
    finally:
        busy.kill()
    walls = np.array([s.wall for s in sampler.samples])
    cpu = cpu_per_event(sampler.samples, walls, np.full(walls.size, 10), start=float(walls[0]))
    assert cpu["by_thread"]["prefetch"]["cpu_seconds_per_event"] > 0
    assert cpu["by_thread"]["prefetch"]["share"] > 0.5  # the main thread only waited for them
    assert cpu["events"] == 10 * (walls.size - 1)
    prefetch = cpu["by_thread"]["prefetch"]
    # one core, three spinning threads: for each second of CPU they ran, they waited about two, and
    # longer where other processes use that core too (the suite runs in two pytest workers)
    waited = prefetch["waiting_for_a_core_seconds_per_event"] / prefetch["cpu_seconds_per_event"]
    assert 1.0 < waited < 6.0
    assert cpu["trainer_waiting_share"] < 0.2  # the main thread was blocked in join, not runnable
    assert 0.0 <= cpu["stolen_share"] <= 1.0  # this machine's own /proc/stat, whatever its host did


def test_the_hosts_steal_is_the_share_of_all_cores_taken_over_the_counted_window():
    ranks = {(1, 1): ("trainer", 0.0, 0.0)}
    cores = os.cpu_count()
    later = {(1, 1): ("trainer", 1.0, 0.0)}
    samples = [CpuSample(100.0, ranks, 0.0, stolen=7.0), CpuSample(102.0, later, 0.0, stolen=7.0 + cores)]
    cpu = cpu_per_event(samples, np.array([101.0, 102.0]), np.array([10, 10]), start=100.0)
    assert cpu["stolen_share"] == pytest.approx(0.5)  # one core's worth of the two seconds, on every core
    assert stolen_seconds() <= stolen_seconds()


def test_pipeline_benchmark_runs_both_pipelines_on_two_ranks_and_records_their_device():
    saved = _bench("pipeline", "--quick", "--config", str(SMALL_CONFIG))
    assert saved["ranks"] == 2
    assert saved["legs"]["base"]["events"] == saved["legs"]["sparse_dist"]["events"] > 0
    assert saved["ratio"] > 0
    assert saved["legs"]["base"]["device"] == saved["legs"]["sparse_dist"]["device"] == "cpu"


@pytest.mark.integration  # starts its own broker
def test_freshness_benchmark_reports_quantiles_at_each_load():
    saved = _bench("freshness", "--quick", "--config", str(SMALL_CONFIG))
    assert saved["max_events_per_second"] > 0
    assert [load["load"] for load in saved["loads"]] == [0.5, 0.9]
    for load in saved["loads"]:
        assert load["counted_events"] > 0 and load["cdf"]
        assert 0 <= load["freshness"]["p50"] <= load["freshness"]["p99"] <= load["freshness"]["max"]


@pytest.mark.integration  # starts its own broker, workers with delivery on, and a scoring server
def test_delivery_benchmark_reports_servable_latency_the_throughput_ratio_and_bytes_against_its_goals():
    saved, printed = _run_bench("delivery", "--quick", "--config", str(SMALL_CONFIG), timeout=600)
    live = saved["live"]
    assert saved["max_events_per_second"] > 0 and live["produced_events"] > 0
    assert live["deltas_applied"] >= 2 and live["servable"]["counted_events"] > 0
    assert 0 < live["delta_cut_seconds_mean"] < 60  # the worker's own histogram of its cuts, read before its stop
    # served no sooner than trained: a delta is cut after the step it covers
    assert 0 < saved["servable_p50_seconds"] <= saved["servable_p99_seconds"] <= saved["servable_max_seconds"]
    assert len(saved["legs"]["with"]) == len(saved["legs"]["without"]) == 1  # one round when quick
    assert saved["throughput_ratio"] == saved["with_events_per_second"] / saved["without_events_per_second"] > 0
    assert saved["throughput_ratios"] == [saved["throughput_ratio"]] and saved["throughput_ratio_spread"]["rounds"] == 1
    assert saved["delta_bytes_per_second"] > 0 and saved["snapshot_bytes"] > 0 and live["artifact_bytes"] > 0
    assert re.search(r"servable p99 [\d.]+s: goal <= 5 s (met|NOT met)", printed)
    assert re.search(r"throughput ratio [\d.]+: goal >= 0.9 (met|NOT met)", printed)


def test_servable_latency_is_the_first_covering_deltas_apply_time_less_the_event_time():
    import numpy as np

    from streamtrain.bench.delivery import servable_latency
    from streamtrain.bench.record import RunRecord

    # steps 1..4 at walls 1..4, one event each, every event 0.5 s old when trained
    wall = np.array([1.0, 2.0, 3.0, 4.0])
    record = RunRecord(
        step_wall=wall,
        step_events=np.ones(4, np.int64),
        freshness=np.full(4, 0.5),
        fresh_wall=wall,
        ranks=1,
        step_number=np.array([1, 2, 3, 4]),
        fresh_step=np.array([1, 2, 3, 4]),
    )
    # a delta cut at step 2 applied at 10 s, one at step 3 at 12 s; none covers step 4 yet
    latency = servable_latency(record, np.array([3, 2]), np.array([12.0, 10.0]))
    np.testing.assert_allclose(latency[:3], [10.0 - 0.5, 10.0 - 1.5, 12.0 - 2.5])
    assert np.isnan(latency[3])


def test_report_renders_markdown_and_plots_from_results(tmp_path):
    """From hand-written results of every kind, so it needs no benchmark run."""
    results = tmp_path / "results"
    results.mkdir()
    machine = {"cores": 2, "device": "cpu", "torch": "2", "torchrec": "1", "fbgemm_gpu": "1"}
    rate = {"events_per_second": 1000.0, "events": 10, "seconds": 1.0}
    fixtures = {
        "e2e": {
            "legs": {"worker": rate, "naive": rate, "limit": rate},
            "worker_over_naive": 1.0,
            "worker_over_limit": 1.0,
            "events": 10,
            "partitions": 4,
            "ranks": 2,
            "warm_up_seconds": 1,
        },
        "pipeline": {
            "legs": {"base": rate, "sparse_dist": rate},
            "ratio": 1.0,
            "ranks": 2,
            "rounds": 1,
            "steps_per_leg": 5,
        },
        "memory": {
            "samples": [[0, 2**20], [1, 2**20]],
            "warm_up_seconds": 0,
            "backlog_events": 10,
            "growth_after_warm_up": 0.0,
            "rss_after_warm_up_bytes": 2**20,
            "rss_peak_after_warm_up_bytes": 2**20,
        },
        "freshness": {
            "max_events_per_second": 1000.0,
            "seconds": 5,
            "warm_up_seconds": 1,
            "loads": [
                {
                    "load": 0.5,
                    "rate": 500.0,
                    "produced_events_per_second": 500.0,
                    "trained_events_per_second_after_warm_up": 500.0,
                    "cdf": [[0.1, 0.0], [0.5, 1.0]],
                    "freshness": {"p50": 0.2, "p99": 0.4, "max": 0.5},
                }
            ],
        },
    }
    for name, fields in fixtures.items():
        (results / f"{name}-20260101-000000.json").write_text(
            json.dumps({"benchmark": name, "machine": machine, **fields})
        )
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "streamtrain",
            "bench",
            "report",
            "--results",
            str(results),
            "--out",
            str(tmp_path / "out"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    text = (tmp_path / "out" / "report.md").read_text()
    assert text.startswith("# Latest benchmark results\n")
    assert "| naive consume-decode-train loop |" in text and "| 50% |" in text
    assert "![throughput](throughput.png)" in text  # beside the page, as the docs site has it
    assert {p.name for p in (tmp_path / "out").glob("*.png")} == {
        "throughput.png",
        "memory_rss.png",
        "freshness_cdf.png",
    }


@pytest.mark.integration
def test_naive_ranks_whose_port_was_taken_start_again_not_wait_for_the_timeout(kafka, topic_name, monkeypatch):
    """Rank 0 of the naive loop cannot bind a port another socket holds, and rank 1 would wait
    for it until the process group's timeout: the leg stops both at once and starts again on a
    port that is free."""
    import socket

    import streamtrain.dev.kafka
    from streamtrain.bench.e2e import naive_leg
    from streamtrain.dev.produce import produce

    produce(kafka.bootstrap_servers, topic_name, 4_000, partitions=4, schema_path=REPO / "schemas/click_event.avsc")
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = iter([taken.getsockname()[1]])
    real_free_port = streamtrain.dev.kafka.free_port
    monkeypatch.setattr(streamtrain.dev.kafka, "free_port", lambda: next(ports, None) or real_free_port())
    started = time.monotonic()
    with taken:
        leg = naive_leg(SMALL_CONFIG, kafka.bootstrap_servers, topic_name, warm_up=0.0, timeout=240)
    assert next(ports, None) is None  # the taken port was handed out, and another after it
    assert leg["events"] > 0 and len(leg["log"]) == 2
    assert time.monotonic() - started < 180  # not the rank's wait for a peer that had died


def test_each_worker_leg_trains_the_whole_backlog_not_a_snapshot_the_leg_before_left(kafka, topic_name, tmp_path):
    """Two worker legs on one topic, as bench e2e's warm-up and rounds run them, each in a group of
    its own, under a config that snapshots to a path in the checkout (deploy/worker.yaml's
    ``snapshots``): the second trains every event too, not resuming from the first's snapshot at
    the end, and neither writes into the checkout."""
    import shutil

    from streamtrain.bench.e2e import worker_leg
    from streamtrain.dev.produce import produce

    produce(kafka.bootstrap_servers, topic_name, 3_000, partitions=4, schema_path=REPO / "schemas/click_event.avsc")
    raw = yaml.safe_load(SMALL_CONFIG.read_text())
    in_checkout = f"snapshots-{topic_name}"  # relative: the bench runs its workers in the checkout
    raw["checkpoint"] = {"path": in_checkout}
    config = tmp_path / "worker.yaml"
    config.write_text(yaml.safe_dump(raw))
    try:
        for group in ("first", "second"):
            leg = worker_leg(
                config, kafka.bootstrap_servers, topic_name, warm_up=0.0,
                environment={"STREAMTRAIN_KAFKA__GROUP_ID": f"{topic_name}-{group}"},
            )  # fmt: skip
            assert leg["total_events"] == 3_000, (group, leg["log"])
        assert not (REPO / in_checkout).exists()
    finally:
        shutil.rmtree(REPO / in_checkout, ignore_errors=True)


def test_report_soak_figure_judges_exactly_once_and_staleness_against_their_goals():
    from streamtrain.bench.report import FIGURES

    (figure,) = [f for f in FIGURES if f.benchmark == "soak"]
    run = {"lost": 0, "duplicated": 0, "max_stale_seconds": 9.78, "faults": {"broker": 7, "rank": 5}, "minutes": 20.0}
    assert figure.read(run) == (
        "**0** lost, **0** trained twice (goal 0: met); serve stale **9.8 s** at most (goal ≤ 10 s: met); "
        "12 faults in 20 minutes"
    )
    assert "(goal 0: missed)" in figure.read(run | {"duplicated": 3})
    assert "(goal ≤ 10 s: missed)" in figure.read(run | {"max_stale_seconds": 64.0})
    assert figure.read({"benchmark": "soak", "quick": True}) is None  # a run that judged nothing


def test_report_delayed_figure_comes_from_the_reference_joiners_stream_not_a_waiting_joiners():
    from streamtrain.bench.report import FIGURES

    (figure,) = [f for f in FIGURES if f.benchmark == "delayed" and "best correction" in f.name]
    legs = {"oracle": {"holdout_auc": 0.84}, "fnw": {"holdout_auc": 0.83, "calibration": 0.99}}
    run = {
        "goals": {"clk": {"best_correction": "fnw", "best_met": False}},
        "tasks": {"clk": legs},
        "stream": {"delays_events": {"wait": 0.0}},
    }
    assert figure.read(run) == (
        "clk: fnw **+0.0100** below the oracle, calibration **0.990** (goal ≤ 0.003 and within [0.97, 1.03]: missed)"
    )
    assert figure.read(run | {"stream": {"delays_events": {"wait": 5000.0}}}) is None


def test_throughput_excludes_the_warm_up_and_counts_from_its_end_to_the_last_event():
    import numpy as np

    from streamtrain.bench.common import throughput

    wall = np.array([0.0, 1.0, 2.0, 3.0, 4.0, 5.0])
    events = np.array([10, 10, 10, 0, 10, 10])
    result = throughput(wall, events, warm_up_seconds=1.5)  # the window starts at the step at 1.0
    assert result["events"] == 30 and result["seconds"] == 4.0 and result["events_per_second"] == 7.5
    assert result["warm_up_events"] == 20 and result["total_events"] == 50


def test_decode_benchmark_runs_both_decoders_and_reports_a_ratio_on_the_cpu_device():
    saved, printed = _run_bench("decode", "--quick")
    assert "ratio" in printed
    assert saved["baseline_events_per_second"] > 0 and saved["compiled_events_per_second"] > 0
    assert saved["ratio"] == saved["compiled_events_per_second"] / saved["baseline_events_per_second"]
    assert saved["first_call_seconds"] > 0
    assert saved["device"] == "cpu"


def test_quality_benchmark_reports_each_tasks_progressive_holdout_and_bayes_auc_per_architecture():
    saved = _bench("quality", "--quick", "--config", str(SMALL_CONFIG))
    models = {"dlrm", "dcn_v2", "deepfm", "din"}
    assert set(saved["architectures"]) == {"clk_alone", "shared_bottom", "mmoe", "dbmtl", *models}
    assert set(saved["architectures"]["clk_alone"]["tasks"]) == {"clk"}
    for name in ("shared_bottom", "mmoe", "dbmtl", *models):
        tasks = saved["architectures"][name]["tasks"]
        assert set(tasks) == {"clk", "buy"}
        for figures in tasks.values():
            assert {"progressive_auc", "holdout_auc", "bayes_auc"} <= set(figures)
            # a quick run judges nothing, but a model that learned nothing would sit at 0.5
            assert 0.55 < figures["holdout_auc"] <= figures["bayes_auc"] + 0.02 < 1.02
    assert saved["bayes_auc"]["buy"] > saved["bayes_auc"]["clk"] > 0.75
    # the batch-size axis (quick: 256 and 1,024 events a step): each task's holdout AUC per size,
    # and the largest gap to the first size's
    runs = saved["batch_size_axis"]["runs"]
    assert set(runs) == {"256", "1024"} and all(set(run["tasks"]) == {"clk", "buy"} for run in runs.values())
    assert runs["1024"]["learning_rate_scales"] == {"sparse": 1.0, "dense": 1.0}  # at the reference
    gap = max(runs["256"]["tasks"][t]["holdout_auc"] - runs["1024"]["tasks"][t]["holdout_auc"] for t in ("clk", "buy"))
    assert saved["batch_size_gaps"] == {"1024": pytest.approx(gap)}


def _naive_gradients_rank(rank: int, port: int, out: str) -> None:
    import os

    import torch
    import torch.distributed as dist

    from streamtrain.bench.naive import NaiveDLRM, average_sparse_gradients, to_tensors
    from streamtrain.config import load_config
    from streamtrain.dev.produce import ClickStream

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    config = load_config(SMALL_CONFIG)
    batches = [ClickStream(seed=3).chunk(64).records[:5], []]  # rank 1 trains an empty batch

    def trained(records: list) -> NaiveDLRM:
        torch.manual_seed(0)
        model = NaiveDLRM(config.features, config.model)
        model(*to_tensors(records, config.features)[:3]).sum().backward()
        return model

    def dense_gradients(model: NaiveDLRM) -> list[torch.Tensor]:
        return [table.weight.grad.to_dense() for table in model.tables]

    model = trained(batches[rank])
    average_sparse_gradients(model.tables, 2)
    expected = [
        (a + b) / 2
        for a, b in zip(dense_gradients(trained(batches[0])), dense_gradients(trained(batches[1])), strict=True)
    ]
    torch.save({"averaged": dense_gradients(model), "expected": expected}, f"{out}/rank-{rank}.pt")
    dist.destroy_process_group()


def test_naive_loop_averages_the_tables_sparse_gradients_over_ranks(tmp_path):
    """The baseline's own all-gather gives every rank the mean of the ranks' table gradients, as
    DDP would, also when one rank's batch is empty."""
    import torch
    import torch.multiprocessing as mp

    from streamtrain.dev.kafka import free_port

    mp.spawn(_naive_gradients_rank, args=(free_port(), str(tmp_path)), nprocs=2)
    for rank in range(2):
        result = torch.load(tmp_path / f"rank-{rank}.pt")
        assert any(g.any() for g in result["averaged"])
        for averaged, expected in zip(result["averaged"], result["expected"], strict=True):
            assert torch.allclose(averaged, expected)


def test_idspace_benchmark_trains_one_drifting_stream_hash_managed_and_reference_side_by_side():
    """All three legs run, the managed leg within the hash leg's memory, and the bench reports both goals;
    then again on the stream with a one-off tail, the managed leg with the default admission."""
    result = subprocess.run(
        [sys.executable, "-m", "streamtrain", "bench", "idspace", "--quick", "--config", str(SMALL_CONFIG)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=420,
    )
    assert "results: " in result.stdout, result.stderr[-3000:]
    saved = json.loads(Path(result.stdout.split("results: ")[1].strip()).read_text())
    printed = result.stdout
    assert {"hash_auc", "managed_auc", "reference_auc", "bayes_auc", "throughput_ratio"} <= set(saved)
    assert saved["reference_rows"] >= 10 * saved["rows"]
    assert all(n >= 10 * saved["rows"] for n in saved["distinct_ids"].values()), saved["distinct_ids"]
    # a quick run judges nothing, but a leg that learned nothing would sit at 0.5
    for name in ("hash_auc", "reference_auc"):
        assert 0.6 < saved[name] < saved["bayes_auc"] + 0.02, (name, saved)
    legs = saved["legs"]
    assert legs["reference"]["state_bytes"] > legs["hash"]["state_bytes"]
    assert re.search(r"hash +hash +300 ", printed) and re.search(r"reference +hash +3,000 ", printed)
    assert "Bayes AUC over the last 4,000 events" in printed
    assert result.returncode == 0, result.stderr[-3000:]
    assert 0.6 < saved["managed_auc"] < saved["bayes_auc"] + 0.02 and saved["throughput_ratio"] > 0
    assert legs["managed"]["state_bytes"] <= legs["hash"]["state_bytes"], "the managed leg must fit the same memory"
    assert "managed - hash" in printed and "throughput managed / hash" in printed
    # the scale leg: real ranks at 1, 2 and 4 share the map's memory and ids evenly
    scale = saved["scale"]
    assert set(scale["world_sizes"]) == {"1", "2", "4"} and all(
        len(r) == int(w) for w, r in scale["world_sizes"].items()
    )
    assert scale["memory_per_rank_ratio"] <= 1.2 and scale["ids_per_rank_ratio"] <= 1.3
    assert scale["projected_step_seconds_8x32k"] > 0 and "projected map time a step" in printed
    assert scale["threaded"]["speedup"] > 0 and f"1 rank on {scale['threaded']['threads']} threads" in printed
    # the figures the managed map's goals read: compute per id, the projection's two terms, the ratios
    assert saved["ns_per_id_one_thread"] == scale["ns_per_id_one_thread"] > 0 and scale["ns_per_id_threaded"] > 0
    assert saved["projected_step_seconds_8x32k"] == pytest.approx(
        saved["projected_compute_seconds"] + saved["projected_exchange_seconds"]
    )
    assert 0 < saved["projected_exchange_seconds"] < saved["projected_compute_seconds"]
    assert saved["throughput_ratio"] == statistics.median(saved["throughput_ratio_by_round"])
    assert len(saved["throughput_ratio_by_round"]) == 9  # the rounds after the warm-up
    assert saved["throughput_ratio_2_ranks"] == statistics.median(saved["throughput_ratio_2_ranks_by_round"]) > 0
    assert "at 2 ranks: throughput managed / hash" in printed and "ns an id on one thread" in printed
    # where the managed leg's time went, from its id space's metrics: the map is part of the step,
    # and at 2 ranks its all-to-alls part of the map
    assert 0 < legs["managed"]["map_seconds_per_step"] < legs["managed"]["seconds_per_step"]
    assert "map_seconds_per_step" not in legs["hash"] and legs["hash"]["seconds_per_step"] > 0
    assert 0 < saved["exchange_seconds_per_step_2_ranks"] < saved["map_seconds_per_step_2_ranks"]
    assert saved["map_seconds_per_step_2_ranks"] < saved["seconds_per_step_2_ranks"]["managed"]
    # at 1 and 2 ranks, and in the tailed leg
    assert printed.count("the managed leg's map took") == 3 and "ms in its all-to-alls" in printed
    tailed = saved["tailed"]
    assert tailed["drift"]["one_off"] == pytest.approx(1 / 3) and tailed["managed_admission"] == {"min_count": 2}
    assert "scale" not in tailed  # the scale leg reads no stream: it runs once
    assert all(tailed["distinct_ids"][t] > 2 * n for t, n in saved["distinct_ids"].items()), tailed["distinct_ids"]
    for name in ("hash_auc", "managed_auc", "reference_auc"):
        assert 0.55 < tailed[name] < tailed["bayes_auc"] + 0.02, (name, tailed)
    assert tailed["legs"]["managed"]["state_bytes"] <= tailed["legs"]["hash"]["state_bytes"]
    assert "tailed leg: 33% of the events' users and of their ads seen once" in printed


@pytest.mark.integration  # starts its own broker
def test_datapath_benchmark_reports_each_thread_counts_rate_the_scaling_and_a_projection():
    saved, printed = _run_bench("datapath", "--quick", "--config", str(SMALL_CONFIG))
    threads = saved["threads"]
    assert threads == list(range(1, len(threads) + 1)) and len(threads) >= 2
    decode, whole = saved["decode_events_per_second_by_threads"], saved["events_per_second_by_threads"]
    assert set(decode) == set(whole) == {str(n) for n in threads}
    assert all(rate > 0 for rate in [*decode.values(), *whole.values()])
    assert saved["scaling_2_threads"] == statistics.median(saved["scaling_2_threads_by_round"])
    assert len(saved["scaling_2_threads_by_round"]) == 1  # --quick: one round
    assert saved["events_per_second_per_thread"] == whole[str(threads[-1])] / threads[-1]
    assert saved["decode_seconds_per_event"] > 0 and saved["serial_cpu_seconds_per_event"] > 0
    # The rank's own CPU: the prefetch thread works at every thread count, the helpers only from 2.
    cpu = saved["cpu_seconds_per_event_by_threads"]
    assert cpu["1"]["st-decode"] == 0 and cpu["2"]["st-decode"] > 0 and cpu["1"]["st-prefetch"] > 0
    assert cpu["1"]["librdkafka"] >= saved["librdkafka_thread_cpu_seconds_per_event"] > 0
    assert all(rate > 0 for rate in saved["events_per_cpu_second_by_threads"].values())
    assert 0 < saved["projected_events_per_second"] <= saved["ceiling_events_per_second"]
    assert "decode stage, 2 threads / 1" in printed and "projected from the CPU, 16 cores" in printed


def test_delayed_benchmark_trains_every_leg_on_one_stream_and_scores_each_tasks_holdout():
    saved, printed = _run_bench("delayed", "--quick", "--config", str(SMALL_CONFIG))
    legs = {"oracle", "window", "bound", "naive", "fnw", "fnc", "es_dfm", "pu"}
    for task in ("clk", "buy"):
        assert set(saved["tasks"][task]) == legs
        for figures in saved["tasks"][task].values():
            assert 0.5 < figures["holdout_auc"] <= 1 and figures["ne"] > 0 and figures["calibration"] > 0
        assert saved["goals"][task]["best_correction"] in ("fnw", "fnc", "es_dfm", "pu")
        bound = saved["tasks"][task]["bound"]["holdout_auc"]
        assert saved["goals"][task]["oracle_minus_bound_auc"] == saved["tasks"][task]["oracle"]["holdout_auc"] - bound
        # with every label late (the reference joiner), es_dfm's share is 1: it is fnw
        assert saved["tasks"][task]["es_dfm"] == saved["tasks"][task]["fnw"]
    assert saved["stream"]["late_labels"] > 0 and saved["stream"]["samples"] == 6_000 + saved["stream"]["late_labels"]
    assert saved["evaluated_after"] == [4_000, 6_000] and set(saved["final_holdout"]["clk"]) == legs
    assert set(saved["throughput"]) == {"fnw", "fnc", "es_dfm", "pu"} and saved["throughput_ratio"] > 0
    assert saved["throughput_ratio"] == min(t["ratio"] for t in saved["throughput"].values())
    assert "best correction" in printed and "training throughput over naive's" in printed
    assert "the delay's own cost (bound)" in printed
