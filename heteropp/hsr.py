"""The HeteroSpeedupRatio (the H2 paper, section 6.2): what training on all chip groups together
gains over each group training alone.

    HSR = throughput of the heterogeneous run / sum over groups of each group's throughput alone

where a throughput is the tokens of one iteration over its time. At *constant batch* every run
trains the same global batch; at *sum batch* the heterogeneous run's batch is the sum of the
groups' batches. HSR > 1: mixing the chips trains faster than running the groups as separate
jobs would, in total. The planner's estimate (``expected``) uses its own cost model for every
run; ``benchmarks/hsr.py`` measures the same ratio on the runtime.
"""
from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

from .cluster import ClusterSpec
from .model_spec import ModelSpec
from .plan import Plan
from .search import HeteroAuto, NoFeasiblePlan


def hetero_speedup_ratio(hetero_tokens_per_s: float, group_tokens_per_s: Sequence[float]) -> float:
    """HSR from the heterogeneous run's throughput and each group's alone (groups that cannot
    train alone count 0)."""
    alone = sum(group_tokens_per_s)
    if hetero_tokens_per_s < 0 or any(t < 0 for t in group_tokens_per_s):
        raise ValueError(f"throughputs must be >= 0; got {hetero_tokens_per_s} and {list(group_tokens_per_s)}")
    if alone <= 0:
        raise ValueError("no chip group can train the model alone: the HeteroSpeedupRatio is undefined")
    return hetero_tokens_per_s / alone


def throughput(plan: Plan) -> float:
    """Tokens per second of ``plan`` as the planner estimates it."""
    return plan.global_batch_tokens / plan.estimate["iteration_time_s"]


def sub_cluster(cluster: ClusterSpec, names: Sequence[str]) -> ClusterSpec:
    """``cluster`` with only the chip types ``names``."""
    return dataclasses.replace(cluster, chips=tuple(c for c in cluster.chips if c.name in names),
                               name=f"{cluster.name}[{'+'.join(names)}]")


def best_plan(model: ModelSpec, cluster: ClusterSpec, gbs_tokens: int, alpha: float,
              two_stage: bool = True) -> Plan | None:
    """HeteroAuto's plan for ``cluster`` (None: it cannot train the model)."""
    try:
        auto = HeteroAuto(model, cluster, gbs_tokens, alpha=alpha)
        return auto.to_plan(auto.search(two_stage=two_stage))
    except NoFeasiblePlan:
        return None


@dataclasses.dataclass
class Expectation:
    """The planner's view of a cluster against its chip groups alone, at constant batch."""

    whole: Plan
    alone: dict[str, Plan | None]  # chip type -> its best plan alone (None: cannot train alone)

    @property
    def ratio(self) -> float:
        return hetero_speedup_ratio(throughput(self.whole), [throughput(p) if p else 0.0 for p in self.alone.values()])

    def faster_groups(self) -> list[str]:
        """Chip types that alone train faster than the whole cluster."""
        whole = throughput(self.whole)
        return [n for n, p in self.alone.items() if p is not None and throughput(p) > whole]


def expected(model: ModelSpec, cluster: ClusterSpec, gbs_tokens: int, alpha: float, whole: Plan,
             two_stage: bool = True) -> Expectation:
    """The whole cluster's plan beside each chip group's best plan alone, at the same batch."""
    alone = {c.name: best_plan(model, sub_cluster(cluster, [c.name]), gbs_tokens, alpha, two_stage)
             for c in cluster.chips}
    return Expectation(whole, alone)


def fastest_subset(model: ModelSpec, cluster: ClusterSpec, gbs_tokens: int, alpha: float, known: Expectation,
                   two_stage: bool = True) -> Plan | None:
    """The plan of the subset of chip types that trains fastest. The whole cluster and each type
    alone come from ``known``; every other non-empty subset is planned here (clusters have a
    handful of chip types). Of equally fast subsets the one with fewer types wins."""
    names = [c.name for c in cluster.chips]
    candidates: list[Plan | None] = [known.alone.get(n) for n in names]
    for r in range(2, len(names)):
        candidates += [best_plan(model, sub_cluster(cluster, subset), gbs_tokens, alpha, two_stage)
                       for subset in itertools.combinations(names, r)]
    candidates.append(known.whole)
    best: Plan | None = None
    for plan in candidates:
        if plan is not None and (best is None or throughput(plan) > throughput(best) * (1 + 1e-12)):
            best = plan
    return best
