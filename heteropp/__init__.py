"""HeteroPP planning: HeteroAuto (strategy search), the cost model, schedules and the simulator.

Pure Python; nothing here needs the C++ layers.
"""
from .cluster import ChipSpec, ClusterSpec, LinkSpec, parse_tokens
from .cost_model import StageCost, pipeline_time, stage_costs
from .model_spec import ModelSpec
from .plan import Plan, PlanError, StagePlan
from .profile import ChipProfile, LayerTimes
from .search import HeteroAuto, NoFeasiblePlan, SearchResult

__all__ = [
    "ChipSpec", "ClusterSpec", "LinkSpec", "parse_tokens", "StageCost", "pipeline_time", "stage_costs",
    "ModelSpec", "Plan", "PlanError", "StagePlan", "ChipProfile", "LayerTimes", "HeteroAuto",
    "NoFeasiblePlan", "SearchResult",
]
