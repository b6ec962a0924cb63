"""A follower's data server (ZeroMQ ROUTER): clusters push units (BF16 parameters, or a
compressed pseudo-gradient) and pull them (BF16 parameters, or compressed changes since a
version they hold; ``dips.codec``).

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

from diutil import untrusted
from diutil.untrusted import BadMessage, RateLimitedLog

from .auth import JobToken, push_id_issued
from .codec import Codec
from .curve import Authenticator, KeyPair, serving_socket, tcp_endpoint
from .follower_state import WHOLE, FollowerState
from .layout import pack_unit, unpack_unit

log = logging.getLogger("dips.follower")

ZAP_DOMAIN = "dips-data"
MAX_ID_CHARS = 128  # push and request ids a cluster sends are echoed back: bound them
MAX_HEADER_BYTES = 64 * 1024  # a header names one unit's tensors: far below this
MAX_VERSION = 2 ** 62
MAX_SQNORM = 1e300  # a reported squared norm: finite, and the sum over a model stays finite


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
        self._bad = RateLimitedLog(log)
        self._threads = [threading.Thread(target=fn, daemon=True, name=f"dips-follower-{fn.__name__}")
                         for fn in (self._network_loop, self._decode_loop, self._encode_loop)]
        for t in self._threads:
            t.start()

    def alive(self) -> bool:
        """Whether all three threads run (the follower stops heartbeating otherwise, so the
        leader relaunches it)."""
        return all(t.is_alive() for t in self._threads)

    def stop(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        for t in self._threads:
            t.join(timeout=2)
        self._auth.stop()
        # Sockets of a thread that did not end are closed here, without lingering, so that
        # term() cannot wait for them.
        self._ctx.destroy(linger=0)

    def _network_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._pull_sock, zmq.POLLIN)
        while not self._stop.is_set():
            events = dict(poller.poll(50))
            if self._router in events:
                frames = self._router.recv_multipart(copy=False)
                try:
                    self._route(frames)
                except Exception:  # a bug, not bad input (that is refused in _route): keep serving
                    log.exception("%s: routing a data message failed", self.name)
            if self._pull_sock in events:
                self._router.send_multipart(self._pull_sock.recv_multipart(copy=False), copy=False)
        self._router.close(0)
        self._pull_sock.close(0)

    def _route(self, frames) -> None:
        ident = frames[0].bytes
        try:
            if len(frames) < 2:
                raise BadMessage("a data message without a header frame")
            header = untrusted.json_object(frames[1].bytes, "data message header", MAX_HEADER_BYTES)
            req = untrusted.text(header, "req", MAX_ID_CHARS)
        except BadMessage as exc:  # answered without an id: the sender learns why, if it listens
            self._bad.warning("%s: refused a data message: %s", self.name, exc)
            self._reply_now(ident, {"ok": False, "err": str(exc)[:500], "req": None})
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
                unit = self._stage(header, payload)
                reply = {"ok": True, "push": header["push"], "unit": unit}
            except Exception as exc:  # ValueError for bad input; anything else must not end the thread
                if not isinstance(exc, ValueError):
                    log.exception("%s: staging a pushed unit failed", self.name)
                self._bad.warning("%s rejected a pushed unit: %s", self.name, exc)
                reply = {"ok": False, "err": str(exc)[:500]}
            reply["req"] = header["req"]
            out.send_multipart([ident, json.dumps(reply).encode()])
        out.close(0)

    def _stage(self, header: dict, payload) -> int:
        """Checks one pushed unit against the layout and the leader's ids, then stages it; the unit."""
        state = self.state
        unit = untrusted.integer(header, "unit", state.unit_range.start, state.unit_range.stop - 1)
        spec = state.layout.units[unit]
        want = [t.name for t in spec.tensors]
        want_shapes = [list(t.shape) for t in spec.tensors]
        if header.get("names") != want:
            raise BadMessage(f"unit {spec.name}: tensors {str(header.get('names'))[:200]}; expected {want}")
        if header.get("shapes") != want_shapes:
            raise BadMessage(f"unit {spec.name}: shapes {str(header.get('shapes'))[:200]}; expected {want_shapes}")
        codec = Codec.parse(header.get("codec", "bf16"))
        if not codec.fixed_size:
            raise BadMessage(f"unit {spec.name}: codec {codec} carries pulls, not pushes")
        if not codec.lossy and header.get("dtype") != "bfloat16":
            raise BadMessage(f"unit {spec.name}: dtype {str(header.get('dtype'))[:40]!r}; expected 'bfloat16'")
        push = untrusted.text(header, "push", MAX_ID_CHARS)
        base = untrusted.integer(header, "base", 0, MAX_VERSION)
        cluster = untrusted.text(header, "cluster", MAX_ID_CHARS)
        if not push_id_issued(self.token, push, cluster):
            raise BadMessage(f"push {push}: not an id the leader issued to cluster {cluster[:40]!r}")
        if codec.lossy:  # the pseudo-gradient itself, checked whole by the codec before anything is staged
            sqnorm = untrusted.number(header, "sqnorm", 0.0, MAX_SQNORM)
            flat = codec.decode(payload, sum(t.numel for t in spec.tensors), what=f"unit {spec.name}")
            tensors = dict(zip(want, (c.view(t.shape) for c, t in zip(flat.split([t.numel for t in spec.tensors]),
                                                                         spec.tensors))))
            state.stage(unit, push, base, cluster, tensors, form="delta", sqnorm=sqnorm)
            return unit
        tensors = unpack_unit(spec, payload)
        for n, t in tensors.items():
            if not torch.isfinite(t).all():
                raise ValueError(f"unit {spec.name}: tensor {n} has non-finite values")
        state.stage(unit, push, base, cluster, tensors)
        return unit

    def _encode_loop(self) -> None:
        out = self._sender()
        while not self._stop.is_set():
            try:
                ident, header = self._encode_q.get(timeout=0.1)
            except queue.Empty:
                continue
            reply, payload = {"req": header["req"]}, []
            try:
                # A pull names each unit once, at most all of this follower's: the reply is
                # bounded by one copy of its slice.
                r = self.state.unit_range
                version = untrusted.integer(header, "version", 0, MAX_VERSION)
                units = untrusted.integers(header, "units", r.start, r.stop - 1, len(r), distinct=True)
                codec = Codec.parse(header.get("codec", "bf16"))
                cluster = untrusted.text(header, "cluster", MAX_ID_CHARS, default=None)
                if codec.lossy:  # the difference from what the cluster holds
                    since = untrusted.integer(header, "since", WHOLE, MAX_VERSION)  # WHOLE: from nothing
                    if cluster is None:
                        raise BadMessage("a compressed pull names its cluster")
                    payload = self.state.pull_change(version, since, units, cluster, codec)
                else:
                    payload = [pack_unit(ts) for ts in self.state.pull(version, units, cluster)]
                reply.update(ok=True, version=version, units=units, codec=str(codec))
            except Exception as exc:
                if not isinstance(exc, ValueError):
                    log.exception("%s: serving a pull failed", self.name)
                self._bad.warning("%s refused a pull: %s", self.name, exc)
                reply.update(ok=False, err=str(exc)[:500])
            out.send_multipart([ident, json.dumps(reply).encode(), *payload])
        out.close(0)
