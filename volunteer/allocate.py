"""The allocator (section 3.3.3): reliable devices clustered into stages, stages ordered, servers
split into frontal and backward, unreliable devices and layers given to stages.

    reliable partition tau*   divisive clustering, stopping where Equation 2 (with Equation 3's
                              DT_k) stops improving (rule "paper"); or every level, each refined
                              by moving clusters of the hierarchy between its stages, keeping
                              the level of least makespan (rule "full", the default)
    stage order               open TSP over the coarse graph, by simulated annealing
    FS / BS                   each server on the side (previous or next stage) it is closer to;
                              each side keeps at least one
    unreliable partition      each device to the stage of smallest mean alpha + t / beta
    layer partition sigma*    layers in proportion to each stage's total compute, within what
                              its smallest device holds

A stage never gets more layers than its smallest device holds (the reason to pipeline at all):
the others take the rest, and a level whose stages cannot hold the model together is never
chosen.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

from .clustering import MIN_CLUSTER, divisive_levels, edge_weights
from .cost import StageMembers, Workload, approximate_pipeline_time, pipeline_makespan, pipeline_time
from .devices import Fleet
from .tsp import open_tsp_annealing


@dataclasses.dataclass(frozen=True)
class Allocation:
    """Stages in pipeline order; ``level_times`` are the times the allocator's rule scored for
    1, 2, ... clusters, ``pipeline_time`` is Equation 2 (with Equation 1) for the chosen stages and
    ``makespan`` the same with the pipeline's fill (the time a batch is predicted to take)."""

    fleet: Fleet
    workload: Workload
    stages: tuple[StageMembers, ...]
    level_times: tuple[float, ...]
    pipeline_time: float
    makespan: float

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
            "makespan_s": self.makespan,
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


class DoesNotFit(ValueError):
    """The stages of a level cannot hold the model's layers."""


def split_layers(layers: int, compute: Sequence[float], capacity: Sequence[float] | None = None) -> list[int]:
    """``layers`` in proportion to ``compute``, each stage at least one (largest remainder), and
    none above its ``capacity`` (the layers its smallest device holds): a stage the proportion
    would take past its capacity keeps its capacity, and the others share the rest the same way."""
    k = len(compute)
    if layers < k:
        raise ValueError(f"{layers} layers cannot fill {k} stages")
    capacity = [math.inf] * k if capacity is None else list(capacity)
    if len(capacity) != k:
        raise ValueError(f"{len(capacity)} capacities for {k} stages")
    if min(capacity) < 1 or sum(min(c, layers) for c in capacity) < layers:
        raise DoesNotFit(f"{layers} layers do not fit stages that hold {[c if math.isfinite(c) else 'any' for c in capacity]}")
    fixed: dict[int, int] = {}  # stages held at their capacity
    while True:
        rest = [i for i in range(k) if i not in fixed]
        share = _proportional(layers - sum(fixed.values()), [compute[i] for i in rest])
        over = [i for i, n in zip(rest, share) if n > capacity[i]]
        if not over:
            out = {**fixed, **dict(zip(rest, share))}
            return [out[i] for i in range(k)]
        fixed.update({i: int(capacity[i]) for i in over})


def _proportional(layers: int, compute: Sequence[float]) -> list[int]:
    """One layer each, the rest in proportion to ``compute`` by largest remainder."""
    exact = np.array(compute) / sum(compute) * (layers - len(compute))
    counts = np.floor(exact).astype(int) + 1
    for i in np.argsort(-(exact - np.floor(exact)), kind="stable")[: layers - counts.sum()]:
        counts[i] += 1
    return [int(c) for c in counts]


def stage_capacity(fleet: Fleet, work: Workload, reliable: Sequence[int], clients: Sequence[int]) -> float:
    """The layers a stage's smallest device holds (unbounded without memory figures)."""
    if work.layer_state_bytes <= 0:
        return math.inf
    smallest = min([fleet.reliable[j].memory for j in reliable] + [fleet.unreliable[i].memory for i in clients])
    return math.floor(smallest / work.layer_state_bytes) if math.isfinite(smallest) else math.inf


def build_stages(fleet: Fleet, work: Workload, ordered: list[list[int]]) -> tuple[StageMembers, ...]:
    """Everything after the reliable partition and its order: servers, clients and layers."""
    clients = assign_unreliable(fleet, work, ordered)
    compute = [sum(fleet.reliable[j].flops for j in c) + sum(fleet.unreliable[i].flops for i in u)
               for c, u in zip(ordered, clients)]
    layers = split_layers(work.layers, compute,
                          [stage_capacity(fleet, work, c, u) for c, u in zip(ordered, clients)])
    stages = []
    for k in range(len(ordered)):
        frontal, backward = split_servers(fleet, ordered, k)
        stages.append(StageMembers(frontal, backward, tuple(clients[k]), layers[k]))
    return tuple(stages)


def scored_stages(fleet: Fleet, work: Workload, ordered: list[list[int]]) -> tuple[float, tuple[StageMembers, ...] | None]:
    """(makespan, stages) of a partition in pipeline order; (inf, None) when its stages cannot
    hold the model."""
    try:
        stages = build_stages(fleet, work, ordered)
    except DoesNotFit:
        return math.inf, None
    return pipeline_makespan(fleet, work, stages), stages


def refine(fleet: Fleet, work: Workload, ordered: list[list[int]], groups: Sequence[Sequence[int]]) -> list[list[int]]:
    """Moves whole ``groups`` (clusters of the hierarchy: devices close to each other, such as a
    site) from one stage to a neighbouring one, the move that shortens the makespan most first,
    until none does (at most 2 Ns moves). Divisive clustering cuts where the links are slowest
    and not where the compute balances, so a level can put two sites in one stage and four in
    the other; moving single devices instead would split a site across stages, paying inter-site
    links inside a stage. Each stage keeps at least MIN_CLUSTER devices and its place in the
    order."""
    ordered = [sorted(c) for c in ordered]
    best = scored_stages(fleet, work, ordered)[0]
    for _ in range(2 * fleet.n_reliable):
        move = None
        for a, src in enumerate(ordered):
            for g in groups:
                if not set(g) < set(src) or len(src) - len(g) < MIN_CLUSTER:
                    continue
                for b in (a - 1, a + 1):
                    if not 0 <= b < len(ordered):
                        continue
                    trial = list(ordered)
                    trial[a] = [j for j in src if j not in g]
                    trial[b] = sorted(ordered[b] + list(g))
                    t = scored_stages(fleet, work, trial)[0]
                    if t < best and (move is None or t < move[0]):
                        move = (t, trial)
        if move is None:
            break
        best, ordered = move
    return ordered


def allocate(fleet: Fleet, work: Workload, seed: int = 0, rule: str = "full") -> Allocation:
    """The allocation of ``fleet`` for ``work`` (see the module docstring for the steps).

    ``rule="paper"`` walks down the hierarchy and stops at the first level whose approximate
    time (Equation 3's DT_k) is worse than the level above, as the paper does. ``rule="full"``
    (the default) builds the stages of every level, which costs little since there are at most
    Ns / 2 levels, refines each by moving clusters of the hierarchy between its stages
    (``refine``), and keeps the level of least Equation 2 time with Equation 1's DT_k and the
    pipeline's fill (pipeline_makespan): it sees compute imbalance and intra-stage links that
    Equation 3 ignores, and what one more stage adds to a batch of few micro-batches
    (docs/volunteer.md gives the gap of both rules to an exhaustive search).
    """
    if rule not in ("paper", "full"):
        raise ValueError(f"rule={rule!r}; expected 'paper' or 'full'")
    w = edge_weights(fleet.reliable_delay, fleet.reliable_bandwidth, work.microbatch_bytes)
    levels = divisive_levels(w, max_clusters=min(work.layers, fleet.n_reliable // 2))
    groups = sorted({tuple(c) for level in levels for c in level})
    times: list[float] = []
    best: tuple[float, tuple[StageMembers, ...]] | None = None
    for clusters in levels:
        ordered = order_clusters(fleet, work, clusters, seed)
        if rule == "full":
            ordered = refine(fleet, work, ordered, groups)
        makespan, stages = scored_stages(fleet, work, ordered)
        if stages is None:
            times.append(math.inf)
            continue
        if rule == "paper":
            t = approximate_pipeline_time(fleet, work, ordered)
            if best is not None and t > times[-1]:
                times.append(t)
                break
            times.append(t)
            best = (t, stages)
        else:
            times.append(makespan)
            if best is None or makespan < best[0]:
                best = (makespan, stages)
    if best is None:
        raise ValueError(f"no allocation fits: a layer's state takes {work.layer_state_bytes / 2**30:.2f} GiB and "
                         f"even {len(levels[-1])} stages leave some device short of memory")
    stages = best[1]
    return Allocation(fleet, work, stages, tuple(times), pipeline_time(fleet, work, stages),
                      pipeline_makespan(fleet, work, stages))
