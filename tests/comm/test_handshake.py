"""Connection set-up against a peer the test plays itself, at the protocol level: connections
that reach a rank's listener and never say a word must not hold its set-up up. The test is the
group's rank 0 (it hosts the store, publishes its auth key and info, dials with a proper Hello);
rank 1 is a real dicomm backend in a subprocess, and the silent connections are in its backlog
before the real ones, deterministically."""
from __future__ import annotations

import datetime
import os
import secrets
import socket
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
HELLO = struct.Struct("<QiiQ32sii")  # csrc/comm/transport/Socket.h: Hello (64 bytes)
HELLO_MAGIC = 0x326D6D6F4369446C
LANES = 2

RANK1 = """
import datetime, sys, time, torch, dicomm
store = torch.distributed.TCPStore("127.0.0.1", int(sys.argv[1]), 2, is_master=False,
                                   timeout=datetime.timedelta(seconds=60))
t0 = time.monotonic()
pg = dicomm.ProcessGroupDicomm(store, 1, 2, 60.0)
print(f"init {time.monotonic() - t0:.3f}", flush=True)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(120)
def test_silent_connections_do_not_hold_up_set_up():
    port = _free_port()
    store = torch.distributed.TCPStore("127.0.0.1", port, 2, is_master=True, wait_for_workers=False,
                                       timeout=datetime.timedelta(seconds=60))
    key = secrets.token_bytes(32)
    store.set("dicomm/auth", key)
    import dicomm

    store.set("dicomm/info/0", f"{dicomm.local_host_id()}\ntcp".encode())  # this host; tcp only
    env = dict(os.environ, PYTHONPATH=str(ROOT), DICOMM_TRANSPORT="tcp", DICOMM_TCP_STREAMS=str(LANES))
    rank1 = subprocess.Popen([sys.executable, "-c", RANK1, str(port)], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    held: list[socket.socket] = []
    try:
        try:
            store.wait(["dicomm/tcp/addr/1"], datetime.timedelta(seconds=30))
        except Exception:
            rank1.kill()
            raise AssertionError("rank 1 did not publish its address: " + rank1.communicate()[1][-3000:]) from None
        host, port1 = store.get("dicomm/tcp/addr/1").decode().removeprefix("tcp:").rsplit(":", 1)
        # Three connections that never send their Hello, first in rank 1's backlog.
        held += [socket.create_connection((host, int(port1))) for _ in range(3)]
        # Then rank 0's lanes, as the transport dials them.
        for lane in range(LANES):
            s = socket.create_connection((host, int(port1)))
            s.sendall(HELLO.pack(HELLO_MAGIC, 0, os.getpid(), 0, key, lane, LANES))
            reply = s.recv(HELLO.size, socket.MSG_WAITALL)
            magic, rank, *_ = HELLO.unpack(reply)
            assert (magic, rank) == (HELLO_MAGIC, 1), reply
            held.append(s)
        out, err = rank1.communicate(timeout=60)
    finally:
        for s in held:
            s.close()
        if rank1.poll() is None:
            rank1.kill()
    assert rank1.returncode == 0, err[-3000:]
    seconds = float(out.split()[1])
    # Each silent connection used to hold rank 1's accept loop for 10 s.
    assert seconds < 5, (seconds, out, err[-2000:])
