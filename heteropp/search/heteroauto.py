"""HeteroAuto: the search over one model, cluster and global batch, and its plan output."""
from __future__ import annotations

import dataclasses
import time

from ..cluster import ClusterSpec
from ..cost_model import pipeline_time, stage_costs
from ..model_spec import ModelSpec
from ..plan import Plan, StagePlan
from .branch_and_bound import search_groups
from .explain import explain
from .refine import refine
from .results import Group, NoFeasiblePlan, OverBudget, SearchResult
from .space import SearchSpace

_EXACT_STAGE_TWO_NODES = 100  # stage two is an exact branch and bound while it visits fewer nodes


class HeteroAuto:
    """The search over one model, cluster and global batch.

    ``alpha`` is the bubble coefficient (1: 1F1B). ``blocking_p2p`` charges stage sends to
    the stage (Megatron 1F1B); without it P2P is assumed overlapped.
    """

    def __init__(self, model: ModelSpec, cluster: ClusterSpec, global_batch_tokens: int, alpha: float = 1.0,
                 blocking_p2p: bool = True, subgroup_size: int = 128):
        if global_batch_tokens % model.seq:
            raise NoFeasiblePlan(
                f"divisibility: global batch of {global_batch_tokens} tokens is not a multiple of seq={model.seq}"
            )
        self.model = model
        self.cluster = cluster
        self.gbs_tokens = global_batch_tokens
        self.batch = global_batch_tokens // model.seq  # B, in sequences (micro-batch size 1)
        self.alpha = alpha
        self.blocking_p2p = blocking_p2p
        self.subgroup_size = subgroup_size
        self.space = SearchSpace(model, cluster, self.batch, alpha, blocking_p2p)
        self.profiles = self.space.profiles
        self.types = self.space.types  # pipeline order: descending memory (ties: the order given)

    @property
    def leaves(self) -> int:
        """Layer-sharding evaluations of the last search."""
        return self.space.leaves

    def search(self, two_stage: bool = True) -> SearchResult:
        """Run stage one (and, by default, stage two) and return the best configuration."""
        t0 = time.perf_counter()
        self.space.reset()
        groups = [Group(c, c.count, i) for i, c in enumerate(self.types)]
        first = search_groups(self.space, groups, self.space.dp_candidates(groups), incumbent=None)
        if first is None:
            raise NoFeasiblePlan(explain(self.space))
        first.leaves = self.leaves
        best = first
        if two_stage:
            sub = self._split(first.dp)
            if len(sub) > len(groups):
                # the exact branch and bound while it stays small, else the local search
                try:
                    second = search_groups(self.space, sub, [first.dp], first.objective,
                                           node_budget=_EXACT_STAGE_TWO_NODES) or first
                except OverBudget:
                    second = refine(self.space, sub, first)
                if second.objective < first.objective:
                    best = second
        best = dataclasses.replace(best, stage1=first, leaves=self.leaves)
        best.seconds = time.perf_counter() - t0
        return best

    def to_plan(self, result: SearchResult, schedule: str = "1f1b") -> Plan:
        """Expand a search result into stages with exact layer and rank ranges."""
        stages: list[StagePlan] = []
        layer, rank = 0, 0
        for g, ch in zip(result.groups, result.choices):
            # a group with fewer layers than s * k gives the shortfall to its earliest stages,
            # which hold the most warm-up micro-batches
            short = ch.stages * ch.layers_per_stage - ch.layers
            for j in range(ch.stages):
                n = ch.layers_per_stage - (1 if j < short else 0)
                stages.append(StagePlan(chip=g.chip.name, tp=ch.tp, dp=result.dp, layers=n, first_layer=layer,
                                        recompute=ch.recompute, first_rank=rank, group=g.index))
                layer += n
                rank += ch.tp * result.dp
        plan = Plan(model=self.model, cluster=self.cluster, global_batch_tokens=self.gbs_tokens, dp=result.dp,
                    stages=tuple(stages), alpha=self.alpha, schedule=schedule)
        costs = stage_costs(self.model, self.cluster, self.profiles, plan.stage_tuples(), self.blocking_p2p)
        t = pipeline_time(costs, plan.num_microbatches, self.alpha)
        estimate = {
            "iteration_time_s": t,
            "objective_s": result.objective,
            "tokens_per_chip_per_s": self.gbs_tokens / (t * plan.num_chips),
            "stage_time_s": [c.per_microbatch for c in costs],
            "search_seconds": result.seconds,
            "search_leaves": result.leaves,
        }
        plan = dataclasses.replace(plan, estimate=estimate)
        plan.validate()
        return plan

    def _split(self, dp: int) -> list[Group]:
        """Stage two's groups: each chip type of more than ``subgroup_size`` chips split into
        sub-groups of that size (where TP and DP allow), each free to choose for itself."""
        out: list[Group] = []
        n = self.subgroup_size
        for c in self.types:
            if n and c.count > n and c.count % n == 0 and any(n % (tp * dp) == 0 for tp in c.tp_sizes()):
                out.extend(Group(c, n, 0) for _ in range(c.count // n))
            else:
                out.append(Group(c, c.count, 0))
        return [dataclasses.replace(g, index=i) for i, g in enumerate(out)]
