"""A client's parameters arrive in shards, one from each server of its stage; a version is
installed once every shard sent its piece of it. Shards that committed in between may answer
with different versions; then the client asks again."""
from __future__ import annotations

import torch

from .job import shard_bounds


class ParameterPull:
    """Pulls of a flat parameter vector of ``numel`` values from ``shards`` servers."""

    def __init__(self, numel: int, shards: int):
        self.numel, self.shards = numel, shards
        self.version = -1                 # installed
        self.pulling: int | None = None   # asked for
        self.replies = 0
        self.incoming: dict[int, dict[int, torch.Tensor]] = {}  # version -> shard -> piece

    def ask(self, version: int) -> bool:
        """Start pulling ``version``; False when it is being pulled already (nothing to send)."""
        if self.pulling == version:
            return False
        self.pulling, self.replies, self.incoming = version, 0, {}
        return True

    def bounds(self, shard: int) -> tuple[int, int]:
        """The slice of the flat vector that ``shard`` holds."""
        return shard_bounds(self.numel, self.shards, shard)

    def received(self, version: int, shard: int, piece: torch.Tensor) -> None:
        self.incoming.setdefault(version, {})[shard] = piece
        self.replies += 1

    def complete(self) -> int | None:
        """The oldest version at least as new as asked for that every shard sent; None before."""
        if self.pulling is None:
            return None
        versions = [v for v, pieces in self.incoming.items() if len(pieces) == self.shards and v >= self.pulling]
        return min(versions) if versions else None

    def answered_without_one(self) -> bool:
        """Whether every shard answered and no complete version came of it (ask again)."""
        return self.pulling is not None and self.complete() is None and self.replies >= self.shards

    def take(self, version: int) -> torch.Tensor:
        """The flat parameters of complete ``version``, now the installed one."""
        flat = torch.cat([self.incoming[version][i] for i in range(self.shards)])
        self.version, self.pulling, self.incoming = version, None, {}
        return flat
