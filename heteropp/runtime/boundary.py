"""The boundary between two stages of one DP replica, when their TP sizes differ or not.

A stage holds its activation (forward) and its input gradient (backward) in one of two layouts
(tensor_parallel.py): *replicated* on its TP ranks, or, with sequence parallelism, *sharded*
along the sequence (rank i holds the i-th of a equal parts). The tensor is cut along the
sequence into k = max(a, d) pieces, a and d the TP sizes of the sending and receiving side.

- ``srag``, replicated (send-receive + all-gather, H2 Figure 10): piece p goes from sender
  p mod a to receiver p mod d, so every sending rank's NIC carries 1/a of the tensor and one
  copy crosses; the receivers all-gather their pieces inside their node.
- ``srag``, sharded: piece p goes from the sender that holds it (p // (k/a)) to the receiver
  whose shard it belongs to (p // (k/d)); one copy crosses and nobody needs to gather.
- ``naive``: sender 0 ships the whole tensor to every receiver (d copies cross, one NIC works);
  a sharded side first gathers it, a sharded receiver keeps its part.

Each (sender, receiver) pair carries at most one piece per message. The backward mirrors the
forward with the roles of the two sides swapped. Messages are tagged by micro-batch and
direction, so transfers of different micro-batches never mix.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import torch
import torch.distributed as dist

from .tensor_parallel import TPGroup

RESHARD_MODES = ("srag", "naive")
FORWARD, BACKWARD = "F", "B"


@dataclasses.dataclass(frozen=True)
class Route:
    piece: int
    src: int
    dst: int


def routes(sources: Sequence[int], dests: Sequence[int], mode: str, sharded: bool = False) -> tuple[int, list[Route]]:
    """(number of pieces, who sends which piece to whom) from one side's ranks to the other's."""
    a, d = len(sources), len(dests)
    if mode == "srag":
        k = max(a, d)
        if sharded:
            return k, [Route(p, sources[p // (k // a)], dests[p // (k // d)]) for p in range(k)]
        return k, [Route(p, sources[p % a], dests[p % d]) for p in range(k)]
    if mode == "naive":
        return 1, [Route(0, sources[0], dst) for dst in dests]
    raise ValueError(f"reshard mode {mode!r}: expected one of {RESHARD_MODES}")


class PendingRecv:
    """A receive posted early; ``wait`` completes it (and any gather) when compute needs it."""

    def __init__(self, works: list, buffers: list[torch.Tensor], assemble):
        self._works, self._buffers, self._assemble = works, buffers, assemble

    def wait(self) -> torch.Tensor:
        for w in self._works:
            w.wait()
        return self._assemble(self._buffers)


class StageBoundary:
    """Transfers between stage s (``senders``: its TP ranks of one replica) and stage s + 1
    (``receivers``), seen from global rank ``me``, which is on one of the two sides.

    ``local_tp`` is the TP group of ``me``'s own side; ``shape`` is the whole activation of one
    micro-batch (b, s, ...) and ``sharded`` says whether each side holds sequence shards of it."""

    def __init__(self, senders: Sequence[int], receivers: Sequence[int], me: int, local_tp: TPGroup,
                 shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, mode: str = "srag",
                 sharded: bool = False):
        if me not in senders and me not in receivers:
            raise ValueError(f"rank {me} is on neither side of the boundary {list(senders)} -> {list(receivers)}")
        self.senders, self.receivers, self.me, self.local_tp = list(senders), list(receivers), me, local_tp
        self.shape, self.dtype, self.device, self.mode = tuple(shape), dtype, device, mode
        self.sharded = sharded
        k, _ = routes(self.senders, self.receivers, mode, sharded)
        if shape[1] % max(k, len(self.senders), len(self.receivers)):
            raise ValueError(f"{mode} resharding cuts the sequence into {max(k, len(self.senders), len(self.receivers))} "
                             f"pieces, which does not divide seq={shape[1]}; use a sequence length divisible by it")
        self.bytes_sent = 0

    def _sides(self, direction: str) -> tuple[list[int], list[int]]:
        return (self.senders, self.receivers) if direction == FORWARD else (self.receivers, self.senders)

    @staticmethod
    def _tag(direction: str, microbatch: int) -> int:
        return 2 * microbatch + (direction == BACKWARD)

    def local_shape(self, side: Sequence[int]) -> tuple[int, ...]:
        """The tensor one rank of ``side`` holds."""
        if not self.sharded:
            return self.shape
        return (self.shape[0], self.shape[1] // len(side)) + self.shape[2:]

    def send(self, direction: str, microbatch: int, tensor: torch.Tensor) -> list:
        """Post this rank's pieces of ``tensor`` (its own layout); returns the works to wait on."""
        return self.post(direction, microbatch, self.pieces(direction, microbatch, tensor))

    def post(self, direction: str, microbatch: int, pieces: list[tuple[torch.Tensor, int]]) -> list:
        """Post the sends of ``pieces`` (from :meth:`pieces`); returns the works to wait on."""
        works = []
        for piece, dst in pieces:
            works.append(dist.isend(piece, dst, tag=self._tag(direction, microbatch)))
            self.bytes_sent += piece.numel() * piece.element_size()
        return works

    def pieces(self, direction: str, microbatch: int, tensor: torch.Tensor) -> list[tuple[torch.Tensor, int]]:
        """This rank's pieces of ``tensor`` (its own layout) and the rank each goes to."""
        sources, dests = self._sides(direction)
        expect = self.local_shape(sources)
        if tuple(tensor.shape) != expect or tensor.dtype != self.dtype:
            raise ValueError(f"boundary {direction} micro-batch {microbatch}: tensor {tuple(tensor.shape)} {tensor.dtype}, "
                             f"expected {expect} {self.dtype}")
        k, rts = routes(sources, dests, self.mode, self.sharded)
        if self.mode == "naive":
            pieces = [self.local_tp.gather_sequence(tensor) if self.sharded else tensor]
        elif self.sharded:
            mine = tensor.chunk(k // len(sources), dim=1)
            first = sources.index(self.me) * (k // len(sources)) if self.me in sources else 0
            pieces = {first + q: piece for q, piece in enumerate(mine)}
        else:
            pieces = tensor.chunk(k, dim=1)
        return [(pieces[r.piece].contiguous(), r.dst) for r in rts if r.src == self.me]

    def post_recv(self, direction: str, microbatch: int) -> PendingRecv:
        """Post the receives of this rank's pieces; the result assembles its tensor."""
        sources, dests = self._sides(direction)
        k, rts = routes(sources, dests, self.mode, self.sharded)
        mine = [r for r in rts if r.dst == self.me]
        j, d = dests.index(self.me), len(dests)
        if self.mode == "naive":
            shape = self.shape
        else:
            shape = (self.shape[0], self.shape[1] // k) + self.shape[2:]
        buffers = [torch.empty(shape, dtype=self.dtype, device=self.device) for _ in mine]
        works = [dist.irecv(b, r.src, tag=self._tag(direction, microbatch)) for b, r in zip(buffers, mine)]
        if self.mode == "naive":
            keep = (lambda bufs: bufs[0].chunk(d, dim=1)[j].contiguous()) if self.sharded else (lambda bufs: bufs[0])
            return PendingRecv(works, buffers, keep)
        if self.sharded:  # pieces arrive in sequence order (routes list them by piece)
            return PendingRecv(works, buffers, lambda bufs: torch.cat(bufs, dim=1))
        return PendingRecv(works, buffers, lambda bufs: self._all_gather(bufs, k, d))

    def _all_gather(self, mine: list[torch.Tensor], k: int, d: int) -> torch.Tensor:
        """Receiver j holds pieces j, j + d, ...; gather all d ranks' and put pieces in order."""
        stacked = self.local_tp.all_gather(torch.stack(mine))  # (d * k/d, b, s/k, ...): rank-major
        per_rank = k // d
        ordered = [stacked[(p % d) * per_rank + p // d] for p in range(k)]
        return torch.cat(ordered, dim=1)
