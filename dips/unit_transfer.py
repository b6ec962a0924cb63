"""A cluster's data plane (ZeroMQ, CURVE-encrypted): its units pushed to the followers that own
them and pulled back, one message per unit, every reply matched to its request id. Payloads are
BF16 parameters or a ``dips.codec`` encoding; ``stats`` counts the bytes each way."""
from __future__ import annotations

import itertools
import json
import logging
import time

import torch
import zmq

from .auth import CLUSTER_KEY_LABEL, JobToken
from .codec import Codec
from .curve import KeyPair, connecting_socket, tcp_endpoint
from .layout import ModelLayout, pack_unit, unpack_unit

log = logging.getLogger("dips.client")


class UnitTransfer:
    """Moves units of ``layout`` to and from the followers of the current ``plan`` (the leader's
    data plan: followers, the units each owns, their public key). ``stats["pull_s"]`` counts the
    time spent pulling, ``stats["push_bytes"]``/``["pull_bytes"]`` the payload bytes moved."""

    def __init__(self, token: JobToken, layout: ModelLayout, timeout_s: float, stats: dict):
        self.layout, self.timeout_s, self.stats = layout, timeout_s, stats
        self.plan: dict = {}
        self.refused = False    # whether the latest failed pull was answered with a refusal
        self.last_pull_s = 0.0  # the latest pull's time, which the leader's schedule takes into account
        self._req = itertools.count()
        self._ctx = zmq.Context.instance()
        self._keys = KeyPair.derive(token, CLUSTER_KEY_LABEL)
        self._socks: dict[str, zmq.Socket] = {}

    def close(self) -> None:
        for s in self._socks.values():
            s.close(0)
        self._socks.clear()

    def sock(self, address: str) -> zmq.Socket:
        s = self._socks.get(address)
        if s is None:
            s = self._socks[address] = connecting_socket(self._ctx, self.plan["key"].encode(), self._keys,
                                                         tcp_endpoint(address), self.layout.max_message_bytes)
        return s

    @staticmethod
    def header(**fields) -> bytes:
        return json.dumps(fields).encode()

    def send_unit(self, task: dict, unit: int, address: str, values: dict[str, torch.Tensor]) -> str:
        """Unit ``unit`` of push ``task`` (its BF16 parameters ``values``) to the follower at ``address``; the request id."""
        spec = self.layout.units[unit]
        return self.send_payload(task, unit, address, pack_unit([values[t.name] for t in spec.tensors]), "bf16")

    def send_payload(self, task: dict, unit: int, address: str, payload: bytes, codec: str,
                     sqnorm: float | None = None) -> str:
        """Unit ``unit`` of push ``task`` as ``payload`` in ``codec`` (``bf16``: its parameters;
        any other: its encoded pseudo-gradient, with ``sqnorm`` the squared norm of the
        uncompressed one) to the follower at ``address``; the request id."""
        spec = self.layout.units[unit]
        req = f"{task['push']}:{unit}"
        self.sock(address).send_multipart([
            self.header(op="push", push=task["push"], cluster=task["cluster"], base=task["base"], unit=unit,
                        names=[t.name for t in spec.tensors], shapes=[list(t.shape) for t in spec.tensors],
                        dtype="bfloat16", codec=codec, req=req,
                        **({} if sqnorm is None else {"sqnorm": sqnorm})), payload], copy=False)
        self.stats["push_bytes"] += len(payload)
        return req

    def await_acks(self, push: str, waiting: dict[str, set]) -> bool:
        """Whether every follower acknowledged every unit sent to it (``waiting``: address -> request ids)."""
        ok = True
        for address, reqs in waiting.items():
            for reply, _ in self.replies(address, reqs):
                if not reply.get("ok"):
                    log.warning("follower %s refused unit %s of push %s: %s", address, reply.get("unit"), push,
                                reply.get("err"))
                    ok = False
            if reqs:
                log.warning("follower %s did not acknowledge %d units of push %s", address, len(reqs), push)
                ok = False
        return ok

    def replies(self, address: str, reqs: set):
        """Yield (header, payload frames) for the awaited request ids until all came or time ran out."""
        sock = self.sock(address)
        deadline = time.monotonic() + self.timeout_s
        while reqs and time.monotonic() < deadline:
            if not sock.poll(int(max(1, (deadline - time.monotonic()) * 1000))):
                break
            frames = sock.recv_multipart()
            try:
                header = json.loads(frames[0])
            except ValueError:
                continue
            if isinstance(header, dict) and header.get("req") in reqs:  # replies to abandoned requests are dropped
                reqs.discard(header["req"])
                yield header, frames[1:]

    def pull(self, version: int, units, codec: Codec | None = None, since: int = -1,
             cluster: str | None = None) -> dict[str, torch.Tensor] | None:
        """``units`` at ``version`` from the followers that own them, as FP32 (None: a pull failed;
        ``refused`` then says whether a follower answered no). With a lossy ``codec``, the decoded
        difference from what ``cluster`` holds at version ``since`` instead; a whole pull naming
        ``cluster`` tells the followers it now holds these values."""
        t0 = time.monotonic()
        out: dict[str, torch.Tensor] = {}
        wanted = set(units)
        change = codec is not None and codec.lossy
        self.refused = False
        for i, (address, (start, stop)) in enumerate(zip(self.plan["followers"], self.plan["units"])):
            mine = [u for u in range(start, stop) if u in wanted]
            if not mine:
                continue
            req = f"pull:{version}:{i}:{next(self._req)}"
            extra = {"codec": str(codec), "since": since} if change else {}
            if cluster is not None:
                extra["cluster"] = cluster
            self.sock(address).send_multipart([self.header(op="pull", version=version, units=mine, req=req, **extra)])
            got = list(self.replies(address, {req}))
            if not got or not got[0][0].get("ok") or len(got[0][1]) != len(mine):
                log.warning("pull of version %d from %s failed: %s", version, address,
                            got[0][0].get("err") if got else "timeout")
                self.refused = bool(got)
                return None
            try:
                for unit, payload in zip(mine, got[0][1]):
                    self.stats["pull_bytes"] += len(payload)
                    out.update(self._decode(unit, payload, codec) if change
                               else unpack_unit(self.layout.units[unit], payload))
            except ValueError as exc:
                log.warning("pull of version %d from %s refused: %s", version, address, exc)
                self.refused = True
                return None
        self.last_pull_s = time.monotonic() - t0
        self.stats["pull_s"] += self.last_pull_s
        self.stats["pulls"] += 1
        return {n: t.float() for n, t in out.items()}

    def _decode(self, unit: int, payload, codec: Codec) -> dict[str, torch.Tensor]:
        spec = self.layout.units[unit]
        sizes = [t.numel for t in spec.tensors]
        flat = codec.decode(payload, sum(sizes),
                            what=f"pulled unit {spec.name}")
        return {t.name: part.view(t.shape) for t, part in zip(spec.tensors, flat.split(sizes))}
