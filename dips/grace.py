"""Grace time of a round: the ski-rental choice tau* = (1/lambda) ln(C_m lambda) (paper, 4.1).

Waiting tau for more pushes costs tau; closing early makes a push that arrives later wait a
whole update+pull, C_m. With Poisson arrivals of rate lambda the expected cost
tau + C_m exp(-lambda tau) is smallest at tau*; when C_m lambda <= 1 waiting never pays and tau*=0.
"""
from __future__ import annotations

import math
from collections import deque


def optimal_grace(arrival_rate: float, update_cost: float) -> float:
    """tau* for arrival rate ``lambda`` (1/s) and update+pull cost ``C_m`` (s)."""
    if arrival_rate < 0 or update_cost < 0:
        raise ValueError(f"arrival_rate={arrival_rate} and update_cost={update_cost} must be >= 0")
    if arrival_rate == 0 or update_cost * arrival_rate <= 1.0:
        return 0.0
    return math.log(update_cost * arrival_rate) / arrival_rate


class GraceEstimator:
    """Estimates lambda from recent push arrival times and C_m from measured update+pull times."""

    def __init__(self, initial: float = 0.05, window: int = 16, max_grace: float = 5.0):
        if initial < 0 or max_grace < initial:
            raise ValueError(f"need 0 <= initial ({initial}) <= max_grace ({max_grace})")
        self.initial = initial
        self.max_grace = max_grace
        self.arrivals: deque[float] = deque(maxlen=window)
        self.costs: deque[float] = deque(maxlen=window)

    def observe_arrival(self, t: float) -> None:
        self.arrivals.append(t)

    def observe_cost(self, seconds: float) -> None:
        if seconds >= 0:
            self.costs.append(seconds)

    @property
    def arrival_rate(self) -> float | None:
        if len(self.arrivals) < 3 or self.arrivals[-1] <= self.arrivals[0]:
            return None
        return (len(self.arrivals) - 1) / (self.arrivals[-1] - self.arrivals[0])

    @property
    def update_cost(self) -> float | None:
        return sum(self.costs) / len(self.costs) if self.costs else None

    def grace(self) -> float:
        lam, cm = self.arrival_rate, self.update_cost
        if lam is None or cm is None:
            return self.initial
        return min(self.max_grace, optimal_grace(lam, cm))

    def state(self) -> dict:
        return {"arrivals": list(self.arrivals), "costs": list(self.costs)}

    def load_state(self, state: dict) -> None:
        self.arrivals.extend(state.get("arrivals", []))
        self.costs.extend(state.get("costs", []))
