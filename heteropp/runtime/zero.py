"""ZeRO-1 for one stage: AdamW's state sharded over the stage's DP group.

The stage's parameters are viewed as one flat vector (padded to a multiple of the DP size).
Gradients are reduce-scattered, so each DP rank holds the summed gradient of its 1/dp slice;
AdamW, which is elementwise, steps that slice's fp32 copy with its own moments; the updated
slices are all-gathered back into the parameters. Memory for AdamW's moments falls by the DP
size. ``torch.distributed.optim.ZeroRedundancyOptimizer`` shards whole parameters over ranks
(uneven, and it all-reduces gradients rather than reduce-scattering them), so it is not used.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


class ZeroAdamW:
    """AdamW over ``params`` with state sharded over ``group`` (``size`` ranks, this one ``rank``)."""

    def __init__(self, params: list[nn.Parameter], group: dist.ProcessGroup, size: int, rank: int,
                 lr: float, weight_decay: float):
        self.params, self.group, self.size, self.rank = params, group, size, rank
        self.numel = sum(p.numel() for p in params)
        self.shard = -(-self.numel // size)
        device = params[0].device
        flat = self._flat([p.detach() for p in params])
        self.master = nn.Parameter(flat[rank * self.shard:(rank + 1) * self.shard].clone())
        self.optimizer = torch.optim.AdamW([self.master], lr=lr, weight_decay=weight_decay)
        self._device = device

    def _flat(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        flat = torch.cat([t.reshape(-1) for t in tensors])
        pad = self.shard * self.size - self.numel
        return torch.cat([flat, flat.new_zeros(pad)]) if pad else flat

    def _unflat(self, flat: torch.Tensor) -> list[torch.Tensor]:
        out, at = [], 0
        for p in self.params:
            out.append(flat[at:at + p.numel()].view_as(p))
            at += p.numel()
        return out

    def _gather(self, shard: torch.Tensor) -> torch.Tensor:
        full = shard.new_empty(self.shard * self.size)
        dist.all_gather_into_tensor(full, shard.contiguous(), group=self.group)
        return full

    def reduce_scatter_gradients(self) -> None:
        """Sum the gradients over the DP group; this rank keeps its slice (as the master's grad)."""
        flat = self._flat([p.grad for p in self.params])
        shard = flat.new_empty(self.shard)
        dist.reduce_scatter_tensor(shard, flat, group=self.group)
        self.master.grad = shard
        for p in self.params:
            p.grad = None

    def owned_sumsq(self, owned: list[bool]) -> torch.Tensor:
        """Sum of squared gradients of this rank's slice, over parameters marked ``owned``."""
        mask = self._flat([torch.full((p.numel(),), float(o), device=self._device) for p, o in zip(self.params, owned)])
        mine = mask[self.rank * self.shard:(self.rank + 1) * self.shard]
        return (self.master.grad.double().pow(2) * mine.double()).sum()

    @torch.no_grad()
    def step(self, grad_scale: float) -> None:
        """Scale (clip) the slice's gradient, step it, and all-gather the parameters back."""
        self.master.grad.mul_(grad_scale)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        for p, value in zip(self.params, self._unflat(self._gather(self.master.detach()))):
            p.copy_(value)

    # -- checkpoints: per-parameter state, as the unsharded AdamW keeps it ---------------------
    def param_state(self) -> dict[nn.Parameter, dict[str, torch.Tensor]]:
        """Each parameter's AdamW state, gathered over the DP group (collective)."""
        st = self.optimizer.state.get(self.master)
        if not st:
            return {}
        avg, sq = self._unflat(self._gather(st["exp_avg"])), self._unflat(self._gather(st["exp_avg_sq"]))
        return {p: {"exp_avg": a, "exp_avg_sq": s, "step": st["step"]} for p, a, s in zip(self.params, avg, sq)}

    @torch.no_grad()
    def load_param_state(self, state: dict[nn.Parameter, dict[str, torch.Tensor]]) -> None:
        """Take this rank's slice of per-parameter AdamW state (and the parameters' values)."""
        self.master.copy_(self._flat([p.detach() for p in self.params])[self.rank * self.shard:(self.rank + 1) * self.shard])
        if not state:
            return
        lo, hi = self.rank * self.shard, (self.rank + 1) * self.shard
        self.optimizer.state[self.master] = {
            "exp_avg": self._flat([state[p]["exp_avg"].to(self._device) for p in self.params])[lo:hi].clone(),
            "exp_avg_sq": self._flat([state[p]["exp_avg_sq"].to(self._device) for p in self.params])[lo:hi].clone(),
            "step": state[self.params[0]]["step"].clone(),
        }
