"""The stage order: an open travelling-salesman path over the coarse graph of clusters, found by
simulated annealing (section 3.3.3). The graph is small (one node per stage), so a few
thousand moves from several starts settle on the optimum in practice; tests check that against
an exhaustive search."""
from __future__ import annotations

import math

import numpy as np


def path_length(weights: np.ndarray, order: list[int]) -> float:
    """Sum of the edge weights along ``order`` (an open path: no edge back to the start)."""
    return float(sum(weights[a, b] for a, b in zip(order, order[1:])))


def open_tsp_annealing(weights: np.ndarray, seed: int = 0, restarts: int = 4, steps: int = 4000,
                       start_temperature: float = 1.0, end_temperature: float = 1e-4) -> list[int]:
    """An order of the nodes of the symmetric ``weights`` matrix with a short open path.

    Moves are 2-opt reversals of a segment (including segments touching either end, which an
    open path allows) and moves of one node to another place; temperatures fall geometrically
    and are relative to the mean edge weight, so the schedule does not depend on units.
    """
    n = weights.shape[0]
    if weights.shape != (n, n):
        raise ValueError(f"weights must be square, got shape {weights.shape}")
    if n <= 2:
        return list(range(n))
    rng = np.random.default_rng(seed)
    scale = float(np.mean(weights[~np.eye(n, dtype=bool)])) or 1.0
    best_order, best_len = list(range(n)), path_length(weights, list(range(n)))
    for _ in range(restarts):
        order = [int(x) for x in rng.permutation(n)]
        length = path_length(weights, order)
        for step in range(steps):
            temperature = scale * start_temperature * (end_temperature / start_temperature) ** (step / steps)
            i, j = sorted(int(x) for x in rng.choice(n, size=2, replace=False))
            if rng.random() < 0.5:
                candidate = order[:i] + order[i:j + 1][::-1] + order[j + 1:]
            else:
                candidate = order[:i] + order[i + 1:]
                candidate.insert(j, order[i])
            cand_len = path_length(weights, candidate)
            if cand_len <= length or rng.random() < math.exp((length - cand_len) / temperature):
                order, length = candidate, cand_len
                if length < best_len - 1e-12:
                    best_order, best_len = list(order), length
    return best_order
