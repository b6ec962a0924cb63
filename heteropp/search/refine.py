"""Stage two's local search, for sub-groups too many for the exact branch and bound."""
from __future__ import annotations

from typing import Sequence

from .results import Group, SearchResult
from .sharding import group_choices, shard_layers
from .space import SearchSpace, StageOption


def evaluate(space: SearchSpace, groups: Sequence[Group], opts: Sequence[StageOption],
             dp: int) -> tuple[float, list[int]] | None:
    """Memory limits by position, P2P terms and layer sharding for one full assignment."""
    G, L = len(groups), space.model.n_layers
    caps, suffix = [0] * G, 0
    for gi in range(G - 1, -1, -1):
        o = opts[gi]
        if suffix + o.s > L:
            return None
        caps[gi] = space.max_layers(groups[gi], o, dp, suffix, first=gi == 0, last=gi == G - 1)
        if caps[gi] < 1:
            return None
        suffix += o.s
    space.leaves += 1
    pmax, psum = space.p2p_terms(groups, opts, dp)
    return shard_layers(L, space.alpha, space.batch // dp, opts, caps, pmax, psum)


def refine(space: SearchSpace, groups: list[Group], first: SearchResult) -> SearchResult:
    """Sub-groups start from their chip type's stage-one choice; a sub-group at a time switches
    to the (tp, r) that lowers T most, keeping (tp, r) non-increasing along the pipeline inside a
    chip type, until no switch helps (the full product over 16 sub-groups is out of reach, and
    stage one already fixed dp)."""
    dp, L = first.dp, space.model.n_layers
    all_opts = [space.options(g, dp) for g in groups]
    by_type = {g.chip.name: (ch.tp, ch.recompute) for g, ch in zip(first.groups, first.choices)}
    cur = []
    for g, oo in zip(groups, all_opts):
        match = [o for o in oo if o.key == by_type[g.chip.name]]
        if not match:  # the sub-group size does not allow the type's choice
            return first
        cur.append(match[0])
    res = evaluate(space, groups, cur, dp)
    if res is None:
        return first
    best_val, best_ks = res
    G = len(groups)
    improved = True
    while improved:
        improved = False
        move = None
        for gi in range(G):
            lo = cur[gi + 1].key if gi + 1 < G and groups[gi + 1].chip.name == groups[gi].chip.name else None
            hi = cur[gi - 1].key if gi > 0 and groups[gi - 1].chip.name == groups[gi].chip.name else None
            for o in all_opts[gi]:
                if o is cur[gi] or (lo is not None and o.key < lo) or (hi is not None and o.key > hi):
                    continue
                trial = cur[:gi] + [o] + cur[gi + 1:]
                r = evaluate(space, groups, trial, dp)
                if r is not None and r[0] < best_val - 1e-9:
                    best_val, best_ks, move = r[0], r[1], (gi, o)
        if move is not None:
            cur[move[0]] = move[1]
            improved = True
    return SearchResult(dp=dp, groups=list(groups), choices=group_choices(cur, best_ks, L), objective=best_val)
