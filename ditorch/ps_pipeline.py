"""A HeteroPP pipeline cluster as the PS sees it (the :class:`dips.client.ParameterView` of one).

Each stage's first rank (DP replica 0, TP rank 0) is a worker, numbered by its stage: it holds
the stage's units whole (the TP ranks of replica 0 gather their shards to it) and pushes and
pulls them itself, so the stages' transfers run in parallel on the schedule the leader makes.
New values go back the other way: the worker's TP group receives them whole and each rank cuts
its shard (the rule that cuts a fresh initialization), then every DP replica copies replica 0.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from heteropp.runtime.stage_model import cut, gather_full, shard_dim


class PipelineStages:
    """The view of a :class:`heteropp.runtime.trainer.PipelineTrainer`'s rank; the cluster is the
    whole run (every rank calls the OuterClient)."""

    group = None  # the default group: all ranks of the run

    def __init__(self, trainer):
        if trainer.groups.tied is not None:
            raise ValueError("a Di-PS pipeline cluster whose tied embedding and LM head lie on different stages is "
                             "not supported (the PS holds the tied tensor once); plan one stage, or untie them")
        self.module, self.place, self.groups = trainer.module, trainer.place, trainer.groups
        self.tp = trainer.groups.tp
        self.replica0 = self.place.dp_index == 0
        self.worker = self.place.stage if self.replica0 and self.place.tp_index == 0 else None

    def specs(self) -> list[tuple[str, tuple[int, ...]]]:
        if self.worker is None:
            return []
        return [(name, self._full_shape(name, p)) for name, p in self.module.named_parameters()]

    def _full_shape(self, name: str, p: torch.Tensor) -> tuple[int, ...]:
        """The whole tensor's shape, from this TP rank's shard."""
        shape, dim = list(p.shape), shard_dim(name)
        if dim is not None:
            shape[dim] *= self.tp.size
        return tuple(shape)

    def full(self) -> dict[str, torch.Tensor]:
        if not self.replica0:
            return {}
        out = {}
        for name, p in self.module.named_parameters():
            whole = gather_full(p.detach(), shard_dim(name), self.tp)  # every TP rank of replica 0 joins
            if self.worker is not None:
                out[name] = whole.to("cpu", torch.float32, copy=True)
        return out

    @torch.no_grad()
    def install(self, new: dict[str, torch.Tensor]) -> None:
        for name, p in self.module.named_parameters():
            if self.replica0:
                whole = self._from_worker(name, p, new.get(name))
                p.copy_(cut(name, whole, self.tp.size, self.tp.rank))
            if self.groups.dp is not None:
                dist.broadcast(p.data, src=dist.get_global_rank(self.groups.dp, 0), group=self.groups.dp)

    def _from_worker(self, name: str, p: torch.Tensor, value: torch.Tensor | None) -> torch.Tensor:
        """The worker's full ``value`` on every TP rank of replica 0."""
        if self.tp.size == 1:
            return value.to(p.device, p.dtype)
        whole = (value.to(p.device, p.dtype) if self.worker is not None
                 else torch.empty(self._full_shape(name, p), dtype=p.dtype, device=p.device))
        dist.broadcast(whole, src=dist.get_global_rank(self.tp.group, 0), group=self.tp.group)
        return whole

    def cluster_tokens(self, pending: int) -> int:
        """Every rank counts the cluster's tokens per step (the global batch): rank 0's count is it."""
        return pending
