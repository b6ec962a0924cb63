"""A thread that waits for a peer's message reads the connection itself (Pair::progress).

Only one thread reads a connection at a time: the transport's receive thread, or one of the
user threads waiting on that peer, which then handles every frame that arrives, its own or
not. These tests put several waiters on one peer at once, mix large rendezvous (striped)
messages with small ones under a waiting thread, run with polling off and with a long polling
budget, and kill the peer while a thread polls. Data is checked against a byte pattern
computed independently on both sides.
"""
from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from launcher import run_ranks

MiB = 1 << 20


def pattern(numel: int, seed: int) -> torch.Tensor:
    i = torch.arange(numel, dtype=torch.int64)
    return ((i * 5 + (i >> 11) + seed) % 251).to(torch.uint8)


# (tag, bytes): small eager messages and rendezvous ones (>= 1 MiB, striped from 2 MiB on tcp)
MESSAGES = [(1, 8), (2, 3 * MiB + 7), (3, 64), (4, 4096), (5, MiB), (6, 17)]


def many_waiters(rank: int, world: int, _port: int) -> dict:
    import torch.distributed as dist

    out = {"bad": [], "errors": []}
    if rank == 0:
        # Sent in reverse tag order: every receiving thread sees frames for the others first.
        for tag, n in reversed(MESSAGES):
            dist.send(pattern(n, tag), dst=1, tag=tag)
        # Then a large and a small message to one thread that waits on the small one.
        dist.send(pattern(5 * MiB, 77), dst=1, tag=10)
        dist.send(pattern(8, 78), dst=1, tag=11)
    else:
        got = {tag: torch.empty(n, dtype=torch.uint8) for tag, n in MESSAGES}

        def receive(tag: int) -> None:
            try:
                dist.recv(got[tag], src=0, tag=tag)
            except Exception as e:  # noqa: BLE001 - reported to the parent
                out["errors"].append(f"tag {tag}: {e}")

        threads = [threading.Thread(target=receive, args=(tag,)) for tag, _ in MESSAGES]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        out["alive"] = sum(t.is_alive() for t in threads)
        for tag, n in MESSAGES:
            if not torch.equal(got[tag], pattern(n, tag)):
                out["bad"].append(tag)
        big = torch.empty(5 * MiB, dtype=torch.uint8)
        pending = dist.irecv(big, src=0, tag=10)
        small = torch.empty(8, dtype=torch.uint8)
        dist.recv(small, src=0, tag=11)  # polls; handles the large one's frames on the way
        pending.wait()
        out["mixed_ok"] = torch.equal(big, pattern(5 * MiB, 77)) and torch.equal(small, pattern(8, 78))
    # the same the other way round, one thread, so rank 0 polls too
    echo = torch.empty(3 * MiB + 1, dtype=torch.uint8)
    if rank == 1:
        dist.send(pattern(3 * MiB + 1, 91), dst=0)
    else:
        dist.recv(echo, src=1)
        out["echo_ok"] = torch.equal(echo, pattern(3 * MiB + 1, 91))
    return out


# spin 0: no polling, the receive threads do all the reading; 20 ms: waiters poll and read.
@pytest.mark.parametrize("transport,spin_us", [("tcp", "0"), ("tcp", "20000"), ("shm", "20000")])
def test_waiting_threads_receive_for_each_other(transport: str, spin_us: str) -> None:
    env = {"DICOMM_TRANSPORT": transport, "DICOMM_SPIN_US": spin_us, "DICOMM_TCP_STREAMS": "2"}
    results = run_ranks(many_waiters, 2, env=env, op_timeout_s=60)
    r1 = results[1]
    assert r1["errors"] == [] and r1["alive"] == 0
    assert r1["bad"] == [], f"corrupted tags {r1['bad']} ({transport}, spin {spin_us} us)"
    assert r1["mixed_ok"]
    assert results[0]["echo_ok"]


def dies_while_peer_polls(rank: int, world: int, _port: int) -> dict:
    import torch.distributed as dist

    x = torch.ones(4)
    dist.all_reduce(x)  # both connected and warm
    if rank == 1:
        time.sleep(0.3)  # rank 0 is polling in recv by now (1 s budget)
        os._exit(3)
    t0 = time.monotonic()
    try:
        dist.recv(x, src=1)
        return {"error": None}
    except Exception as e:  # noqa: BLE001
        return {"error": str(e), "seconds": time.monotonic() - t0}


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_peer_dies_while_a_thread_polls_its_connection(transport: str) -> None:
    env = {"DICOMM_TRANSPORT": transport, "DICOMM_SPIN_US": "1000000"}
    results = run_ranks(dies_while_peer_polls, 2, env=env, op_timeout_s=60, expect_exit={1})
    r0 = results[0]
    assert r0["error"] is not None, "recv from a dead peer returned"
    assert "recv from rank 1" in r0["error"] and "rank 1" in r0["error"].split("failed:", 1)[1]
    assert r0["seconds"] < 10, f"failure took {r0['seconds']:.1f} s to surface"
