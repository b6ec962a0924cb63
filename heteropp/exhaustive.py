"""Exhaustive search over HeteroAuto's space, for small cases: every s_dp dividing B, every
(tp, r) per group and every layers-per-stage vector k within each group's memory limit.
It shares only the objective with ``HeteroAuto`` (the paper's T, P2P, memory limits), none
of the pruning or layer-sharding heuristics, so it checks that the heuristic search finds
the optimum of that objective."""
from __future__ import annotations

import itertools
import math

from .search import Group, HeteroAuto, NoFeasiblePlan, SearchResult
from .search.sharding import group_choices, objective


def exhaustive_search(auto: HeteroAuto, groups: list[Group] | None = None, dps: list[int] | None = None,
                      max_leaves: int = 2_000_000) -> SearchResult:
    """The optimum of the paper's T over the whole space (one group per chip type by default)."""
    groups = groups or [Group(c, c.count, i) for i, c in enumerate(auto.types)]
    dps = dps or [dp for dp in range(1, auto.batch + 1) if auto.batch % dp == 0]
    L, G = auto.model.n_layers, len(groups)
    best: SearchResult | None = None
    evaluated = 0
    for dp in dps:
        b = auto.batch // dp
        all_opts = [auto.space.options(g, dp) for g in groups]
        if any(not o for o in all_opts):
            continue
        for opts in itertools.product(*all_opts):
            if sum(o.s for o in opts) > L:
                continue
            caps, suffix = [0] * G, 0
            for gi in range(G - 1, -1, -1):
                caps[gi] = auto.space.max_layers(groups[gi], opts[gi], dp, suffix, first=gi == 0, last=gi == G - 1)
                suffix += opts[gi].s
            if min(caps) < 1:
                continue
            pmax, psum = auto.space.p2p_terms(groups, opts, dp)
            # k above ceil(L / s) only adds layers past L; T is monotone in k, so those never win
            for ks in itertools.product(*[range(1, min(c, -(-L // o.s)) + 1) for c, o in zip(caps, opts)]):
                if sum(o.s * k for o, k in zip(opts, ks)) < L:
                    continue
                evaluated += 1
                if evaluated > max_leaves:
                    raise ValueError(f"exhaustive search: more than {max_leaves} configurations; use a smaller case")
                v = objective(auto.alpha, b, opts, ks, pmax, psum)
                if best is None or v < best.objective - 1e-12:
                    best = SearchResult(dp=dp, groups=list(groups), choices=group_choices(opts, list(ks), L), objective=v)
    if best is None:
        raise NoFeasiblePlan("exhaustive search: no configuration fits")
    best.leaves = evaluated
    return best
