"""Cross-DC pipeline training (JEEVES, HotNets'25): the pipeline split over two data centres,
the comm-aware schedule, memory-aware uneven stage division and inter-replica coordinated
sends on the shared cross-DC link.

``cross_dc_pipeline`` builds the simulator's pipeline for R replicas whose stages are split
between two DCs at ``cut`` (stages < cut in DC1); the boundary at the cut is one shared link
per direction. ``memory_aware_division`` picks layers per stage under a fixed per-stage
activation budget: it moves layers off the early stages (which hold the most in-flight
micro-batches) and keeps the division the comm-aware schedule finishes fastest on,
judged on a proportionally scaled-down copy (fewer replicas, the same per-replica bandwidth).
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from .cluster import LinkSpec
from .model_spec import ModelSpec
from .profile import ChipProfile
from .simulator import LinkModel, Pipeline, StageModel, simulate


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
