"""A client's links to its stage's servers: one ZeroMQ socket to each (frontal servers first,
then backward servers), an emulated slow link for the rows tasks move, and heartbeats from a
thread and sockets of their own, so that a long task never makes a live client look gone."""
from __future__ import annotations

import threading
import time

import zmq

from .job import Job
from .security import JobKeys, connecting_socket
from .server import max_message_bytes
from .wire import Message

HEARTBEAT = 0.5  # seconds between heartbeats; the job's liveness is several of them
PACED_OPS = ("TASK", "BWD", "ACT", "BWD_DONE")


class ServerLinks:
    """Sockets to the servers of stage ``stage`` as ``identity``; ``link``: (seconds of delay,
    bytes per second) emulated for task data, None for none."""

    def __init__(self, job: Job, stage: int, identity: bytes, keys: JobKeys, link: tuple[float, float] | None):
        self.spec, self.identity, self.keys, self.link = job.stages[stage], identity, keys, link
        self.context = zmq.Context()
        max_bytes = max_message_bytes(job)
        self.sockets = [connecting_socket(self.context, keys, f"tcp://{s.address}", identity, max_bytes)
                        for s in self.spec.servers]
        self.frontal = self.sockets[:len(self.spec.frontal)]
        self.backward = self.sockets[len(self.spec.frontal):]
        self._beating: threading.Event | None = None
        self._heart: threading.Thread | None = None

    def send(self, sock: zmq.Socket, msg: Message) -> None:
        self.cross(msg)
        sock.send_multipart(msg.encode(), copy=False)

    def broadcast(self, msg: Message) -> None:
        for s in self.sockets:
            self.send(s, msg)

    def cross(self, msg: Message) -> None:
        """Emulates a slow link for the rows a task moves (not for parameters, whose transfer
        delayed updates overlap with compute): sleeps its delay plus the bytes' time."""
        if self.link is not None and msg.op in PACED_OPS and msg.tensors:
            delay, rate = self.link
            time.sleep(delay + sum(t.numel() * t.element_size() for t in msg.tensors) / rate)

    def start_heartbeats(self) -> None:
        self._beating = threading.Event()
        self._heart = threading.Thread(target=self._heartbeat, args=(self._beating,),
                                       name=f"{self.identity.decode()}-heartbeat", daemon=True)
        self._heart.start()

    def stop_heartbeats(self) -> None:
        if self._heart is not None:
            self._beating.set()
            self._heart.join()
            self._heart = None

    def _heartbeat(self, done: threading.Event) -> None:
        socks = [connecting_socket(self.context, self.keys, f"tcp://{s.address}", self.identity + b":hb", 64 << 10)
                 for s in self.spec.servers]
        beat = Message("HEARTBEAT", {}).encode()
        try:
            while not done.wait(HEARTBEAT):
                for sock in socks:
                    sock.send_multipart(beat)
        finally:
            for sock in socks:
                sock.close(0)

    def close(self, linger_ms: int = 0) -> None:
        for s in self.sockets:
            s.close(linger_ms)
        self.context.term()
