import numpy as np
import pytest

from streamtrain.metrics import ProgressiveAUC, roc_auc


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


def test_progressive_auc_keeps_only_the_window():
    auc = ProgressiveAUC(window=100)
    auc.add(np.array([1.0] * 100), np.array([0] * 100))  # perfectly wrong, then pushed out
    for _ in range(5):
        auc.add(np.linspace(0, 1, 50), (np.linspace(0, 1, 50) > 0.5).astype(int))
    assert auc.value() == 1.0
    assert auc.held <= 150
