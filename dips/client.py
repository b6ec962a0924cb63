"""OuterClient: the Di-PS side of one training cluster.

Every ``inner_steps`` calls of :meth:`OuterClient.step` (collective over the cluster's ranks) the
cluster pushes its parameters (BF16, one message per layer unit) to the followers, waits for the
round to close and pulls the new global parameters. Which rank holds which units is a
:class:`ParameterView`: in a data-parallel cluster (:class:`ReplicatedModel`) rank 0 holds every
unit; in a pipeline cluster (``ditorch.ps_pipeline.PipelineStages``) each stage's owning rank
holds its stage's units and pushes them itself, following the leader's schedule (Appendix A)
with a barrier per step.

The cluster's rank 0 is its *speaker*: it alone talks to the leader (gRPC) and tells the other
ranks what to do next (one small object broadcast over a gloo group, so the training groups'
backend does not matter). If the leader cannot be reached the outer step is skipped and inner
training goes on; the speaker reconnects in the background (heartbeats) and never blocks on a
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
from typing import Protocol

import torch
import torch.distributed as dist
import zmq

from .auth import CLUSTER_KEY_LABEL, JobToken
from .curve import KeyPair, connecting_socket, tcp_endpoint
from .layout import ModelLayout, pack_unit, unpack_unit
from .rpc import RpcClient, RpcError, Tls

log = logging.getLogger("dips.client")


class ParameterView(Protocol):
    """Where a cluster's parameters live, in the PS's full-model names.

    ``worker``: the id this rank pushes and pulls as (ranks with the same id must not exist; None:
    it holds no unit itself). ``group``: the cluster's process group (None: the default group, or a
    single process). ``full`` and ``install`` are collective over the cluster.
    """

    worker: int | None
    group: object

    def specs(self) -> list[tuple[str, tuple[int, ...]]]:
        """This worker's tensors, full names and full shapes, in model order ([] on non-workers)."""

    def full(self) -> dict[str, torch.Tensor]:
        """This worker's tensors, whole (TP shards gathered), on the CPU; {} on other ranks."""

    def install(self, new: dict[str, torch.Tensor]) -> None:
        """Make every rank's parameters the worker's ``new`` full values (others pass {})."""

    def cluster_tokens(self, pending: int) -> int:
        """Tokens the cluster consumed, from each rank's ``pending`` count."""


class ReplicatedModel:
    """A data-parallel cluster (or one process): every rank holds the whole model; rank 0 pushes."""

    def __init__(self, model: torch.nn.Module, group=None):
        self.model, self.group = model, group
        self.distributed = dist.is_available() and dist.is_initialized()
        self.size = dist.get_world_size(group) if self.distributed else 1
        self.worker = 0 if not self.distributed or dist.get_rank(group) == 0 else None
        self.params = dict(model.named_parameters())

    def specs(self) -> list[tuple[str, tuple[int, ...]]]:
        return [(n, tuple(p.shape)) for n, p in self.params.items()] if self.worker == 0 else []

    def full(self) -> dict[str, torch.Tensor]:
        if self.worker != 0:
            return {}
        return {n: p.detach().to("cpu", torch.float32, copy=True) for n, p in self.params.items()}

    @torch.no_grad()
    def install(self, new: dict[str, torch.Tensor]) -> None:
        src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        for n, p in self.params.items():
            if self.worker == 0:
                p.copy_(new[n].to(p.dtype))
            if self.size > 1:
                dist.broadcast(p.data, src=src, group=self.group)

    def cluster_tokens(self, pending: int) -> int:
        if self.size == 1:
            return pending
        t = torch.tensor([pending], dtype=torch.int64)
        dist.all_reduce(t, group=self.group)
        return int(t.item())


class OuterClient:
    """Asynchronous outer optimization of a cluster's model through a Di-PS leader.

    ``model``: an ``nn.Module`` (a data-parallel cluster over ``process_group``: default the
    default group when torch.distributed is initialized, else one process) or a
    :class:`ParameterView` (e.g. a pipeline cluster's stages). ``name``: a stable cluster id (a
    restarted cluster keeps its identity). Construction is collective over the cluster's ranks.
    """

    def __init__(self, model, leader: str, inner_steps: int,
                 token_file: str | os.PathLike | None = None, token: JobToken | None = None,
                 name: str | None = None, process_group=None, heartbeat_s: float = 0.5,
                 round_timeout_s: float = 60.0, transfer_timeout_s: float = 30.0, join: bool = True,
                 tls: Tls | None = None):
        if inner_steps < 1:
            raise ValueError(f"inner_steps={inner_steps}; expected >= 1")
        if (token is None) == (token_file is None):
            raise ValueError("give exactly one of token_file or token")
        self.view: ParameterView = ReplicatedModel(model, process_group) if isinstance(model, torch.nn.Module) else model
        self.model, self.inner_steps, self.name = model, inner_steps, name
        self.token = token or JobToken.from_file(token_file)
        self.distributed = dist.is_available() and dist.is_initialized()
        group = self.view.group
        self.many = self.distributed and dist.get_world_size(group) > 1
        # control decisions travel over gloo whatever the training groups' backend (dicomm, nccl)
        self._ctl = dist.new_group(dist.get_process_group_ranks(group) if group is not None else None,
                                   backend="gloo") if self.many else None
        self._speaker_rank = dist.get_global_rank(self._ctl, 0) if self.many else 0
        self.rank = dist.get_rank(self._ctl) if self.many else 0
        self.layout, self.workers = self._gather_layout()
        self.my_units = self.workers.get(self.view.worker, []) if self.view.worker is not None else []
        self.params = self.view.params if isinstance(self.view, ReplicatedModel) else {}  # a one-process model's
        self.heartbeat_s, self.round_timeout_s, self.transfer_timeout_s = heartbeat_s, round_timeout_s, transfer_timeout_s
        self.inner_count = 0
        self.tokens_pending = 0      # tokens consumed since the last sealed push
        self._cluster_tokens = 0     # the whole cluster's, counted at an outer step
        self.tokens_total = 0
        self.done = False            # the leader's token budget is spent
        self.cluster_id: str | None = None
        self.base = -1
        self.plan: dict = {}
        self.pending: str | None = None                  # sealed push awaiting its fate (speaker)
        self._snapshot: dict[str, torch.Tensor] = {}     # this worker's units as pushed (BF16)
        self.stats = {"pushed": 0, "failed": 0, "skipped": 0, "applied": 0, "rejected": 0, "push_s": 0.0,
                      "wait_s": 0.0, "pull_s": 0.0}
        self._last_pull_s = 0.0
        self._req = itertools.count()
        self._leader_up = threading.Event()
        self._stop = threading.Event()
        self._ctx = zmq.Context.instance()
        self._keys = KeyPair.derive(self.token, CLUSTER_KEY_LABEL)
        self._socks: dict[str, zmq.Socket] = {}
        if self.rank == 0:
            self.leader = RpcClient("dips.Leader", leader, self.token, tls)
            self._hb = threading.Thread(target=self._heartbeat_loop, daemon=True, name="dips-client-heartbeat")
            self._hb.start()
        if join:
            self._round(self._join)

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
        self._cluster_tokens = self.view.cluster_tokens(self.tokens_pending)
        return self._round(self._outer_step)

    def join(self, timeout_s: float = 30.0) -> bool:
        """(Re)join the PS, retrying until ``timeout_s``; collective over the cluster's ranks.

        Returns True once the model holds the global parameters of its base version.
        """
        deadline = time.monotonic() + timeout_s
        while True:  # a seeding push still waiting for its round is resolved, not pushed again
            joined = self._round(self._join if self.pending is None else self._outer_step)
            give_up = self._share(time.monotonic() > deadline)
            if joined or give_up:
                return joined
            time.sleep(0.2)

    def close(self, leave: bool = True) -> None:
        """Stop heartbeating and, with ``leave``, tell the leader the cluster departs (best
        effort) so rounds stop counting on it at once; a cluster that just stops is removed once
        its heartbeats lapse."""
        self._stop.set()
        if self.rank == 0:
            self._hb.join(timeout=2)
            if leave and self.cluster_id is not None:
                try:
                    self.leader.call("Leave", timeout=2.0, id=self.cluster_id)
                except RpcError as exc:
                    log.warning("could not tell the leader that cluster %s leaves: %s", self.cluster_id, exc)
            self.leader.close()
        for s in self._socks.values():
            s.close(0)

    # ------------------------------------------------------- cluster ranks
    def _share(self, obj):
        """The speaker's ``obj`` on every rank of the cluster."""
        if not self.many:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=self._speaker_rank, group=self._ctl)
        return box[0]

    def _all_ok(self, ok: bool) -> bool:
        if not self.many:
            return ok
        flags = [None] * dist.get_world_size(self._ctl)
        dist.all_gather_object(flags, bool(ok), group=self._ctl)
        return all(flags)

    def _gather_layout(self) -> tuple[ModelLayout, dict[int, list[int]]]:
        """The full model's layout from every worker's tensors, and which worker holds which units."""
        mine = (self.view.worker, self.view.specs())
        if self.many:
            held = [None] * dist.get_world_size(self._ctl)
            dist.all_gather_object(held, mine, group=self._ctl)
        else:
            held = [mine]
        held = sorted((w, s) for w, s in held if w is not None)
        ids = [w for w, _ in held]
        if len(set(ids)) != len(ids):
            raise ValueError(f"worker ids {ids}: each worker must be one rank")
        layout = ModelLayout.of_specs([spec for _, specs in held for spec in specs])
        owner = {name: w for w, specs in held for name, _ in specs}
        workers: dict[int, list[int]] = {}
        for i, unit in enumerate(layout.units):
            holders = {owner[t.name] for t in unit.tensors}
            if len(holders) != 1:
                raise ValueError(f"unit {unit.name} is split over workers {sorted(holders)}; a unit must be held whole")
            workers.setdefault(holders.pop(), []).append(i)
        return layout, workers

    def _round(self, control) -> bool:
        """One outer step on every rank: the speaker runs ``control`` (leader RPCs) and the ranks
        carry out the tasks it hands them. Returns True when parameters were replaced."""
        task = self._share(control() if self.rank == 0 else None)
        self.done = task["done"]
        if task.get("consumed"):  # the tokens counted so far went into a sealed push (or a join)
            self.tokens_pending = 0
        if task["do"] == "push":
            sent = self._all_ok(self._push_units(task))
            sealed = self._share(self._seal(task["push"], sent) if self.rank == 0 else None)
            if not sealed:
                self._snapshot = {}
                return False
            self.tokens_pending = 0
            task = self._share(self._resolve(self.round_timeout_s) if self.rank == 0 else None)
            self.done = task["done"]
        if task["do"] == "drop":
            self._snapshot = {}
        if task["do"] != "pull":
            return False
        self.plan = task["plan"]
        new = self._pull_units(task["version"], task["merge"])
        if not self._all_ok(new is not None):
            return False
        self.view.install(new)
        self.base = task["version"]
        if task["merge"]:
            self._snapshot = {}
        return True

    def _push_units(self, task: dict) -> bool:
        """This worker's units, sent in the schedule's steps with a barrier after each."""
        self.plan = task["plan"]
        full = self.view.full()
        self._snapshot = {n: t.to(torch.bfloat16) for n, t in full.items()}
        one_worker = len(self.workers) == 1
        ok, waiting = True, {}
        for step in task["schedule"]:
            for worker, unit, follower in step:
                if worker == self.view.worker:
                    waiting.setdefault(self.plan["followers"][follower], set()).add(
                        self._send_unit(task, unit, self.plan["followers"][follower]))
            if not one_worker:  # pairs of a step must not collide with the next step's
                ok = self._await_acks(task["push"], waiting) and ok
                waiting = {}
                dist.barrier(group=self._ctl)
        return self._await_acks(task["push"], waiting) and ok

    def _send_unit(self, task: dict, unit: int, address: str) -> str:
        spec = self.layout.units[unit]
        req = f"{task['push']}:{unit}"
        self._sock(address).send_multipart([
            self._header(op="push", push=task["push"], cluster=task["cluster"], base=task["base"], unit=unit,
                         names=[t.name for t in spec.tensors], shapes=[list(t.shape) for t in spec.tensors],
                         dtype="bfloat16", req=req),
            pack_unit([self._snapshot[t.name] for t in spec.tensors])], copy=False)
        return req

    def _await_acks(self, push: str, waiting: dict[str, set]) -> bool:
        ok = True
        for address, reqs in waiting.items():
            for reply, _ in self._replies(address, reqs):
                if not reply.get("ok"):
                    log.warning("follower %s refused unit %s of push %s: %s", address, reply.get("unit"), push,
                                reply.get("err"))
                    ok = False
            if reqs:
                log.warning("follower %s did not acknowledge %d units of push %s", address, len(reqs), push)
                ok = False
        return ok

    def _pull_units(self, version: int, merge: bool) -> dict[str, torch.Tensor] | None:
        """This worker's units at ``version`` (merged with inner progress since the push); None
        when a pull failed. Collective (the merge reads the current parameters)."""
        local = self.view.full() if merge else {}
        if self.view.worker is None:
            return {}
        new = self._pull(version, self.my_units)
        if new is None:
            return None
        if merge:
            for n in new:
                new[n] = new[n] + (local[n] - self._snapshot[n].float())
        return new

    # ------------------------------------------------------- speaker only
    def _task(self, do: str, **fields) -> dict:
        return {"do": do, "done": self.done, **fields}

    def _heartbeat_loop(self) -> None:
        while not self._stop.is_set():
            try:
                if self.cluster_id is not None:
                    reply = self.leader.call("Heartbeat", timeout=1.0, id=self.cluster_id)
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

    def _join(self) -> dict:
        try:
            reply = self.leader.call("RegisterCluster", timeout=2.0, name=self.name,
                                     fingerprint=self.layout.fingerprint)
            if reply["status"] == "layout":  # a PS seeded from its first cluster has no model yet
                reply = self.leader.call("RegisterCluster", timeout=2.0, name=self.name,
                                         fingerprint=self.layout.fingerprint, layout=self.layout.to_wire())
        except RpcError as exc:
            if not exc.unavailable:
                raise
            log.info("leader unreachable; training on without it for now")
            return self._task("none")
        if reply["status"] != "ok":
            return self._task("none")
        self._leader_up.set()
        self.cluster_id = reply["id"]
        self.heartbeat_s = min(self.heartbeat_s, float(reply["hb"]))  # the leader's interval rules
        self.pending = None
        if reply.get("seed"):  # this cluster's parameters become the PS's version 1: push them, pull that
            log.info("cluster %s seeds the PS with its parameters", self.cluster_id)
            self.base, self.plan = int(reply["version"]), _data_plan(reply)
            return self._request_push()
        return self._task("pull", version=int(reply["version"]), merge=False, plan=_data_plan(reply),
                          consumed=True)

    def _outer_step(self) -> dict:
        if not self._leader_up.is_set():
            self.stats["skipped"] += 1
            return self._task("none")
        try:
            if self.cluster_id is None:
                return self._join()
            if self.pending is not None:
                task = self._resolve(timeout=0.0)
                if self.pending is not None:
                    self.stats["skipped"] += 1
                    return task
                if task["do"] == "pull":
                    return task
            return self._request_push()
        except RpcError as exc:
            log.warning("outer step skipped: %s", exc)
            self.stats["skipped"] += 1
            return self._task("none")

    def _request_push(self) -> dict:
        self._t_push = time.monotonic()
        workers = {str(w): units for w, units in self.workers.items()}
        reply = self.leader.call("PushRequest", id=self.cluster_id, tokens=self._cluster_tokens, base=self.base,
                                 workers=workers, pull_s=self._last_pull_s)
        if reply["status"] == "unknown":
            self.cluster_id = None
            return self._join()
        if reply["status"] == "done":
            self.done = True
            return self._task("none")
        if reply["status"] != "ok":
            self.stats["skipped"] += 1
            return self._task("none")
        return self._task("push", push=reply["push"], schedule=reply["schedule"], base=self.base,
                          cluster=self.cluster_id, plan=_data_plan(reply))

    def _seal(self, push: str, sent: bool) -> bool:
        if not sent:
            self.stats["failed"] += 1
            return False
        try:
            done = self.leader.call("PushDone", id=self.cluster_id, push=push)
        except RpcError as exc:
            log.warning("push %s: %s", push, exc)
            done = {"status": "unknown", "err": str(exc)}
        self.stats["push_s"] += time.monotonic() - self._t_push
        if done["status"] != "sealed":
            log.warning("push %s not accepted: %s", push, done.get("err"))
            self.stats["failed"] += 1
            return False
        self.stats["pushed"] += 1
        self.pending = push
        return True

    def _resolve(self, timeout: float) -> dict:
        """Learn the fate of the pending push: a pull-and-merge task once it has a result."""
        t0 = time.monotonic()
        try:
            fate = self.leader.call("WaitPush", timeout=timeout + 5.0, push=self.pending, wait=timeout)
        except RpcError as exc:
            log.warning("waiting for push %s: %s", self.pending, exc)
            return self._task("none")
        self.stats["wait_s"] += time.monotonic() - t0
        self.done = self.done or bool(fate.get("done"))
        if fate["state"] == "pending":
            return self._task("none")
        self.pending = None
        if fate["state"] in ("unknown", "failed"):
            return self._task("drop")  # never sealed: its progress is still local and goes into the next push
        self.stats[fate["state"]] += 1
        return self._task("pull", version=int(fate["version"]), merge=True, plan=self.plan)

    # ------------------------------------------------------------- data flow
    def _sock(self, address: str) -> zmq.Socket:
        s = self._socks.get(address)
        if s is None:
            s = self._socks[address] = connecting_socket(self._ctx, self.plan["key"].encode(), self._keys,
                                                         tcp_endpoint(address), self.layout.max_message_bytes)
        return s

    def fetch_global(self) -> int | None:
        """Load the latest complete global parameters into a one-process model (no outer step)."""
        if not isinstance(self.view, ReplicatedModel) or self.many:
            raise ValueError("fetch_global reads the whole model into one process: give the client an nn.Module "
                             "and no process group")
        st = self.leader.call("Plan")
        self.plan = _data_plan(st)
        new = self._pull(int(st["version"]), range(len(self.layout.units)))
        if new is None:
            return None
        with torch.no_grad():
            for n, p in self.params.items():
                p.copy_(new[n].to(p.dtype))
        return int(st["version"])

    def _header(self, **fields) -> bytes:
        return json.dumps(fields).encode()

    def _replies(self, address: str, reqs: set):
        """Yield (header, payload frames) for the awaited request ids until all came or time ran out."""
        sock = self._sock(address)
        deadline = time.monotonic() + self.transfer_timeout_s
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

    def _pull(self, version: int, units) -> dict[str, torch.Tensor] | None:
        """``units`` at ``version`` from the followers that own them, as FP32."""
        t0 = time.monotonic()
        out: dict[str, torch.Tensor] = {}
        wanted = set(units)
        for i, (address, (start, stop)) in enumerate(zip(self.plan["followers"], self.plan["units"])):
            mine = [u for u in range(start, stop) if u in wanted]
            if not mine:
                continue
            req = f"pull:{version}:{i}:{next(self._req)}"
            self._sock(address).send_multipart([self._header(op="pull", version=version, units=mine, req=req)])
            got = list(self._replies(address, {req}))
            if not got or not got[0][0].get("ok") or len(got[0][1]) != len(mine):
                log.warning("pull of version %d from %s failed: %s", version, address,
                            got[0][0].get("err") if got else "timeout")
                return None
            for unit, payload in zip(mine, got[0][1]):
                out.update(unpack_unit(self.layout.units[unit], payload))
        self._last_pull_s = time.monotonic() - t0
        self.stats["pull_s"] += self._last_pull_s
        return {n: t.float() for n, t in out.items()}


def _data_plan(reply: dict) -> dict:
    """The part of a leader reply the ranks need to move units: followers, their units, their key."""
    return {k: reply[k] for k in ("followers", "units", "key")}
