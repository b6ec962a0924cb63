"""Connection set-up against a rank 0 the test plays at the protocol level (tests/fake_rank0.py):
rank 1 is a real dicomm backend in a subprocess. The handshake is checked against an independent
HMAC computed here."""
from __future__ import annotations

import hmac
import os
import secrets
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fake_rank0 import HELLO, HELLO_MAGIC, FakeRank0, closed_by_peer, master_store, proof

ROOT = Path(__file__).resolve().parents[2]

RANK1 = """
import datetime, sys, time, torch, dicomm
store = torch.distributed.TCPStore("127.0.0.1", int(sys.argv[1]), 2, is_master=False,
                                   timeout=datetime.timedelta(seconds=60))
t0 = time.monotonic()
pg = dicomm.ProcessGroupDicomm(store, 1, 2, 60.0)
print(f"init {time.monotonic() - t0:.3f}", flush=True)
"""


class Rank1:
    """A real rank 1 in a subprocess, beside the test's rank 0."""

    def __init__(self, transport: str = "tcp"):
        store, port = master_store()
        self.rank0 = FakeRank0(store, lanes=2 if transport == "tcp" else 1, transport=transport)
        env = dict(os.environ, PYTHONPATH=str(ROOT), DICOMM_TRANSPORT=transport,
                   DICOMM_TCP_STREAMS=str(self.rank0.lanes))
        self.proc = subprocess.Popen([sys.executable, "-c", RANK1, str(port)], env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        try:
            self.rank0.rank1_address()
        except Exception:
            self.proc.kill()
            raise AssertionError("rank 1 did not publish its address: " + self.proc.communicate()[1][-3000:]) from None

    def finish(self) -> tuple[str, str]:
        out, err = self.proc.communicate(timeout=60)
        assert self.proc.returncode == 0, err[-3000:]
        return out, err

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()


@pytest.mark.timeout(120)
def test_silent_connections_do_not_hold_up_set_up():
    rank1 = Rank1()
    held = []
    try:
        # Three connections that never send their Hello, first in rank 1's backlog.
        held += [rank1.rank0.connect() for _ in range(3)]
        held += rank1.rank0.join()
        out, err = rank1.finish()
    finally:
        for s in held:
            s.close()
        rank1.kill()
    seconds = float(out.split()[1])
    # Each silent connection used to hold rank 1's accept loop for 10 s.
    assert seconds < 5, (seconds, out, err[-2000:])


@pytest.mark.timeout(120)
def test_key_never_crosses_the_wire_and_proofs_are_checked_both_ways():
    rank1 = Rank1()
    rank0 = rank1.rank0
    held = []
    try:
        # Rank 1's answer: its Hello and an HMAC of both Hellos under the key; never the key.
        s, mine, theirs, their_proof = rank0.greet(0)
        magic, rank, pid, _, nonce, *_ = HELLO.unpack(theirs)
        assert (magic, rank, pid) == (HELLO_MAGIC, 1, rank1.proc.pid)
        assert rank0.key not in theirs + their_proof
        assert hmac.compare_digest(their_proof, proof(rank0.key, "accept", mine, theirs))
        # A wrong dialer proof: rank 1 drops the connection.
        s.sendall(proof(secrets.token_bytes(32), "dial", mine, theirs))
        assert closed_by_peer(s), "a connection with a wrong proof was kept"
        # A replay: the proof that was right for an earlier exchange, on a new connection with
        # the very same Hello. Rank 1's nonce is fresh, so the old proof no longer fits.
        s1, mine1, theirs1, _ = rank0.greet(0)
        recorded = proof(rank0.key, "dial", mine1, theirs1)
        s1.close()
        s2 = rank0.connect()
        s2.sendall(mine1)
        s2.settimeout(10)
        theirs2 = s2.recv(HELLO.size + 32, socket.MSG_WAITALL)[:HELLO.size]
        assert HELLO.unpack(theirs2)[4] != HELLO.unpack(theirs1)[4], "rank 1 reused its nonce"
        s2.sendall(recorded)
        assert closed_by_peer(s2), "a replayed proof was accepted"
        # The acceptor's own proof sent back as the dialer's is refused too (roles are labelled).
        s3, _, _, proof3 = rank0.greet(0)
        s3.sendall(proof3)
        assert closed_by_peer(s3), "the acceptor's proof was accepted as the dialer's"
        # Then the real lanes: rank 1 completes its set-up with them alone.
        held += rank0.join()
        rank1.finish()
    finally:
        for s in held:
            s.close()
        rank1.kill()


@pytest.mark.timeout(120)
def test_a_hello_naming_a_rank_outside_the_group_gets_no_answer():
    rank1 = Rank1()
    rank0 = rank1.rank0
    held = []
    try:
        lanes = rank0.lanes
        for fields in [(HELLO_MAGIC, 7, 0, lanes), (HELLO_MAGIC, 1, 0, lanes), (HELLO_MAGIC, 0, 5, lanes),
                       (HELLO_MAGIC, 0, 0, 99), (HELLO_MAGIC ^ 1, 0, 0, lanes)]:
            magic, rank, lane, n = fields
            s = rank0.connect()
            s.sendall(HELLO.pack(magic, rank, os.getpid(), 0, secrets.token_bytes(32), lane, n))
            assert closed_by_peer(s), f"rank 1 answered a Hello with (magic, rank, lane, lanes) = {fields}"
        held += rank0.join()
        rank1.finish()
    finally:
        for s in held:
            s.close()
        rank1.kill()


@pytest.mark.timeout(120)
def test_shm_admits_only_the_process_its_hello_names():
    import dicomm

    if "shm" not in dicomm.transports_usable():
        pytest.skip("cross-memory attach is not permitted here, so there is no shm transport")
    rank1 = Rank1("shm")
    rank0 = rank1.rank0
    held = []
    try:
        # The Hello names another process (the one whose memory rank 1 would read): dropped
        # unanswered, whatever the proof. SO_PEERCRED tells rank 1 who really connected.
        s = rank0.connect()
        s.sendall(HELLO.pack(HELLO_MAGIC, 0, rank1.proc.pid, 0, secrets.token_bytes(32), 0, 1))
        assert closed_by_peer(s), "rank 1 answered a Hello naming a pid that is not the caller's"
        held += rank0.join()  # our own pid: admitted
        rank1.finish()
    finally:
        for s in held:
            s.close()
        rank1.kill()


RANK1_FEW_FILES = """
import datetime, os, resource, sys, time, torch, dicomm
# Few descriptors to spare: the test's silent connections run this rank out of them.
open_now = len(os.listdir("/proc/self/fd"))
resource.setrlimit(resource.RLIMIT_NOFILE, (open_now + 40, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
store = torch.distributed.TCPStore("127.0.0.1", int(sys.argv[1]), 2, is_master=False,
                                   timeout=datetime.timedelta(seconds=60))
t0, c0 = time.monotonic(), time.process_time()
pg = dicomm.ProcessGroupDicomm(store, 1, 2, 60.0)
print(f"init {time.monotonic() - t0:.3f} cpu {time.process_time() - c0:.3f}", flush=True)
"""


@pytest.mark.timeout(120)
def test_more_half_open_connections_than_descriptors_do_not_keep_the_peer_out():
    """150 connections that never say Hello, more than rank 1 may hold open: it neither spins on
    the connection it cannot accept (EMFILE) nor keeps the real peer waiting for them to time out."""
    store, port = master_store()
    rank0 = FakeRank0(store, lanes=2, transport="tcp")
    env = dict(os.environ, PYTHONPATH=str(ROOT), DICOMM_TRANSPORT="tcp", DICOMM_TCP_STREAMS="2")
    proc = subprocess.Popen([sys.executable, "-c", RANK1_FEW_FILES, str(port)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    held = []
    try:
        rank0.rank1_address()
        held += [rank0.connect() for _ in range(150)]
        held += rank0.join()
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err[-3000:]
    finally:
        for s in held:
            s.close()
        if proc.poll() is None:
            proc.kill()
    _, wall, _, cpu = out.split()
    assert float(wall) < 5, (out, err[-2000:])
    assert float(cpu) < 2, (out, err[-2000:])


RANK_LAST = """
import datetime, sys, time, torch, dicomm
rank, world = int(sys.argv[2]), int(sys.argv[3])
store = torch.distributed.TCPStore("127.0.0.1", int(sys.argv[1]), 2, is_master=False,
                                   timeout=datetime.timedelta(seconds=60))
pg = dicomm.ProcessGroupDicomm(store, rank, world, 60.0)
print("init done", flush=True)
"""


def open_descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def wait_until(condition, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} within {timeout_s} s"
        time.sleep(0.05)


@pytest.mark.timeout(120)
def test_a_group_dialling_at_once_is_admitted_whole_once_descriptors_are_free_again():
    """The last rank of a 13-rank group runs out of descriptors under a flood of silent
    connections (EMFILE), which lowers its greeting bound; once the flood is gone and its
    descriptor limit is back, the other 12 ranks (played here) open all 24 lanes at once and every
    one is admitted: none is evicted for room as the flood's were."""
    import resource

    world, lanes = 13, 2
    store, port = master_store()
    fake = FakeRank0(store, lanes=lanes, real=world - 1)
    env = dict(os.environ, PYTHONPATH=str(ROOT), DICOMM_TRANSPORT="tcp", DICOMM_TCP_STREAMS=str(lanes))
    proc = subprocess.Popen([sys.executable, "-c", RANK_LAST, str(port), str(world - 1), str(world)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    held, flood = [], []
    try:
        fake.rank1_address()  # listening, and waiting for the group in its first accept
        limit = resource.prlimit(proc.pid, resource.RLIMIT_NOFILE)
        base = open_descriptors(proc.pid)
        resource.prlimit(proc.pid, resource.RLIMIT_NOFILE, (base + 40, limit[1]))
        flood = [fake.connect() for _ in range(150)]
        # Evictions for room start only once accept() failed: the group's own bound is 116.
        assert closed_by_peer(flood[0], within=8), "the flood never ran the rank out of descriptors"
        for s in flood:
            s.close()
        wait_until(lambda: open_descriptors(proc.pid) <= base + 2, "the flood's descriptors were freed")
        resource.prlimit(proc.pid, resource.RLIMIT_NOFILE, limit)
        dialled = [(rank, lane, fake.connect()) for rank in range(world - 1) for lane in range(lanes)]
        hellos = []
        for rank, lane, s in dialled:
            hellos.append(HELLO.pack(HELLO_MAGIC, rank, os.getpid(), 0, secrets.token_bytes(32), lane, lanes))
            s.sendall(hellos[-1])
        for (rank, lane, s), mine in zip(dialled, hellos):
            s.settimeout(10)
            answer = s.recv(HELLO.size + 32, socket.MSG_WAITALL)
            assert len(answer) == HELLO.size + 32, f"rank {rank} lane {lane} was dropped before its handshake"
            s.sendall(proof(fake.key, "dial", mine, answer[:HELLO.size]))
            held.append(s)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0 and "init done" in out, err[-3000:]
    finally:
        for s in held + flood:
            s.close()
        if proc.poll() is None:
            proc.kill()
