"""What the search works on and returns: groups of chips, each group's choice, the result."""
from __future__ import annotations

import dataclasses

from ..cluster import ChipSpec


class NoFeasiblePlan(ValueError):
    """No plan satisfies the constraints; the message names the binding one."""


class OverBudget(Exception):
    """A branch and bound that would visit more nodes than it was allowed."""


@dataclasses.dataclass(frozen=True)
class Group:
    """Chips the search treats as one unit: one TP size, recompute switch and layer count."""

    chip: ChipSpec
    count: int
    index: int  # position in pipeline order


@dataclasses.dataclass(frozen=True)
class GroupChoice:
    tp: int
    recompute: bool
    stages: int
    layers_per_stage: int  # k: ceil of the group's layers over its stages
    layers: int  # the group's exact layer total


@dataclasses.dataclass
class SearchResult:
    """The best configuration found and how the search went."""

    dp: int
    groups: list[Group]
    choices: list[GroupChoice]
    objective: float  # the paper's T for the configuration (ceil layers per stage)
    leaves: int = 0
    seconds: float = 0.0
    stage1: "SearchResult | None" = None
