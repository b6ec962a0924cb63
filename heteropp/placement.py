"""Where a plan puts its ranks in the fleet, and the links between its stages: what the simulator
times and what an emulated run's dicomm paces, from one link model (diutil/datasheets/links.py).

Each chip type is a DC of its own (``ClusterSpec.fleet_links``); a stage's TP group of one DP
replica is one node, so TP stays inside a node and stage boundaries and DP cross nodes, as the
cost model has it (its TP all-reduces on the scale-up fabric, everything else on NICs).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from diutil.datasheets.links import LinkSpec, Place, link_class

if TYPE_CHECKING:
    from .plan import Plan


def rank_places(plan: "Plan") -> list[Place]:
    """The place of every global rank of ``plan`` (rank = stage's first + dp * tp + tp index)."""
    places: list[Place] = []
    for i, stage in enumerate(plan.stages):
        chip = plan.cluster.chip(stage.chip)
        for dp_index in range(stage.dp):
            places += [Place(dc=stage.chip, node=f"s{i}r{dp_index}", nic_bandwidth=chip.nic_bandwidth)] * stage.tp
    return places


def boundary_link(plan: "Plan", boundary: int, time_scale: float = 1.0) -> LinkSpec:
    """The link between stage ``boundary`` and the next, at ``time_scale`` (an emulated run's)."""
    places = rank_places(plan)
    a, b = (places[plan.stages[i].rank_range[0]] for i in (boundary, boundary + 1))
    link = plan.cluster.fleet_links.between(a, b)
    assert link is not None  # stages are on two nodes, whose classes every cluster names
    return link.scaled(time_scale)


def boundary_shared(plan: "Plan", boundary: int) -> bool:
    """Whether the link between stage ``boundary`` and the next is one that every DP replica's
    boundary crosses (the cross-DC link, one per direction between two DCs) rather than each
    replica's own (its sending rank's NIC or scale-up port)."""
    places = rank_places(plan)
    a, b = (places[plan.stages[i].rank_range[0]] for i in (boundary, boundary + 1))
    return link_class(a, b) == "inter_cluster"


def link_env(plan: "Plan", rank: int, time_scale: float, state: str | None = None) -> dict[str, str]:
    """The environment that makes dicomm emulate the plan's links for ``rank`` (FleetLinks.env)."""
    places = rank_places(plan)
    if not 0 <= rank < len(places):
        raise ValueError(f"rank {rank} is outside the plan's {len(places)} ranks")
    return plan.cluster.fleet_links.env(places[rank], time_scale, state)
