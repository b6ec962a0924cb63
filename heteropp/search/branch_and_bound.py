"""The branch and bound over groups: a DFS that picks a (TP, recompute) option for each group,
from the pipeline's last group to its first, so the number of in-flight micro-batches (and so
the memory limit) of each group is known when it is chosen.

A branch stops when the remaining groups cannot hold all layers even at their best, or when a
lower bound on T (the continuous relaxation of the stage-time balance) already exceeds the best
plan found. Leaves are sharded exactly (``sharding.shard_layers``)."""
from __future__ import annotations

import math
from typing import Sequence

from .results import Group, OverBudget, SearchResult
from .sharding import group_choices, shard_layers
from .space import SearchSpace, StageOption


class BranchAndBound:
    """One DFS over ``groups`` at one DP size, improving on ``incumbent`` (T of the best so far)."""

    def __init__(self, space: SearchSpace, groups: Sequence[Group], dp: int, incumbent: float,
                 same_type_order: bool, node_budget: int | None, visited: int = 0):
        self.space, self.groups, self.dp = space, list(groups), dp
        self.same_type_order, self.node_budget = same_type_order, node_budget
        self.visited = visited  # nodes so far, this DFS's and those before it (against node_budget)
        self.best_val, self.best = incumbent, None
        self.L, self.alpha, self.b = space.model.n_layers, space.alpha, space.batch // dp
        self.options = [space.options(g, dp) for g in groups]
        G = len(groups)
        self.chosen: list[StageOption | None] = [None] * G
        self.caps = [0] * G
        # optimistic stand-ins for the groups not chosen yet (the pipeline's prefix): best
        # layers-per-bottleneck-time rate, most layers memory could allow, cheapest layer
        self.rest_rate = [0.0] * (G + 1)
        self.rest_layers = [0] * (G + 1)
        self.rest_c = [math.inf] * (G + 1)
        if self.feasible:
            for i in range(G):
                oo = self.options[i]
                self.rest_rate[i + 1] = self.rest_rate[i] + max(o.s / o.w for o in oo)
                self.rest_layers[i + 1] = self.rest_layers[i] + max(o.s * o.m_ub for o in oo)
                self.rest_c[i + 1] = min(self.rest_c[i], min(o.c for o in oo))

    @property
    def feasible(self) -> bool:
        """Whether every group has an option at this DP size."""
        return all(self.options)

    def root_bound(self) -> float:
        """A lower bound on T for any plan at this DP size."""
        G = len(self.groups)
        return self.L / self.rest_rate[G] + self.alpha * self.L * self.rest_c[G]

    def bound(self, gi: int) -> float:
        """Lower bound on T: groups gi+1.. chosen (rate s/w up to s*k layers), the rest
        optimistic; the bottleneck level theta solves sum min(s*k, theta*s/w) >= L."""
        G, L, chosen, caps = len(self.groups), self.L, self.chosen, self.caps
        segs = sorted((caps[j] * chosen[j].w, chosen[j].s / chosen[j].w, chosen[j].s * caps[j])
                      for j in range(gi + 1, G))
        rate = self.rest_rate[gi + 1] + sum(x[1] for x in segs)
        full = 0.0  # layers of groups already saturated at their memory limit
        theta = 0.0
        for sat, r, n in segs:
            theta = (L - full) / rate
            if theta <= sat * (1 + 1e-12):  # L / (1 / w) can round above L * w
                break
            full += n
            rate -= r
            if full >= L:  # the groups saturated so far already hold every layer
                theta = sat
                break
        else:
            theta = (L - full) / rate if rate > 0 else math.inf
        c_min = min([self.rest_c[gi + 1]] + [chosen[j].c for j in range(gi + 1, G)])
        stage_sum = sum(chosen[j].s * chosen[j].c for j in range(gi + 1, G))  # k >= 1 everywhere
        return theta + self.alpha * max(L * c_min, stage_sum)

    def run(self) -> SearchResult | None:
        """The best plan below the incumbent at this DP size (None: none beats it)."""
        G = len(self.groups)
        if self.feasible and self.root_bound() < self.best_val:
            self._dfs(G - 1, 0, 0)
        return self.best

    def _leaf(self) -> None:
        space = self.space
        space.leaves += 1
        opts = list(self.chosen)
        pmax, psum = space.p2p_terms(self.groups, opts, self.dp)
        res = shard_layers(self.L, self.alpha, self.b, opts, self.caps, pmax, psum)
        if res is None:
            space.why.setdefault("layers", "memory: the chosen stages cannot hold all layers")
            return
        val, ks = res
        if val < self.best_val - 1e-12:
            self.best_val = val
            self.best = SearchResult(dp=self.dp, groups=list(self.groups), choices=group_choices(opts, ks, self.L),
                                     objective=val)

    def _dfs(self, gi: int, suffix_stages: int, layers_ub: int) -> None:
        self.visited += 1
        if self.node_budget is not None and self.visited > self.node_budget:
            raise OverBudget()
        if gi < 0:
            self._leaf()
            return
        groups, G, L = self.groups, len(self.groups), self.L
        g = groups[gi]
        same_next = self.same_type_order and gi + 1 < G and groups[gi + 1].chip.name == g.chip.name
        for o in self.options[gi]:
            if same_next and o.key < self.chosen[gi + 1].key:  # (tp, r) non-increasing along a chip type
                continue
            if suffix_stages + o.s > L:
                continue
            k = self.space.max_layers(g, o, self.dp, suffix_stages, first=gi == 0, last=gi == G - 1)
            if k < 1:
                continue
            ub = layers_ub + o.s * k
            if ub + self.rest_layers[gi] < L:
                continue
            self.chosen[gi], self.caps[gi] = o, k
            if self.bound(gi - 1) < self.best_val:
                self._dfs(gi - 1, suffix_stages + o.s, ub)
        self.chosen[gi] = None


def search_groups(space: SearchSpace, groups: list[Group], dps: Sequence[int], incumbent: float | None,
                  same_type_order: bool = False, node_budget: int | None = None) -> SearchResult | None:
    """The best plan over ``groups`` for any DP size in ``dps`` that beats ``incumbent``, the most
    promising DP size first (a good incumbent prunes more); None when none does."""
    best_val = math.inf if incumbent is None else incumbent
    best: SearchResult | None = None
    searches = [BranchAndBound(space, groups, dp, best_val, same_type_order, node_budget) for dp in dps]
    visited = 0
    for search in sorted(searches, key=lambda s: s.root_bound() if s.feasible else math.inf):
        search.best_val, search.visited = best_val, visited
        found = search.run()
        visited = search.visited
        if found is not None:
            best, best_val = found, search.best_val
    return best
