"""Layer sharding at a leaf (heteropp/search/sharding.py) against enumeration of every
layers-per-stage vector: the cover is the cheapest, and T is the smallest, over random groups."""
from __future__ import annotations

import itertools
import random

import pytest

from heteropp.search.sharding import min_cost_cover, objective, shard_layers
from heteropp.search.space import StageOption


def random_options(rng: random.Random, groups: int, layers: int) -> list[StageOption]:
    out = []
    for _ in range(groups):
        s = rng.randint(1, max(1, layers // groups))
        c, u = rng.uniform(0.1, 3.0), rng.uniform(0.0, 1.0)
        out.append(StageOption(tp=1, r=False, s=s, c=c, u=u, w=0.0, state=0, act=0, work=0, key=(1, False), m_ub=layers))
    return out


def vectors(opts, caps, L):
    for ks in itertools.product(*[range(1, cap + 1) for cap in caps]):
        if sum(o.s * k for o, k in zip(opts, ks)) >= L:
            yield ks


@pytest.mark.parametrize("seed", range(40))
def test_min_cost_cover_is_the_cheapest_cover(seed):
    rng = random.Random(seed)
    L = rng.randint(1, 24)
    opts = random_options(rng, rng.randint(1, 4), L)
    lims = [rng.randint(1, 8) for _ in opts]
    cost = lambda ks: sum(o.s * o.c * k for o, k in zip(opts, ks))
    covers = list(vectors(opts, lims, L))
    got = min_cost_cover(L, opts, lims)
    if not covers:
        assert got is None
        return
    assert got is not None and sum(o.s * k for o, k in zip(opts, got[1])) >= L
    assert got[0] == pytest.approx(min(cost(ks) for ks in covers), rel=1e-12)
    assert got[0] == pytest.approx(cost(got[1]), rel=1e-12)


@pytest.mark.parametrize("seed", range(60))
def test_shard_layers_minimises_t_over_every_layer_vector(seed):
    rng = random.Random(1000 + seed)
    L = rng.randint(2, 20)
    opts = random_options(rng, rng.randint(1, 4), L)
    caps = [rng.randint(1, 10) for _ in opts]
    alpha, b = rng.choice([0.0, 0.5, 1.0]), rng.randint(2, 16)
    pmax = [rng.uniform(0, 0.5) for _ in opts]
    psum = [p * o.s for p, o in zip(pmax, opts)]
    candidates = list(vectors(opts, caps, L)) if sum(o.s for o in opts) <= L else []
    got = shard_layers(L, alpha, b, opts, caps, pmax, psum)
    if not candidates:
        assert got is None
        return
    best = min(objective(alpha, b, opts, ks, pmax, psum) for ks in candidates)
    assert got is not None and got[0] == pytest.approx(best, rel=1e-9)
    assert got[0] == pytest.approx(objective(alpha, b, opts, got[1], pmax, psum), rel=1e-12)
