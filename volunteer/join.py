"""How a client joins: it fetches the job from any server, measures its link to every stage's
servers and joins the stage it reaches best (section 3.2.1, Dynamic Client Participation)."""
from __future__ import annotations

import logging
import secrets
import time

import torch
import zmq

from .job import Job
from .security import JobKeys, connecting_socket
from .wire import Message, ProtocolError

log = logging.getLogger("volunteer.join")

PROBE_BYTES = 256 << 10
# A client may start beside the servers it joins (the demo starts them together); on a loaded
# 2-core host a server's start-up (importing torch, building its stage) took over 15 s.
JOIN_TIMEOUT = 60.0
MAX_JOB_MESSAGE = 4 << 20


def _ask(context: zmq.Context, keys: JobKeys, address: str, msg: Message, timeout: float,
         max_bytes: int) -> Message:
    sock = connecting_socket(context, keys, f"tcp://{address}", f"j:{secrets.token_hex(6)}".encode(), max_bytes)
    try:
        sock.send_multipart(msg.encode())
        if not sock.poll(timeout * 1000):
            raise TimeoutError(f"no answer from the server at {address} within {timeout:.0f} s "
                               "(is it running, reachable, and is the token file the job's?)")
        return Message.decode(sock.recv_multipart())
    finally:
        sock.close(0)


def fetch_job(address: str, keys: JobKeys, timeout: float = JOIN_TIMEOUT) -> Job:
    """The job the server at ``address`` (host:port) serves."""
    context = zmq.Context.instance()
    reply = _ask(context, keys, address, Message("JOIN", {}), timeout, MAX_JOB_MESSAGE)
    if reply.op != "JOB" or not isinstance(reply.fields.get("job"), dict):
        raise ProtocolError(f"the server at {address} answered {reply.op!r} to JOIN; expected JOB")
    return Job.from_dict(reply.fields["job"])


def probe_seconds(address: str, keys: JobKeys, timeout: float = 5.0) -> float:
    """Round trip of a PROBE_BYTES ping: delay plus transfer time, as Equation 1 charges a client."""
    context = zmq.Context.instance()
    payload = torch.zeros(PROBE_BYTES // 4)
    t0 = time.monotonic()
    try:
        _ask(context, keys, address, Message("PING", {}, [payload]), timeout, 2 * PROBE_BYTES)
    except TimeoutError:
        return float("inf")
    return time.monotonic() - t0


def choose_stage(job: Job, keys: JobKeys) -> int:
    """The stage whose servers this device reaches fastest on average."""
    means = []
    for k, stage in enumerate(job.stages):
        times = [probe_seconds(s.address, keys) for s in stage.servers]
        means.append(sum(times) / len(times))
        log.info("stage %d: mean probe %.1f ms", k, means[-1] * 1e3)
    best = min(range(len(means)), key=means.__getitem__)
    if means[best] == float("inf"):
        raise TimeoutError("no stage's servers answered a probe")
    return best
