"""Pseudo-gradient penalty of Di-PS (paper, 4.2): outlier filter, token weights, clipping.

The leader keeps an exponentially weighted mean mu and deviation sigma of pseudo-gradient norms
G (alpha = 0.02) and a bounded stack E of recent accepted scores. A cluster whose score
E = (G - mu) / sigma exceeds beta * max(E) is an outlier and is left out of the update.
Accepted pseudo-gradients are averaged with weights proportional to consumed tokens, and the
average is clipped to norm ``clip_norm``.

Stale pushes are penalized (the paper's section 3 asks the PS to; section 4.2 does not say how):
the clipped average is scaled by the token-weighted mean of (1 + s_j) ** -staleness_decay over
its pushes, s_j the versions decided since push j's base. With decay 1 this is the
staleness-aware learning rate of asynchronous SGD (Zhang et al., IJCAI 2016: lr / s); it comes
after the clip because a clip that binds would undo any scaling made before it.

Two choices the paper leaves open, made here so the rule never misfires:
- the threshold is beta * max(max(E), 1): in a healthy run the norms shrink, mu lags above them,
  every score is negative and a bare beta * max(E) would be negative and reject normal pushes;
  the floor of 1 makes the rule never stricter than a beta-sigma z-score test;
- the first ``warmup`` rounds accept everything and seed mu and sigma from the norms seen, since
  an EMA started from one sample has sigma = 0. The seed is robust: mu the median, sigma the
  median absolute deviation (scaled by 1.4826 to estimate a standard deviation), at least
  ``WARMUP_SIGMA_FLOOR`` of mu. A mean and standard deviation would let one huge push among the
  few warm-up norms (a cluster's bad first step) inflate sigma so far that later outliers pass
  for hundreds of rounds while the EMA slowly forgets it.
"""
from __future__ import annotations

import dataclasses
import math
from collections import deque
import statistics
from collections.abc import Mapping

WARMUP_SIGMA_FLOOR = 0.05  # relative to mu: norms that agree exactly do not make every change an outlier
MAD_TO_SIGMA = 1.4826      # the MAD of a normal distribution times this is its standard deviation


@dataclasses.dataclass
class PenaltyDecision:
    accepted: list[str]
    rejected: list[str]
    weights: dict[str, float]  # accepted push -> weight, summing to 1
    scores: dict[str, float]


class PseudoGradientPenalty:
    def __init__(self, alpha: float = 0.02, beta: float = 3.0, clip_norm: float | None = 1.0,
                 warmup: int = 3, stack_size: int = 32, score_floor: float = 1.0, staleness_decay: float = 0.0):
        if not 0 < alpha < 1 or beta <= 0 or warmup < 1 or stack_size < 1 or not staleness_decay >= 0:
            raise ValueError(f"need 0 < alpha ({alpha}) < 1, beta ({beta}) > 0, warmup ({warmup}) >= 1, "
                             f"stack_size ({stack_size}) >= 1, staleness_decay ({staleness_decay}) >= 0")
        if clip_norm is not None and clip_norm <= 0:
            raise ValueError(f"clip_norm must be positive or None, got {clip_norm}")
        self.alpha, self.beta, self.clip_norm, self.staleness_decay = alpha, beta, clip_norm, staleness_decay
        self.warmup, self.score_floor = warmup, score_floor
        self.mu: float | None = None
        self.sigma: float = 0.0
        self.seen: list[float] = []  # norms of the warm-up rounds
        self.stack: deque[float] = deque(maxlen=stack_size)

    def score(self, norm: float) -> float:
        if self.mu is None or self.sigma <= 0:
            return 0.0
        return (norm - self.mu) / self.sigma

    def threshold(self) -> float:
        return self.beta * max(max(self.stack, default=self.score_floor), self.score_floor)

    def decide(self, norms: Mapping[str, float], tokens: Mapping[str, float]) -> PenaltyDecision:
        """Filter one round's pushes (``norms[p]`` = G of push p) and update the statistics."""
        for p, g in norms.items():
            if not math.isfinite(g) or g < 0:
                raise ValueError(f"pseudo-gradient norm of push {p} is {g}; expected a finite value >= 0")
        warming = self.mu is None
        scores = {p: self.score(g) for p, g in norms.items()}
        if warming:
            accepted = list(norms)
        else:
            limit = self.threshold()
            accepted = [p for p in norms if scores[p] <= limit]
        rejected = [p for p in norms if p not in accepted]
        for p in accepted:
            self._observe(norms[p])
            if not warming:
                self.stack.append(scores[p])
        return PenaltyDecision(accepted, rejected, token_weights({p: tokens[p] for p in accepted}), scores)

    def _observe(self, g: float) -> None:
        if self.mu is None:
            self.seen.append(g)
            if len(self.seen) >= self.warmup:
                self.mu = statistics.median(self.seen)
                mad = statistics.median(abs(x - self.mu) for x in self.seen)
                self.sigma = max(MAD_TO_SIGMA * mad, WARMUP_SIGMA_FLOOR * abs(self.mu))
            return
        self.mu = self.alpha * g + (1 - self.alpha) * self.mu
        self.sigma = math.sqrt((1 - self.alpha) * self.sigma ** 2 + self.alpha * (g - self.mu) ** 2)

    def clip_scale(self, global_norm: float) -> float:
        """Factor min(1, clip_norm / ||delta||) applied to the averaged pseudo-gradient."""
        if self.clip_norm is None or global_norm <= self.clip_norm:
            return 1.0
        return self.clip_norm / global_norm

    def staleness_scale(self, weights: Mapping[str, float], staleness: Mapping[str, int]) -> float:
        """Token-weighted mean of (1 + s) ** -staleness_decay over a round's accepted pushes."""
        bad = {p: s for p, s in staleness.items() if not (isinstance(s, int) and s >= 0)}
        if bad or set(staleness) != set(weights):
            raise ValueError(f"staleness {dict(staleness)}: expected a count >= 0 for each of the pushes {list(weights)}")
        return sum(w * (1 + staleness[p]) ** -self.staleness_decay for p, w in weights.items())

    def state(self) -> dict:
        return {"mu": self.mu, "sigma": self.sigma, "seen": self.seen, "stack": list(self.stack)}

    def load_state(self, state: dict) -> None:
        self.mu, self.sigma = state["mu"], state["sigma"]
        self.seen = list(state["seen"])
        self.stack.clear()
        self.stack.extend(state["stack"])


def token_weights(tokens: Mapping[str, float]) -> dict[str, float]:
    """Weights T_j / sum T over the given pushes (equal weights when no tokens were reported)."""
    bad = {p: t for p, t in tokens.items() if not t >= 0}
    if bad:
        raise ValueError(f"token counts {bad}; expected counts >= 0 (a weight is never negative)")
    total = float(sum(tokens.values()))
    if not tokens:
        return {}
    if total <= 0:
        return {p: 1.0 / len(tokens) for p in tokens}
    return {p: float(t) / total for p, t in tokens.items()}
