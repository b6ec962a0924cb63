"""OuterClient: the Di-PS side of one training cluster.

Every ``inner_steps`` calls of :meth:`OuterClient.step`, rank 0 of the cluster pushes its
parameters (BF16, one message per layer unit, in the leader's schedule order) to the followers,
waits for the round to close and pulls the new global parameters, which it broadcasts to the
other data-parallel ranks. If the leader cannot be reached the outer step is skipped and inner
training goes on; the client reconnects in the background (heartbeats) and never blocks on a
dead leader. A push whose fate is unknown (the leader died after sealing it) is resolved later:
its result is merged as theta_new + (theta_local - theta_pushed), so inner steps taken since are
kept and nothing is counted twice.
"""
from __future__ import annotations

import itertools
import json
import logging
import os
import threading
import time

import torch
import torch.distributed as dist
import zmq

from .auth import CLUSTER_KEY_LABEL, JobToken
from .curve import KeyPair, connecting_socket, tcp_endpoint
from .layout import ModelLayout, pack_unit, unpack_unit
from .rpc import RpcClient, RpcError, Tls

log = logging.getLogger("dips.client")


class OuterClient:
    """Asynchronous outer optimization of ``model`` through a Di-PS leader.

    ``process_group``: the cluster's data-parallel group (default: the default group when
    torch.distributed is initialized, else a single-process cluster). Only its rank 0 talks to
    the PS. ``name``: a stable cluster id (a restarted cluster keeps its identity).
    """

    def __init__(self, model: torch.nn.Module, leader: str, inner_steps: int,
                 token_file: str | os.PathLike | None = None, token: JobToken | None = None,
                 name: str | None = None, process_group=None, heartbeat_s: float = 0.5,
                 round_timeout_s: float = 60.0, transfer_timeout_s: float = 30.0, join: bool = True,
                 tls: Tls | None = None):
        if inner_steps < 1:
            raise ValueError(f"inner_steps={inner_steps}; expected >= 1")
        if (token is None) == (token_file is None):
            raise ValueError("give exactly one of token_file or token")
        self.model, self.inner_steps, self.name = model, inner_steps, name
        self.token = token or JobToken.from_file(token_file)
        self.group = process_group
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank(process_group) if self.distributed else 0
        self.layout = ModelLayout.of(model)
        self.params = dict(model.named_parameters())
        self.heartbeat_s, self.round_timeout_s, self.transfer_timeout_s = heartbeat_s, round_timeout_s, transfer_timeout_s
        self.inner_count = 0
        self.tokens_pending = 0      # tokens consumed since the last sealed push
        self.tokens_total = 0
        self.done = False            # the leader's token budget is spent
        self.cluster_id: str | None = None
        self.base = -1
        self.pending: tuple[str, dict[str, torch.Tensor]] | None = None  # sealed push awaiting its fate
        self.stats = {"pushed": 0, "failed": 0, "skipped": 0, "applied": 0, "rejected": 0, "push_s": 0.0,
                      "wait_s": 0.0, "pull_s": 0.0}
        self._last_pull_s = 0.0
        self._req = itertools.count()
        self._leader_up = threading.Event()
        self._stop = threading.Event()
        if self.rank == 0:
            self.leader = RpcClient("dips.Leader", leader, self.token, tls)
            self._keys = KeyPair.derive(self.token, CLUSTER_KEY_LABEL)
            self._ctx = zmq.Context.instance()
            self._socks: dict[str, zmq.Socket] = {}
            self._hb = threading.Thread(target=self._heartbeat_loop, daemon=True, name="dips-client-heartbeat")
            self._hb.start()
        if join:
            self._collective(self._join if self.rank == 0 else None)

    # ----------------------------------------------------------- training API
    def step(self, tokens: int = 0) -> bool:
        """Count one inner step (``tokens`` consumed on this rank); every H steps run the outer step.

        Returns True when the model's parameters were replaced by new global ones.
        """
        self.inner_count += 1
        self.tokens_pending += int(tokens)
        self.tokens_total += int(tokens)
        if self.inner_count % self.inner_steps:
            return False
        if self.distributed and dist.get_world_size(self.group) > 1:
            t = torch.tensor([self.tokens_pending], dtype=torch.int64)
            dist.all_reduce(t, group=self.group)
            self._cluster_tokens = int(t.item())
        else:
            self._cluster_tokens = self.tokens_pending
        return self._collective(self._outer_step if self.rank == 0 else None)

    def join(self, timeout_s: float = 30.0) -> bool:
        """(Re)join the PS, retrying until ``timeout_s``; collective over the cluster's ranks.

        Returns True once the model holds the global parameters of its base version.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            joined = self._collective(self._join if self.rank == 0 else None)
            flag = torch.tensor([joined or time.monotonic() > deadline], dtype=torch.int64)
            if self.distributed and dist.get_world_size(self.group) > 1:
                dist.broadcast(flag, src=dist.get_global_rank(self.group, 0) if self.group else 0, group=self.group)
            if flag[0]:
                return joined
            time.sleep(0.2)

    def close(self) -> None:
        self._stop.set()
        if self.rank == 0:
            self._hb.join(timeout=2)
            for s in self._socks.values():
                s.close(0)
            self.leader.close()

    # ---------------------------------------------------------------- ranks
    def _collective(self, fn) -> bool:
        """Run ``fn`` on rank 0 (it returns new parameters or None) and share the result."""
        self._consumed = False
        new = fn() if fn is not None else None
        flag = torch.tensor([new is not None, self.done, self._consumed], dtype=torch.int64)
        many = self.distributed and dist.get_world_size(self.group) > 1
        if many:
            dist.broadcast(flag, src=dist.get_global_rank(self.group, 0) if self.group else 0, group=self.group)
            self.done = bool(flag[1])
        if flag[2]:  # the tokens counted so far went into a sealed push (or were dropped on join)
            self.tokens_pending = 0
        if flag[0]:
            with torch.no_grad():
                for n, p in self.params.items():
                    if new is not None:
                        p.copy_(new[n].to(p.dtype))
                    if many:
                        dist.broadcast(p.data, src=dist.get_global_rank(self.group, 0) if self.group else 0,
                                       group=self.group)
        return bool(flag[0])

    # ---------------------------------------------------------- rank 0 only
    def _heartbeat_loop(self) -> None:
        while not self._stop.is_set():
            try:
                if self.cluster_id is not None:
                    reply = self.leader.call("Heartbeat", timeout=1.0, kind="cluster", id=self.cluster_id)
                    if not reply.get("known"):
                        log.warning("cluster %s is unknown to the leader; it will re-join", self.cluster_id)
                        self.cluster_id = None
                    self.done = self.done or bool(reply.get("done"))
                else:
                    self.leader.call("Status", timeout=1.0)
                self._leader_up.set()
            except RpcError:
                self._leader_up.clear()
            self._stop.wait(self.heartbeat_s)

    def _join(self) -> dict[str, torch.Tensor] | None:
        try:
            reply = self.leader.call("RegisterCluster", timeout=2.0, name=self.name,
                                     fingerprint=self.layout.fingerprint)
        except RpcError as exc:
            if not exc.unavailable:
                raise
            log.info("leader unreachable; training on without it for now")
            return None
        if reply["status"] != "ok":
            return None
        self._leader_up.set()
        self.cluster_id, self.plan = reply["id"], reply
        self.heartbeat_s = min(self.heartbeat_s, float(reply["hb"]))  # the leader's interval rules
        self.pending = None
        self._consumed = True
        new = self._pull(int(reply["version"]))
        if new is not None:
            self.base = int(reply["version"])
        return new

    def _outer_step(self) -> dict[str, torch.Tensor] | None:
        if not self._leader_up.is_set():
            self.stats["skipped"] += 1
            return None
        try:
            if self.cluster_id is None:
                return self._join()
            if self.pending is not None:
                new = self._resolve(timeout=0.0)
                if self.pending is not None:
                    self.stats["skipped"] += 1
                    return None
                if new is not None:
                    return new
            return self._push_and_pull()
        except RpcError as exc:
            log.warning("outer step skipped: %s", exc)
            self.stats["skipped"] += 1
            return None

    def _push_and_pull(self) -> dict[str, torch.Tensor] | None:
        t0 = time.monotonic()
        reply = self.leader.call("PushRequest", id=self.cluster_id, tokens=self._cluster_tokens, base=self.base,
                                 workers={"0": list(range(len(self.layout.units)))}, pull_s=self._last_pull_s)
        if reply["status"] == "unknown":
            self.cluster_id = None
            return self._join()
        if reply["status"] == "done":
            self.done = True
            return None
        if reply["status"] != "ok":
            self.stats["skipped"] += 1
            return None
        push = reply["push"]
        snapshot = {n: p.detach().to("cpu", torch.bfloat16) for n, p in self.params.items()}
        if not self._send(push, reply["schedule"], snapshot):
            self.stats["failed"] += 1
            return None
        done = self.leader.call("PushDone", id=self.cluster_id, push=push)
        self.stats["push_s"] += time.monotonic() - t0
        if done["status"] != "sealed":
            log.warning("push %s not accepted: %s", push, done.get("err"))
            self.stats["failed"] += 1
            return None
        self.stats["pushed"] += 1
        self.pending = (push, snapshot)
        self._consumed = True
        return self._resolve(timeout=self.round_timeout_s)

    def _resolve(self, timeout: float) -> dict[str, torch.Tensor] | None:
        """Learn the fate of the pending push; on a result, pull and merge the new parameters."""
        push, snapshot = self.pending
        t0 = time.monotonic()
        try:
            fate = self.leader.call("WaitPush", timeout=timeout + 5.0, push=push, wait=timeout)
        except RpcError as exc:
            log.warning("waiting for push %s: %s", push, exc)
            return None
        self.stats["wait_s"] += time.monotonic() - t0
        self.done = self.done or bool(fate.get("done"))
        if fate["state"] == "pending":
            return None
        self.pending = None
        if fate["state"] in ("unknown", "failed"):
            return None  # never sealed: its progress is still local and goes into the next push
        self.stats[fate["state"]] += 1
        new = self._pull(int(fate["version"]))
        if new is None:
            return None
        self.base = int(fate["version"])
        with torch.no_grad():
            for n, p in self.params.items():
                local = p.detach().to("cpu", torch.float32)
                new[n] = new[n].float() + (local - snapshot[n].float())
        return new

    # ------------------------------------------------------------- data flow
    def _sock(self, address: str) -> zmq.Socket:
        s = self._socks.get(address)
        if s is None:
            s = self._socks[address] = connecting_socket(self._ctx, self.plan["key"].encode(), self._keys,
                                                         tcp_endpoint(address), self.layout.max_message_bytes)
        return s

    def fetch_global(self) -> int | None:
        """Load the latest complete global parameters into the model (rank 0, no outer step)."""
        st = self.leader.call("Plan")
        self.plan = st
        new = self._pull(int(st["version"]))
        if new is None:
            return None
        with torch.no_grad():
            for n, p in self.params.items():
                p.copy_(new[n].to(p.dtype))
        return int(st["version"])

    def _header(self, **fields) -> bytes:
        return json.dumps(fields).encode()

    def _send(self, push: str, schedule: list, snapshot: dict[str, torch.Tensor]) -> bool:
        followers = self.plan["followers"]
        expected: dict[str, set] = {}
        for step in schedule:
            for worker, unit, follower in step:
                if worker != 0:
                    continue  # other workers (PP stages) send their own units
                spec = self.layout.units[unit]
                tensors = [snapshot[t.name] for t in spec.tensors]
                req = f"{push}:{unit}"
                self._sock(followers[follower]).send_multipart([
                    self._header(op="push", push=push, cluster=self.cluster_id, base=self.base, unit=unit,
                                 names=[t.name for t in spec.tensors], shapes=[list(t.shape) for t in spec.tensors],
                                 dtype="bfloat16", req=req),
                    pack_unit(tensors)], copy=False)
                expected.setdefault(followers[follower], set()).add(req)
        ok = True
        for address, reqs in expected.items():
            for reply, _ in self._replies(address, reqs):
                if not reply.get("ok"):
                    log.warning("follower %s refused unit %s of push %s: %s", address, reply.get("unit"), push,
                                reply.get("err"))
                    ok = False
            if reqs:
                log.warning("follower %s did not acknowledge %d units of push %s", address, len(reqs), push)
                ok = False
        return ok

    def _replies(self, address: str, reqs: set):
        """Yield (header, payload frames) for the awaited request ids until all came or time ran out."""
        sock = self._sock(address)
        deadline = time.monotonic() + self.transfer_timeout_s
        while reqs and time.monotonic() < deadline:
            if not sock.poll(int(max(1, (deadline - time.monotonic()) * 1000))):
                break
            frames = sock.recv_multipart()
            header = json.loads(frames[0])
            if header.get("req") in reqs:  # replies to abandoned requests are dropped
                reqs.discard(header["req"])
                yield header, frames[1:]

    def _pull(self, version: int) -> dict[str, torch.Tensor] | None:
        t0 = time.monotonic()
        out: dict[str, torch.Tensor] = {}
        for i, (address, (start, stop)) in enumerate(zip(self.plan["followers"], self.plan["units"])):
            req = f"pull:{version}:{i}:{next(self._req)}"
            units = list(range(start, stop))
            self._sock(address).send_multipart([self._header(op="pull", version=version, units=units, req=req)])
            got = list(self._replies(address, {req}))
            if not got or not got[0][0].get("ok"):
                log.warning("pull of version %d from %s failed: %s", version, address,
                            got[0][0].get("err") if got else "timeout")
                return None
            for unit, payload in zip(units, got[0][1]):
                out.update(unpack_unit(self.layout.units[unit], payload))
        self._last_pull_s = time.monotonic() - t0
        self.stats["pull_s"] += self._last_pull_s
        return {n: t.float() for n, t in out.items()}
