"""SR&AG and naive resharding move the right bytes to the right ranks, checked rank by rank
without a process group: every receiver's pieces plus its group's all-gather rebuild the tensor."""
from __future__ import annotations

import itertools

import pytest
import torch

from heteropp.runtime.boundary import StageBoundary, routes


class _GatherAcrossReceivers:
    """Stands in for a receiving stage's TP group: all_gather concatenates what every receiver
    contributes, in rank order (what dist.all_gather_into_tensor does)."""

    def __init__(self, contributions: list[torch.Tensor], rank: int):
        self.size, self.rank, self._contributions = len(contributions), rank, contributions

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        assert torch.equal(t, self._contributions[self.rank])
        return torch.cat(self._contributions)


@pytest.mark.parametrize("a,d", list(itertools.product([1, 2, 4, 8], repeat=2)))
@pytest.mark.parametrize("mode", ["srag", "naive"])
def test_every_receiver_rebuilds_the_activation(a, d, mode):
    senders, receivers = list(range(a)), list(range(100, 100 + d))
    x = torch.randn(1, 16, 5)
    k, rts = routes(senders, receivers, mode)
    # each route's payload: what its sender cuts from x (every sender holds all of x)
    payload = {(r.src, r.dst): x.chunk(k, dim=1)[r.piece] for r in rts}
    assert len(payload) == len(rts), "a pair carries at most one piece per message"
    crossing = sum(p.numel() for p in payload.values())
    assert crossing == (x.numel() if mode == "srag" else d * x.numel())
    busiest_sender = max(sum(p.numel() for (s, _), p in payload.items() if s == src) for src in senders)
    assert busiest_sender == (x.numel() // min(a, k) if mode == "srag" else d * x.numel())
    mine = {j: [payload[(r.src, r.dst)] for r in rts if r.dst == dst] for j, dst in enumerate(receivers)}
    for j, dst in enumerate(receivers):
        if mode == "naive":
            assert len(mine[j]) == 1 and torch.equal(mine[j][0], x)
            continue
        stacks = [torch.stack(mine[i]) for i in range(d)]
        b = StageBoundary(senders, receivers, dst, _GatherAcrossReceivers(stacks, j), x.shape, x.dtype,
                          torch.device("cpu"), mode)
        assert torch.equal(b._all_gather(mine[j], k, d), x)


@pytest.mark.parametrize("a,d", list(itertools.product([1, 2, 4, 8], repeat=2)))
def test_sequence_shards_move_to_their_owners(a, d):
    """Sequence-parallel sides: each receiver gets exactly its shard, from the senders holding it."""
    senders, receivers = list(range(a)), list(range(100, 100 + d))
    x = torch.randn(1, 16, 5)
    k, rts = routes(senders, receivers, "srag", sharded=True)
    held = {src: x.chunk(a, dim=1)[i] for i, src in enumerate(senders)}
    payload = {}
    for r in rts:  # what the sender cuts from its own shard, as StageBoundary.send does
        i = senders.index(r.src)
        payload[(r.src, r.dst)] = held[r.src].chunk(k // a, dim=1)[r.piece - i * (k // a)]
    assert len(payload) == len(rts)
    assert sum(p.numel() for p in payload.values()) == x.numel()
    for j, dst in enumerate(receivers):
        mine = torch.cat([payload[(r.src, r.dst)] for r in rts if r.dst == dst], dim=1)
        assert torch.equal(mine, x.chunk(d, dim=1)[j])


def test_sequence_must_split_into_the_pieces():
    with pytest.raises(ValueError, match=r"cuts the sequence into 4 pieces, which does not divide seq=6"):
        StageBoundary([0, 1, 2, 3], [4], 4, None, (1, 6, 8), torch.float32, torch.device("cpu"), "srag")
    with pytest.raises(ValueError, match="reshard mode 'fast'"):
        routes([0], [1], "fast")
