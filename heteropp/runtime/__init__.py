"""The HeteroPP runtime: train one model over a plan's stages of different chip types.

Needs torch (the planner in ``heteropp`` does not). Entry points: ``python -m ditorch.train``
(under torchrun) and the pieces below for programs of your own.
"""
from .boundary import RESHARD_MODES, StageBoundary, routes
from .executor import StageExecutor
from .layout import PipelineLayout, RankPlace, StageGroups
from .reference import train_reference
from .stage_model import StageModule, cut, shard_dim
from .tensor_parallel import TPGroup, WeightGradStore
from .trainer import PipelineTrainer, TrainOptions, build_schedule, model_config

__all__ = [
    "PipelineLayout", "PipelineTrainer", "RESHARD_MODES", "RankPlace", "StageBoundary", "StageExecutor",
    "StageGroups", "StageModule", "TPGroup", "TrainOptions", "WeightGradStore", "build_schedule", "cut",
    "model_config", "routes", "shard_dim", "train_reference",
]
