"""Several tasks from one stream: config, labels (required ones dead-lettered, others masked), the
shared_bottom, mmoe and dbmtl heads on real TorchRec, per-task quality, and the snapshot fingerprint."""

import copy
import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml

from streamtrain.checkpoint import compatibility_fingerprint, fingerprint_differences
from streamtrain.config import ConfigError, parse_config
from streamtrain.decode import AvroBatchDecoder, FastavroDecoder
from streamtrain.dev.produce import AvroEncoder, ClickStream
from streamtrain.device import init_distributed
from streamtrain.heads import DBMTL
from streamtrain.metrics import TaskQualities, WorkerMetrics, roc_auc
from streamtrain.source import RawEvent
from streamtrain.train import Trainer
from streamtrain.worker import _Progress

REPO = Path(__file__).resolve().parent.parent
SCHEMA = REPO / "schemas" / "click_event.avsc"
TASKS = [
    {"name": "ctr", "label": "clk"},
    {"name": "cvr", "label": "buy", "loss_weight": 2.0, "required": False},
]


def raw_config(tasks=TASKS, **model) -> dict:
    raw = yaml.safe_load((REPO / "tests" / "worker-small.yaml").read_text())
    raw["kafka"] = {"bootstrap_servers": "unused:9092", "topic": "unused"}
    if tasks is not None:
        del raw["features"]["label"]
        raw["model"]["tasks"] = copy.deepcopy(tasks)
    raw["model"].update(model)
    return raw


@pytest.fixture(scope="module")
def nullable_buy_schema(tmp_path_factory) -> Path:
    """The reference schema with buy nullable: a purchase not known yet."""
    schema = json.loads(SCHEMA.read_text())
    for field in schema["fields"]:
        if field["name"] == "buy":
            field["type"], field["default"] = ["null", "int"], None
    path = tmp_path_factory.mktemp("schema") / "click_event.avsc"
    path.write_text(json.dumps(schema))
    return path


def events(schema: Path, records: list[dict]) -> list[RawEvent]:
    encoder = AvroEncoder(schema)
    return [RawEvent(0, i, encoder.encode(r), 0) for i, r in enumerate(records)]


# --- config ------------------------------------------------------------------------------------


def test_the_single_label_config_is_one_required_task_named_after_its_label():
    config = parse_config(raw_config(tasks=None), environ={})
    (task,) = config.tasks()
    assert (task.name, task.label, task.loss_weight, task.required) == ("clk", "clk", 1.0, True)
    assert [t.name for t in parse_config(raw_config(), environ={}).tasks()] == ["ctr", "cvr"]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda c: c["features"].update(label="clk"), "features.label is the single-task form"),
        (lambda c: c["model"]["tasks"][1].update(label="byu"), "model.tasks.1.label: 'byu' is not a field"),
        (lambda c: c["model"]["tasks"][1].update(label="pid"), "model.tasks.1.label: field 'pid' is string"),
        (lambda c: c["model"]["tasks"][1].update(name="ctr"), "task names must be unique"),
        (lambda c: c["model"]["tasks"][1].update(loss_weight=0), "model.tasks.1.loss_weight"),
        (lambda c: c["model"].update(multitask="ple"), "model.multitask"),
        (lambda c: c["model"]["tasks"][1].update(depends_on="ctr"), "model.tasks.1.depends_on: only dbmtl reads it"),
        (
            lambda c: c["model"].update(multitask="dbmtl") or c["model"]["tasks"][0].update(depends_on="cvr"),
            "model.tasks.0.depends_on: 'cvr' is not a task listed before 'ctr'",
        ),
        (
            lambda c: c["model"].update(multitask="dbmtl") or c["model"]["tasks"][1].update(depends_on="ctrr"),
            "model.tasks.1.depends_on: 'ctrr' is not a task listed before",
        ),
    ],
)
def test_bad_task_configs_are_refused_naming_the_field(change, message):
    raw = raw_config()
    change(raw)
    with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("'", ".")):
        parse_config(raw, environ={})


# --- labels ------------------------------------------------------------------------------------


@pytest.mark.parametrize("decoder_class", [AvroBatchDecoder, FastavroDecoder])
def test_a_null_label_is_masked_unless_its_task_is_required(decoder_class, nullable_buy_schema):
    records = ClickStream(seed=4).chunk(4).records
    records[1]["buy"] = None
    raw = raw_config()
    raw["features"]["schema_path"] = str(nullable_buy_schema)
    config = parse_config(raw, environ={})
    batch = decoder_class(config.features, tasks=config.tasks()).decode(events(nullable_buy_schema, records)).batch
    assert batch.labels.shape == (4, 2)
    assert batch.labels[:, 0].tolist() == [float(r["clk"]) for r in records]
    assert np.isnan(batch.labels[1, 1].item()) and not batch.labels[[0, 2, 3], 1].isnan().any()

    raw["model"]["tasks"][1]["required"] = True
    config = parse_config(raw, environ={})
    result = decoder_class(config.features, tasks=config.tasks()).decode(events(nullable_buy_schema, records))
    assert [(e.offset, reason) for e, reason in result.rejected] == [(1, "missing_label")]
    assert result.batch.size == 3


def test_a_masked_label_adds_nothing_to_the_loss_and_the_weights_scale_each_task():
    config = parse_config(raw_config(), environ={})
    records = ClickStream(seed=5).chunk(64).records
    batch = AvroBatchDecoder(config.features, tasks=config.tasks()).decode(events(SCHEMA, records)).batch
    labels = batch.labels.clone()
    labels[::2, 1] = float("nan")
    trainer = Trainer(config, init_distributed())
    (result,) = list(trainer.train(iter([batch.__class__(**{**batch.__dict__, "labels": labels})])))
    logits = torch.as_tensor(result.logits)
    assert logits.shape == (64, 2)
    expected = F.binary_cross_entropy_with_logits(logits[:, 0], labels[:, 0], reduction="sum")
    expected += 2.0 * F.binary_cross_entropy_with_logits(logits[1::2, 1], labels[1::2, 1], reduction="sum")
    assert result.loss_sum == pytest.approx(float(expected), rel=1e-5)


# --- heads -------------------------------------------------------------------------------------


DBMTL_TASKS = [TASKS[0], {**TASKS[1], "depends_on": "ctr"}]


@pytest.mark.parametrize("multitask", ["shared_bottom", "mmoe", "dbmtl"])
def test_each_architecture_learns_both_tasks_on_shared_tables(multitask):
    tasks = DBMTL_TASKS if multitask == "dbmtl" else TASKS
    config = parse_config(raw_config(tasks, multitask=multitask, num_experts=3), environ={})
    trainer = Trainer(config, init_distributed())
    names = list(trainer.model.state_dict())
    assert any(n.startswith("dlrm.sparse_arch.") for n in names)
    assert any(".towers.ctr." in n for n in names) and any(".towers.cvr." in n for n in names)
    assert any(".experts.2." in n for n in names) == (multitask == "mmoe")
    decoder = AvroBatchDecoder(config.features, tasks=config.tasks())
    stream = ClickStream(seed=6)
    batches = [decoder.decode(events(SCHEMA, stream.chunk(256).records)).batch for _ in range(40)]
    batches.insert(1, decoder.decode([]).batch)  # a lockstep filler: [0, 2] labels add nothing
    quality = TaskQualities(["ctr", "cvr"], window=4096)
    for result in trainer.train(iter(batches)):
        assert result.logits.shape == (result.batch.size, 2) and np.isfinite(result.loss_sum)
        quality.add(result.logits.numpy(), result.batch.labels.numpy())
    figures = quality.compute()
    # 10k events: both tasks are well above chance (buy has ~300 positives)
    assert figures["ctr"]["window"]["auc"] > 0.6
    assert figures["cvr"]["window"]["auc"] > 0.6


def test_a_dbmtl_task_reads_the_tower_of_the_task_it_depends_on():
    config = parse_config(raw_config(DBMTL_TASKS, multitask="dbmtl"), environ={})
    heads = DBMTL(40, config.tasks(), config.model, torch.device("cpu"))
    hidden = config.model.over_arch_layer_sizes[-2]
    assert heads.logits["ctr"].in_features == hidden and heads.logits["cvr"].in_features == 2 * hidden
    interaction = torch.randn(32, 40)

    def logits_after_scaling(task: str) -> torch.Tensor:
        with torch.no_grad():
            heads.towers[task]._mlp[0]._linear.weight.mul_(3.0)
            return heads(interaction)

    before = heads(interaction)
    assert before.shape == (32, 2)
    after_ctr = logits_after_scaling("ctr")
    # buy's logit moves with clk's tower ...
    assert not torch.allclose(after_ctr[:, 1], before[:, 1]) and not torch.allclose(after_ctr[:, 0], before[:, 0])
    # ... and clk's logit does not move with buy's
    after_cvr = logits_after_scaling("cvr")
    assert torch.equal(after_cvr[:, 0], after_ctr[:, 0]) and not torch.allclose(after_cvr[:, 1], after_ctr[:, 1])
    # buy's loss trains clk's tower: the dependency is not cut from the graph
    heads(interaction)[:, 1].sum().backward()
    assert heads.towers["ctr"]._mlp[0]._linear.weight.grad.abs().sum() > 0


def test_one_task_is_dlrm_exactly_so_its_snapshots_keep_their_names():
    config = parse_config(raw_config(tasks=None), environ={})
    trainer = Trainer(config, init_distributed())
    assert any(n.startswith("dlrm.over_arch.model.") for n in trainer.model.state_dict())
    assert not any("towers" in n for n in trainer.model.state_dict())


# --- quality -----------------------------------------------------------------------------------


def test_each_task_has_its_own_progressive_figures_and_masked_labels_are_left_out(caplog):
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(1000, 2))
    labels = (rng.random((1000, 2)) < 0.3).astype(np.float32)
    labels[::3, 1] = np.nan
    metrics = WorkerMetrics(10_000, ["ctr", "cvr"])
    metrics.task_quality.add(logits, labels)
    figures = metrics.task_quality.compute()
    assert figures["ctr"]["window"]["auc"] == pytest.approx(roc_auc(logits[:, 0], labels[:, 0]))
    known = ~np.isnan(labels[:, 1])
    assert figures["cvr"]["window"]["auc"] == pytest.approx(roc_auc(logits[known, 1], labels[known, 1]))
    assert metrics.task_quality.by_task["cvr"].sums[3] == known.sum()

    with caplog.at_level(logging.INFO, logger="streamtrain.worker"):
        _Progress(metrics, 0, "clicks", 3600, lambda: 0, []).report()
    assert "progressive AUC ctr 0." in caplog.text and ", cvr 0." in caplog.text
    for task in ("ctr", "cvr"):
        value = metrics.registry.get_sample_value(
            "streamtrain_progressive_auc", {"task": task, "window": "window", "maturity": "provisional"}
        )
        assert value == pytest.approx(figures[task]["window"]["auc"])


# --- snapshots ---------------------------------------------------------------------------------


def test_the_fingerprint_covers_the_heads_but_not_labels_or_weights():
    config = parse_config(raw_config(), environ={})
    ours = compatibility_fingerprint(config)

    def differences(**model) -> list[str]:
        other = parse_config(raw_config(**model), environ={})
        return fingerprint_differences(ours, compatibility_fingerprint(other), config)

    tasks = copy.deepcopy(TASKS)
    tasks[1].update(loss_weight=5.0, required=True)
    assert differences(tasks=tasks) == []
    assert differences(multitask="mmoe") != []
    dbmtl = compatibility_fingerprint(parse_config(raw_config(DBMTL_TASKS, multitask="dbmtl"), environ={}))
    assert dbmtl["heads"]["depends_on"] == {"cvr": "ctr"}
    # a dependency widens the logit layer: a snapshot without it does not fit
    independent = compatibility_fingerprint(parse_config(raw_config(multitask="dbmtl"), environ={}))
    assert fingerprint_differences(independent, dbmtl, config) != []
    assert differences(tasks=[*TASKS, {"name": "fav", "label": "buy"}]) != []

    # snapshots written before multi-task carry no heads: DLRM's, which a one-task config has
    single = parse_config(raw_config(tasks=None), environ={})
    theirs = compatibility_fingerprint(single)
    del theirs["heads"]
    assert fingerprint_differences(compatibility_fingerprint(single), theirs, single) == []
    assert fingerprint_differences(ours, theirs, config) != []


# --- the worker, on the real broker --------------------------------------------------------------


@pytest.mark.integration
def test_a_two_task_worker_trains_both_heads_and_exports_each_tasks_quality(kafka, topic_name, start_worker, tmp_path):
    from streamtrain.dev.produce import produce

    report = produce(kafka.bootstrap_servers, topic_name, 12_000, partitions=4, seed=9, schema_path=SCHEMA)
    config = tmp_path / "two-tasks.yaml"
    config.write_text(yaml.safe_dump(raw_config(multitask="mmoe")))
    worker = start_worker(topic_name, "--until-end", config=config)
    assert worker.wait(timeout=120) == 0, worker.output()[-3000:]
    output = worker.output()
    assert "progressive AUC ctr 0." in output and ", cvr 0." in output
    # the labels in the stream are never null: nothing was dead-lettered, every event trained
    assert "12,000 events trained" in output, output[-2000:]
    assert report.bayes_aucs["buy"] > report.bayes_aucs["clk"]


@pytest.mark.integration
def test_dbmtl_trains_both_heads_on_two_ranks_with_each_tasks_quality(kafka, topic_name, start_ranks, tmp_path):
    from streamtrain.dev.produce import produce

    produce(kafka.bootstrap_servers, topic_name, 8_000, partitions=4, seed=10, schema_path=SCHEMA)
    config = tmp_path / "dbmtl.yaml"
    # with the reference config's target match: each rank counts matches in its own batches
    matches = [{"candidate": "cate_id", "history": "recent_cate_ids"}]
    config.write_text(yaml.safe_dump(raw_config(DBMTL_TASKS, multitask="dbmtl", target_matches=matches)))
    # the last --config wins: the ranks start with the small config's, then this one
    ranks = start_ranks(topic_name, 2, "--until-end", "--config", str(config))
    assert [r.wait(timeout=180) for r in ranks] == [0, 0], ranks[0].output()[-3000:] + ranks[1].output()[-3000:]
    trained = 0
    for rank in ranks:
        output = rank.output()
        assert "progressive AUC ctr 0." in output and ", cvr 0." in output, output[-2000:]
        trained += int(output.split(" events trained")[0].rsplit(" ", 1)[1].replace(",", ""))
    assert trained == 8_000
