"""The HeteroPP runtime: train one model over a plan's stages of different chip types.

Needs torch (the planner in ``heteropp`` does not). Entry points: ``python -m ditorch.train``
(under torchrun) and the pieces below for programs of your own.
"""
from .boundary import RESHARD_MODES, StageBoundary, routes
from .executor import StageExecutor
from .layout import PipelineLayout, RankPlace, StageGroups
from .model_family import HFFamily, LlamaFamily, model_family
from .reference import train_reference
from .stage_model import PipelineStage, StageModule, cut, shard_dim
from .tensor_parallel import TPGroup, WeightGradStore
from .trainer import PipelineTrainer, TrainOptions

__all__ = [
    "HFFamily", "LlamaFamily", "PipelineLayout", "PipelineStage", "PipelineTrainer", "RESHARD_MODES", "RankPlace",
    "StageBoundary", "StageExecutor", "StageGroups", "StageModule", "TPGroup", "TrainOptions", "WeightGradStore",
    "cut", "model_family", "routes", "shard_dim", "train_reference",
]
