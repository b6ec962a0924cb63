"""A follower's data server (ZeroMQ ROUTER): clusters push BF16 units and pull BF16 parameters.

One network thread owns the socket; a decoder thread deserializes and checks pushes and an
encoder thread serializes pulls, so (de)serialization overlaps the network (the paper's
producer/consumer). Messages queued are bounded in number, each at most the socket's largest
message, so a cluster can make the follower hold only so much."""
from __future__ import annotations

import json
import logging
import queue
import threading
import time

import torch
import zmq

from .auth import JobToken, push_id_issued
from .curve import Authenticator, KeyPair, serving_socket, tcp_endpoint
from .follower_state import FollowerState
from .layout import pack_unit, unpack_unit

log = logging.getLogger("dips.follower")

ZAP_DOMAIN = "dips-data"
MAX_ID_CHARS = 128  # push and request ids a cluster sends are echoed back: bound them


class FollowerDataServer:
    """Serves ``state`` at ``bind`` to clusters holding ``cluster_key``; pushes must carry ids the
    leader issued (``token``)."""

    def __init__(self, state: FollowerState, token: JobToken, keys: KeyPair, cluster_key: bytes, bind: str):
        self.state, self.token, self.name = state, token, state.name
        self._stop = threading.Event()
        self._ctx = zmq.Context()  # its own: the ZAP handler is per context
        self._auth = Authenticator(self._ctx, ZAP_DOMAIN, [cluster_key])
        self._router = serving_socket(self._ctx, keys, ZAP_DOMAIN, tcp_endpoint(bind), state.layout.max_message_bytes)
        self._outbox = f"inproc://dips-follower-{id(self)}"
        depth = state.max_unsealed_pushes * len(state.unit_range)
        self._decode_q: queue.Queue = queue.Queue(maxsize=depth)
        self._encode_q: queue.Queue = queue.Queue(maxsize=depth)
        self._pull_sock = self._ctx.socket(zmq.PULL)
        self._pull_sock.bind(self._outbox)
        self._threads = [threading.Thread(target=fn, daemon=True, name=f"dips-follower-{fn.__name__}")
                         for fn in (self._network_loop, self._decode_loop, self._encode_loop)]
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=2)
        self._auth.stop()
        self._ctx.term()

    def _network_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._pull_sock, zmq.POLLIN)
        while not self._stop.is_set():
            events = dict(poller.poll(50))
            if self._router in events:
                frames = self._router.recv_multipart(copy=False)
                self._route(frames)
            if self._pull_sock in events:
                self._router.send_multipart(self._pull_sock.recv_multipart(copy=False), copy=False)
        self._router.close(0)
        self._pull_sock.close(0)

    def _route(self, frames) -> None:
        ident = frames[0].bytes
        try:
            header = json.loads(frames[1].bytes)
            if not isinstance(header, dict):
                raise ValueError("header is not a JSON object")
        except (ValueError, IndexError) as exc:
            log.warning("%s: malformed data message: %s", self.name, exc)
            return
        req = header.get("req")
        if not isinstance(req, str) or len(req) > MAX_ID_CHARS:
            log.warning("%s: data message without a request id of at most %d characters", self.name, MAX_ID_CHARS)
            return
        try:
            if header.get("op") == "push":
                self._decode_q.put_nowait((ident, header, frames[2].buffer if len(frames) > 2 else b""))
            elif header.get("op") == "pull":
                self._encode_q.put_nowait((ident, header))
            else:
                self._reply_now(ident, {"ok": False, "err": f"unknown op {str(header.get('op'))[:40]!r}", "req": req})
        except queue.Full:
            self._reply_now(ident, {"ok": False, "err": "follower busy: too many messages queued; retry", "req": req})

    def _reply_now(self, ident: bytes, header: dict, payload: list[bytes] = ()) -> None:
        self._router.send_multipart([ident, json.dumps(header).encode(), *payload])

    def _sender(self):
        sock = self._ctx.socket(zmq.PUSH)
        sock.connect(self._outbox)
        return sock

    def _decode_loop(self) -> None:
        out = self._sender()
        while not self._stop.is_set():
            try:
                ident, header, payload = self._decode_q.get(timeout=0.1)
            except queue.Empty:
                self.state.drop_stale(time.monotonic())
                continue
            try:
                self._stage(header, payload)
                reply = {"ok": True}
            except (ValueError, KeyError, TypeError) as exc:
                log.warning("%s rejected push unit: %s", self.name, exc)
                reply = {"ok": False, "err": str(exc)}
            reply.update(req=header.get("req"), push=header.get("push"), unit=header.get("unit"))
            out.send_multipart([ident, json.dumps(reply).encode()])
        out.close(0)

    def _stage(self, header: dict, payload) -> None:
        """Checks one pushed unit against the layout and the leader's ids, then stages it."""
        state = self.state
        unit = int(header["unit"])
        if unit not in state.unit_range:
            raise ValueError(f"unit {unit} is not owned by {self.name} (owns {list(state.unit_range)})")
        spec = state.layout.units[unit]
        names, shapes = header["names"], [tuple(s) for s in header["shapes"]]
        want = [t.name for t in spec.tensors]
        if names != want:
            raise ValueError(f"unit {spec.name}: tensors {names}; expected {want}")
        if shapes != [t.shape for t in spec.tensors]:
            raise ValueError(f"unit {spec.name}: shapes {shapes}; expected {[t.shape for t in spec.tensors]}")
        if header.get("dtype") != "bfloat16":
            raise ValueError(f"unit {spec.name}: dtype {header.get('dtype')!r}; expected 'bfloat16'")
        push, base = header["push"], int(header["base"])
        if not isinstance(push, str) or not 0 < len(push) <= MAX_ID_CHARS:
            raise ValueError(f"push id {str(push)[:40]!r}; expected a string of 1..{MAX_ID_CHARS} characters")
        if not push_id_issued(self.token, push, header.get("cluster")):
            raise ValueError(f"push {push}: not an id the leader issued to cluster {str(header.get('cluster'))[:40]!r}")
        tensors = unpack_unit(spec, payload)
        for n, t in tensors.items():
            if not torch.isfinite(t).all():
                raise ValueError(f"unit {spec.name}: tensor {n} has non-finite values")
        state.stage(unit, push, base, header.get("cluster"), tensors)

    def _encode_loop(self) -> None:
        out = self._sender()
        while not self._stop.is_set():
            try:
                ident, header = self._encode_q.get(timeout=0.1)
            except queue.Empty:
                continue
            reply, payload = {"req": header.get("req")}, []
            try:
                version = int(header["version"])
                units = [int(u) for u in header["units"]]
                tensors = self.state.pull(version, units)
                payload = [pack_unit(ts) for ts in tensors]
                reply.update(ok=True, version=version, units=units)
            except (ValueError, KeyError, TypeError) as exc:
                reply.update(ok=False, err=str(exc))
            out.send_multipart([ident, json.dumps(reply).encode(), *payload])
        out.close(0)
