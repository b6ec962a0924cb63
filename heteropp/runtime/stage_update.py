"""A stage's update after its micro-batches: gradients reduced (the TP-partial ones over TP, a
tied embedding's and LM head's between the first and last stages, everything over DP in place
in the stage's flat gradient buffer, or reduce-scattered from it under ZeRO-1), the global
gradient norm summed over every stage, TP and DP rank, clipped as
``torch.nn.utils.clip_grad_norm_`` clips, and the optimizer stepped."""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .flat_parameters import FlatParameters
from .layout import RankPlace, StageGroups
from .stage_model import PipelineStage, shard_dim


class StageUpdate:
    """The optimizer (AdamW, or ZeRO-1's sharded AdamW when ``zero1`` and DP > 1) of this rank's
    stage ``module``, clipping at ``clip``."""

    def __init__(self, module: PipelineStage, groups: StageGroups, place: RankPlace, dp: int, lr: float,
                 weight_decay: float, clip: float, zero1: bool, device: torch.device):
        self.module, self.groups, self.place, self.clip, self.device = module, groups, place, clip, device
        self.zero = None
        sharded = zero1 and dp > 1
        self.flat = FlatParameters(list(module.parameters()), pad_to=dp if sharded else 1)
        if sharded:
            from .zero import ZeroAdamW

            self.zero = ZeroAdamW(self.flat, groups.dp, dp, place.dp_index, lr, weight_decay)
        else:
            self.optimizer = make_optimizer(module.parameters(), lr, weight_decay)

    def state(self) -> dict:
        """AdamW's state per parameter of this rank (gathered over DP under ZeRO-1: collective)."""
        return self.zero.param_state() if self.zero is not None else dict(self.optimizer.state)

    def load_state(self, state: dict) -> None:
        """Install per-parameter AdamW state (after the parameters themselves were loaded)."""
        if self.zero is not None:
            self.zero.load_param_state(state)
        else:
            for p, st in state.items():
                self.optimizer.state[p] = st

    def apply(self, loss_sum: float) -> float:
        """Reduce, clip and step; ``loss_sum`` is this rank's share of the batch's summed loss.
        Returns the loss summed over every rank (collective over the whole job)."""
        module = self.module
        partial = module.tp_partial_parameters()
        if partial:
            all_reduce_flat([p.grad for p in partial], self.groups.tp.group)
        if self.groups.tied is not None:
            self._sum_tied_gradients()
        owned = [self._owned(n, p) for n, p in module.named_parameters()]
        if self.zero is not None:
            self.zero.reduce_scatter_gradients()
            sumsq = self.zero.owned_sumsq(owned)
        else:
            if self.groups.dp is not None:
                dist.all_reduce(self.flat.grad, group=self.groups.dp)
            mine = [p.grad for p, o in zip(module.parameters(), owned) if o and self.place.dp_index == 0]
            sumsq = squared_norm(mine, self.device)
        totals = torch.stack([sumsq, torch.tensor(loss_sum, dtype=torch.float64, device=self.device)])
        dist.all_reduce(totals)
        total_norm, loss_total = math.sqrt(totals[0].item()), totals[1].item()
        coef = clip_coefficient(total_norm, self.clip)
        if self.zero is not None:
            self.zero.step(coef)
        else:
            step_flat(self.flat, self.optimizer, coef)
        return loss_total

    def _sum_tied_gradients(self) -> None:
        """The tied embedding and LM head are one tensor: each end's rows get the sum of both
        ends' gradients over every replica, divided by DP since the DP reduction sums it again."""
        p = self.module.tied_head()
        tp = self.groups.tp
        rows, first = p.shape[0], tp.rank * p.shape[0]
        whole = torch.zeros((rows * tp.size,) + tuple(p.shape[1:]), dtype=p.grad.dtype, device=p.grad.device)
        whole[first:first + rows] = p.grad
        dist.all_reduce(whole, group=self.groups.tied)
        p.grad.copy_(whole[first:first + rows]).div_(self.groups.dp_size)

    def _owned(self, name: str, p: torch.Tensor) -> bool:
        """Whether this TP rank counts ``name`` in the global norm (a replicated tensor counts on
        TP rank 0 only; a tied head on the first stage only); over DP, replica 0 counts, or with
        ZeRO-1 each rank its own slice."""
        if self.groups.tied is not None and p is self.module.tied_head() and not self.module.is_first:
            return False
        return shard_dim(name) is not None or self.place.tp_index == 0


def all_reduce_flat(grads: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    """Sum ``grads`` over ``group`` as one bucket."""
    flat = torch._utils._flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=group)
    for g, reduced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
        g.copy_(reduced)


def squared_norm(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The sum of the squares of ``grads``' elements, in float64 (zero for no gradients)."""
    if not grads:
        return torch.zeros((), dtype=torch.float64, device=device)
    return torch.stack(torch._foreach_norm(grads)).double().pow(2).sum()


def clip_coefficient(total_norm: float, clip: float) -> float:
    """The factor gradients are scaled by, as ``torch.nn.utils.clip_grad_norm_`` computes it."""
    return min(1.0, clip / (total_norm + 1e-6))


def step_flat(flat: FlatParameters, optimizer: torch.optim.Optimizer, coef: float) -> None:
    """Scale the flat gradients by ``coef``, step, and zero them for the next batch (the local
    step of a replicated stage, and what ``ditorch profile`` times as a layer's update)."""
    flat.grad.mul_(coef)
    optimizer.step()
    flat.zero_grad()


def make_optimizer(params, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """The optimizer of every stage, and of the single-process reference alike."""
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
