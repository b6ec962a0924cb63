"""Layer sharding at a leaf of the search: how many layers per stage each group takes, exactly
optimal for the paper's T given the groups' options and memory limits; and T itself.

T = max_g(a_g k_g + p_g) + alpha * sum_g s_g c_g k_g (+ constants), with sum_g s_g k_g >= L and
1 <= k_g <= caps_g, where a_g = (b - alpha) c_g + u_g and p_g the group's P2P term."""
from __future__ import annotations

import math
from typing import Sequence

from .results import GroupChoice
from .space import StageOption


def objective(alpha: float, b: int, opts: Sequence[StageOption], ks: Sequence[int], pmax, psum) -> float:
    """The paper's T for layers per stage ``ks`` (b micro-batches, bubble coefficient alpha)."""
    bm = b - alpha
    worst = 0.0
    total = 0.0
    for o, k, pm, ps in zip(opts, ks, pmax, psum):
        a = bm * (k * o.c + pm) + k * o.u
        if a > worst:
            worst = a
        total += o.s * k * o.c + ps
    return worst + alpha * total


def shard_layers(L: int, alpha: float, b: int, opts: Sequence[StageOption], caps: Sequence[int], pmax,
                 psum) -> tuple[float, list[int]] | None:
    """Layers per stage k_g for every group, exactly optimal for T (None: no fit).

    The optimum's bottleneck is one of the levels a_g k + p_g; for each level from the lowest
    feasible one up, the cheapest cover of L stage-layers under it is a small bounded-knapsack DP
    (min_cost_cover). Levels stop once the level plus the cheapest cover at any level cannot beat
    the best found; with alpha = 0 the lowest feasible level is the answer.
    """
    G = len(opts)
    S = sum(o.s for o in opts)
    if sum(o.s * m for o, m in zip(opts, caps)) < L or S > L:
        return None
    # A group never needs more layers per stage than cover what the others' one layer per stage
    # leaves: fewer never raise T (its level and its cost only grow with k). Memory caps that do
    # not bind (a small model on big chips) would otherwise make the levels below millions long.
    caps = [min(c, -(-(L - S + o.s) // o.s)) for o, c in zip(opts, caps)]
    bm = b - alpha
    a = [bm * o.c + o.u for o in opts]
    p = [bm * pm for pm in pmax]
    # no cover, at any level, costs less than all L layers on the cheapest group
    floor_term = alpha * (L * min(o.c for o in opts) + sum(psum))
    levels = sorted({a[i] * k + p[i] for i in range(G) for k in range(1, caps[i] + 1)})
    best: tuple[float, list[int]] | None = None
    for level in levels:
        if best is not None and level + floor_term >= best[0]:
            break
        lims = [min(caps[i], int((level - p[i]) / a[i] * (1 + 1e-12) + 1e-9)) for i in range(G)]
        if min(lims) < 1 or sum(o.s * k for o, k in zip(opts, lims)) < L:
            continue
        # the fractional cover bounds every integer one; greedy meets the bound unless the
        # last group it fills overshoots, and only then is the DP needed
        bound, greedy = greedy_cover(L, opts, lims)
        if best is not None and level + alpha * (bound + sum(psum)) >= best[0]:
            continue
        cover = greedy if greedy[0] <= bound * (1 + 1e-12) else min_cost_cover(L, opts, lims)
        if cover is None:
            continue
        value = objective(alpha, b, opts, cover[1], pmax, psum)
        if best is None or value < best[0]:
            best = (value, cover[1])
        if alpha == 0:
            break
    return best


def greedy_cover(L: int, opts: Sequence[StageOption], lims: Sequence[int]) -> tuple[float, tuple[float, list[int]]]:
    """(fractional lower bound, greedy integer cover) of min sum_g s_g c_g k_g, 1 <= k_g <=
    lims_g, sum_g s_g k_g >= L: one layer per stage everywhere, then the cheapest groups first."""
    ks = [1] * len(opts)
    bound = sum(o.s * o.c for o in opts)
    need = L - sum(o.s for o in opts)
    cost = bound
    for i in sorted(range(len(opts)), key=lambda i: opts[i].c):
        if need <= 0:
            break
        o = opts[i]
        room = (lims[i] - 1) * o.s
        take = min(room, need)
        bound += take * o.c
        add = -(-take // o.s)
        ks[i] += add
        cost += add * o.s * o.c
        need -= add * o.s
    return bound, (cost, ks)


def min_cost_cover(L: int, opts: Sequence[StageOption], lims: Sequence[int]) -> tuple[float, list[int]] | None:
    """min sum_g s_g c_g k_g over 1 <= k_g <= lims_g with sum_g s_g k_g >= L: a DP over the
    stage-layers covered so far (capped at L), group by group."""
    inf = math.inf
    cost = [inf] * (L + 1)
    cost[0] = 0.0
    parents = []
    for o, lim in zip(opts, lims):
        if lim < 1:
            return None
        s, step = o.s, o.s * o.c
        new, came_from = [inf] * (L + 1), [None] * (L + 1)
        for x in range(L + 1):
            cx = cost[x]
            if cx == inf:
                continue
            for k in range(1, lim + 1):
                y = x + s * k
                if y > L:
                    y = L
                v = cx + step * k
                if v < new[y]:
                    new[y], came_from[y] = v, (x, k)
                if y == L:
                    break  # more layers only cost more
        parents.append(came_from)
        cost = new
    if cost[L] == inf:
        return None
    ks, y = [], L
    for came_from in reversed(parents):
        y, k = came_from[y]
        ks.append(k)
    return cost[L], ks[::-1]


def group_choices(opts: Sequence[StageOption], ks: Sequence[int], L: int) -> list[GroupChoice]:
    """Exact layer totals: trim the surplus of s * k over L from the slowest groups first."""
    layers = [o.s * k for o, k in zip(opts, ks)]
    surplus = sum(layers) - L
    order = sorted(range(len(opts)), key=lambda i: -opts[i].c)
    for i in order:
        if surplus <= 0:
            break
        cut = min(surplus, opts[i].s - 1, layers[i] - opts[i].s)
        layers[i] -= cut
        surplus -= cut
    return [GroupChoice(o.tp, o.r, o.s, k, n) for o, k, n in zip(opts, ks, layers)]
