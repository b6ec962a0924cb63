"""A whole job in one process, servers and clients as threads on loopback: for tests, the
benchmark and trying the system out. Each server and client has its own ZeroMQ context and
sockets, exactly as in separate processes; only the address space is shared."""
from __future__ import annotations

import dataclasses
import secrets
import threading
import time
from typing import Any

import torch
import zmq

from dips.auth import JobToken
from diutil.address import free_port

from .client import Client
from .job import Job, Server, StageSpec
from .security import JobKeys
from .server import StageServer


LOOPBACK = "127.0.0.1"
BIND_ATTEMPTS = 5


def loopback_job(model: dict[str, Any], layers: list[tuple[int, int]], servers: list[tuple[int, int]],
                 **training: Any) -> Job:
    """A job whose stage k has ``servers[k] = (frontal, backward)`` servers on loopback ports."""
    stages = []
    for k, ((f, b), rng) in enumerate(zip(servers, layers)):
        def side(prefix: str, n: int) -> tuple[Server, ...]:
            return tuple(Server(f"{prefix}{k}.{i}", f"{LOOPBACK}:{free_port()}") for i in range(n))
        stages.append(StageSpec(rng, side("f", f), side("b", b)))
    return Job(model=model, stages=tuple(stages), **training)


def with_fresh_ports(job: Job) -> Job:
    """`job` with every server moved to a loopback port free now."""
    def side(servers: tuple[Server, ...]) -> tuple[Server, ...]:
        return tuple(dataclasses.replace(s, address=f"{LOOPBACK}:{free_port()}") for s in servers)
    return dataclasses.replace(job, stages=tuple(dataclasses.replace(st, frontal=side(st.frontal),
                                                                     backward=side(st.backward))
                                                 for st in job.stages))


class LocalJob:
    """Runs every server of ``job`` in a thread; clients are added with ``add_client``."""

    def __init__(self, job: Job, token: JobToken | None = None, data: torch.Tensor | None = None,
                 server_token: JobToken | None = None):
        self.keys = JobKeys(token or JobToken(secrets.token_hex(32)), server_token or JobToken(secrets.token_hex(32)))
        self.job, self.servers = self._bind_servers(job, data)
        self.threads = [threading.Thread(target=s.run, name=s.name, daemon=True) for s in self.servers]
        self.clients: list[tuple[Client, threading.Thread]] = []
        for t in self.threads:
            t.start()

    def _bind_servers(self, job: Job, data: torch.Tensor | None) -> tuple[Job, list[StageServer]]:
        """Every server of `job`, bound. A port free_port() found can be taken (by any socket on
        the host) before its server binds it; then every server of a loopback job moves to fresh
        ports and binding starts over, a bounded number of times. `self.job` is the job as bound."""
        loopback = all(s.address.startswith(f"{LOOPBACK}:") for st in job.stages for s in st.servers)
        for attempt in range(BIND_ATTEMPTS):
            servers: list[StageServer] = []
            try:
                for st in job.stages:
                    for s in st.servers:
                        servers.append(StageServer(job, s.name, self.keys, data=data, linger=0.5))
                return job, servers
            except zmq.ZMQError as exc:
                for server in servers:
                    server.close()
                if exc.errno != zmq.EADDRINUSE or not loopback or attempt + 1 == BIND_ATTEMPTS:
                    raise
                job = with_fresh_ports(job)
        raise AssertionError("unreachable")

    @property
    def losses(self) -> dict[int, float]:
        """Loss per step, from the last stage's first frontal server."""
        last = self.job.stages[-1].frontal[0].name
        return next(s for s in self.servers if s.name == last).role.losses

    def add_client(self, stage: int, name: str, **kwargs: Any) -> Client:
        client = Client(self.job, stage, name, self.keys, **kwargs)
        thread = threading.Thread(target=client.run, name=name, daemon=True)
        thread.start()
        self.clients.append((client, thread))
        return client

    def wait(self, timeout: float) -> bool:
        """True when every server finished within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self.threads)

    def close(self) -> None:
        for c, _ in self.clients:
            c.stop()
        for s in self.servers:
            s.stop()
        for _, t in self.clients:
            t.join(10)
        for t in self.threads:
            t.join(10)
