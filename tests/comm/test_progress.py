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


def wait_unpolled(work, limit_s: float = 10.0) -> float:
    """Seconds until `work` completes, watched with is_completed() only: no wait(), so no
    thread polls the connection for it."""
    t0 = time.monotonic()
    while not work.is_completed():
        if time.monotonic() - t0 > limit_s:
            raise TimeoutError(f"not completed after {limit_s} s without a waiter")
        time.sleep(0.0005)
    return time.monotonic() - t0


def ping_pong(rank: int, n: int) -> None:
    """`n` polled round trips: each waiter leaves its connection parked for the next message."""
    import torch.distributed as dist

    t = torch.zeros(2)
    for _ in range(n):
        if rank == 0:
            dist.send(t, 1)
            dist.recv(t, 1)
        else:
            dist.recv(t, 0)
            dist.send(t, 0)


def parked_then_unpolled(rank: int, world: int, _port: int) -> dict:
    import torch.distributed as dist

    out = {}
    ping_pong(rank, 50)
    # A small message nobody polls for, sent while the receiver's connection is parked.
    if rank == 0:
        dist.send(pattern(8, 1), dst=1, tag=7)
    else:
        got = torch.empty(8, dtype=torch.uint8)
        out["small_s"] = wait_unpolled(dist.irecv(got, src=0, tag=7))
        out["small_ok"] = torch.equal(got, pattern(8, 1))
    ping_pong(rank, 50)
    # A rendezvous message neither side waits on: its answers (CTS, then the payload) need the
    # receive threads of both parked connections.
    n = 3 * MiB + 3
    if rank == 0:
        out["large_s"] = wait_unpolled(dist.isend(pattern(n, 2), dst=1, tag=8))
    else:
        got = torch.empty(n, dtype=torch.uint8)
        out["large_s"] = wait_unpolled(dist.irecv(got, src=0, tag=8))
        out["large_ok"] = torch.equal(got, pattern(n, 2))
    ping_pong(rank, 50)
    # A collective right after polled point-to-point traffic.
    x = torch.tensor([rank + 1.0])
    dist.all_reduce(x)
    out["allreduce"] = x.item()
    return out


def dies_while_parked(rank: int, world: int, _port: int) -> dict:
    import torch.distributed as dist

    ping_pong(rank, 50)
    if rank == 1:
        time.sleep(0.2)
        os._exit(3)
    pending = dist.irecv(torch.zeros(2), src=1, tag=9)  # nobody polls for it
    seconds = wait_unpolled(pending)
    try:
        pending.wait()
        return {"error": None}
    except Exception as e:  # noqa: BLE001
        return {"error": str(e), "seconds": seconds}


# Parking hands a connection's reading to the thread that just waited on it; what arrives for
# nobody's wait must still be read (by the receive thread, within 1 ms of the last poll).
@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_parked_connections_deliver_what_nobody_polls_for(transport: str) -> None:
    results = run_ranks(parked_then_unpolled, 2, env={"DICOMM_TRANSPORT": transport}, op_timeout_s=60)
    r0, r1 = results[0], results[1]
    assert r1["small_ok"] and r1["large_ok"]
    assert r0["allreduce"] == r1["allreduce"] == 3.0
    for who, key in ((r1, "small_s"), (r0, "large_s"), (r1, "large_s")):
        assert who[key] < 2.0, f"{key}: {who[key]:.3f} s ({transport})"


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_peer_dies_while_a_connection_is_parked(transport: str) -> None:
    results = run_ranks(dies_while_parked, 2, env={"DICOMM_TRANSPORT": transport}, op_timeout_s=60,
                        expect_exit={1})
    r0 = results[0]
    assert r0["error"] is not None and "rank 1" in r0["error"], r0
    assert r0["seconds"] < 5.0, f"the failure took {r0['seconds']:.2f} s to surface"
