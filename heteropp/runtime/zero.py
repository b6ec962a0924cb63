"""ZeRO-1 for one stage: AdamW's state sharded over the stage's DP group.

The stage's parameters live in one flat buffer (``flat_parameters.py``, padded to a multiple of
the DP size). Gradients are reduce-scattered from the flat gradient buffer, so each DP rank
holds the summed gradient of its 1/dp slice; AdamW, which is elementwise, steps that slice of
the parameter buffer itself (no master copy: the weights are fp32 already) with its own
moments; the slices are then all-gathered back into the buffer. Per parameter a rank holds
4 B of weight and 4 B of gradient, and (4 B of reduced gradient + 8 B of moments) / dp.
``torch.distributed.optim.ZeroRedundancyOptimizer`` shards whole parameters over ranks (uneven,
and it all-reduces gradients rather than reduce-scattering them), so it is not used.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ditorch_ext.torch_compat import all_gather_single, reduce_scatter_single

from .flat_parameters import FlatParameters


class ZeroAdamW:
    """AdamW over ``flat``'s parameters with state sharded over ``group`` (``size`` ranks, this
    one ``rank``); ``flat`` must be padded to a multiple of ``size``."""

    def __init__(self, flat: FlatParameters, group: dist.ProcessGroup, size: int, rank: int,
                 lr: float, weight_decay: float):
        if flat.data.numel() % size:
            raise ValueError(f"ZeroAdamW: a buffer of {flat.data.numel()} elements does not split into {size} "
                             f"equal slices; expected FlatParameters(pad_to={size})")
        self.flat, self.group, self.size, self.rank = flat, group, size, rank
        self.shard = flat.data.numel() // size
        self.lo, self.hi = rank * self.shard, (rank + 1) * self.shard
        # The slice of the parameters' own storage this rank steps.
        self.slice = nn.Parameter(flat.data[self.lo:self.hi])
        self.slice.grad = torch.zeros_like(self.slice)
        self.optimizer = torch.optim.AdamW([self.slice], lr=lr, weight_decay=weight_decay)

    def reduce_scatter_gradients(self) -> None:
        """Sum the gradients over the DP group; this rank keeps its slice (the slice's grad)."""
        reduce_scatter_single(self.slice.grad, self.flat.grad, group=self.group)

    def owned_sumsq(self, owned: list[bool]) -> torch.Tensor:
        """Sum of squared gradients of this rank's slice, over parameters marked ``owned``."""
        total = torch.zeros((), dtype=torch.float64, device=self.flat.data.device)
        for lo, hi in _runs(self.flat.ranges, owned):
            lo, hi = max(lo, self.lo), min(hi, self.hi)
            if lo < hi:
                total += self.slice.grad[lo - self.lo:hi - self.lo].double().pow(2).sum()
        return total

    @torch.no_grad()
    def step(self, grad_scale: float) -> None:
        """Scale (clip) the slice's gradient, step it, all-gather the parameters back, and zero
        the gradients for the next step."""
        self.slice.grad.mul_(grad_scale)
        self.optimizer.step()
        mine = self.slice.detach().clone()  # a gather's input must not alias its output
        all_gather_single(self.flat.data, mine, group=self.group)
        self.flat.zero_grad()

    # -- checkpoints: per-parameter state, as the unsharded AdamW keeps it ---------------------
    def param_state(self) -> dict[nn.Parameter, dict[str, torch.Tensor]]:
        """Each parameter's AdamW state, gathered over the DP group (collective)."""
        st = self.optimizer.state.get(self.slice)
        if not st:
            return {}
        avg, sq = (self.flat.unpack(self._gather(st[k])) for k in ("exp_avg", "exp_avg_sq"))
        return {p: {"exp_avg": a, "exp_avg_sq": s, "step": st["step"]}
                for p, a, s in zip(self.flat.params, avg, sq)}

    @torch.no_grad()
    def load_param_state(self, state: dict[nn.Parameter, dict[str, torch.Tensor]]) -> None:
        """Take this rank's slice of per-parameter AdamW state (the parameters themselves were
        loaded into the buffer already)."""
        if not state:
            return
        device = self.flat.data.device
        slice_of = lambda key: self.flat.pack([state[p][key].to(device) for p in self.flat.params])[self.lo:self.hi]
        self.optimizer.state[self.slice] = {"exp_avg": slice_of("exp_avg").clone(),
                                            "exp_avg_sq": slice_of("exp_avg_sq").clone(),
                                            "step": state[self.flat.params[0]]["step"].clone()}

    def _gather(self, shard: torch.Tensor) -> torch.Tensor:
        full = shard.new_empty(self.shard * self.size)
        all_gather_single(full, shard.contiguous(), group=self.group)
        return full


def _runs(ranges: list[tuple[int, int]], marked: list[bool]) -> list[tuple[int, int]]:
    """The [start, end) runs covered by the consecutive ``ranges`` that are ``marked``."""
    runs: list[tuple[int, int]] = []
    for (a, b), m in zip(ranges, marked):
        if not m:
            continue
        if runs and runs[-1][1] == a:
            runs[-1] = (runs[-1][0], b)
        else:
            runs.append((a, b))
    return runs
