"""Where each global rank sits in a plan (stage, DP replica, TP rank) and the process groups
that follow from it: one TP group per stage replica, one DP group per stage TP rank.

The rank order is the plan's contract (docs/heteropp.md): rank = rank_range[0] + dp·tp + t.
"""
from __future__ import annotations

import dataclasses

import torch.distributed as dist

from heteropp.plan import Plan, PlanError

from .tensor_parallel import SINGLE, TPGroup


@dataclasses.dataclass(frozen=True)
class RankPlace:
    """One rank's place in the pipeline."""

    rank: int
    stage: int
    dp_index: int
    tp_index: int


class PipelineLayout:
    """The plan's stages laid out over global ranks."""

    def __init__(self, plan: Plan):
        self.plan = plan

    @property
    def world_size(self) -> int:
        return self.plan.num_chips

    def check_world(self, world_size: int) -> None:
        """Refuse a job whose size is not the plan's, naming both."""
        if world_size != self.world_size:
            ranges = ", ".join(f"stage {i} ({s.chip}, tp {s.tp} x dp {s.dp}): ranks {list(s.rank_range)}"
                               for i, s in enumerate(self.plan.stages))
            raise PlanError(f"the plan needs exactly {self.world_size} ranks ({ranges}) but the job has "
                            f"world size {world_size}")

    def rank_of(self, stage: int, dp_index: int, tp_index: int) -> int:
        s = self.plan.stages[stage]
        return s.first_rank + dp_index * s.tp + tp_index

    def place(self, rank: int) -> RankPlace:
        for i, s in enumerate(self.plan.stages):
            lo, hi = s.rank_range
            if lo <= rank < hi:
                dp_index, tp_index = divmod(rank - lo, s.tp)
                return RankPlace(rank, i, dp_index, tp_index)
        raise PlanError(f"rank {rank} is outside the plan's {self.world_size} ranks")

    def tp_ranks(self, stage: int, dp_index: int) -> list[int]:
        return [self.rank_of(stage, dp_index, t) for t in range(self.plan.stages[stage].tp)]

    def dp_ranks(self, stage: int, tp_index: int) -> list[int]:
        return [self.rank_of(stage, d, tp_index) for d in range(self.plan.dp)]


@dataclasses.dataclass
class StageGroups:
    """This rank's TP group and DP group (``None`` where the size is 1), and with tied embeddings
    split over stages, the group of every rank of the first and last stages (``tied``: None
    elsewhere) that sums the embedding's and the LM head's gradients."""

    tp: TPGroup
    dp: dist.ProcessGroup | None
    dp_size: int
    tied: dist.ProcessGroup | None = None

    @classmethod
    def create(cls, layout: PipelineLayout, place: RankPlace, tied_embeddings: bool = False) -> "StageGroups":
        """Make every stage's groups; all ranks must call this in the same order (new_group is
        collective over the world), each keeps its own."""
        plan = layout.plan
        tp: TPGroup = SINGLE
        dp = None
        for i, s in enumerate(plan.stages):
            if s.tp > 1:
                for d in range(plan.dp):
                    ranks = layout.tp_ranks(i, d)
                    g = dist.new_group(ranks)
                    if place.rank in ranks:
                        tp = TPGroup(g, s.tp, place.tp_index)
            if plan.dp > 1:
                for t in range(s.tp):
                    ranks = layout.dp_ranks(i, t)
                    g = dist.new_group(ranks)
                    if place.rank in ranks:
                        dp = g
        tied = None
        if tied_embeddings and len(plan.stages) > 1:
            ends = (plan.stages[0], plan.stages[-1])
            ranks = sorted({r for s in ends for r in range(*s.rank_range)})
            g = dist.new_group(ranks)
            tied = g if place.rank in ranks else None
        return cls(tp=tp, dp=dp, dp_size=plan.dp, tied=tied)
