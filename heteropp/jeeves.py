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
the one boundary between two chip types is the cross-DC link, shared by every DP replica.
``plan_pipeline`` is the simulator's view of such a plan (every replica, the shared link);
``comm_aware_schedules`` are the per-replica lists JEEVES's greedy scheduler runs on it (with
``coordinated``, the replicas take turns on the cross-DC link); ``divide_plan`` is the
memory-aware division of the plan's layers. The activation budget of every stage is what the
first stage of an even division holds under 1F1B (S micro-batches of L/S layers): JEEVES runs
in the memory 1F1B would take.
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
    candidates = [base]
    for front in range(1, min(3, stages // 2) + 1):  # the first `front` stages give up `d` layers each
        for d in range(1, min(max_shift, base[0] - 1) + 1):
            lay = [n - d if i < front else n for i, n in enumerate(base)]
            spare = front * d
            back = stages - front
            for i in range(front, stages):
                lay[i] += spare // back + (1 if (i - front) < spare % back else 0)
            candidates.append(lay)
    best, best_t = base, float("inf")
    for lay in candidates:
        t = simulate(cross_dc_pipeline(setup, lay, coordinated=coordinated, ack_wait=ack_wait,
                                       replicas=probe_replicas), "comm-aware").iteration_time
        if t < best_t - 1e-12:
            best, best_t = lay, t
    return best


# -- a HeteroPP plan across two DCs ---------------------------------------------------------------
def cross_dc_boundary(plan: "Plan") -> int | None:
    """The boundary (stage i to i + 1) whose stages sit in different DCs, or None when the plan
    stays in one. A plan that crosses DCs more than once is refused: JEEVES splits a pipeline
    over two DCs."""
    from .plan import PlanError

    cuts = [i for i in range(plan.num_stages - 1) if plan.stages[i].chip != plan.stages[i + 1].chip]
    if len(cuts) > 1:
        raise PlanError(f"the plan crosses between clusters at boundaries {cuts} "
                        f"({' -> '.join(s.chip for s in plan.stages)}); a cross-DC schedule needs two DCs, "
                        f"one crossing")
    return cuts[0] if cuts else None


def budget_layers(num_stages: int, num_layers: int, num_microbatches: int) -> int:
    """Layer-micro-batches of activations a stage may hold under the comm-aware schedule: what
    the first stage of an even division holds under 1F1B."""
    return min(num_stages, num_microbatches) * math.ceil(num_layers / num_stages)


def inflight_microbatches(plan: "Plan", stage: int) -> int:
    """How many micro-batches' activations stage ``stage`` holds at most under the budget."""
    s = plan.stages[stage]
    budget = budget_layers(plan.num_stages, plan.model.n_layers, plan.num_microbatches)
    return max(1, min(plan.num_microbatches, budget // s.layers))


def plan_pipeline(plan: "Plan", coordinated: bool = False, ack_wait: bool = False) -> Pipeline:
    """The simulator's pipeline of ``plan`` with every DP replica: the cross-DC boundary (if
    any) is one link per direction that all replicas share (``inter_cluster``'s bandwidth,
    each micro-batch's whole activation), served in turns with ``coordinated``; each stage's
    activations are capped at the budget. ``ack_wait``: blocking sends (DAPPLE)."""
    base = pipeline_from_plan(plan)
    cut = cross_dc_boundary(plan)
    links = list(base.links)
    if cut is not None:
        lk = plan.cluster.inter_cluster
        links[cut] = LinkModel(plan.model.p2p_bytes(1) * plan.micro_batch_size, lk.bandwidth, lk.latency, shared=True)
    stages = []
    for i, st in enumerate(base.stages):
        limit = inflight_microbatches(plan, i) * st.act_bytes
        stages.append(dataclasses.replace(st, act_limit=min(st.act_limit, limit)))
    return Pipeline(stages=stages, links=links, microbatches=[plan.num_microbatches] * plan.dp, ack_wait=ack_wait,
                    coordinated=coordinated and cut is not None)


def comm_aware_schedules(plan: "Plan", coordinated: bool) -> list[Schedule]:
    """Per DP replica, the lists JEEVES's greedy scheduler runs on ``plan_pipeline(plan)``
    (named ``jeeves`` with coordinated turns on the cross-DC link, else ``comm-aware``)."""
    res = simulate(plan_pipeline(plan, coordinated=coordinated), "comm-aware")
    cut = cross_dc_boundary(plan)
    turns = (cut,) if coordinated and cut is not None else ()
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
    memory under the budget, the one the comm-aware schedule finishes fastest on."""
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
