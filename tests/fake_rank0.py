"""Rank 0 of a two-rank dicomm group played at the protocol level, for tests that need a peer
that says exactly what they choose: it hosts the store, publishes the group key and its info, and
dials rank 1 (a real backend) the way the tcp transport does. The wire formats are re-implemented
here from their descriptions (csrc/comm/transport/Handshake.h, StreamTransport.h, Transport.h,
core/Tags.h) with Python's struct and hmac modules: an independent reference for what a real
rank sends and accepts."""
from __future__ import annotations

import datetime
import hashlib
import hmac
import os
import secrets
import socket
import struct
from typing import Callable

import torch

from diutil.address import free_port

HELLO = struct.Struct("<QiiQ32sii")  # magic, rank, pid, probe, nonce, lane, lanes (64 bytes)
HELLO_MAGIC = 0x336D6D6F4369446C
LABEL = {"accept": b"dicomm-accept-1\0", "dial": b"dicomm-dial-1\0\0\0"}
# kind, status, envelope (tag, nbytes, dtype, flags), address, seq, reserved (64 bytes)
FRAME = struct.Struct("<IiQQiIQQ16x")
KIND = {"inline": 1, "remote": 2, "ack": 3, "goodbye": 4, "rts": 5, "cts": 6, "data": 7, "part": 8}


def proof(key: bytes, role: str, dialer_hello: bytes, acceptor_hello: bytes) -> bytes:
    return hmac.new(key, LABEL[role] + dialer_hello + acceptor_hello, hashlib.sha256).digest()


def p2p_tag(tag: int) -> int:
    return (1 << 60) | (tag & 0xFFFFFFFF)


def frame(kind: str | int, tag: int = 0, nbytes: int = 0, dtype: int = -1, address: int = 0,
          seq: int = 0, status: int = 0) -> bytes:
    return FRAME.pack(KIND.get(kind, kind) if isinstance(kind, str) else kind, status, tag, nbytes, dtype, 0,
                      address, seq)


def closed_by_peer(s: socket.socket, within: float = 5.0) -> bool:
    """Whether the peer closes `s` (reading and dropping what it sends) within `within` s."""
    s.settimeout(within)
    try:
        while True:
            if s.recv(1 << 16) == b"":
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except socket.timeout:
        return False


class FakeRank0:
    """The store and rank 0 of one group under `prefix` in `store` (tcp only, `lanes` lanes)."""

    def __init__(self, store: torch.distributed.Store, prefix: str = "", lanes: int = 2, transport: str = "tcp",
                 real: int = 1):
        """``real``: the rank of the real backend (rank 1 of two by default; the last of a larger
        group whose other ranks the test plays, each dialling it as rank 0 does)."""
        self.store, self.prefix, self.lanes, self.transport, self.real = store, prefix, lanes, transport, real
        self.key = secrets.token_bytes(32)
        import dicomm

        store.set(prefix + "dicomm/auth", self.key)
        # This host, and the one transport rank 1 is to use with us.
        for rank in range(real):
            store.set(prefix + f"dicomm/info/{rank}", f"{dicomm.local_host_id()}\n{transport}".encode())

    def rank1_address(self, timeout: float = 30.0) -> tuple[str, int] | str:
        """Rank 1's listener: (host, port) for tcp, the abstract socket name for shm."""
        key = self.prefix + f"dicomm/{self.transport}/addr/{self.real}"
        self.store.wait([key], datetime.timedelta(seconds=timeout))
        address = self.store.get(key).decode()
        if self.transport == "shm":
            return "\0" + address.removeprefix("unix:")
        host, port = address.removeprefix("tcp:").rsplit(":", 1)
        return host, int(port)

    def connect(self) -> socket.socket:
        address = self.rank1_address()
        if isinstance(address, str):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(address)
            return s
        return socket.create_connection(address)

    def greet(self, lane: int, rank: int = 0, pid: int | None = None) -> tuple[socket.socket, bytes, bytes, bytes]:
        """Send rank 0's Hello for `lane`; returns the socket, our Hello, rank 1's Hello and proof."""
        s = self.connect()
        mine = HELLO.pack(HELLO_MAGIC, rank, os.getpid() if pid is None else pid, 0, secrets.token_bytes(32),
                          lane, self.lanes)
        s.sendall(mine)
        s.settimeout(10)
        answer = s.recv(HELLO.size + 32, socket.MSG_WAITALL)
        assert len(answer) == HELLO.size + 32, answer
        return s, mine, answer[:HELLO.size], answer[HELLO.size:]

    def join(self, first: Callable[[socket.socket], None] | None = None) -> list[socket.socket]:
        """Dial every lane with a correct handshake; returns the lanes (main lane first).

        ``first`` runs on the main lane once it is admitted, before the data lanes are dialled:
        what it sends is waiting when rank 1's pair starts, so rank 1 meets it while its
        process group is still being made."""
        lanes = []
        for lane in range(self.lanes):
            s, mine, theirs, _ = self.greet(lane)
            s.sendall(proof(self.key, "dial", mine, theirs))
            lanes.append(s)
            if lane == 0 and first is not None:
                first(s)
        if self.transport == "shm":
            # The cross-memory attach probe results, one byte each way: we read nothing of rank 1.
            lanes[0].sendall(b"\0")
            lanes[0].settimeout(10)
            assert len(lanes[0].recv(1)) == 1
        return lanes


def master_store(port: int | None = None) -> tuple[torch.distributed.TCPStore, int]:
    port = port or free_port()
    store = torch.distributed.TCPStore("127.0.0.1", port, 2, is_master=True, wait_for_workers=False,
                                       timeout=datetime.timedelta(seconds=60))
    return store, port
