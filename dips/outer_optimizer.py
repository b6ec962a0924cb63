"""Nesterov outer optimizer in FP32, the rule of torch.optim.SGD(nesterov=True, dampening=0)."""
from __future__ import annotations

import torch


class NesterovOuter:
    """Outer step on a dict of FP32 tensors: buf = m*buf + g; p -= lr * (g + m*buf)."""

    def __init__(self, lr: float = 0.7, momentum: float = 0.8):
        if lr <= 0 or not 0 <= momentum < 1:
            raise ValueError(f"outer lr={lr} must be > 0 and momentum={momentum} in [0, 1)")
        self.lr, self.momentum = lr, momentum

    @torch.no_grad()
    def step(self, params: dict[str, torch.Tensor], grads: dict[str, torch.Tensor],
             buffers: dict[str, torch.Tensor]) -> None:
        """Update ``params`` in place; ``buffers`` holds the momentum (created on first use)."""
        for name, g in grads.items():
            p = params[name]
            g = g.to(torch.float32)
            buf = buffers.get(name)
            if buf is None:
                buf = buffers[name] = g.clone()
            else:
                buf.mul_(self.momentum).add_(g)
            p.sub_(g.add(buf, alpha=self.momentum), alpha=self.lr)
