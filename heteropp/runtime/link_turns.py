"""Turns on a shared cross-DC link (JEEVES section 3.3): the DP replicas' messages over one
boundary cross one at a time, at the link's full bandwidth, in the global order
``heteropp.schedule.turn_order`` gives (a micro-batch of every replica in turn), instead of
all at once, each at a share of it.

Each sending rank of the boundary (one per replica and TP index; the chain runs over the ranks
of one TP index) hands the turn to the next in the order with a one-element message inside its
DC as soon as its own message is out: it does not wait for the message to arrive on the other
side (the non-blocking hand-off). On an emulated link (dicomm's, docs/dicomm.md) a send
completes when the message is delivered, a latency after its last byte left, so the turn
passes once the link's serialisation time (bytes over bandwidth, times the time scale) has
elapsed since the send was posted; on a link that is not emulated it passes when the send
completes. The stage's compute never waits for a turn: ``put`` queues a message and returns,
and a thread of this rank waits for the turn, posts the message, waits until it is out and
passes the turn on. Tensors reach the thread ready to send, in host memory (the caller copies
them once the device has finished them, so a send never waits for the device's later work);
the thread only posts point-to-point operations. It runs while the stage's thread waits for its
device (the emulated device's synchronisation lets go of the GIL, as CUDA's does).
"""
from __future__ import annotations

import queue
import threading
import time
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from heteropp.schedule import turn_order

# Turn messages use tags of their own (boundary messages use 2 * micro-batch + direction).
TURN_TAG = 1 << 24


class LinkTurns:
    """This rank's place in one direction's chain of turns over a coordinated boundary.

    ``chain[r]`` is the rank that sends replica r's messages (this rank is ``chain[replica]``);
    ``post(mb, pieces)`` posts one message's sends and returns their works; ``serialize_s(n)``
    is how long the link takes to put out n bytes (None: the link is not emulated)."""

    def __init__(self, chain: Sequence[int], replica: int, microbatches: int, direction: str,
                 post: Callable[[int, list], list], serialize_s: Callable[[int], float] | None = None):
        if len(chain) < 2 or not 0 <= replica < len(chain):
            raise ValueError(f"replica {replica} in a chain of {len(chain)} replicas: turns need two or more "
                             f"replicas and a place among them")
        self.chain, self.replica, self.microbatches = list(chain), replica, microbatches
        self.direction, self._post, self._serialize_s = direction, post, serialize_s
        order = turn_order([microbatches] * len(chain))
        self._prev: dict[int, int | None] = {}
        self._next: dict[int, int | None] = {}
        for k, (r, m) in enumerate(order):
            if r == replica:
                self._prev[m] = self.chain[order[k - 1][0]] if k > 0 else None
                self._next[m] = self.chain[order[k + 1][0]] if k + 1 < len(order) else None
        self._tag_base = TURN_TAG + (1 << 22) * (direction == "B")
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def start(self) -> None:
        """Begin a step: the thread takes this step's messages in micro-batch order."""
        if self._thread is not None:
            raise RuntimeError("LinkTurns.start: the previous step was not finished")
        self._error = None
        self._thread = threading.Thread(target=self._run, name=f"link-turns-{self.direction}", daemon=True)
        self._thread.start()

    def put(self, mb: int, pieces: list) -> None:
        """Queue micro-batch ``mb``'s message (its pieces, ready to send); returns at once."""
        self._queue.put((mb, pieces))

    def finish(self) -> None:
        """End the step: every message sent and its turn passed on (re-raises the thread's error)."""
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
        if self._error is not None:
            raise RuntimeError(f"cross-DC turns ({self.direction}): {self._error}") from self._error

    def abandon(self) -> None:
        """End a step that failed: the thread (a daemon) may wait for messages that will never
        be queued, so it is left behind, not joined; the run is failing anyway."""
        self._thread = None
        self._queue = queue.Queue()

    def _run(self) -> None:
        token = torch.zeros(1)
        pending = []
        try:
            for expect in range(self.microbatches):
                mb, pieces = self._queue.get()
                if mb != expect:
                    raise RuntimeError(f"message of micro-batch {mb} queued where the turn order has {expect}")
                prev, nxt = self._prev[mb], self._next[mb]
                if prev is not None:
                    dist.irecv(token, prev, tag=self._tag_base + mb).wait()
                posted = time.monotonic()
                works = self._post(mb, pieces)
                if self._serialize_s is None:
                    for w in works:
                        w.wait()
                else:  # the last byte is out: hand the turn on, the delivery completes on its own
                    nbytes = sum(p.numel() * p.element_size() for p, _ in pieces)
                    time.sleep(max(0.0, posted + self._serialize_s(nbytes) - time.monotonic()))
                    pending += works
                if nxt is not None:
                    pending.append(dist.isend(torch.zeros(1), nxt, tag=self._tag_base + self._next_mb(mb, nxt)))
            for w in pending:
                w.wait()
        except BaseException as exc:  # noqa: BLE001 - re-raised by finish() on the step's thread
            self._error = exc

    def _next_mb(self, mb: int, nxt: int) -> int:
        """The micro-batch whose turn the successor ``nxt`` takes after ours (mb, or mb + 1 when
        the order wraps from the last replica to the first)."""
        return mb + 1 if self.chain.index(nxt) <= self.replica else mb
