"""Cross-DC pipeline training (JEEVES, HotNets'25): the pipeline split over two data centres,
the comm-aware schedule, memory-aware uneven stage division and inter-replica coordinated
sends on the shared cross-DC link.

``cross_dc_pipeline`` builds the simulator's pipeline for R replicas whose stages are split
between two DCs at ``cut`` (stages < cut in DC1); the boundary at the cut is one shared link
per direction. ``memory_aware_division`` picks layers per stage under a fixed per-stage
activation budget: it moves layers off the early stages (which hold the most in-flight
micro-batches) and keeps the division the comm-aware schedule finishes fastest on,
judged on a proportionally scaled-down copy (fewer replicas, the same per-replica bandwidth).

The same three parts for a HeteroPP plan whose stages span two DCs (the runtime runs these):
the DCs are the plan's clusters (each chip type is a cluster, ``ClusterSpec.link_between``), so
a boundary between two chip types is a cross-DC link, shared by every DP replica (JEEVES has
one; a plan over more DCs gets the same treatment at each).
``plan_pipeline`` is the simulator's view of such a plan (every replica, the shared link);
``comm_aware_schedules`` are the per-replica lists JEEVES's greedy scheduler runs on it (with
``coordinated``, the replicas take turns on the cross-DC link); ``divide_plan`` is the
memory-aware division of the plan's layers. A stage's activation budget is what its chip's
memory holds beside its weights and optimizer state (the paper's constraint); the greedy
scheduler runs a forward only while the budget has room.
"""
from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Sequence

from .cluster import LinkSpec
from .model_spec import ModelSpec
from .profile import ChipProfile
from .schedule import Schedule
from .simulator import LinkModel, Pipeline, StageModel, pipeline_from_plan, simulate

if TYPE_CHECKING:
    from .plan import Plan


@dataclasses.dataclass(frozen=True)
class CrossDCSetup:
    model: ModelSpec
    profile: ChipProfile
    tp: int
    replicas: int
    batch: int  # micro-batches in all (micro-batch size 1), spread over the replicas
    cut: int  # first stage in the second DC
    cross: LinkSpec  # the DC interconnect (all replicas share it, per direction)
    intra: LinkSpec  # a replica's link between neighbouring stages inside a DC
    message_bytes: float  # one micro-batch's activation (or gradient) across a boundary
    act_limit_layers: int  # activation budget per stage, in layer-micro-batches

    def microbatches(self, replicas: int | None = None) -> list[int]:
        R = replicas or self.replicas
        per, extra = divmod(self.batch * R // self.replicas, R)
        return [per + (1 if r < extra else 0) for r in range(R)]


def cross_dc_pipeline(setup: CrossDCSetup, layers: Sequence[int], *, intra_dc: bool = False,
                      coordinated: bool = False, ack_wait: bool = True, replicas: int | None = None) -> Pipeline:
    """The pipeline for a division ``layers`` (layers per stage). ``intra_dc`` replaces the
    cross-DC link by an ordinary one; ``replicas`` < setup.replicas scales the shared link's
    bandwidth down in proportion (a smaller copy with the same per-replica share)."""
    R = replicas or setup.replicas
    lt = setup.profile.layer_times(setup.tp)
    act = setup.model.activation_bytes(1, setup.tp, False)
    stages = [StageModel(fwd=n * lt.fwd, bwd_input=n * lt.bwd_input, bwd_weight=n * lt.bwd_weight,
                         recompute_time=n * lt.recompute, recompute=False, act_bytes=n * act, full_act_bytes=0.0,
                         act_limit=setup.act_limit_layers * act, name=f"DC{1 if i < setup.cut else 2}")
              for i, n in enumerate(layers)]
    links = []
    for i in range(len(layers) - 1):
        if i == setup.cut - 1 and not intra_dc:
            links.append(LinkModel(setup.message_bytes, setup.cross.bandwidth * R / setup.replicas,
                                   setup.cross.latency, shared=True))
        else:
            links.append(LinkModel(setup.message_bytes, setup.intra.bandwidth, setup.intra.latency))
    return Pipeline(stages=stages, links=links, microbatches=setup.microbatches(R), ack_wait=ack_wait,
                    coordinated=coordinated and not intra_dc)


def memory_aware_division(setup: CrossDCSetup, stages: int, probe_replicas: int = 2, max_shift: int = 3,
                          coordinated: bool = False, ack_wait: bool = True) -> list[int]:
    """Layers per stage for the comm-aware schedule under the activation budget (see module)."""
    L = setup.model.n_layers
    base = [L // stages + (1 if i < L % stages else 0) for i in range(stages)]
    best, best_t = base, float("inf")
    for lay in division_candidates(base, max_shift=max_shift):
        t = simulate(cross_dc_pipeline(setup, lay, coordinated=coordinated, ack_wait=ack_wait,
                                       replicas=probe_replicas), "comm-aware").iteration_time
        if t < best_t - 1e-12:
            best, best_t = lay, t
    return best


# -- a HeteroPP plan across two DCs ---------------------------------------------------------------
def cross_dc_boundaries(plan: "Plan") -> list[int]:
    """The boundaries (stage i to i + 1) whose two stages sit in different DCs (clusters): one
    for JEEVES's two DCs, none for a plan inside one DC."""
    return [i for i in range(plan.num_stages - 1) if plan.stages[i].chip != plan.stages[i + 1].chip]


def inflight_microbatches(plan: "Plan", stage: int) -> int:
    """How many micro-batches' activations stage ``stage`` may hold under the comm-aware
    schedule: as many as its chip has room for beside its weights and optimizer state (JEEVES's
    memory constraint is the chip's memory), at most all of them and at least one."""
    s = plan.stages[stage]
    room = plan.cluster.chip(s.chip).usable_memory - plan.stage_memory(stage, inflight=0)
    per = plan.stage_memory(stage, inflight=1) - plan.stage_memory(stage, inflight=0)
    fits = int(room // per) if per > 0 else plan.num_microbatches
    return max(1, min(plan.num_microbatches, fits))


def plan_pipeline(plan: "Plan", coordinated: bool = False, ack_wait: bool = False) -> Pipeline:
    """The simulator's pipeline of ``plan`` with every DP replica (``pipeline_from_plan``: a
    cross-DC boundary is one link per direction that all replicas share), served in turns with
    ``coordinated``; each stage's activations are capped by its chip's memory. ``ack_wait``: a
    channel's next message waits for the previous one's acknowledgement."""
    base = pipeline_from_plan(plan, blocking_ack=ack_wait)
    cuts = cross_dc_boundaries(plan)
    return dataclasses.replace(base, microbatches=[plan.num_microbatches] * plan.dp,
                               coordinated=coordinated and bool(cuts), handoff=handoff_time(plan) if cuts else 0.0)


def handoff_time(plan: "Plan") -> float:
    """The turn's hand-off on a coordinated link: a one-element message between two replicas'
    ranks of a stage, inside their DC (at the profiles' time scale, as the run has it)."""
    from .placement import rank_places

    if plan.dp < 2:
        return 0.0
    places = rank_places(plan)
    first = plan.stages[0]
    a, b = places[first.first_rank], places[first.first_rank + first.tp]  # replicas 0 and 1 of stage 0
    link = plan.cluster.fleet_links.between(a, b)
    return 0.0 if link is None else link.transfer_time(4.0, plan.cluster.emulated_time_scale or 1.0)


def comm_aware_schedules(plan: "Plan", coordinated: bool) -> list[Schedule]:
    """Per DP replica, the lists JEEVES's greedy scheduler runs on ``plan_pipeline(plan)``
    (named ``jeeves`` with coordinated turns on the cross-DC link, else ``comm-aware``)."""
    res = simulate(plan_pipeline(plan, coordinated=coordinated), "comm-aware")
    turns = tuple(cross_dc_boundaries(plan)) if coordinated else ()
    name = "jeeves" if coordinated else "comm-aware"
    return [dataclasses.replace(s, name=name, coordinated=turns) for s in res.schedules]


def with_layers(plan: "Plan", layers: Sequence[int]) -> "Plan":
    """``plan`` with its stages' layers replaced (same chips, TP, DP, recompute), validated."""
    stages, first = [], 0
    for s, n in zip(plan.stages, layers):
        stages.append(dataclasses.replace(s, layers=n, first_layer=first))
        first += n
    out = dataclasses.replace(plan, stages=tuple(stages), estimate={})
    out.validate()
    return out


def division_candidates(layers: Sequence[int], max_front: int = 3, max_shift: int = 3) -> list[list[int]]:
    """``layers`` and the divisions that move layers off the early stages: the first ``front``
    stages give up ``d`` layers each, spread evenly over the others (JEEVES section 3.2)."""
    S = len(layers)
    out = [list(layers)]
    for front in range(1, min(max_front, S // 2) + 1):
        for d in range(1, min(max_shift, min(layers[:front]) - 1) + 1):
            lay = [n - d if i < front else n for i, n in enumerate(layers)]
            spare, back = front * d, S - front
            for i in range(front, S):
                lay[i] += spare // back + (1 if (i - front) < spare % back else 0)
            out.append(lay)
    return out


def divide_plan(plan: "Plan", coordinated: bool = True) -> "Plan":
    """The memory-aware division of ``plan``: of ``division_candidates`` that fit the chips'
    memory, the one the comm-aware schedule finishes fastest on."""
    from .plan import PlanError

    best, best_t = plan, simulate(plan_pipeline(plan, coordinated=coordinated), "comm-aware").iteration_time
    for lay in division_candidates([s.layers for s in plan.stages])[1:]:
        try:
            cand = with_layers(plan, lay)
        except PlanError:
            continue  # a stage over its chip's memory
        t = simulate(plan_pipeline(cand, coordinated=coordinated), "comm-aware").iteration_time
        if t < best_t - 1e-12:
            best, best_t = cand, t
    return best
