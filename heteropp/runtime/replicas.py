"""Checking that a stage's data-parallel replicas hold the same parameters.

Replicas stay equal only if every path that writes parameters writes the same bytes on each:
the gradient all-reduce, ZeRO-1's all-gather, a checkpoint load, a Di-PS pull. A replica that
drifts still trains and its losses look plausible, and a checkpoint keeps one copy of each
replicated tensor, so nothing else would notice. The check compares a 64-bit digest of each
parameter's bytes across the DP group (Megatron-core has the same check,
``check_param_hashes_across_dp_replicas``); digests rather than values keep the traffic to 8
bytes per parameter.
"""
from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist


class ReplicaDivergence(RuntimeError):
    """Data-parallel replicas of a stage hold different parameter values."""


def parameter_digests(named: list[tuple[str, torch.Tensor]]) -> torch.Tensor:
    """One signed 64-bit digest of each tensor's bytes (shape, dtype and values), in order."""
    out = []
    for _, p in named:
        t = p.detach().to("cpu").contiguous()
        h = hashlib.blake2b(digest_size=8)
        h.update(repr((tuple(t.shape), t.dtype)).encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        out.append(int.from_bytes(h.digest(), "little", signed=True))
    return torch.tensor(out, dtype=torch.int64)


def diverged(names: list[str], digests: list[torch.Tensor]) -> list[str]:
    """The names whose digest differs between any two replicas (`digests`: one row per replica)."""
    table = torch.stack(digests)
    return [n for n, column in zip(names, table.unbind(1)) if bool((column != column[0]).any())]


def check_replicas(module: torch.nn.Module, group: dist.ProcessGroup | None, where: str) -> None:
    """Raise ReplicaDivergence naming the parameters whose bytes differ between the replicas of
    `group` (this rank's DP group; None: a single replica, nothing to check). Collective over
    `group`; `where` (stage and TP rank) goes into the error."""
    if group is None:
        return
    named = list(module.named_parameters())
    mine = parameter_digests(named)
    device = named[0][1].device if named else torch.device("cpu")
    gathered = [torch.empty_like(mine, device=device) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine.to(device), group=group)
    bad = diverged([n for n, _ in named], [g.cpu() for g in gathered])
    if bad:
        shown = ", ".join(bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        raise ReplicaDivergence(f"{where}: the {len(gathered)} data-parallel replicas differ in "
                                f"{len(bad)} of {len(named)} parameters: {shown}")
