"""Where to deploy the PS: i* = argmax_i B[i, :] . p (paper, 4.1, PS Deployment)."""
from __future__ import annotations

from collections.abc import Sequence


def choose_deployment(bandwidth: Sequence[Sequence[float]], throughput: Sequence[float]) -> int:
    """Index of the candidate cluster whose links carry the most throughput-weighted bandwidth.

    ``bandwidth[i][j]`` is the bandwidth between candidate ``i`` and training cluster ``j``;
    ``throughput[j]`` is cluster ``j``'s training throughput (its push frequency is proportional
    to it). Ties go to the lowest index.
    """
    p = [float(x) for x in throughput]
    if not bandwidth:
        raise ValueError("bandwidth matrix is empty; expected one row per candidate cluster")
    if any(x < 0 for x in p):
        raise ValueError(f"throughput must be non-negative, got {p}")
    best, best_score = -1, float("-inf")
    for i, row in enumerate(bandwidth):
        if len(row) != len(p):
            raise ValueError(f"bandwidth row {i} has {len(row)} entries; expected {len(p)} (one per training cluster)")
        if any(b < 0 for b in row):
            raise ValueError(f"bandwidth row {i} has a negative entry: {list(row)}")
        score = sum(float(b) * x for b, x in zip(row, p))
        if score > best_score:
            best, best_score = i, score
    return best
