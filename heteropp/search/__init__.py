"""HeteroAuto: the strategy search of the H2 paper (section 4.3).

For each DP size s_dp dividing the batch B, a DFS picks for every chip group a TP size
s_tp (a power of two up to TP_MAX) and a recompute switch r; the group's pipeline depth
follows from N = s_pp * s_tp * s_dp. Groups run in pipeline order of descending chip memory
(the early, warm-up-heavy stages go to the big-memory chips). At each leaf the layer sharding
picks layers per stage k_g for every group, exactly optimal for the paper's T (``cost_model``,
with P2P between stages) within each group's memory limit.

Two stages (the paper's refinement): the first searches one group per chip type and fixes
s_dp; the second splits each big chip type into sub-groups of ``subgroup_size`` chips that
may each pick their own TP, recompute and layers, with (TP, r) non-increasing along the
pipeline inside a chip type.

Pruning: the DFS walks the pipeline from its end so the number of in-flight micro-batches
(and so the memory limit) of each group is known when it is chosen; a branch stops when the
remaining groups cannot hold all layers even at their best, or when a lower bound on T (the
continuous relaxation of the stage-time balance) already exceeds the best plan found.

One file a part: what the search works on and returns (results.py), the options of a group and
their memory model (space.py), the layer sharding at a leaf (sharding.py), the branch and bound
(branch_and_bound.py), stage two's local search (refine.py), why no plan fits (explain.py), and
HeteroAuto, which joins them and writes the plan (heteroauto.py).
"""
from .heteroauto import HeteroAuto
from .results import Group, GroupChoice, NoFeasiblePlan, SearchResult

__all__ = ["Group", "GroupChoice", "HeteroAuto", "NoFeasiblePlan", "SearchResult"]
