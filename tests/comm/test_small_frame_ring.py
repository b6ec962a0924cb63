"""The shm pair's small-frame ring (csrc/comm/transport/SmallFrameRing.h): its sleep/wake
handshake never loses a wake-up, checked by a small C++ program built here against the same
source (tests/comm/unit/ring_handshake.cpp): thousands of rounds taking the reader away before,
inside and after a publication, then two processes exchanging thousands of messages."""
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ["tests/comm/unit/ring_handshake.cpp", "csrc/comm/transport/SmallFrameRing.cpp"]


@pytest.fixture(scope="module")
def ring_handshake(tmp_path_factory):
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not cxx:
        pytest.skip("no C++ compiler on PATH (set CXX)")
    binary = tmp_path_factory.mktemp("ring") / "ring_handshake"
    build = subprocess.run([cxx, "-std=c++17", "-O1", "-Wall", "-Werror", "-I", str(ROOT / "csrc"),
                            *[str(ROOT / s) for s in SOURCES], "-o", str(binary)],
                           capture_output=True, text=True, timeout=120)
    assert build.returncode == 0, build.stderr[-4000:]
    return binary


def test_reader_going_away_at_any_point_is_never_left_asleep(ring_handshake):
    run = subprocess.run([str(ring_handshake), "windows", "6000"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "no lost wake-up" in run.stdout


def test_two_processes_exchange_thousands_of_messages(ring_handshake):
    run = subprocess.run([str(ring_handshake), "stress", "5000"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "delivered" in run.stdout


def pattern(numel: int, seed: int):
    """Bytes both ranks compute for message `seed`: a pattern, the message's number in front."""
    import torch

    if numel not in _BASE:
        i = torch.arange(numel, dtype=torch.int64)
        _BASE[numel] = ((i * 7 + (i >> 9)) % 251).to(torch.uint8)
    t = _BASE[numel].clone()
    t[: min(numel, 8)] = torch.tensor(list(seed.to_bytes(8, "little")), dtype=torch.uint8)[: min(numel, 8)]
    return t


_BASE: dict = {}
BIG = 1 << 20
# Ring-sized (up to 960 B), socket-sized inline (961 B, 2 KiB) and cross-memory (100 KiB, 1 MiB)
# messages on one tag: their order must hold whichever path each took. A 1 MiB message, which
# the receiver's polling thread copies (one thread: more would make the host look busy, and a
# busy host's waiters do not poll, so nothing takes the ring), followed at once by a
# socket-sized and a ring-sized one leaves the last in the ring while the one before it waits
# on the socket: it must not overtake it.
SIZES = [8, BIG, 961, 8, 100 << 10, 2048, 17, BIG, 2048, 8, 960, 961]
COUNT = 360


def mixed_order(rank: int, world: int, _port: int) -> dict:
    import time

    import torch
    import torch.distributed as dist

    bad = []
    if rank == 0:
        pending = []
        for i in range(COUNT):
            t = pattern(SIZES[i % len(SIZES)], i)
            if t.numel() == BIG:
                time.sleep(0.002)  # the receiver polls for it by now: its poller makes the copy
            if i % 6 == 0:
                dist.send(t, dst=1, tag=5)
            else:
                pending.append((dist.isend(t, dst=1, tag=5), t))  # queued behind each other
        for work, _ in pending:
            work.wait()
    else:
        for i in range(COUNT):
            buf = torch.empty(SIZES[i % len(SIZES)], dtype=torch.uint8)
            if i % 5 == 4:
                time.sleep(0.0003)  # away: the next messages take the socket, or ring its bell
            if i % 7 == 6:
                dist.irecv(buf, src=0, tag=5).wait()
            else:
                dist.recv(buf, src=0, tag=5)
            if not torch.equal(buf, pattern(buf.numel(), i)):
                bad.append(i)
    dist.barrier()
    return {"bad": bad}


def test_shm_messages_keep_their_order_across_ring_and_socket():
    """Small messages go through the ring while the receiver polls, the rest (and those sent
    while it is away) on the socket: one tag's messages still arrive in the order sent, each
    with its own bytes (a pattern both ranks compute)."""
    from launcher import run_ranks

    results = run_ranks(mixed_order, 2, env={"DICOMM_TRANSPORT": "shm", "DICOMM_SPIN_US": "20000"},
                        op_timeout_s=60)
    assert results[1]["bad"] == [], f"messages out of order or corrupted: {results[1]['bad'][:10]}"
