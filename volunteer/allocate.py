"""The allocator (section 3.3.3): reliable devices clustered into stages, stages ordered, servers
split into frontal and backward, unreliable devices and layers given to stages.

    reliable partition tau*   divisive clustering, stopping where Equation 2 (with Equation 3's
                              DT_k) stops improving
    stage order               open TSP over the coarse graph, by simulated annealing
    FS / BS                   each server on the side (previous or next stage) it is closer to;
                              each side keeps at least one
    unreliable partition      each device to the stage of smallest mean alpha + t / beta
    layer partition sigma*    layers in proportion to each stage's total compute

A level whose stages would not fit their smallest device's memory (the reason to pipeline at
all) is never chosen.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from .clustering import divisive_levels, edge_weights
from .cost import StageMembers, Workload, approximate_pipeline_time, pipeline_time
from .devices import Fleet
from .tsp import open_tsp_annealing


@dataclasses.dataclass(frozen=True)
class Allocation:
    """Stages in pipeline order; ``level_times`` are the times the allocator's rule scored for
    1, 2, ... clusters, ``pipeline_time`` is Equation 2 (with Equation 1) for the chosen stages."""

    fleet: Fleet
    workload: Workload
    stages: tuple[StageMembers, ...]
    level_times: tuple[float, ...]
    pipeline_time: float

    def layer_ranges(self) -> list[tuple[int, int]]:
        out, first = [], 0
        for s in self.stages:
            out.append((first, first + s.layers))
            first += s.layers
        return out

    def to_dict(self) -> dict:
        f = self.fleet
        ranges = self.layer_ranges()
        return {
            "workload": dataclasses.asdict(self.workload),
            "pipeline_time_s": self.pipeline_time,
            "level_times_s": [t if math.isfinite(t) else None for t in self.level_times],  # None: did not fit
            "stages": [{
                "layers": list(ranges[k]),
                "frontal": [f.reliable[j].name for j in s.frontal],
                "backward": [f.reliable[j].name for j in s.backward],
                "clients": [f.unreliable[i].name for i in s.clients],
            } for k, s in enumerate(self.stages)],
            "fleet": f.to_dict(),
        }



def order_clusters(fleet: Fleet, work: Workload, clusters: list[list[int]], seed: int = 0) -> list[list[int]]:
    """Clusters in the order of the shortest open path over the coarse graph, whose edge between
    two clusters is the mean edge label between their members."""
    w = edge_weights(fleet.reliable_delay, fleet.reliable_bandwidth, work.microbatch_bytes)
    coarse = np.array([[w[np.ix_(a, b)].mean() if a is not b else 0.0 for b in clusters] for a in clusters])
    return [clusters[i] for i in open_tsp_annealing(coarse, seed=seed)]


def split_servers(fleet: Fleet, ordered: list[list[int]], k: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Frontal and backward servers of stage k: each device joins the side whose neighbouring stage
    it has the smaller mean delay to (the first stage's frontal side faces the data, at no delay;
    the last stage's backward side faces the loss, likewise). An empty side takes the slowest
    device of the other."""
    delay = fleet.reliable_delay
    frontal, backward = [], []
    for j in ordered[k]:
        to_prev = delay[j, ordered[k - 1]].mean() if k > 0 else 0.0
        to_next = delay[j, ordered[k + 1]].mean() if k + 1 < len(ordered) else 0.0
        (frontal if to_prev <= to_next else backward).append(j)
    slowest = lambda side: min(side, key=lambda j: (fleet.reliable[j].flops, j))  # noqa: E731
    if not frontal:
        frontal.append(backward.pop(backward.index(slowest(backward))))
    if not backward:
        backward.append(frontal.pop(frontal.index(slowest(frontal))))
    return tuple(sorted(frontal)), tuple(sorted(backward))


def assign_unreliable(fleet: Fleet, work: Workload, ordered: list[list[int]]) -> list[list[int]]:
    """Each unreliable device to the stage of smallest mean alpha + t_s / beta to its members."""
    out: list[list[int]] = [[] for _ in ordered]
    for i in range(fleet.n_unreliable):
        cost = [np.mean(fleet.unreliable_delay[i, c] + work.microbatch_bytes / fleet.unreliable_bandwidth[i, c])
                for c in ordered]
        out[int(np.argmin(cost))].append(i)
    return out


def split_layers(layers: int, compute: list[float]) -> list[int]:
    """``layers`` in proportion to ``compute``, each stage at least one (largest remainder)."""
    k = len(compute)
    if layers < k:
        raise ValueError(f"{layers} layers cannot fill {k} stages")
    exact = np.array(compute) / sum(compute) * (layers - k)
    counts = np.floor(exact).astype(int) + 1
    for i in np.argsort(-(exact - np.floor(exact)), kind="stable")[: layers - counts.sum()]:
        counts[i] += 1
    return [int(c) for c in counts]


def build_stages(fleet: Fleet, work: Workload, ordered: list[list[int]]) -> tuple[StageMembers, ...]:
    """Everything after the reliable partition and its order: servers, clients and layers."""
    clients = assign_unreliable(fleet, work, ordered)
    compute = [sum(fleet.reliable[j].flops for j in c) + sum(fleet.unreliable[i].flops for i in u)
               for c, u in zip(ordered, clients)]
    layers = split_layers(work.layers, compute)
    stages = []
    for k in range(len(ordered)):
        frontal, backward = split_servers(fleet, ordered, k)
        stages.append(StageMembers(frontal, backward, tuple(clients[k]), layers[k]))
    return tuple(stages)


def fits(fleet: Fleet, work: Workload, stages: tuple[StageMembers, ...]) -> bool:
    """Every device of every stage holds its stage's layer state."""
    for s in stages:
        smallest = min([fleet.reliable[j].memory for j in s.reliable] + [fleet.unreliable[i].memory for i in s.clients])
        if s.layers * work.layer_state_bytes > smallest:
            return False
    return True


def allocate(fleet: Fleet, work: Workload, seed: int = 0, rule: str = "full") -> Allocation:
    """The allocation of ``fleet`` for ``work`` (see the module docstring for the steps).

    ``rule="paper"`` walks down the hierarchy and stops at the first level whose approximate
    time (Equation 3's DT_k) is worse than the level above, as the paper does. ``rule="full"``
    (the default) builds the stages of every level, which costs little since there are at most
    Ns / 2 levels, and keeps the level of least Equation 2 time with Equation 1's DT_k: it sees
    compute imbalance and intra-stage links that Equation 3 ignores (docs/volunteer.md gives the
    gap of both rules to an exhaustive search).
    """
    if rule not in ("paper", "full"):
        raise ValueError(f"rule={rule!r}; expected 'paper' or 'full'")
    w = edge_weights(fleet.reliable_delay, fleet.reliable_bandwidth, work.microbatch_bytes)
    levels = divisive_levels(w, max_clusters=min(work.layers, fleet.n_reliable // 2))
    times: list[float] = []
    best: tuple[float, tuple[StageMembers, ...]] | None = None
    for clusters in levels:
        ordered = order_clusters(fleet, work, clusters, seed)
        stages = build_stages(fleet, work, ordered)
        if not fits(fleet, work, stages):
            times.append(float("inf"))
            continue
        if rule == "paper":
            t = approximate_pipeline_time(fleet, work, ordered)
            if best is not None and t > times[-1]:
                times.append(t)
                break
            times.append(t)
            best = (t, stages)
        else:
            t = pipeline_time(fleet, work, stages)
            times.append(t)
            if best is None or t < best[0]:
                best = (t, stages)
    if best is None:
        raise ValueError(f"no allocation fits: a layer's state takes {work.layer_state_bytes / 2**30:.2f} GiB and "
                         f"even {len(levels[-1])} stages leave some device short of memory")
    stages = best[1]
    return Allocation(fleet, work, stages, tuple(times), pipeline_time(fleet, work, stages))
