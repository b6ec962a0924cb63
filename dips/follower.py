"""Follower PS: owns a contiguous slice of layer units and runs the outer optimizer on it.

Data flow (ZeroMQ ROUTER): clusters push BF16 units and pull BF16 parameters. One network thread
owns the socket; a decoder thread deserializes and validates pushes and an encoder thread
serializes pulls, so (de)serialization overlaps the network (the paper's producer/consumer).
Control flow (gRPC, from the leader): Seal a push (check it is complete, compute its
pseudo-gradient norm, persist it), Prepare/Apply a round, Discard pushes.

Durability: a sealed push is written to disk before Seal returns, and stays there until a
checkpoint that includes the round which consumed it is written. Checkpoints are written in the
background every ``checkpoint_every`` outer steps (the last ``keep_checkpoints`` kept); a slow
disk never queues more than one: the writer snapshots the latest version when it is free. A
follower restarted from
its latest checkpoint is behind the leader by the rounds applied since; the leader replays them
from its decision log, so no accepted push is lost.
"""
from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from pathlib import Path

import torch
import zmq

from diutil import address
from .auth import FOLLOWER_KEY_LABEL, JobToken, push_id_issued
from .curve import Authenticator, KeyPair, serving_socket, tcp_endpoint
from .layout import WIRE_DTYPE, ModelLayout, pack_unit, unpack_unit
from .leader_state import MAX_DECISIONS
from .model import initial_parameters, load_initial
from .outer_optimizer import NesterovOuter
from .rpc import RpcClient, RpcError, RpcServer, Tls

log = logging.getLogger("dips.follower")

STALE_UNSEALED_S = 120.0
ZAP_DOMAIN = "dips-data"
MAX_ID_CHARS = 128  # push and request ids a cluster sends are echoed back: bound them


# Rounds wait for every follower, so a follower that restarts is at most one checkpoint interval
# (plus a snapshot in progress) behind; the leader keeps up to MAX_DECISIONS decisions back to the
# oldest checkpoint, so bounding the interval at half that guarantees it can replay its way back.
# (No peer could send it a checkpoint instead: followers hold disjoint slices of the model.)
MAX_CHECKPOINT_EVERY = MAX_DECISIONS // 2


class Follower:
    """A follower PS serving data at ``bind``; ``server_token`` is the secret it shares with the
    leader (the job token of clusters is not needed: the leader sends the clusters' public key).
    ``advertise``: the data address clusters dial (default: ``bind``, or for a wildcard bind the
    address of the interface that routes to the leader)."""

    def __init__(self, leader: str, bind: str, server_token: JobToken, checkpoint_dir: str | os.PathLike,
                 keep_checkpoints: int = 3, heartbeat_s: float = 1.0, index: int | None = None,
                 checkpoint_every: int = 1, max_unsealed_pushes: int = 32,
                 advertise: str | None = None, tls: Tls | None = None, init: str | os.PathLike | None = None):
        self.leader_addr, self.bind, self.token = leader, bind, server_token
        self._init = load_initial(init) if init is not None else None
        self._init_fingerprint = (ModelLayout.of_specs([(n, tuple(t.shape)) for n, t in self._init.items()]).fingerprint
                                  if self._init is not None else None)
        self.advertise = address.advertised(bind, advertise, toward=leader)
        self.keys = KeyPair.derive(server_token, FOLLOWER_KEY_LABEL)
        self.dir = Path(checkpoint_dir)
        (self.dir / "pushes").mkdir(parents=True, exist_ok=True)
        if not 1 <= checkpoint_every <= MAX_CHECKPOINT_EVERY or keep_checkpoints < 1:
            raise ValueError(f"checkpoint_every={checkpoint_every}, keep_checkpoints={keep_checkpoints}; expected "
                             f"1 <= checkpoint_every <= {MAX_CHECKPOINT_EVERY} and keep_checkpoints >= 1")
        self.keep_checkpoints, self.heartbeat_s, self.checkpoint_every = keep_checkpoints, heartbeat_s, checkpoint_every
        # memory a cluster can make this follower hold: staged pushes (each at most its slice)
        # and queued messages (each at most MAXMSGSIZE) are bounded in number
        self.max_unsealed_pushes = max_unsealed_pushes
        meta = self.dir / "follower.json"
        self.index = index if index is not None else (json.loads(meta.read_text())["index"] if meta.exists() else None)
        self.lock = threading.RLock()
        self.version = -1
        self.ckpt_version = -1
        self.theta: dict[str, torch.Tensor] = {}
        self.momentum: dict[str, torch.Tensor] = {}
        self.bases: dict[int, dict[str, torch.Tensor]] = {}
        self.staged: dict[str, dict] = {}   # push id -> {base, cluster, units{u: {name: bf16}}, t}
        self.sealed: dict[str, dict] = {}   # push id -> {base, params{name: bf16}}
        self.applied_at: dict[str, int] = {}  # push id -> version whose checkpoint retires it
        self._stop = threading.Event()
        self._ckpt_wanted = threading.Event()  # a version worth checkpointing was applied
        self._ctx = zmq.Context()  # its own: the ZAP handler is per context
        self._threads: list[threading.Thread] = []
        handlers = {"Seal": self._seal, "Prepare": self._prepare, "Apply": self._apply,
                    "Discard": self._discard, "Status": self._status}
        self.rpc = RpcServer("dips.Follower", handlers, {n: (server_token,) for n in handlers},
                             bind=address.join(address.split(bind)[0], 0), tls=tls)
        self.ctrl = address.join(address.split(self.advertise)[0], self.rpc.port)
        self.leader = RpcClient("dips.Leader", leader, server_token, tls)
        self._register()
        self._start_data_flow()
        for fn in (self._heartbeat_loop, self._checkpoint_loop):
            self._spawn(fn)

    # ---------------------------------------------------------------- setup
    def _spawn(self, fn) -> None:
        t = threading.Thread(target=fn, daemon=True, name=f"dips-follower-{fn.__name__}")
        t.start()
        self._threads.append(t)

    def _register(self) -> None:
        """Register with the leader and load this follower's state, holding the lock throughout: the
        leader starts replaying rounds as soon as it knows the version on disk, and an Apply must
        not find the state half-loaded."""
        with self.lock:
            while not self._stop.is_set():
                try:
                    reply = self.leader.call("RegisterFollower", index=self.index, data=self.advertise,
                                             ctrl=self.ctrl, version=self._disk_version(), fingerprint=self._init_fingerprint)
                    if reply.get("status") == "ok":
                        break
                    time.sleep(self.heartbeat_s)  # "wait": a seeded PS has no model until a cluster joins
                except RpcError as exc:
                    if not exc.unavailable:
                        raise ValueError(f"the leader refused this follower: {exc}") from None
                    time.sleep(self.heartbeat_s)
            self.index = reply["index"]
            self.heartbeat_s = min(self.heartbeat_s, float(reply.get("hb", self.heartbeat_s)))  # the leader's rules
            (self.dir / "follower.json").write_text(json.dumps({"index": self.index}))
            self.opt = NesterovOuter(reply["lr"], reply["momentum"])
            if "layout" in reply:  # a seeded PS: zeros until the seeding round
                initial, self.layout = None, ModelLayout.from_wire(reply["layout"])
            else:
                initial = self._initial(reply)
                self.layout = ModelLayout.of_specs([(n, tuple(t.shape)) for n, t in initial.items()])
            self.cluster_key = reply["cluster_key"].encode()
            start, stop = reply["units"]
            self.unit_range = range(start, stop)
            if not self.theta:
                self._load_or_init(initial)
            self._init = None  # the --init file's other slices are not this follower's to keep
            log.info("follower %d owns units %s at version %d", self.index, [start, stop], self.version)

    def _disk_version(self) -> int:
        ckpts = sorted(self.dir.glob("ckpt-*.pt"))
        return int(ckpts[-1].stem.split("-")[1]) if ckpts else 0

    def _initial(self, reply: dict) -> dict[str, torch.Tensor]:
        """Version 0: the leader's LLaMA config and seed, or this follower's --init file (the
        leader checked at registration that it is the model it serves)."""
        if "model" in reply:
            return initial_parameters(reply["model"], reply["seed"])
        return self._init

    def _load_or_init(self, initial: dict[str, torch.Tensor] | None) -> None:
        ckpts = sorted(self.dir.glob("ckpt-*.pt"))
        if ckpts:
            state = torch.load(ckpts[-1], weights_only=True)
            self.theta, self.momentum = state["theta"], state["momentum"]
            self.bases = {int(v): b for v, b in state["bases"].items()}
            self.version = self.ckpt_version = int(state["version"])
        else:
            mine = [t for u in self.unit_range for t in self.layout.units[u].tensors]
            if initial is None:  # seeded PS: version 1 replaces these
                self.theta = {t.name: torch.zeros(t.shape) for t in mine}
            else:
                self.theta = {t.name: initial[t.name].float().clone() for t in mine}
            self.version = 0
            self.bases = {0: {n: t.to(WIRE_DTYPE) for n, t in self.theta.items()}}
        # pushes sealed since the checkpoint: the leader replays their rounds
        for f in sorted((self.dir / "pushes").glob("*.pt")):
            rec = torch.load(f, weights_only=True)
            self.sealed[f.stem] = {"base": int(rec["base"]), "params": rec["params"]}
        log.info("follower %d starts at version %d (%s, %d sealed pushes)", self.index, self.version,
                 ckpts[-1].name if ckpts else "initial parameters", len(self.sealed))

    # ------------------------------------------------------------- data flow
    def _start_data_flow(self) -> None:
        self._auth = Authenticator(self._ctx, ZAP_DOMAIN, [self.cluster_key])
        self._router = serving_socket(self._ctx, self.keys, ZAP_DOMAIN, tcp_endpoint(self.bind),
                                      self.layout.max_message_bytes)
        self._outbox = f"inproc://dips-follower-{id(self)}"
        depth = self.max_unsealed_pushes * len(self.unit_range)
        self._decode_q: queue.Queue = queue.Queue(maxsize=depth)
        self._encode_q: queue.Queue = queue.Queue(maxsize=depth)
        self._pull_sock = self._ctx.socket(zmq.PULL)
        self._pull_sock.bind(self._outbox)
        for fn in (self._network_loop, self._decode_loop, self._encode_loop):
            self._spawn(fn)

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
            log.warning("follower %s: malformed data message: %s", self.index, exc)
            return
        req = header.get("req")
        if not isinstance(req, str) or len(req) > MAX_ID_CHARS:
            log.warning("follower %s: data message without a request id of at most %d characters", self.index,
                        MAX_ID_CHARS)
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
                self._drop_stale_unsealed()
                continue
            try:
                self._stage(header, payload)
                reply = {"ok": True}
            except (ValueError, KeyError, TypeError) as exc:
                log.warning("follower %s rejected push unit: %s", self.index, exc)
                reply = {"ok": False, "err": str(exc)}
            reply.update(req=header.get("req"), push=header.get("push"), unit=header.get("unit"))
            out.send_multipart([ident, json.dumps(reply).encode()])
        out.close(0)

    def _stage(self, header: dict, payload) -> None:
        unit = int(header["unit"])
        if unit not in self.unit_range:
            raise ValueError(f"unit {unit} is not owned by follower {self.index} (owns {list(self.unit_range)})")
        spec = self.layout.units[unit]
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
        with self.lock:
            if base not in self.bases:
                raise ValueError(f"push {push}: base version {base} is not held (held: {sorted(self.bases)})")
            if push in self.sealed:
                raise ValueError(f"push {push} is already sealed")
            if push not in self.staged and len(self.staged) >= self.max_unsealed_pushes:
                raise ValueError(f"{len(self.staged)} pushes are staged and not sealed, the most this follower holds "
                                 "(--max-unsealed-pushes); retry later")
            rec = self.staged.setdefault(push, {"base": base, "cluster": header.get("cluster"), "units": {},
                                                "t": time.monotonic()})
            if rec["base"] != base:
                raise ValueError(f"push {push}: base {base} differs from its earlier units' base {rec['base']}")
            rec["units"][unit] = tensors

    def _drop_stale_unsealed(self) -> None:
        now = time.monotonic()
        with self.lock:
            for p in [p for p, r in self.staged.items() if now - r["t"] > STALE_UNSEALED_S]:
                log.warning("follower %s dropped unsealed push %s after %.0f s", self.index, p, STALE_UNSEALED_S)
                del self.staged[p]

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
                with self.lock:
                    params = self.bases.get(version)
                    if params is None:
                        raise ValueError(f"version {version} is not held (held: {sorted(self.bases)})")
                    for u in units:
                        if u not in self.unit_range:
                            raise ValueError(f"unit {u} is not owned by follower {self.index}")
                    tensors = [[params[t.name] for t in self.layout.units[u].tensors] for u in units]
                payload = [pack_unit(ts) for ts in tensors]
                reply.update(ok=True, version=version, units=units)
            except (ValueError, KeyError, TypeError) as exc:
                reply.update(ok=False, err=str(exc))
            out.send_multipart([ident, json.dumps(reply).encode(), *payload])
        out.close(0)

    # ---------------------------------------------------------- control flow
    def _pseudo_gradient(self, push: str) -> dict[str, torch.Tensor]:
        rec = self.sealed[push]
        base = self.bases.get(rec["base"])
        if base is None:
            raise ValueError(f"push {push}: base version {rec['base']} is no longer held")
        return {n: base[n].float() - p.float() for n, p in rec["params"].items()}

    def _seal(self, msg: dict) -> dict:
        push = str(msg["push"])
        with self.lock:
            if push in self.sealed:
                delta = self._pseudo_gradient(push)
                return {"ok": True, "norm": _norm(delta)}
            rec = self.staged.get(push)
            if rec is None:
                return {"ok": False, "err": f"follower {self.index} holds no unit of push {push}"}
            missing = [u for u in self.unit_range if u not in rec["units"]]
            if missing:
                return {"ok": False, "err": f"push {push} is partial: follower {self.index} lacks units {missing}"}
            params = {n: t for u in self.unit_range for n, t in rec["units"][u].items()}
            torch.save({"base": rec["base"], "params": params}, _tmp(self.dir / "pushes" / f"{push}.pt"))
            os.replace(_tmp(self.dir / "pushes" / f"{push}.pt"), self.dir / "pushes" / f"{push}.pt")
            del self.staged[push]
            self.sealed[push] = {"base": rec["base"], "params": params}
            return {"ok": True, "norm": _norm(self._pseudo_gradient(push))}

    def _average(self, weights: dict[str, float]) -> dict[str, torch.Tensor]:
        delta: dict[str, torch.Tensor] = {n: torch.zeros_like(t) for n, t in self.theta.items()}
        for push, w in weights.items():
            if push not in self.sealed:
                raise ValueError(f"push {push} is not sealed on follower {self.index}")
            for n, d in self._pseudo_gradient(push).items():
                delta[n].add_(d, alpha=float(w))
        return delta

    def _prepare(self, msg: dict) -> dict:
        with self.lock:
            return {"sqnorm": _norm(self._average(msg["weights"])) ** 2}

    def _apply(self, msg: dict) -> dict:
        version = int(msg["version"])
        with self.lock:
            if self.version >= version:
                return {"version": self.version}
            if self.version != version - 1:
                raise ValueError(f"follower {self.index} is at version {self.version}; cannot apply {version}")
            if msg.get("seed"):  # a seeded PS's version 1: the seeding cluster's parameters, as sent
                self._install_seed(msg["weights"])
            else:
                delta = self._average(msg["weights"])
                scale = float(msg.get("scale", 1.0))
                if scale != 1.0:
                    for d in delta.values():
                        d.mul_(scale)
                self.opt.step(self.theta, delta, self.momentum)
            self.version = version
            self.bases[version] = {n: t.to(WIRE_DTYPE) for n, t in self.theta.items()}
            for push in list(msg["weights"]) + list(msg.get("drop", [])):
                if self.sealed.pop(push, None) is not None:
                    self.applied_at[push] = version
            # A push still waiting for its round needs its base whatever the leader's list says:
            # a restarted follower replaying old rounds gets the list of the round run now.
            keep = {int(v) for v in msg.get("keep", [])} | {version}
            keep |= {rec["base"] for rec in [*self.sealed.values(), *self.staged.values()]}
            for v in [v for v in self.bases if v not in keep]:
                del self.bases[v]
        if version % self.checkpoint_every == 0:
            self._ckpt_wanted.set()
        return {"version": version}

    def _install_seed(self, weights: dict) -> None:
        if len(weights) != 1 or next(iter(weights)) not in self.sealed:
            raise ValueError(f"a seed decision names one sealed push; got {sorted(weights)[:4]}")
        params = self.sealed[next(iter(weights))]["params"]
        self.theta = {n: params[n].float() for n in self.theta}
        self.momentum = {}

    def _discard(self, msg: dict) -> dict:
        with self.lock:
            for push in msg["pushes"]:
                self.staged.pop(push, None)
                if self.sealed.pop(push, None) is not None:
                    self.applied_at[push] = self.version
        return {}

    def _status(self, msg: dict) -> dict:
        with self.lock:
            return {"version": self.version, "ckpt": self.ckpt_version, "sealed": len(self.sealed)}

    # ------------------------------------------------------- checkpointing
    def _checkpoint_loop(self) -> None:
        while not self._stop.is_set():
            if not self._ckpt_wanted.wait(0.1):
                continue
            self._ckpt_wanted.clear()
            with self.lock:  # the latest version: versions applied while the last write ran are skipped
                snap = {"version": self.version, "theta": {n: t.clone() for n, t in self.theta.items()},
                        "momentum": {n: t.clone() for n, t in self.momentum.items()},
                        "bases": {str(v): b for v, b in self.bases.items()}}
            path = self.dir / f"ckpt-{snap['version']:08d}.pt"
            torch.save(snap, _tmp(path))
            os.replace(_tmp(path), path)
            with self.lock:
                self.ckpt_version = snap["version"]
                done = [p for p, v in self.applied_at.items() if v <= snap["version"]]
                for p in done:
                    del self.applied_at[p]
            for p in done:
                (self.dir / "pushes" / f"{p}.pt").unlink(missing_ok=True)
            for old in sorted(self.dir.glob("ckpt-*.pt"))[: -self.keep_checkpoints]:
                old.unlink(missing_ok=True)

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                with self.lock:
                    v, c = self.version, self.ckpt_version
                reply = self.leader.call("FollowerHeartbeat", timeout=2.0, id=self.index, version=v, ckpt=c)
                if not reply.get("known", True):
                    self.leader.call("RegisterFollower", index=self.index, data=self.advertise,
                                     ctrl=self.ctrl, version=v)
            except RpcError:
                pass  # leader down: keep trying, never block the data flow

    def wait(self) -> None:
        while not self._stop.wait(0.5):
            pass

    def stop(self) -> None:
        self._stop.set()
        self.rpc.stop()
        for t in self._threads:
            t.join(timeout=2)
        self.leader.close()
        if hasattr(self, "_auth"):
            self._auth.stop()
        self._ctx.term()


def _norm(tensors: dict[str, torch.Tensor]) -> float:
    return float(torch.sqrt(sum((t.double() ** 2).sum() for t in tensors.values())))


def _tmp(path: Path) -> Path:
    return path.with_suffix(".tmp")
