"""Di-PS: asynchronous cross-cluster outer optimization through a leader/follower parameter server.

The public names load on first use (PEP 562), so that importing a light submodule such as
``diutil.address`` does not import torch, gRPC and the device layer with the whole package.
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "JobToken": "auth", "OuterClient": "client", "choose_deployment": "deployment", "Follower": "follower",
    "GraceEstimator": "grace", "optimal_grace": "grace", "ModelLayout": "layout", "Leader": "leader",
    "LeaderConfig": "leader", "NesterovOuter": "outer_optimizer", "PenaltyDecision": "penalty",
    "PseudoGradientPenalty": "penalty", "token_weights": "penalty", "greedy_schedule": "schedule",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'dips' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
