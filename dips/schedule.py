"""Greedy worker-to-follower communication schedule (Di-PS paper, Appendix A).

A schedule is a list of steps; a step is a list of ``(worker, unit, follower)`` transfers that
run in parallel under the no-conflict rule: no two transfers of one step target the same follower
and a worker sends one unit per step. Each cluster gets its own schedule; a newly arriving cluster
is planned alone, without re-planning the others.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

Transfer = tuple[int, int, int]  # (worker, unit, follower)


def greedy_schedule(worker_units: Mapping[int, Sequence[int]], dest: Sequence[int]) -> list[list[Transfer]]:
    """Plan the transfers of one cluster.

    ``worker_units`` maps a worker (its PP rank) to the units it holds, in order; ``dest[u]`` is
    the follower that owns unit ``u``. Workers are visited in rank order; each takes its earliest
    unsent unit whose follower is still free in this step (conflicting units wait for a later
    step, keeping their order), so one pass fills as many worker-follower pairs as it can.
    """
    pending: dict[int, list[int]] = {}
    for worker in sorted(worker_units):
        units = list(worker_units[worker])
        for u in units:
            if not 0 <= u < len(dest):
                raise ValueError(f"worker {worker} holds unit {u}; expected a unit index in [0, {len(dest)})")
        pending[worker] = units
    seen = [u for units in pending.values() for u in units]
    if len(seen) != len(set(seen)):
        raise ValueError(f"a unit is held by more than one worker: {sorted(seen)}")
    steps: list[list[Transfer]] = []
    while any(pending.values()):
        busy: set[int] = set()
        step: list[Transfer] = []
        for worker, units in pending.items():
            for i, u in enumerate(units):
                if dest[u] not in busy:
                    busy.add(dest[u])
                    step.append((worker, u, dest[u]))
                    del units[i]
                    break
        steps.append(step)
    return steps
