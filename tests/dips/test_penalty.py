"""Pseudo-gradient penalty against the paper's formulas computed here by hand."""
import math
import random

import pytest

from dips.penalty import PseudoGradientPenalty, token_weights


def reference_ema(norms, alpha, mu, sigma):
    for g in norms:
        mu_next = alpha * g + (1 - alpha) * mu
        sigma = math.sqrt((1 - alpha) * sigma ** 2 + alpha * (g - mu_next) ** 2)
        mu = mu_next
    return mu, sigma


def test_ema_recurrence_and_scores_match_paper():
    pen = PseudoGradientPenalty(alpha=0.02, beta=3, warmup=3)
    warm = [10.0, 12.0, 11.0]
    for g in warm:
        pen.decide({"p": g}, {"p": 1})
    mu0 = 11.0                                         # the median of the warm-up norms
    sigma0 = max(1.4826 * 1.0, 0.05 * mu0)             # 1.4826 x their median absolute deviation
    later = [10.5, 11.5, 9.8, 10.9]
    for g in later:
        expected_score = (g - pen.mu) / pen.sigma
        d = pen.decide({"p": g}, {"p": 1})
        assert d.scores["p"] == pytest.approx(expected_score)
        assert d.accepted == ["p"]
    mu, sigma = reference_ema(later, 0.02, mu0, sigma0)
    assert pen.mu == pytest.approx(mu) and pen.sigma == pytest.approx(sigma)


def test_outlier_rejected_and_excluded_from_statistics():
    pen = PseudoGradientPenalty(warmup=3)
    for g in [10.0, 11.0, 9.0, 10.5, 9.5]:
        pen.decide({"x": g}, {"x": 1})
    mu, sigma = pen.mu, pen.sigma
    d = pen.decide({"good": 10.2, "poisoned": 10.0 * 99}, {"good": 100, "poisoned": 100})
    assert d.accepted == ["good"] and d.rejected == ["poisoned"]
    assert d.weights == {"good": 1.0}
    assert d.scores["poisoned"] > pen.threshold()
    assert pen.mu == pytest.approx(0.02 * 10.2 + 0.98 * mu)  # only the accepted norm entered
    assert pen.sigma != sigma


def test_threshold_is_beta_times_max_recent_score_with_floor():
    pen = PseudoGradientPenalty(beta=3, warmup=1)
    pen.decide({"a": 10.0}, {"a": 1})
    assert pen.threshold() == 3.0          # empty stack: floor 1
    pen.stack.extend([0.5, 2.0, -1.0])
    assert pen.threshold() == pytest.approx(6.0)
    pen.stack.clear()
    pen.stack.extend([-2.0, -1.5])         # shrinking norms: all scores negative
    assert pen.threshold() == 3.0


def test_shrinking_norms_are_not_rejected():
    pen = PseudoGradientPenalty(warmup=3)
    rejected = 0
    for i in range(200):
        g = 20.0 * 0.98 ** i
        rejected += len(pen.decide({"p": g}, {"p": 1}).rejected)
    assert rejected == 0


def test_token_weights_and_clip():
    assert token_weights({"a": 300, "b": 100}) == {"a": 0.75, "b": 0.25}
    assert token_weights({"a": 0, "b": 0}) == {"a": 0.5, "b": 0.5}
    pen = PseudoGradientPenalty(clip_norm=1.0)
    assert pen.clip_scale(4.0) == 0.25 and pen.clip_scale(0.5) == 1.0
    assert PseudoGradientPenalty(clip_norm=None).clip_scale(100.0) == 1.0


def test_staleness_scale_is_token_weighted_mean_of_decayed_factors():
    rng = random.Random(0)
    for _ in range(200):
        decay = rng.choice([0.0, 0.5, 1.0, rng.uniform(0, 3)])
        pushes = [f"p{i}" for i in range(rng.randint(1, 9))]
        weights = token_weights({p: rng.randint(0, 5000) for p in pushes})
        staleness = {p: rng.choice([0, 1, rng.randint(0, 200)]) for p in pushes}
        expected = 0.0
        for p in pushes:  # a push s stale counts 1 / (1 + s) ** decay of its weight
            expected += weights[p] / (1 + staleness[p]) ** decay
        got = PseudoGradientPenalty(staleness_decay=decay).staleness_scale(weights, staleness)
        assert math.isclose(got, expected, rel_tol=1e-12), (decay, weights, staleness)
        assert 0 < got <= 1 + 1e-12
    assert PseudoGradientPenalty(staleness_decay=1).staleness_scale({"a": 1.0}, {"a": 3}) == 0.25
    with pytest.raises(ValueError, match="staleness_decay"):
        PseudoGradientPenalty(staleness_decay=-1)
    with pytest.raises(ValueError, match="staleness"):
        PseudoGradientPenalty().staleness_scale({"a": 1.0}, {"a": -1})
    with pytest.raises(ValueError, match="staleness"):
        PseudoGradientPenalty().staleness_scale({"a": 1.0}, {})


def test_bad_values_named():
    with pytest.raises(ValueError, match="alpha"):
        PseudoGradientPenalty(alpha=1.5)
    with pytest.raises(ValueError, match="push p"):
        PseudoGradientPenalty().decide({"p": float("nan")}, {"p": 1})
    with pytest.raises(ValueError, match="never negative"):
        token_weights({"a": 5, "b": -1})


@pytest.mark.parametrize("at", [0, 1, 2])
def test_one_huge_warmup_push_does_not_open_the_door_to_later_outliers(at):
    """A cluster's norm of 1e6 among the three warm-up rounds (at any position) is accepted, as
    every warm-up push is; a 100x outlier afterwards is still rejected at once, and honest norms
    after it are not."""
    rng = random.Random(at)
    pen = PseudoGradientPenalty(warmup=3)
    warm = [rng.uniform(0.9, 1.1) for _ in range(3)]
    warm[at] = 1e6
    for g in warm:
        assert pen.decide({"p": g}, {"p": 1}).accepted == ["p"]
    rejected = 0
    for step in range(300):
        norms = {f"c{i}": rng.uniform(0.85, 1.15) for i in range(3)}
        if step == 5:
            norms["bad"] = 100.0
        rejected += len(pen.decide(norms, {p: 1 for p in norms}).rejected)
        if step == 5:
            assert rejected == 1, "the 100x outlier was accepted"
    assert rejected == 1, f"{rejected - 1} honest pushes were rejected"


def test_a_clean_run_rejects_nothing():
    rng = random.Random(7)
    pen = PseudoGradientPenalty(warmup=3)
    rejected = 0
    for step in range(1000):
        scale = 10.0 * 0.999 ** step  # norms shrink as training converges
        norms = {f"c{i}": scale * rng.uniform(0.8, 1.2) for i in range(4)}
        rejected += len(pen.decide(norms, {p: 1 for p in norms}).rejected)
    assert rejected == 0
