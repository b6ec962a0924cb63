"""HeteroAuto's cost model: the paper's iteration time T plus P2P activation transfer.

    T = max_i ( b * T_i + U_i + alpha * sum_{j != i} T_j )

with T_i the per-micro-batch time of stage i (its layers times t_fwd + t_bwd + r * t_recomp,
its forward's work outside the layers, plus the P2P sends that block it), U_i the stage's optimizer update time and alpha the
bubble coefficient (1 for 1F1B, 0 for zero-bubble schedules).
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from .cluster import ClusterSpec, LinkSpec
from .model_spec import ModelSpec
from .profile import ChipProfile


@dataclasses.dataclass(frozen=True)
class StageCost:
    """Per-micro-batch compute, blocking P2P and per-iteration update time of one stage (s)."""

    compute: float
    p2p: float
    update: float

    @property
    def per_microbatch(self) -> float:
        return self.compute + self.p2p


def pipeline_time(stages: Sequence[StageCost], num_microbatches: int, alpha: float = 1.0) -> float:
    """The paper's T for one pipeline of stages running ``num_microbatches`` micro-batches."""
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
    total = sum(s.per_microbatch for s in stages)
    return max(
        num_microbatches * s.per_microbatch + s.update + alpha * (total - s.per_microbatch) for s in stages
    )


def boundary_transfer_time(model: ModelSpec, link: LinkSpec, tp_send: int, tp_recv: int,
                           nic_send: float, nic_recv: float, shared_by: int = 0) -> float:
    """One micro-batch's activation (or its gradient) across a stage boundary.

    Activations between layers are sequence-sharded over TP, so each of the min(tp) busiest
    endpoints moves 1/min(tp_send, tp_recv) of the activation over its own affinity NIC
    (the senders work in parallel); the slowest of link, sender NIC, receiver NIC bounds it.
    ``shared_by`` > 0: the link is one that ``shared_by`` DP replicas' boundaries cross at once
    (the cross-DC link, diutil/datasheets/links.py), each with every TP piece, so they take it
    one after another (its bandwidth shared, as the simulator and an emulated run have it).
    """
    nbytes = model.p2p_bytes(min(tp_send, tp_recv))
    pieces = shared_by * min(tp_send, tp_recv) if shared_by > 0 else 1
    return link.latency + pieces * nbytes / min(link.bandwidth, nic_send, nic_recv)


def stage_costs(
    model: ModelSpec,
    cluster: ClusterSpec,
    profiles: dict[str, ChipProfile],
    stages: Sequence[tuple[str, int, int, int, bool]],
    blocking_p2p: bool = True,
) -> list[StageCost]:
    """Costs of stages given as (chip, tp, dp, layers, recompute) in pipeline order.

    With ``blocking_p2p`` each stage pays for its sends (activation forward, gradient
    backward), as in Megatron's 1F1B; with overlapped P2P they are hidden.
    """
    out = []
    for i, (chip, tp, dp, layers, recompute) in enumerate(stages):
        prof = profiles[chip]
        compute = layers * prof.layer_times(tp).compute(recompute)
        embed_fwd, embed_bwd, head_fwd, head_bwd = prof.end_times(tp)
        rerun = 2.0 if recompute else 1.0  # a recomputing stage runs its forward twice
        compute += rerun * prof.stage_time(tp)
        if i == 0:
            compute += rerun * embed_fwd + embed_bwd
        if i == len(stages) - 1:
            compute += rerun * head_fwd + head_bwd
        p2p = 0.0
        if blocking_p2p:
            for j in (i - 1, i + 1):
                if 0 <= j < len(stages):
                    other, other_tp = stages[j][0], stages[j][1]
                    p2p += boundary_transfer_time(
                        model, cluster.link_between(chip, other), tp, other_tp,
                        cluster.chip(chip).nic_bandwidth, cluster.chip(other).nic_bandwidth,
                        shared_by=dp if cluster.link_shared(chip, other) else 0,
                    )
        out.append(StageCost(compute=compute, p2p=p2p, update=prof.stage_update_time(tp, dp, layers)))
    return out
