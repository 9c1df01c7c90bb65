import socket
import warnings

import numpy as np
import pytest

from streamtrain.config import ConfigError
from streamtrain.metrics import Health, ProgressiveQuality, TaskQualities, WorkerMetrics, roc_auc


def brute_force_auc(scores, labels) -> float:
    pos, neg = scores[labels == 1], scores[labels == 0]
    wins = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    return wins / (pos.size * neg.size)


@pytest.mark.parametrize("seed", range(5))
def test_roc_auc_matches_the_definition_with_ties(seed):
    rng = np.random.default_rng(seed)
    scores = rng.integers(0, 20, 500).astype(float)  # many ties
    labels = (rng.random(500) < 0.3).astype(int)
    assert roc_auc(scores, labels) == pytest.approx(brute_force_auc(scores, labels))


def test_roc_auc_of_one_class_is_nan():
    assert np.isnan(roc_auc(np.array([0.1, 0.2]), np.array([1, 1])))


def logit(p):
    p = np.clip(np.asarray(p, dtype=float), 1e-6, 1 - 1e-6)
    return np.log(p / (1 - p))


def test_progressive_quality_keeps_only_the_window():
    quality = ProgressiveQuality(window=100)
    quality.add(logit([0.99] * 100), np.array([0] * 100))  # perfectly wrong, then pushed out
    for _ in range(5):
        quality.add(logit(np.linspace(0.01, 0.99, 50)), (np.linspace(0, 1, 50) > 0.5).astype(int))
    assert quality.compute()["window"]["auc"] == 1.0
    assert quality.held <= 150
    lifetime = quality.compute()["lifetime"]["auc"]
    assert 0.5 < lifetime < 1.0  # the wrong start still counts over the lifetime


def test_ne_and_calibration_of_a_perfectly_calibrated_predictor():
    rng = np.random.default_rng(0)
    p = rng.uniform(0.05, 0.95, 200_000)
    y = (rng.random(p.size) < p).astype(int)
    quality = ProgressiveQuality(window=p.size)
    quality.add(logit(p), y)
    for window in ("window", "lifetime"):
        figures = quality.compute()[window]
        assert figures["calibration"] == pytest.approx(1.0, abs=0.01)
        assert 0.6 < figures["ne"] < 0.95  # informative scores beat the base rate
        assert figures["auc"] == pytest.approx(roc_auc(p, y), abs=0.002)
    rate_only = ProgressiveQuality(window=p.size)
    rate_only.add(logit(np.full(p.size, y.mean())), y)
    assert rate_only.compute()["window"]["ne"] == pytest.approx(1.0, abs=1e-3)


def test_progressive_quality_of_extreme_logits_does_not_overflow():
    quality = ProgressiveQuality(window=10)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        quality.add(np.array([-1000.0, 1000.0, -1000.0, 1000.0]), np.array([0, 1, 1, 0]))
        figures = quality.compute()["window"]
    assert figures["auc"] == 0.5
    assert figures["calibration"] == pytest.approx(1.0)  # two certain clicks predicted, two clicks
    assert np.isfinite(figures["ne"])


def test_per_step_quality_is_folded_in_bounded_chunks_with_the_same_figures():
    rng = np.random.default_rng(1)
    steps = [(rng.normal(size=1024), (rng.random(1024) < 0.2).astype(np.float32)) for _ in range(40)]
    folded = TaskQualities(["clk"], window=30_000)
    at_once = ProgressiveQuality(window=30_000)
    held_back = []
    for logits, labels in steps:
        folded.add(logits, labels)
        held_back.append(folded.by_task["clk"].sums[3])
    # The training thread's add folds at most every FOLD_EVENTS events: never more held back.
    assert max(i * 1024 + 1024 - held for i, held in enumerate(held_back)) < TaskQualities.FOLD_EVENTS
    assert held_back[0] == 0  # one step's arrays alone are only kept
    at_once.add(np.concatenate([s[0] for s in steps]), np.concatenate([s[1] for s in steps]))
    expected, figures = at_once.compute(), folded.compute()["clk"]
    for window in ("window", "lifetime"):
        assert figures[window] == pytest.approx(expected[window])


def test_a_metrics_port_in_use_is_a_config_error_naming_the_settings_and_the_fix():
    """Two workers on one host given one metrics port: the second says which setting to change,
    where it crashed with a bare OSError traceback (the worker exits 2 on a ConfigError)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        metrics = WorkerMetrics()
        with pytest.raises(ConfigError, match=rf"127\.0\.0\.1:{port}: Address already in use") as refused:
            metrics.serve("127.0.0.1", port, Health(60))
        assert "metrics.port" in str(refused.value) and "metrics.host" in str(refused.value)
    metrics = WorkerMetrics()
    assert metrics.serve("127.0.0.1", 0, Health(60)) > 0  # the port 0 the message offers
    metrics.close()
