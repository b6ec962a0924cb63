"""The boundary between two stages of one DP replica, when their TP sizes differ or not.

Activations (forward) and their gradients (backward) are replicated over the TP ranks of the
stage that holds them (tensor_parallel.py), so any rank can send any slice.

- ``srag`` (send-receive + all-gather, H2 Figure 10): the tensor is cut along the sequence into
  k = max(a, d) pieces, a and d the TP sizes of the sending and receiving side; piece p goes
  from sender p mod a to receiver p mod d, each pair carrying at most one piece per message,
  so every sending rank's NIC carries 1/a of the tensor and one copy crosses the boundary. The
  receivers then all-gather their pieces inside their node.
- ``naive``: sender 0 ships the whole tensor to every receiver: d copies cross, one NIC works.

The backward direction mirrors the forward with the roles of the two sides swapped. Messages
are tagged by micro-batch and direction, so transfers of different micro-batches never mix.
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


def routes(sources: Sequence[int], dests: Sequence[int], mode: str) -> tuple[int, list[Route]]:
    """(number of pieces, who sends which piece to whom) from one side's ranks to the other's."""
    if mode == "srag":
        k = max(len(sources), len(dests))
        return k, [Route(p, sources[p % len(sources)], dests[p % len(dests)]) for p in range(k)]
    if mode == "naive":
        return 1, [Route(0, sources[0], d) for d in dests]
    raise ValueError(f"reshard mode {mode!r}: expected one of {RESHARD_MODES}")


class PendingRecv:
    """A receive posted early; ``wait`` completes it (and the all-gather) when compute needs it."""

    def __init__(self, works: list, buffers: list[torch.Tensor], assemble):
        self._works, self._buffers, self._assemble = works, buffers, assemble

    def wait(self) -> torch.Tensor:
        for w in self._works:
            w.wait()
        return self._assemble(self._buffers)


class StageBoundary:
    """Transfers between stage s (``senders``: its TP ranks of one replica) and stage s + 1
    (``receivers``), seen from global rank ``me``, which is on one of the two sides.

    ``local_tp`` is the TP group of ``me``'s own side; ``shape`` and ``dtype`` describe the
    activation of one micro-batch (its gradient has the same)."""

    def __init__(self, senders: Sequence[int], receivers: Sequence[int], me: int, local_tp: TPGroup,
                 shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, mode: str = "srag"):
        if me not in senders and me not in receivers:
            raise ValueError(f"rank {me} is on neither side of the boundary {list(senders)} -> {list(receivers)}")
        self.senders, self.receivers, self.me, self.local_tp = list(senders), list(receivers), me, local_tp
        self.shape, self.dtype, self.device, self.mode = tuple(shape), dtype, device, mode
        k, _ = routes(self.senders, self.receivers, mode)
        if shape[1] % k:
            raise ValueError(f"{mode} resharding cuts the sequence into {k} pieces, which does not divide "
                             f"seq={shape[1]}; use a sequence length divisible by {k}")
        self.bytes_sent = 0

    def _sides(self, direction: str) -> tuple[list[int], list[int]]:
        return (self.senders, self.receivers) if direction == FORWARD else (self.receivers, self.senders)

    @staticmethod
    def _tag(direction: str, microbatch: int) -> int:
        return 2 * microbatch + (direction == BACKWARD)

    def send(self, direction: str, microbatch: int, tensor: torch.Tensor) -> list:
        """Post this rank's pieces of ``tensor``; returns the works to wait on before reusing it."""
        if tuple(tensor.shape) != self.shape or tensor.dtype != self.dtype:
            raise ValueError(f"boundary {direction} micro-batch {microbatch}: tensor {tuple(tensor.shape)} {tensor.dtype}, "
                             f"expected {self.shape} {self.dtype}")
        sources, dests = self._sides(direction)
        k, rts = routes(sources, dests, self.mode)
        pieces = tensor.chunk(k, dim=1)
        works = []
        for r in rts:
            if r.src == self.me:
                piece = pieces[r.piece].contiguous()
                works.append(dist.isend(piece, r.dst, tag=self._tag(direction, microbatch)))
                self.bytes_sent += piece.numel() * piece.element_size()
        return works

    def post_recv(self, direction: str, microbatch: int) -> PendingRecv:
        """Post the receives of this rank's pieces; the result assembles the whole tensor."""
        sources, dests = self._sides(direction)
        k, rts = routes(sources, dests, self.mode)
        mine = [r for r in rts if r.dst == self.me]
        piece_shape = (self.shape[0], self.shape[1] // k) + self.shape[2:]
        whole = self.mode == "naive"
        buffers = [torch.empty(self.shape if whole else piece_shape, dtype=self.dtype, device=self.device) for _ in mine]
        works = [dist.irecv(b, r.src, tag=self._tag(direction, microbatch)) for b, r in zip(buffers, mine)]
        if whole:
            return PendingRecv(works, buffers, lambda bufs: bufs[0])
        return PendingRecv(works, buffers, lambda bufs: self._all_gather(bufs, k, len(dests)))

    def _all_gather(self, mine: list[torch.Tensor], k: int, d: int) -> torch.Tensor:
        """Receiver j holds pieces j, j + d, ...; gather all d ranks' and put pieces in order."""
        stacked = self.local_tp.all_gather(torch.stack(mine))  # (d * k/d, b, s/k, ...): rank-major
        per_rank = k // d
        ordered = [stacked[(p % d) * per_rank + p // d] for p in range(k)]
        return torch.cat(ordered, dim=1)
