"""Megatron-style tensor parallelism inside one pipeline stage, with deferrable weight gradients.

A stage of TP size t splits each projection over its t ranks: column-parallel (``wq``, ``wk``,
``wv``, ``w1``, ``w3``, the LM head: output features split, whole heads and whole KV heads per
rank) and row-parallel (``wo``, ``w2``: input features split, partial outputs summed). The
embedding and the cross-entropy are vocab-parallel. Between blocks the activations are either
replicated on the t ranks (plain Megatron TP: all-reduce after a row-parallel projection) or,
with sequence parallelism, cut along the sequence (reduce-scatter after the row-parallel
projection, all-gather before the column-parallel one), which divides the memory of norms and
residuals by t and what crosses a stage boundary per rank.

Why not ``torch.distributed.tensor.parallel``: the fine-grained schedules split a backward into
input gradients (``I``) and weight gradients (``W``) run at different times. DTensor's parallel
styles compute both in one autograd node and offer no point to defer the second. Here every
projection is a ``ShardedLinear`` whose backward returns the input gradient at once and, inside
``WeightGradStore.deferring``, queues the weight gradient for ``WeightGradStore.flush``.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from ditorch_ext.torch_compat import all_gather_single, reduce_scatter_single


@dataclass(frozen=True)
class TPGroup:
    """The ranks of one stage replica that share its tensors: their group and this rank's place."""

    group: dist.ProcessGroup | None
    size: int
    rank: int

    def all_reduce(self, t: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(t, op=op, group=self.group)
        return t

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """(size * n, ...) from every rank's (n, ...), in rank order."""
        if self.size == 1:
            return t
        out = torch.empty((self.size * t.shape[0],) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
        all_gather_single(out, t.contiguous(), group=self.group)
        return out

    def gather_sequence(self, t: torch.Tensor) -> torch.Tensor:
        """(b, size * n, ...) from every rank's sequence shard (b, n, ...)."""
        if self.size == 1:
            return t
        return self.all_gather(t.transpose(0, 1)).transpose(0, 1)

    def reduce_scatter_sequence(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's sequence shard (b, n / size, ...) of the sum over ranks of (b, n, ...)."""
        if self.size == 1:
            return t
        full = t.transpose(0, 1).contiguous()
        out = torch.empty((full.shape[0] // self.size,) + tuple(full.shape[1:]), dtype=t.dtype, device=t.device)
        reduce_scatter_single(out, full, group=self.group)
        return out.transpose(0, 1)


SINGLE = TPGroup(None, 1, 0)


class _CopyToTP(torch.autograd.Function):
    """Identity forward; the input gradient is summed over the TP ranks (each saw a slice)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
        ctx.tp = tp
        return x

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return ctx.tp.all_reduce(g.contiguous().clone()), None


class _ReduceFromTP(torch.autograd.Function):
    """Partial outputs summed over the TP ranks; the gradient passes through unchanged."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
        return tp.all_reduce(x.contiguous().clone())

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return g, None


class _GatherSequence(torch.autograd.Function):
    """Sequence parallelism: shards gathered into the whole sequence; gradients reduce-scattered."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
        ctx.tp = tp
        return tp.gather_sequence(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return ctx.tp.reduce_scatter_sequence(g), None


class _ReduceScatterSequence(torch.autograd.Function):
    """Sequence parallelism: partial sums reduce-scattered into shards; gradients gathered."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
        ctx.tp = tp
        return tp.reduce_scatter_sequence(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return ctx.tp.gather_sequence(g.contiguous()), None


def enter_tp(x: torch.Tensor, tp: TPGroup, sequence_parallel: bool) -> torch.Tensor:
    """Before a column-parallel projection: the whole (replicated or gathered) input."""
    if tp.size == 1:
        return x
    return _GatherSequence.apply(x, tp) if sequence_parallel else _CopyToTP.apply(x, tp)


def leave_tp(x: torch.Tensor, tp: TPGroup, sequence_parallel: bool) -> torch.Tensor:
    """After a row-parallel projection: partial sums summed (replicated) or reduce-scattered (shards)."""
    if tp.size == 1:
        return x
    return _ReduceScatterSequence.apply(x, tp) if sequence_parallel else _ReduceFromTP.apply(x, tp)


class WeightGradStore:
    """Weight gradients a backward-input (``I``) left for its backward-weight (``W``)."""

    def __init__(self) -> None:
        self._active: int | None = None
        self._pending: dict[int, list[Callable[[], None]]] = {}

    @contextlib.contextmanager
    def deferring(self, microbatch: int) -> Iterator[None]:
        """Backwards run inside queue their weight gradients under ``microbatch``."""
        self._active = microbatch
        self._pending.setdefault(microbatch, [])
        try:
            yield
        finally:
            self._active = None

    def defer_or_run(self, compute: Callable[[], None]) -> None:
        if self._active is None:
            compute()
        else:
            self._pending[self._active].append(compute)

    def flush(self, microbatch: int) -> None:
        """Compute the weight gradients queued for ``microbatch``."""
        if microbatch not in self._pending:
            raise RuntimeError(f"W for micro-batch {microbatch} but its I never ran (no deferred weight gradients)")
        for compute in self._pending.pop(microbatch):
            compute()

    @property
    def pending(self) -> list[int]:
        return sorted(self._pending)


def _accumulate(weight: nn.Parameter, grad: torch.Tensor) -> None:
    grad = grad.to(weight.dtype)
    if weight.grad is None:
        weight.grad = grad
    else:
        weight.grad.add_(grad)


class _LinearFn(torch.autograd.Function):
    """y = x W^T in the autocast dtype when autocast is on; the weight gradient may be deferred."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, store: WeightGradStore | None) -> torch.Tensor:
        device = x.device.type
        if torch.is_autocast_enabled(device):
            dtype = torch.get_autocast_dtype(device)
            x, w = x.to(dtype), weight.to(dtype)
        else:
            w = weight
        with torch.autocast(device, enabled=False):
            y = torch.matmul(x, w.t())
        ctx.save_for_backward(x, w)
        ctx.weight, ctx.store = weight, store
        return y

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        x, w = ctx.saved_tensors
        g = g.to(w.dtype)
        grad_x = torch.matmul(g, w) if ctx.needs_input_grad[0] else None
        weight = ctx.weight

        @torch.no_grad()  # deferred, it runs outside the backward: nothing to record for autograd
        def weight_grad() -> None:
            _accumulate(weight, torch.matmul(g.reshape(-1, g.shape[-1]).t(), x.reshape(-1, x.shape[-1])))

        if ctx.needs_input_grad[1]:
            if ctx.store is None:
                weight_grad()
            else:
                ctx.store.defer_or_run(weight_grad)
        # The weight's gradient is accumulated above (possibly later); autograd gets none.
        return grad_x, None, None


class ShardedLinear(nn.Module):
    """One rank's shard of a projection: ``weight`` is (out / t, in) for a column-parallel layer,
    (out, in / t) for a row-parallel one; the caller adds the TP communication around it
    (enter_tp before a column-parallel one, leave_tp after a row-parallel one). A ``bias`` (of
    column-parallel layers: cut with the outputs) gets its gradient at once; only the weight's
    may be deferred."""

    def __init__(self, in_features: int, out_features: int, store: WeightGradStore | None = None, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.store = store

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _LinearFn.apply(x, self.weight, self.store)
        return y if self.bias is None else y + self.bias.to(y.dtype)


class VocabParallelEmbedding(nn.Module):
    """Rows [rank * V/t, (rank + 1) * V/t) of the embedding on each rank; lookups outside this
    rank's rows give zeros and the ranks' results are summed (into sequence shards under
    sequence parallelism). The ``padding_idx`` row, as in ``nn.Embedding``, gets no gradient."""

    def __init__(self, vocab_size: int, dim: int, tp: TPGroup, sequence_parallel: bool = False,
                 padding_idx: int | None = None):
        super().__init__()
        self.tp, self.sequence_parallel = tp, sequence_parallel
        self.rows = vocab_size // tp.size
        self.first = tp.rank * self.rows
        local_pad = None if padding_idx is None else padding_idx - self.first
        self.padding_idx = local_pad if local_pad is not None and 0 <= local_pad < self.rows else None
        self.weight = nn.Parameter(torch.empty(self.rows, dim))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return nn.functional.embedding(tokens, self.weight, self.padding_idx)
        local = tokens - self.first
        outside = (local < 0) | (local >= self.rows)
        out = nn.functional.embedding(local.masked_fill(outside, 0), self.weight, self.padding_idx)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return leave_tp(out, self.tp, self.sequence_parallel)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of logits split over the vocabulary (each rank V/t columns)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, tp: TPGroup) -> torch.Tensor:
        cols = logits.shape[-1]
        first = tp.rank * cols
        logits_max = tp.all_reduce(logits.max(dim=-1).values.clone(), dist.ReduceOp.MAX)
        shifted = logits - logits_max.unsqueeze(-1)
        local = target - first
        outside = (local < 0) | (local >= cols)
        local = local.masked_fill(outside, 0)
        picked = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        exp = shifted.exp()
        # one all-reduce for both sums
        sums = tp.all_reduce(torch.stack([exp.sum(dim=-1), picked]))
        loss = sums[0].log() - sums[1]
        ctx.save_for_backward(exp.div_(sums[0].unsqueeze(-1)), local, outside)
        return loss

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        softmax, local, outside = ctx.saved_tensors
        grad = softmax.clone()
        hit = (~outside).to(grad.dtype)
        grad.scatter_add_(-1, local.unsqueeze(-1), -hit.unsqueeze(-1))
        return grad * g.unsqueeze(-1), None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Per-token loss of ``logits`` (N, V/t) against ``target`` (N,) holding global token ids."""
    if tp.size == 1:
        return nn.functional.cross_entropy(logits, target, reduction="none")
    return _VocabParallelCrossEntropy.apply(logits, target, tp)
