"""tau*, the deployment choice and the Nesterov outer step against independent references."""
import itertools
import math
import random

import pytest
import torch

from dips.deployment import choose_deployment
from dips.grace import GraceEstimator, optimal_grace
from dips.outer_optimizer import NesterovOuter


@pytest.mark.parametrize("lam,cm", [(2.0, 3.0), (0.5, 10.0), (10.0, 0.4), (1.0, 1.5)])
def test_grace_minimizes_expected_cost(lam, cm):
    cost = lambda tau: tau + cm * math.exp(-lam * tau)  # noqa: E731
    grid = [i * 1e-4 for i in range(200_000)]
    best = min(grid, key=cost)
    assert optimal_grace(lam, cm) == pytest.approx(best, abs=2e-4)


def test_grace_is_zero_when_waiting_never_pays():
    assert optimal_grace(1.0, 0.5) == 0.0
    assert optimal_grace(0.0, 5.0) == 0.0


def test_estimator_recovers_rate_from_poisson_arrivals():
    rng = random.Random(0)
    est = GraceEstimator(window=400)
    t = 0.0
    for _ in range(400):
        t += rng.expovariate(4.0)
        est.observe_arrival(t)
    for c in (0.9, 1.1, 1.0):
        est.observe_cost(c)
    assert est.arrival_rate == pytest.approx(4.0, rel=0.15)
    assert est.grace() == pytest.approx(optimal_grace(est.arrival_rate, 1.0))


def test_estimator_uses_initial_until_it_has_data():
    est = GraceEstimator(initial=0.2)
    est.observe_arrival(1.0)
    assert est.grace() == 0.2


def test_deployment_hand_case():
    # candidate 1 has the fast link to the fast cluster: 10*4 + 1*1 = 41 beats 5*4 + 5*1 = 25
    assert choose_deployment([[5, 5], [10, 1]], [4, 1]) == 1
    assert choose_deployment([[5, 5], [10, 1]], [1, 4]) == 0


def test_deployment_matches_exhaustive_dot_products():
    rng = random.Random(1)
    for _ in range(50):
        n, m = rng.randint(1, 5), rng.randint(1, 6)
        b = [[rng.uniform(0, 10) for _ in range(m)] for _ in range(n)]
        p = [rng.uniform(0, 5) for _ in range(m)]
        scores = (torch.tensor(b, dtype=torch.float64) @ torch.tensor(p, dtype=torch.float64)).tolist()
        assert choose_deployment(b, p) == max(range(n), key=lambda i: scores[i])


def test_deployment_bad_shape_named():
    with pytest.raises(ValueError, match="row 0 has 1 entries; expected 2"):
        choose_deployment([[1.0]], [1.0, 2.0])


@pytest.mark.parametrize("lr,momentum", [(0.7, 0.8), (1.0, 0.9), (0.3, 0.0)])
def test_nesterov_matches_torch_sgd(lr, momentum):
    gen = torch.Generator().manual_seed(0)
    theta0 = {"a": torch.randn(5, 3, generator=gen), "b": torch.randn(7, generator=gen)}
    grads = [{k: torch.randn(v.shape, generator=gen) for k, v in theta0.items()} for _ in range(6)]
    ref = {k: torch.nn.Parameter(v.clone()) for k, v in theta0.items()}
    sgd = torch.optim.SGD(list(ref.values()), lr=lr, momentum=momentum, nesterov=momentum > 0)
    mine, bufs = {k: v.clone() for k, v in theta0.items()}, {}
    opt = NesterovOuter(lr, momentum)
    for g in grads:
        for k, p in ref.items():
            p.grad = g[k].clone()
        sgd.step()
        opt.step(mine, g, bufs)
    for k in theta0:
        torch.testing.assert_close(mine[k], ref[k].detach(), rtol=0, atol=1e-6)
