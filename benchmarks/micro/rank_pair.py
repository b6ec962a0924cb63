"""Two ranks for the communication micro-benchmarks: rank 0 is the pytest process, where
pytest-benchmark times; rank 1 is a helper process that mirrors each timed op.

pytest-benchmark calls the timed function a number of times only it knows, while a peer
rank blocked in a receive cannot be told to stop. So the communication benchmarks use
pedantic mode (rounds, iterations and warm-up fixed in advance): rank 0 tells the helper, over
a pipe, which op to mirror and exactly how many times, and checks afterwards that it made that
many calls itself.
"""
from __future__ import annotations

import datetime
import multiprocessing as mp
import time
from typing import Callable

GROUPS = ("gloo", "dicomm-tcp", "dicomm-shm")
OPS = ("round_trip", "all_reduce", "reduce_scatter", "all_gather")
_TIMEOUT = datetime.timedelta(seconds=120)


def _groups(dist) -> dict:
    """The groups every benchmark picks from, created in the same order on both ranks."""
    from comm import dicomm_group

    return {"gloo": dist.new_group(backend="gloo"), "dicomm-tcp": dicomm_group("tcp"),
            "dicomm-shm": dicomm_group("shm")}


def _buffer(op: str, nbytes: int):
    """What `op` of `nbytes` works on: a tensor, or (input, output) for a reduce-scatter or
    allgather, whose larger side holds `nbytes` and the smaller each rank's half."""
    import torch

    if op == "round_trip":
        return torch.zeros(nbytes, dtype=torch.uint8)
    whole = max(2, nbytes // 4) // 2 * 2
    if op == "reduce_scatter":
        return torch.ones(whole), torch.empty(whole // 2)
    if op == "all_gather":
        return torch.ones(whole // 2), torch.empty(whole)
    return torch.ones(max(1, nbytes // 4), dtype=torch.float32)


def _op(dist, rank: int, op: str, group, buf) -> Callable[[], None]:
    """One call of `op` on `rank`: a ping-pong round trip (rank 0 sends first) or a collective."""
    if op == "all_reduce":
        return lambda: dist.all_reduce(buf, group=group)
    if op == "reduce_scatter":
        return lambda: dist.reduce_scatter_tensor(buf[1], buf[0], group=group)
    if op == "all_gather":
        return lambda: dist.all_gather_into_tensor(buf[1], buf[0], group=group)
    if rank == 0:
        def round_trip() -> None:
            dist.send(buf, 1, group=group)
            dist.recv(buf, 1, group=group)
    else:
        def round_trip() -> None:
            dist.recv(buf, 0, group=group)
            dist.send(buf, 0, group=group)
    return round_trip


def _init(rank: int, port: int, store=None):
    import torch
    import torch.distributed as dist

    import dicomm  # noqa: F401  (registers the backend)

    torch.set_num_threads(1)
    if store is None:
        store = dist.TCPStore("127.0.0.1", port, world_size=2, is_master=False, timeout=_TIMEOUT)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=_TIMEOUT)
    return dist, _groups(dist)


def _helper(port: int, conn) -> None:
    """Rank 1: run each (op, group, nbytes, calls) command rank 0 sends, then say "done"."""
    import os

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist, groups = _init(1, port)
    conn.send("ready")
    while True:
        command = conn.recv()
        if command is None:
            break
        op, label, nbytes, calls = command
        call = _op(dist, 1, op, groups[label], _buffer(op, nbytes))
        for _ in range(calls):
            call()
        conn.send("done")
    dist.destroy_process_group()


class RankPair:
    """Rank 0 here, rank 1 in a helper process; `timed` runs one benchmark on both."""

    def __init__(self, process, conn, dist, groups: dict):
        self._process, self._conn, self._dist, self.groups = process, conn, dist, groups

    @classmethod
    def start(cls) -> "RankPair":
        """Spawn the helper, join it in a gloo default group and create `GROUPS` on both."""
        import os

        import torch.distributed as dist

        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        # Port 0: the store picks a free port, so nothing else can take it before we bind.
        store = dist.TCPStore("127.0.0.1", 0, world_size=2, is_master=True, timeout=_TIMEOUT,
                              wait_for_workers=False)
        ctx = mp.get_context("spawn")
        here, there = ctx.Pipe()
        process = ctx.Process(target=_helper, args=(store.port, there), daemon=True)
        process.start()
        dist_mod, groups = _init(0, store.port, store)
        pair = cls(process, here, dist_mod, groups)
        pair._expect("ready", 120)
        return pair

    def _expect(self, word: str, timeout_s: float) -> None:
        if not self._conn.poll(timeout_s):
            raise TimeoutError(f"the helper rank did not say {word!r} within {timeout_s:.0f} s "
                               f"(alive: {self._process.is_alive()})")
        got = self._conn.recv()
        if got != word:
            raise RuntimeError(f"the helper rank said {got!r}, expected {word!r}")

    def timed(self, benchmark, op: str, group: str, nbytes: int, est_s: float) -> float:
        """Time `op` of `nbytes` on `group` with pytest-benchmark; the helper mirrors every call.
        `est_s`, a rough time per call, sizes the rounds to about half a second in all. Returns
        rank 0's CPU seconds per call, which pytest-benchmark does not measure."""
        if op not in OPS or group not in self.groups:
            raise ValueError(f"op {op!r} on group {group!r}: expected an op of {OPS} on one of {GROUPS}")
        iterations = max(1, min(200, int(0.02 / est_s)))
        rounds = max(5, min(50, int(0.5 / (est_s * iterations))))
        warmup = 1
        calls = 1 if benchmark.disabled else (warmup + rounds) * iterations + (iterations > 1)
        made = 0
        call = _op(self._dist, 0, op, self.groups[group], _buffer(op, nbytes))

        def counted() -> None:
            nonlocal made
            made += 1
            call()

        self._conn.send((op, group, nbytes, calls))
        cpu0 = time.process_time()
        benchmark.pedantic(counted, rounds=rounds, iterations=iterations, warmup_rounds=warmup)
        cpu = time.process_time() - cpu0
        self._expect("done", 120)
        if made != calls:
            raise RuntimeError(f"rank 0 made {made} calls, the helper {calls}: pytest-benchmark's "
                               "pedantic mode no longer calls as rank_pair.py expects")
        return cpu / calls

    def close(self) -> None:
        """Stop the helper and leave the group."""
        try:
            self._conn.send(None)
            self._dist.destroy_process_group()
        finally:
            self._process.join(timeout=30)
            if self._process.is_alive():
                self._process.kill()
