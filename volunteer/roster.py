"""The clients a server has heard from: their compute and when they last spoke."""
from __future__ import annotations

import dataclasses
import time


@dataclasses.dataclass
class ClientInfo:
    flops: float
    last_seen: float


class Roster:
    """Clients by ZeroMQ identity. A client is alive while it has spoken within ``liveness`` s."""

    def __init__(self, liveness: float, clock=time.monotonic):
        self.liveness, self.clock = liveness, clock
        self._clients: dict[bytes, ClientInfo] = {}

    def hello(self, identity: bytes, flops: float) -> None:
        self._clients[identity] = ClientInfo(flops, self.clock())

    def heard(self, identity: bytes) -> None:
        info = self._clients.get(identity)
        if info is not None:
            info.last_seen = self.clock()

    def leave(self, identity: bytes) -> None:
        """The client said it is leaving: from now on it counts as gone."""
        info = self._clients.get(identity)
        if info is not None:
            info.last_seen = -float("inf")

    def known(self, identity: bytes) -> bool:
        return identity in self._clients

    def alive(self, identity: bytes) -> bool:
        info = self._clients.get(identity)
        return info is not None and self.clock() - info.last_seen <= self.liveness

    def identities(self) -> list[bytes]:
        return list(self._clients)

    def share(self, identity: bytes) -> float:
        """This client's fraction of the live clients' compute (1 when it is the only one)."""
        live = [i.flops for c, i in self._clients.items() if self.alive(c) or c == identity]
        mine = self._clients[identity].flops if identity in self._clients else 0.0
        return mine / sum(live) if mine > 0 and sum(live) > 0 else 1.0

    def forget_departed(self, after: float) -> list[bytes]:
        """Drop clients silent for ``after`` seconds, so that a long job's roster holds the clients
        of the last while, not everyone who ever joined; their tasks went back to the pool long ago."""
        now = self.clock()
        gone = [c for c, i in self._clients.items() if now - i.last_seen > after]
        for c in gone:
            del self._clients[c]
        return gone
