"""Divisive (top-down) hierarchical clustering of the reliable devices' delay graph (section
3.3.3): each level splits the widest cluster in two, DIANA-style, so the number of stages grows
one at a time and the allocator can stop where the pipeline time stops improving.

A stage needs a frontal and a backward server, so no cluster is ever smaller than two devices.
"""
from __future__ import annotations

import numpy as np

MIN_CLUSTER = 2


def edge_weights(delay: np.ndarray, bandwidth: np.ndarray, nbytes: float) -> np.ndarray:
    """The graph's edge labels: alpha_ij + alpha_ji + t/beta_ij + t/beta_ji (zero diagonal)."""
    with np.errstate(divide="ignore"):
        w = delay + delay.T + nbytes / bandwidth + nbytes / bandwidth.T
    np.fill_diagonal(w, 0.0)
    return w


def diameter(weights: np.ndarray, cluster: list[int]) -> float:
    return float(weights[np.ix_(cluster, cluster)].max()) if len(cluster) > 1 else 0.0


def split(weights: np.ndarray, cluster: list[int]) -> tuple[list[int], list[int]]:
    """DIANA's split: start a splinter group with the member farthest from the rest on average,
    then move over, one at a time, the member that is closer to the splinter group than to the
    rest, while both sides keep at least two members."""
    if len(cluster) < 2 * MIN_CLUSTER:
        raise ValueError(f"a cluster of {len(cluster)} cannot split into two of at least {MIN_CLUSTER}")
    rest = list(cluster)
    mean_to_rest = [weights[x, [y for y in rest if y != x]].mean() for x in rest]
    splinter = [rest.pop(int(np.argmax(mean_to_rest)))]
    while len(rest) > MIN_CLUSTER:
        gain = [weights[x, [y for y in rest if y != x]].mean() - weights[x, splinter].mean() for x in rest]
        best = int(np.argmax(gain))
        if gain[best] <= 0 and len(splinter) >= MIN_CLUSTER:
            break
        splinter.append(rest.pop(best))
    return sorted(splinter), sorted(rest)


def divisive_levels(weights: np.ndarray, max_clusters: int) -> list[list[list[int]]]:
    """Level p (0-based) holds p + 1 clusters; each level splits the previous level's cluster of
    largest diameter among those that can split. Stops at ``max_clusters`` or when none can."""
    n = weights.shape[0]
    levels = [[list(range(n))]]
    while len(levels[-1]) < max_clusters:
        clusters = levels[-1]
        splittable = [c for c in clusters if len(c) >= 2 * MIN_CLUSTER]
        if not splittable:
            break
        widest = max(splittable, key=lambda c: diameter(weights, c))
        a, b = split(weights, widest)
        levels.append([c for c in clusters if c is not widest] + [a, b])
    return levels
