"""A whole job in one process, servers and clients as threads on loopback: for tests, the
benchmark and trying the system out. Each server and client has its own ZeroMQ context and
sockets, exactly as in separate processes; only the address space is shared."""
from __future__ import annotations

import secrets
import threading
import time
from typing import Any

import torch

from dips.auth import JobToken
from dips.harness import free_port

from .client import Client
from .job import Job, Server, StageSpec
from .security import JobKeys
from .server import StageServer


def loopback_job(model: dict[str, Any], layers: list[tuple[int, int]], servers: list[tuple[int, int]],
                 **training: Any) -> Job:
    """A job whose stage k has ``servers[k] = (frontal, backward)`` servers on loopback ports."""
    stages = []
    for k, ((f, b), rng) in enumerate(zip(servers, layers)):
        def side(prefix: str, n: int) -> tuple[Server, ...]:
            return tuple(Server(f"{prefix}{k}.{i}", f"127.0.0.1:{free_port()}") for i in range(n))
        stages.append(StageSpec(rng, side("f", f), side("b", b)))
    return Job(model=model, stages=tuple(stages), **training)


class LocalJob:
    """Runs every server of ``job`` in a thread; clients are added with ``add_client``."""

    def __init__(self, job: Job, token: JobToken | None = None, data: torch.Tensor | None = None):
        self.job = job
        self.keys = JobKeys(token or JobToken(secrets.token_hex(32)))
        self.servers = [StageServer(job, s.name, self.keys, data=data, linger=0.5)
                        for st in job.stages for s in st.servers]
        self.threads = [threading.Thread(target=s.run, name=s.name, daemon=True) for s in self.servers]
        self.clients: list[tuple[Client, threading.Thread]] = []
        for t in self.threads:
            t.start()

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
