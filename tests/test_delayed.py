"""Late labels (streamtrain/delayed.py, docs/delayed-labels.md): the sample contract checked at
start-up, its fields decoded by the compiled decoder (and alike by fastavro's path), each
correction's loss against hand-computed values, fnc's calibrated output served from a real export,
the late share restored by partition, and the matured quality."""

from __future__ import annotations

import copy
import io
import json
import math
from pathlib import Path

import fastavro
import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml

from conftest import REPO
from streamtrain import avro_program as ap
from streamtrain.config import ConfigError, parse_config
from streamtrain.decode import AvroBatchDecoder, FastavroDecoder
from streamtrain.delayed import Corrections, LateShare, fnc_logits, served_logits
from streamtrain.dev.produce import AvroEncoder
from streamtrain.model import task_losses
from streamtrain.source import RawEvent
from test_decode import event

SAMPLE_SCHEMA = REPO / "schemas" / "click_sample.avsc"
WINDOW_SECONDS = {"clk": 60.0, "buy": 600.0}
T0 = 1_700_000_000_000  # an impression's time, ms


def delayed_raw(clk: str = "fnw", buy: str = "es_dfm", schema: Path | str = "schemas/click_sample.avsc") -> dict:
    """tests/worker-small.yaml on the sample schema, with clk and buy under these corrections."""
    raw = yaml.safe_load((REPO / "tests" / "worker-small.yaml").read_text())
    raw["kafka"] = {"bootstrap_servers": "unused:9092", "topic": "unused"}
    raw["features"]["schema_path"] = str(schema)
    raw["features"].pop("label")
    raw["model"]["tasks"] = [
        {"name": name, "label": name, "attribution_window_seconds": WINDOW_SECONDS[name], "correction": correction}
        for name, correction in (("clk", clk), ("buy", buy))
    ]
    raw["delayed_labels"] = {}
    return raw


def record(**fields) -> dict:
    """A click event (tests/test_decode.py's) at T0, its labels 0 unless ``fields`` say otherwise."""
    return event(**{"event_time": T0, "clk": 0, "buy": 0, **fields})


def impression(impression_id: int, clk: int | None = 0, buy: int | None = 0, **fields) -> dict:
    sample = {"sample_kind": "impression", "impression_id": impression_id, "impression_time": T0}
    return record(**{**sample, "clk": clk, "buy": buy, **fields})


def late_label(impression_id: int, task: str, delay_seconds: float, **fields) -> dict:
    sample = {"sample_kind": "label", "impression_id": impression_id, "impression_time": T0}
    labels = {"clk": None, "buy": None, task: 1}
    return record(**{**sample, "event_time": T0 + int(delay_seconds * 1000), **labels, **fields})


def raw_events(records: list[dict], schema: Path = SAMPLE_SCHEMA, partitions: int = 2) -> list[RawEvent]:
    encoder = AvroEncoder(schema)
    return [RawEvent(i % partitions, i, encoder.encode(r), 0) for i, r in enumerate(records)]


# --- the contract, checked at start-up -----------------------------------------------------------


def test_delayed_config_reads_the_contracts_fields_and_each_tasks_window_and_correction():
    config = parse_config(delayed_raw("fnc", "none"), environ={})
    assert config.delayed_labels is not None
    assert config.delayed_labels.fields() == {
        "kind_field": "sample_kind",
        "impression_id_field": "impression_id",
        "impression_time_field": "impression_time",
    }
    assert [(t.correction, t.attribution_window_seconds) for t in config.tasks()] == [("fnc", 60.0), ("none", 600.0)]
    # a config without the section is today's: no window, no correction
    plain = yaml.safe_load((REPO / "tests" / "worker-small.yaml").read_text())
    plain["kafka"] = {"bootstrap_servers": "unused:9092", "topic": "unused"}
    assert parse_config(plain, environ={}).delayed_labels is None


def _string_kind_schema(tmp_path: Path, kind: object = ["null", "string"]) -> Path:
    schema = json.loads(SAMPLE_SCHEMA.read_text())
    for field in schema["fields"]:
        if field["name"] == "sample_kind":
            field["type"] = kind
    path = tmp_path / "sample.avsc"
    path.write_text(json.dumps(schema))
    return path


def _field_type(tmp_path: Path, name: str, avro_type: object) -> Path:
    schema = json.loads(SAMPLE_SCHEMA.read_text())
    for field in schema["fields"]:
        if field["name"] == name:
            field["type"] = avro_type
            field.pop("default", None)
    path = tmp_path / f"{name}.avsc"
    path.write_text(json.dumps(schema))
    return path


BAD_CONFIGS = {
    "a correction without the section": (
        lambda raw, tmp: raw.pop("delayed_labels"),
        r"model\.tasks\.0\.correction: only read with the delayed_labels section",
    ),
    "the section without tasks": (
        lambda raw, tmp: raw["model"].pop("tasks") and raw["features"].update(label="clk"),
        r"delayed_labels: needs model\.tasks, each with its attribution_window_seconds",
    ),
    "a task without its window": (
        lambda raw, tmp: raw["model"]["tasks"][1].pop("attribution_window_seconds"),
        r"model\.tasks\.1\.attribution_window_seconds: required with delayed_labels \(task 'buy'\)",
    ),
    "an unknown correction": (
        lambda raw, tmp: raw["model"]["tasks"][0].update(correction="defer"),
        r"model\.tasks\.0\.correction: Input should be 'none', 'fnw', 'fnc', 'es_dfm' or 'pu'",
    ),
    "a field the schema lacks": (
        lambda raw, tmp: raw["delayed_labels"].update(impression_id_field="impression"),
        r"delayed_labels\.impression_id_field: 'impression' is not a field of ClickSample; add it to the schema",
    ),
    "a kind that is a number": (
        lambda raw, tmp: raw["delayed_labels"].update(kind_field="clk"),
        r"delayed_labels\.kind_field: field 'clk' is integer, expected one of \['enum', 'string'\]",
    ),
    "an impression time that is a string": (
        lambda raw, tmp: raw["delayed_labels"].update(impression_time_field="pid"),
        r"delayed_labels\.impression_time_field: field 'pid' is string, expected one of \['integer'\]",
    ),
    "an enum without the label symbol": (
        lambda raw, tmp: raw["features"].update(
            schema_path=str(
                _string_kind_schema(tmp, ["null", {"type": "enum", "name": "K", "symbols": ["impression", "x"]}])
            )
        ),
        r"delayed_labels\.kind_field: the enum of 'sample_kind' lacks the symbols \['label'\]",
    ),
    "a label that cannot be null": (
        lambda raw, tmp: raw["features"].update(schema_path=str(_field_type(tmp, "buy", "int"))),
        r"model\.tasks\.1\.label: 'buy' must be nullable \(a union with null\) with delayed_labels",
    ),
}


@pytest.mark.parametrize("case", BAD_CONFIGS, ids=list(BAD_CONFIGS))
def test_delayed_config_refuses_a_breach_of_the_contract_naming_the_field_and_the_fix(case, tmp_path):
    change, message = BAD_CONFIGS[case]
    raw = delayed_raw()
    change(raw, tmp_path)
    with pytest.raises(ConfigError, match=message):
        parse_config(raw, environ={})


def test_delayed_config_takes_a_string_kind_and_environment_overrides(tmp_path):
    raw = delayed_raw(schema=_string_kind_schema(tmp_path))
    config = parse_config(raw, environ={"STREAMTRAIN_DELAYED_LABELS__MATURED_MAX_PENDING": "1000"})
    assert config.delayed_labels is not None and config.delayed_labels.matured_max_pending == 1000
    raw.pop("delayed_labels")
    raw["model"]["tasks"] = [{"name": "clk", "label": "clk"}]
    with_section = parse_config(
        raw,
        environ={
            "STREAMTRAIN_DELAYED_LABELS__KIND_FIELD": "sample_kind",
            "STREAMTRAIN_MODEL__TASKS__0__ATTRIBUTION_WINDOW_SECONDS": "30",
        },
    )
    assert with_section.delayed_labels is not None and with_section.tasks()[0].attribution_window_seconds == 30


# --- decoding the three fields ---------------------------------------------------------------------


def _decoders(raw: dict) -> list:
    config = parse_config(raw, environ={})
    compiled = AvroBatchDecoder(config.features, tasks=config.tasks(), delayed=config.delayed_labels)
    return [compiled, FastavroDecoder(config.features, tasks=config.tasks(), late=compiled.late)]


STREAM = [
    record(clk=1, buy=0),  # 0: a plain event: trained as without the section
    impression(7),  # 1
    late_label(7, "clk", 30),  # 2: within clk's 60 s
    late_label(7, "clk", 100),  # 3: past clk's window: masked, counted
    late_label(7, "buy", 100),  # 4: within buy's 600 s
    impression(8, clk=1),  # 5: a positive known at emission
    record(sample_kind="label", impression_id=7, impression_time=T0, clk=None, buy=None),  # 6: no positive
    impression(9, impression_time=None),  # 7: no impression time
    record(clk=None),  # 8: a plain event's null required label
    record(sample_kind="label", impression_id=7, impression_time=T0, clk=0, buy=1),  # 9: a 0 is masked
]


@pytest.mark.parametrize("kind", ["enum", "string"])
def test_delayed_decode_reads_kind_delay_and_impression_and_masks_what_is_no_positive(kind, tmp_path):
    schema = SAMPLE_SCHEMA if kind == "enum" else _string_kind_schema(tmp_path)
    events = raw_events(STREAM, schema)
    results = [decoder.decode(events) for decoder in _decoders(delayed_raw(schema=schema))]
    for result in results:  # the compiled path and fastavro's agree
        assert [(e.offset, reason) for e, reason in result.rejected] == [
            (6, "label_without_positive"),
            (7, "missing_impression"),
            (8, "missing_label"),
        ]
        batch = result.batch
        samples = batch.samples
        assert samples is not None
        nan = math.nan
        expected = [[1, 0], [0, 0], [1, nan], [nan, nan], [nan, 1], [1, 0], [nan, 1]]
        np.testing.assert_array_equal(batch.labels.numpy(), np.array(expected, np.float32))
        assert samples.kind.tolist() == [ap.PLAIN, ap.IMPRESSION] + [ap.LATE_LABEL] * 3 + [ap.IMPRESSION, ap.LATE_LABEL]
        assert samples.delay_ms.tolist() == [0, 0, 30_000, 100_000, 100_000, 0, 0]
        assert samples.impression_id.tolist() == [0, 7, 7, 7, 7, 8, 7]
        assert samples.partition.tolist() == [0, 1, 0, 1, 0, 1, 1]
        assert samples.past_window.tolist() == [1, 0]
        # per partition: positives known at emission, then late ones within the window, per task
        assert {p: c.tolist() for p, c in samples.positives.items()} == {0: [[0, 0], [1, 1]], 1: [[1, 0], [0, 1]]}
    compiled, fallback = results
    for name in ("kind", "delay_ms", "impression_id"):
        assert torch.equal(getattr(compiled.batch.samples, name), getattr(fallback.batch.samples, name))


def test_delayed_decode_masks_a_late_labels_nulls_even_of_a_required_task_and_rejects_unknown_kinds(tmp_path):
    schema = _string_kind_schema(tmp_path)
    raw = delayed_raw(schema=schema)
    assert all(task["label"] and task.get("required", True) for task in raw["model"]["tasks"])
    for decoder in _decoders(raw):
        records = [late_label(1, "buy", 5), record(sample_kind="click", impression_id=1)]
        result = decoder.decode(raw_events(records, schema))
        assert [r for _e, r in result.rejected] == ["unknown_sample_kind"]
        assert result.batch.labels.numpy().tolist()[0][1] == 1.0 and math.isnan(result.batch.labels[0, 0])


def test_delayed_decode_program_is_compiled_not_left_to_fastavro():
    compiled = _decoders(delayed_raw())[0]
    program = compiled.describe()
    assert "SAMPLE       0 0 1" in program and "-> sample kind" in program and "-> impression time" in program
    assert None in compiled.programs  # a program, not the fastavro fallback


# --- the corrections' losses ----------------------------------------------------------------------

LOG2 = math.log(2.0)


def _corrections(clk: str, buy: str) -> Corrections:
    config = parse_config(delayed_raw(clk, buy), environ={})
    return Corrections(config.tasks(), torch.device("cpu"))


def test_delayed_fnw_weighs_positives_by_one_plus_p_and_negatives_by_one_minus_p_squared():
    corrections = _corrections("fnw", "none")
    logits = torch.zeros(3, 2)  # p = 1/2
    labels = torch.tensor([[1.0, 1.0], [0.0, 0.0], [0.0, 1.0]])
    kind = torch.tensor([ap.LATE_LABEL, ap.IMPRESSION, ap.PLAIN], dtype=torch.int8)
    losses = task_losses(logits, labels, corrections.weights(logits, kind, None))
    # clk: a positive 1.5 log 2, a negative (1 - 1/4) log 2; a plain event and buy (none) as plain BCE
    expected = torch.tensor([[1.5 * LOG2, LOG2], [0.75 * LOG2, LOG2], [LOG2, LOG2]])
    torch.testing.assert_close(losses, expected)
    # at another p: z = log 3, p = 3/4: positive 1.75 * log(4/3), negative (1/4)(7/4) * log 4
    z = torch.full((2, 2), math.log(3.0))
    fnw = task_losses(z, torch.tensor([[1.0, 0.0], [0.0, 0.0]]), corrections.weights(z, kind[:2], None))
    assert fnw[0, 0].item() == pytest.approx(1.75 * math.log(4 / 3), rel=1e-6)
    assert fnw[1, 0].item() == pytest.approx(0.25 * 1.75 * math.log(4), rel=1e-6)
    # a rank's empty batch (the lockstep's filler) is weighed too
    assert [w.shape for w in corrections.weights(torch.zeros(0, 2), kind[:0], torch.ones(2))] == [(0, 2)] * 3
    assert served_logits(torch.zeros(0), (True,)).shape == (0,)


def test_delayed_es_dfm_weighs_by_the_delayed_positive_probability_p_times_the_late_share():
    corrections = _corrections("none", "es_dfm")
    logits = torch.zeros(2, 2)  # p = 1/2
    labels = torch.tensor([[0.0, 1.0], [0.0, 0.0]])
    kind = torch.tensor([ap.LATE_LABEL, ap.IMPRESSION], dtype=torch.int8)
    share = torch.tensor([0.3, 0.5])  # clk's share is not read: its correction is none
    losses = task_losses(logits, labels, corrections.weights(logits, kind, share))
    # f_dp = 1/2 * 1/2 = 1/4; positive 1 + 1/4; negative (1 + 1/4) * (1/2) / (1/2 + 1/4) = 5/6
    torch.testing.assert_close(losses[:, 1], torch.tensor([1.25 * LOG2, 5 / 6 * LOG2]))
    torch.testing.assert_close(losses[:, 0], torch.full((2,), LOG2))
    # a share of 1 is fnw exactly
    fnw = _corrections("none", "fnw").weights(logits, kind, share)
    es_dfm = corrections.weights(logits, kind, torch.ones(2))
    assert all(torch.equal(a[:, 1], b[:, 1]) for a, b in zip(fnw, es_dfm, strict=True))
    # p = 1 with no late positives: a negative's weight is 0, not NaN
    sure = torch.full((1, 2), 100.0)
    _positive, negative, _retracted = corrections.weights(sure, kind[1:], torch.zeros(2))
    assert negative[0, 1].item() == 0.0


def test_delayed_pu_takes_back_the_fake_negative_with_the_late_positive():
    corrections = _corrections("pu", "none")
    logits = torch.tensor([[0.7, 0.7], [0.7, 0.7], [0.7, 0.7], [0.7, 0.7]], requires_grad=True)
    labels = torch.tensor([[1.0, 1.0], [0.0, 0.0], [1.0, 0.0], [1.0, 1.0]])
    kind = torch.tensor([ap.LATE_LABEL, ap.IMPRESSION, ap.IMPRESSION, ap.PLAIN], dtype=torch.int8)
    losses = task_losses(logits, labels, corrections.weights(logits, kind, None))
    z = torch.tensor(0.7)
    positive, negative = F.softplus(-z), F.softplus(z)
    # a late positive: its own log loss less the negative its impression was trained as, -z
    torch.testing.assert_close(losses[0, 0], positive - negative)
    torch.testing.assert_close(losses[0, 0], -z)
    # an impression, a positive known when it was emitted, a plain event: as none
    torch.testing.assert_close(losses[1:, 0], torch.stack([negative, positive, positive]))
    torch.testing.assert_close(
        losses[:, 1], F.binary_cross_entropy_with_logits(logits[:, 1], labels[:, 1], reduction="none")
    )
    # bounded: the late positive's gradient is -1 in the logit however sure the model is
    losses[0, 0].backward()
    assert logits.grad[0, 0].item() == pytest.approx(-1.0)
    # the impression and its late positive together give the final label's loss
    pair = task_losses(
        torch.full((2, 2), 0.7),
        torch.tensor([[0.0, 0.0], [1.0, float("nan")]]),
        corrections.weights(torch.full((2, 2), 0.7), kind[[1, 0]], None),
    )
    torch.testing.assert_close(pair[:, 0].sum(), positive)


def test_delayed_fnc_serves_b_over_one_minus_b_and_trains_as_none():
    b = torch.tensor([0.1, 0.25, 0.4])
    served = torch.sigmoid(fnc_logits(torch.logit(b)))
    torch.testing.assert_close(served, b / (1 - b))
    assert torch.sigmoid(fnc_logits(torch.tensor([0.0, 5.0]))).tolist() == pytest.approx([1 - 1e-6] * 2, abs=1e-7)
    logits = torch.logit(torch.tensor([[0.2, 0.2]]))
    torch.testing.assert_close(
        torch.sigmoid(served_logits(logits, (True, False))), torch.tensor([[0.25, 0.2]]), rtol=1e-6, atol=1e-7
    )
    corrections = _corrections("fnc", "none")
    assert not corrections.any_weighted and corrections.calibrated == (True, False)


# --- the late share --------------------------------------------------------------------------------


def test_delayed_late_share_counts_each_batch_before_it_and_restores_a_ranks_partitions():
    config = parse_config(delayed_raw(), environ={})
    compiled = _decoders(delayed_raw())[0]
    batch = compiled.decode(raw_events(STREAM)).batch
    share = LateShare(2)
    first = share.attach(batch)
    assert first.samples.late_share.tolist() == [1.0, 1.0]  # nothing counted yet
    second = share.attach(batch)
    # before it: clk 1 known at emission, 1 late; buy 0 known, 2 late (one from the 0 masked)
    assert second.samples.late_share.tolist() == pytest.approx([(1 + 1) / (1 + 1 + 1), 1.0])
    assert len(config.tasks()) == 2
    counts = {0: [0, 0, 2, 2], 1: [2, 0, 0, 4], 5: [9, 9, 9, 9]}  # partition 5 is another rank's
    share.restore(counts, [0, 1])
    assert share.counts.tolist() == [[2, 0], [2, 6]]
    assert share.share().tolist() == pytest.approx([3 / 5, 1.0])


def test_delayed_a_batch_without_samples_passes_the_late_share_untouched():
    batch = copy.copy(_decoders(delayed_raw())[0].decode([]).batch)
    assert batch.samples is not None and batch.size == 0
    assert LateShare(2).attach(batch).samples.late_share.tolist() == [1.0, 1.0]


# --- fnc's calibrated output, exported and served --------------------------------------------------


def test_delayed_fnc_export_is_served_calibrated_as_training_scores_it(tmp_path):
    from streamtrain.checkpoint import Checkpointer, StreamState
    from streamtrain.delivery.artifact import ServableModel, export_snapshot
    from streamtrain.device import init_distributed
    from streamtrain.model import net_logits
    from streamtrain.train import Trainer

    raw = delayed_raw("fnc", "none")
    raw["checkpoint"] = {"path": str(tmp_path / "snapshots")}
    config = parse_config(raw, environ={})
    decoder = _decoders(raw)[0]
    stream = [impression(i, clk=int(i % 3 == 0), buy=0, user_id=i, cate_id=i % 7) for i in range(200)]
    stream += [late_label(i, "clk", 5, user_id=i, cate_id=i % 7) for i in range(0, 200, 4)]
    batches = [decoder.decode(raw_events(stream[i : i + 64])).batch for i in range(0, len(stream), 64)]
    trainer = Trainer(config, init_distributed())
    assert len(list(trainer.train(iter(batches)))) == len(batches)
    Checkpointer(config.checkpoint, config, trainer.model, trainer.optimizer, 0, 1, None).save(
        StreamState(step=len(batches), next_offsets={0: 1}, trained={0: 1})
    )
    base = export_snapshot(tmp_path / "snapshots", None, tmp_path / "serving")
    served = ServableModel(base)
    assert [t.correction for t in served.tasks] == ["fnc", "none"]
    batch = batches[0]
    model = trainer.pipeline.detach()
    with torch.no_grad():
        _loss, (_sum, trained_logits, _labels) = model(batch)
        clicked = model.module
        biased = net_logits(clicked.net, clicked.pairs, batch.dense_features, batch.sparse_features)
    scores = served.score(batch)
    np.testing.assert_allclose(scores, torch.sigmoid(trained_logits).numpy(), rtol=1e-5, atol=1e-6)
    b = torch.sigmoid(biased).numpy()
    # clk is served as b / (1 - b) of the net's biased output (at most 1 - 1e-6); buy as it is
    np.testing.assert_allclose(scores[:, 0], np.minimum(b[:, 0] / (1 - b[:, 0]), 1 - 1e-6), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(scores[:, 1], b[:, 1], rtol=1e-5, atol=1e-6)


# --- matured quality ---------------------------------------------------------------------------------


def test_delayed_matured_quality_joins_late_positives_once_each_partitions_window_closes():
    from streamtrain.delayed import MaturedQuality
    from streamtrain.metrics import WorkerMetrics, roc_auc

    config = parse_config(delayed_raw(), environ={})
    decoder = _decoders(delayed_raw())[0]
    metrics = WorkerMetrics(100, ["clk", "buy"])
    matured = MaturedQuality(config.tasks(), window=100, max_pending=1000, metrics=metrics.late)

    def add(records: list[dict], logits: list[list[float]], partition: int) -> None:
        events = [RawEvent(partition, i, AvroEncoder(SAMPLE_SCHEMA).encode(r), 0) for i, r in enumerate(records)]
        batch = decoder.decode(events).batch
        matured.add(np.array(logits, np.float32), batch)

    # partition 0: four impressions; 2 clicks late, 3 was clicked at emission, 4 clicks past the window
    add([impression(i, clk=int(i == 3)) for i in (1, 2, 3, 4)], [[0.1, 0], [0.9, 0], [0.7, 0], [0.3, 0]], 0)
    add([late_label(2, "clk", 30)], [[0, 0]], 0)
    add([impression(9, clk=0), record(clk=1, buy=0)], [[0.5, 0], [0.8, 0]], 1)  # partition 1: nothing closes
    figures = matured.compute()
    # only the plain event so far: clk's windows are open (partition 0 has read up to T0 + 30 s)
    assert metrics.registry.get_sample_value("streamtrain_matured_waiting", {"task": "clk"}) == 5
    assert matured.quality["clk"].held == 1
    later = T0 + 61_000
    add([impression(10, event_time=later, impression_time=later), late_label(4, "clk", 100)], [[0.2, 0], [0, 0]], 0)
    figures = matured.compute()
    # 1..4 matured, with 2 positive (late) and 3 (at emission); 4's late label came past the window
    scores, labels = np.array([0.8, 0.1, 0.9, 0.7, 0.3]), np.array([1, 0, 1, 1, 0])
    assert figures["clk"]["window"]["auc"] == pytest.approx(roc_auc(scores, labels))
    assert matured.quality["clk"].held == 5 and matured.quality["buy"].held == 1  # buy's 600 s are open
    assert metrics.registry.get_sample_value("streamtrain_matured_waiting", {"task": "clk"}) == 2  # 9 and 10
    assert matured.positives["clk"][0].size == 0  # its impression matured


def test_delayed_matured_quality_closes_each_partitions_windows_apart_in_a_backlog():
    """A backlog is read a partition at a time: partition 1's newest impressions, still open, arrive
    before partition 0's oldest, whose window has closed."""
    from streamtrain.delayed import MaturedQuality
    from streamtrain.metrics import WorkerMetrics

    config = parse_config(delayed_raw(), environ={})
    decoder = _decoders(delayed_raw())[0]
    metrics = WorkerMetrics(100, ["clk", "buy"])
    matured = MaturedQuality(config.tasks(), window=100, max_pending=1000, metrics=metrics.late)
    late = T0 + 200_000
    newer = [impression(i, event_time=late, impression_time=late) for i in (5, 6)]
    older = [impression(1, clk=1), impression(2), late_label(2, "clk", 50), record(event_time=T0 + 100_000)]
    for records, partition in ((newer, 1), (older, 0)):
        events = [RawEvent(partition, i, AvroEncoder(SAMPLE_SCHEMA).encode(r), 0) for i, r in enumerate(records)]
        matured.add(np.zeros((len(records), 2), np.float32), decoder.decode(events).batch)
    matured.compute()
    assert matured.waiting("clk") == 2  # 5 and 6; 1 and 2 matured, 2 with its late positive
    assert matured.quality["clk"].labels[-1].tolist() == [1.0, 1.0]  # after the plain event's 0


def test_delayed_matured_quality_holds_at_most_max_pending_and_counts_what_it_drops():
    from streamtrain.delayed import MaturedQuality
    from streamtrain.metrics import WorkerMetrics

    config = parse_config(delayed_raw(), environ={})
    decoder = _decoders(delayed_raw())[0]
    metrics = WorkerMetrics(100, ["clk", "buy"])
    matured = MaturedQuality(config.tasks(), window=100, max_pending=3, metrics=metrics.late)
    batch = decoder.decode(raw_events([impression(i) for i in range(5)], partitions=1)).batch
    matured.add(np.zeros((5, 2), np.float32), batch)
    matured.compute()
    for task in ("clk", "buy"):
        assert metrics.registry.get_sample_value("streamtrain_matured_waiting", {"task": task}) == 3
        assert metrics.registry.get_sample_value("streamtrain_matured_dropped_total", {"task": task}) == 2
    assert [c["id"].tolist() for c in matured.impressions["clk"][0].chunks] == [[2, 3, 4]]  # the oldest went


# --- every built-in model and head ---------------------------------------------------------------

# Each correction trains under every built-in model, on one task or the other of one head or two.
HEAD_CORRECTIONS = {"shared_bottom": ("fnw", "pu"), "mmoe": ("es_dfm", "fnc"), "dbmtl": ("pu", "fnw")}


@pytest.mark.parametrize("multitask", list(HEAD_CORRECTIONS))
@pytest.mark.parametrize("architecture", ["dlrm", "dcn_v2", "deepfm", "din"])
def test_delayed_corrections_train_every_built_in_model_and_head(architecture, multitask):
    from streamtrain.delivery.artifact import unsharded_model

    raw = delayed_raw(*HEAD_CORRECTIONS[multitask])
    raw["model"] |= {"architecture": architecture, "multitask": multitask}
    if multitask == "dbmtl":
        raw["model"]["tasks"][1]["depends_on"] = "clk"
    config = parse_config(raw, environ={})
    decoder = _decoders(raw)[0]
    stream = [impression(i, clk=int(i % 5 == 0), cate_id=i % 9, recent_cate_ids=[i % 9]) for i in range(48)]
    stream += [late_label(i, "clk" if i % 2 else "buy", 10, cate_id=i % 9) for i in range(1, 48, 3)]
    batch = decoder.decode(raw_events(stream)).batch
    batch = LateShare(2).attach(batch)
    model = unsharded_model(config.features, config.model, config.tasks()).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for _ in range(3):
        loss, (_sum, served, _labels) = model(batch.in_global_step(batch.size, 1))
        losses.append(loss.item())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        assert served.shape == (batch.size, 2) and torch.isfinite(served).all()
    assert all(math.isfinite(value) for value in losses) and losses[-1] < losses[0]
    assert all(p.grad is not None for p in model.net.parameters())


# --- the planted delayed stream ------------------------------------------------------------------


def test_delayed_stream_is_written_as_a_joiner_writes_it_with_event_times_on_the_streams_clock():
    from streamtrain.dev.delays import Delays, SampleEncoder, joined_events
    from streamtrain.dev.drift import Drift, DriftingClickStream

    delays = Delays(click_mean=200, buy_median=300, buy_sigma=1.0, click_window=600, buy_window=1500, stream_rate=50)
    encoder = SampleEncoder(SAMPLE_SCHEMA)
    stream = DriftingClickStream(3, T0, delays.stream_rate, Drift(users=300, ads=300, lifetime=2000))
    messages = list(joined_events(stream, encoder, 3000, delays, seed=3))
    reference = AvroEncoder(SAMPLE_SCHEMA)
    decoder = _decoders(delayed_raw())[0]
    events = [RawEvent(0, i, value, 0) for i, (_key, value, _truth) in enumerate(messages)]
    batch = decoder.decode(events).batch
    assert batch.size == len(messages)  # every message is a valid sample
    samples = batch.samples
    kind, ids = samples.kind.numpy(), samples.impression_id.numpy()
    impressions = kind == ap.IMPRESSION
    assert impressions.sum() == 3000 and (kind != ap.PLAIN).all()
    first_seen: dict[int, int] = {}
    for i, impression_id in enumerate(ids.tolist()):
        first_seen.setdefault(impression_id, i)
        assert messages[i][0] == b"%d" % impression_id  # keyed by impression id
    assert all(impressions[first_seen[i]] for i in first_seen)  # an impression comes before its labels
    labels = batch.labels.numpy()
    assert (labels[impressions] == 0).all()  # emitted at once: nothing known yet
    times = batch.event_time_ms.numpy()
    # impression n is shown at T0 + n / rate seconds; a label's time is its arrival's
    position = ids[impressions] - (3 << 40)
    assert (times[impressions] == T0 + position * 1000 // 50).all()
    late = kind == ap.LATE_LABEL
    delay = samples.delay_ms.numpy()[late]
    assert (delay >= 0).all() and np.nanmax(np.where(labels[late, 0] == 1, delay, np.nan)) <= 600 * 1000 / 50
    assert samples.past_window.tolist() == [0, 0]  # the joiner dropped those
    # the truth: an impression's final label is 1 exactly when its positive arrives within the window
    truths = {int(i): t for (_k, _v, t), i in zip(messages, ids.tolist(), strict=True) if t is not None}
    for task, column in (("clk", 0), ("buy", 1)):
        arrived = set(ids[late][labels[late, column] == 1].tolist())
        assert arrived <= {i for i, t in truths.items() if getattr(t, task) == 1}
    clicked = sum(t.clk for t in truths.values())
    assert 0.1 < clicked / 3000 < 0.5 and len(arrived) > 0
    # the spliced bytes are fastavro's
    for (_key, value, _truth), i in zip(messages[:300], range(300), strict=True):
        record = fastavro.schemaless_reader(io.BytesIO(value), reference.schema)
        record["event_time"] = int(times[i])
        record["impression_time"] = int(times[i] - samples.delay_ms[i])
        assert reference.encode(record) == value


def test_delayed_produce_options_need_delays_and_valid_values(capsys):
    from streamtrain.cli import main

    assert main(["produce", "--window-click", "500"]) == 2
    assert "--window-click: only the delayed stream takes these; add --delays" in capsys.readouterr().err
    assert main(["produce", "--delays", "--stream-rate", "0"]) == 2
    assert "delays: stream_rate must be above 0" in capsys.readouterr().err


# --- on the real broker ----------------------------------------------------------------------------

DELAYED_CONFIG = REPO / "tests" / "worker-delayed.yaml"
# At 100 events a second, clk's window of 1,000 events is the config's 10 s, buy's 2,000 its 20 s.
SMALL_DELAYS = {"click_mean": 200, "buy_median": 300, "click_window": 1_000, "buy_window": 2_000, "stream_rate": 100}


def _late_labels_per_task(impressions: int, seed: int) -> dict[str, int]:
    """The label samples of each task that ``produce`` writes for these impressions (it is deterministic)."""
    from streamtrain.dev.delays import Delays, SampleEncoder, joined_events
    from streamtrain.dev.produce import ClickStream

    delays = Delays(**SMALL_DELAYS)
    counts = {"clk": 0, "buy": 0}
    decoder = _decoders(delayed_raw())[0]
    values = [value for _k, value, truth in joined_events(
        ClickStream(seed, T0, delays.stream_rate), SampleEncoder(SAMPLE_SCHEMA), impressions, delays, seed
    ) if truth is None]  # fmt: skip
    labels = decoder.decode([RawEvent(0, i, v, 0) for i, v in enumerate(values)]).batch.labels.numpy()
    counts = {task: int((labels[:, t] == 1).sum()) for t, task in enumerate(("clk", "buy"))}
    return counts


@pytest.mark.integration
def test_delayed_two_ranks_with_corrections_restore_exactly_once_after_a_sigkill(
    kafka, topic_name, start_ranks, tmp_path
):
    import signal

    from conftest import end_offsets
    from streamtrain.checkpoint import list_snapshots
    from streamtrain.dev.delays import Delays
    from streamtrain.dev.produce import produce

    root = tmp_path / "snapshots"
    env = {
        "STREAMTRAIN_CHECKPOINT__PATH": str(root),
        "STREAMTRAIN_CHECKPOINT__INTERVAL_STEPS": "3",
        "STREAMTRAIN_BATCHING__BATCH_SIZE": "64",
    }
    report = produce(
        kafka.bootstrap_servers,
        topic_name,
        2000,
        partitions=4,
        seed=46,
        schema_path=SAMPLE_SCHEMA,
        delays=Delays(**SMALL_DELAYS),
    )
    assert report.late_labels > 0
    ranks = start_ranks(topic_name, 2, env=env, config=DELAYED_CONFIG)
    ranks[0].wait_for(
        lambda: any(s.complete and s.step >= 3 for s in list_snapshots(str(root))), 180, "a snapshot past step 0"
    )
    for rank in ranks:
        rank.signal(signal.SIGKILL)
    assert all(r.wait(timeout=60) != 0 for r in ranks)

    again = start_ranks(topic_name, 2, "--until-end", env=env, config=DELAYED_CONFIG)
    assert [r.wait(timeout=180) for r in again] == [0, 0], again[0].output()[-3000:]
    assert "restored " in again[0].output()
    stream = list_snapshots(str(root))[0].metadata["stream"]
    produced = end_offsets(kafka, topic_name)
    assert {int(p): n for p, n in stream["trained"].items()} == produced
    assert {int(p): o for p, o in stream["next_offsets"].items()} == produced
    # the late share's counts, per partition in the snapshot, hold each late positive once: none
    # counted twice by the replay after the kill, none lost
    counts = np.sum(list(stream["positives"].values()), axis=0).reshape(2, 2)
    assert counts[0].tolist() == [0, 0]  # the joiner knew no positive at emission
    expected = _late_labels_per_task(2000, 46)
    assert counts[1].tolist() == [expected["clk"], expected["buy"]]


IMPRESSIONS = 16_000  # about 80 steps of 256: enough for clk to learn something


@pytest.mark.integration
def test_delayed_worker_reports_matured_quality_beside_the_provisional_on_a_small_real_stream(
    kafka, topic_name, start_worker
):
    from streamtrain.dev.delays import Delays
    from streamtrain.dev.produce import produce

    report = produce(
        kafka.bootstrap_servers,
        topic_name,
        IMPRESSIONS,
        partitions=4,
        seed=47,
        schema_path=SAMPLE_SCHEMA,
        delays=Delays(**SMALL_DELAYS),
    )
    worker = start_worker(topic_name, config=DELAYED_CONFIG)
    trained = lambda: worker.total("streamtrain_events_trained_total")  # noqa: E731
    worker.wait_for(lambda: trained() >= report.produced, timeout=180, what="the stream trained")
    expected = _late_labels_per_task(IMPRESSIONS, 47)

    def matured() -> dict[str, float] | None:
        samples = worker.scrape()
        key = 'streamtrain_progressive_auc{maturity="matured",task="%s",window="window"}'
        return samples if all(key % task in samples for task in ("clk", "buy")) else None

    samples = worker.wait_for(matured, timeout=30, what="matured figures")
    for task in ("clk", "buy"):
        labels = {"maturity": "matured", "task": task, "window": "window"}
        provisional = {**labels, "maturity": "provisional"}
        key = "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"
        provisional_key = "{" + ",".join(f'{k}="{v}"' for k, v in sorted(provisional.items())) + "}"
        # a few thousand events teach clk something; buy's hundred or so positives hardly anything yet
        assert samples["streamtrain_progressive_auc" + key] > (0.55 if task == "clk" else 0), (task, samples)
        assert samples["streamtrain_progressive_calibration" + provisional_key] > 0
        trained_key = f'streamtrain_late_labels_total{{outcome="trained",task="{task}"}}'
        assert samples[trained_key] == expected[task]
        assert samples[f'streamtrain_late_label_delay_seconds_count{{task="{task}"}}'] == expected[task]
        assert samples[f'streamtrain_late_positive_share{{task="{task}"}}'] == 1.0  # every label came late
        # the newest 10 s (clk) and 20 s (buy) of each partition are still open
        assert 0 < samples[f'streamtrain_matured_waiting{{task="{task}"}}'] < IMPRESSIONS


def test_delayed_stream_with_a_joiner_that_waits_carries_the_early_positives_on_the_impression():
    """ES-DFM's elapsed time: the joiner holds each impression W events; positives known by then come
    on it, later ones as label samples, and the late share the worker estimates is their share."""
    from streamtrain.dev.delays import Delays, SampleEncoder, joined_events
    from streamtrain.dev.produce import ClickStream

    delays = Delays(click_mean=200, buy_median=300, click_window=1_000, buy_window=2_000, stream_rate=100, wait=100)
    messages = list(joined_events(ClickStream(5, T0, 100), SampleEncoder(SAMPLE_SCHEMA), 4000, delays, seed=5))
    batch = _decoders(delayed_raw())[0].decode([RawEvent(0, i, v, 0) for i, (_k, v, _t) in enumerate(messages)]).batch
    kind, labels = batch.samples.kind.numpy(), batch.labels.numpy()
    impressions = kind == ap.IMPRESSION
    known = impressions & (labels[:, 0] == 1)
    late = (kind == ap.LATE_LABEL) & (labels[:, 0] == 1)
    assert known.any() and late.any()
    assert (batch.samples.delay_ms.numpy()[late] > 100 * 1000 / 100).all()  # past the wait
    # an impression comes out W events after it was shown: its event time is W / rate seconds old then
    positions = (batch.samples.impression_id.numpy() - (5 << 40))[impressions]
    assert (np.diff(positions) > 0).all() and impressions.sum() < 4000  # the last W still held
    share = LateShare(2)
    share.attach(batch)
    click_share = share.share()[0]
    # an exponential delay of mean 200 events is past a wait of 100 with probability e^-1/2, within the window
    expected = (math.exp(-0.5) - math.exp(-5)) / (1 - math.exp(-5))
    assert click_share == pytest.approx(expected, abs=0.05)
    with_share = _corrections("es_dfm", "none").weights(
        torch.zeros(1, 2), torch.tensor([1], dtype=torch.int8), torch.tensor([click_share, 1.0])
    )
    fnw = _corrections("fnw", "none").weights(torch.zeros(1, 2), torch.tensor([1], dtype=torch.int8), None)
    assert with_share[0][0, 0] < fnw[0][0, 0]  # es_dfm weighs a positive less than fnw when some come at once
