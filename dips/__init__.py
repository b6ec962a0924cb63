"""Di-PS: asynchronous cross-cluster outer optimization through a leader/follower parameter server."""
from .auth import JobToken
from .client import OuterClient
from .deployment import choose_deployment
from .follower import Follower
from .grace import GraceEstimator, optimal_grace
from .layout import ModelLayout
from .leader import Leader, LeaderConfig
from .outer_optimizer import NesterovOuter
from .penalty import PenaltyDecision, PseudoGradientPenalty, token_weights
from .schedule import greedy_schedule

__all__ = [
    "JobToken", "OuterClient", "choose_deployment", "Follower", "GraceEstimator", "optimal_grace",
    "ModelLayout", "Leader", "LeaderConfig", "NesterovOuter", "PenaltyDecision", "PseudoGradientPenalty",
    "token_weights", "greedy_schedule",
]
