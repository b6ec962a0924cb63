"""A cluster's voice to the Di-PS leader (gRPC), run by the cluster's rank 0 alone: registration,
heartbeats, push requests, sealing and the fates of pushes, each turned into a *task* for the
cluster's ranks (``none``, ``push``, ``pull``, ``drop``). If the leader cannot be reached the
outer step is skipped and inner training goes on; heartbeats reconnect in the background and
nothing blocks on a dead leader."""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from .auth import JobToken
from .layout import ModelLayout
from .rpc import RpcClient, RpcError, Tls

log = logging.getLogger("dips.client")
# A leader that is gone refuses at once; one that is slow (a loaded host) may take a few seconds,
# and an outer step skipped for a late heartbeat loses that round's progress for nothing.
HEARTBEAT_TIMEOUT_S = 5.0


class LeaderSpeaker:
    """Speaks for the cluster ``name`` (None: the leader names it) whose model is ``layout``, held
    by ``workers`` (worker -> units). ``pull_seconds`` gives the latest pull's time (the leader
    schedules around it); ``stats`` are the client's counters."""

    def __init__(self, leader: str, token: JobToken, tls: Tls | None, name: str | None, layout: ModelLayout,
                 workers: dict[int, list[int]], heartbeat_s: float, stats: dict, pull_seconds: Callable[[], float]):
        self.leader = RpcClient("dips.Leader", leader, token, tls)
        self.name, self.layout, self.workers, self.heartbeat_s = name, layout, workers, heartbeat_s
        self.stats, self._pull_seconds = stats, pull_seconds
        self.cluster_id: str | None = None
        self.secret: str | None = None  # the leader's proof that calls for cluster_id come from us
        self.base = -1               # the global version the cluster's parameters started from
        self.plan: dict = {}         # the leader's data plan: followers, their units, their key
        self.pending: str | None = None  # a sealed push awaiting its fate
        self.done = False            # the leader's token budget is spent
        self.cluster_tokens = 0      # the whole cluster's tokens for the next push
        self._t_push = 0.0
        self._leader_up = threading.Event()
        self._stop = threading.Event()
        self._hb = threading.Thread(target=self._heartbeat_loop, daemon=True, name="dips-client-heartbeat")
        self._hb.start()

    def finish(self, timeout: float) -> dict | None:
        """The fate of the pending push (None: no push pending), waiting up to ``timeout`` seconds
        for its round; nothing is pulled. A push whose fate is unknown at the bound is reported
        as ``pending``: the leader still holds it sealed and may commit it after the cluster left."""
        if self.pending is None:
            return None
        push, deadline = self.pending, time.monotonic() + timeout
        while True:  # WaitPush waits 30 s at most per call
            left = deadline - time.monotonic()
            try:
                fate = self.leader.call("WaitPush", timeout=max(left, 0.0) + 5.0, push=push, wait=max(left, 0.0))
            except RpcError as exc:
                log.warning("waiting for push %s at close: %s", push, exc)
                return {"push": push, "state": "pending"}
            if fate["state"] != "pending" or left <= 0:
                break
        if fate["state"] != "pending":
            self.pending = None
            if fate["state"] in ("applied", "rejected"):
                self.stats[fate["state"]] += 1
        return {"push": push, **fate}

    def close(self, leave: bool) -> None:
        """Stop heartbeating and, with ``leave``, tell the leader the cluster departs (best effort)."""
        self._stop.set()
        self._hb.join(timeout=2)
        if leave and self.cluster_id is not None:
            try:
                self.leader.call("Leave", timeout=2.0, **self._me())
            except RpcError as exc:
                log.warning("could not tell the leader that cluster %s leaves: %s", self.cluster_id, exc)
        self.leader.close()

    def task(self, do: str, **fields) -> dict:
        return {"do": do, "done": self.done, "cluster": self.cluster_id, **fields}

    def pulled(self, version: int) -> None:
        """The cluster's parameters are now the global ones of ``version``."""
        self.base = version

    def _heartbeat_loop(self) -> None:
        while not self._stop.is_set():
            try:
                if self.cluster_id is not None:
                    reply = self.leader.call("Heartbeat", timeout=HEARTBEAT_TIMEOUT_S, **self._me())
                    if not reply.get("known"):
                        log.warning("cluster %s is unknown to the leader; it will re-join", self.cluster_id)
                        self.cluster_id = None
                    self.done = self.done or bool(reply.get("done"))
                else:
                    self.leader.call("Status", timeout=HEARTBEAT_TIMEOUT_S)
                self._leader_up.set()
            except RpcError:
                self._leader_up.clear()
            self._stop.wait(self.heartbeat_s)

    def _me(self) -> dict:
        """The fields that say which cluster calls: its id and the secret it registered with."""
        return {"id": self.cluster_id, "secret": self.secret}

    def join(self) -> dict:
        """Register the cluster: a pull of the global parameters, or (seeding a PS that has no
        model yet) a push of this cluster's."""
        mine = {"name": self.name, "fingerprint": self.layout.fingerprint}
        if self.secret is not None:
            mine["secret"] = self.secret  # re-joining under our name
        try:
            reply = self.leader.call("RegisterCluster", timeout=2.0, **mine)
            if reply["status"] == "layout":  # a PS seeded from its first cluster has no model yet
                reply = self.leader.call("RegisterCluster", timeout=2.0, **mine, layout=self.layout.to_wire())
        except RpcError as exc:
            if exc.code == "PERMISSION_DENIED" and self.name is not None:
                log.warning("%s; joining later", exc)  # our name's earlier holder has not lapsed yet
                return self.task("none")
            if not exc.unavailable:
                raise
            log.info("leader unreachable; training on without it for now")
            return self.task("none")
        if reply["status"] != "ok":
            return self.task("none")
        self._leader_up.set()
        self.cluster_id, self.secret = reply["id"], reply["secret"]
        self.heartbeat_s = min(self.heartbeat_s, float(reply["hb"]))  # the leader's interval rules
        self.pending = None
        if reply.get("seed"):  # this cluster's parameters become the PS's version 1: push them, pull that
            log.info("cluster %s seeds the PS with its parameters", self.cluster_id)
            self.base, self.plan = int(reply["version"]), data_plan(reply)
            return self.request_push(seed=True)
        self.plan = data_plan(reply)
        return self.task("pull", version=int(reply["version"]), merge=False, plan=self.plan, consumed=True)

    def outer_step(self, wait_s: float = 0.0, stream: bool = False) -> dict:
        """What the cluster does at an outer step: resolve the pending push (waiting up to
        ``wait_s`` for its round), or push anew (``stream``: its units will come spread over the
        inner steps)."""
        if not self._leader_up.is_set():
            self.stats["skipped"] += 1
            return self.task("none")
        try:
            if self.cluster_id is None:
                return self.join()
            if self.pending is not None:
                task = self.resolve(timeout=wait_s)
                if self.pending is not None:
                    self.stats["skipped"] += 1
                    return task
                if task["do"] == "pull":
                    return task
            return self.request_push(stream=stream)
        except RpcError as exc:
            log.warning("outer step skipped: %s", exc)
            self.stats["skipped"] += 1
            return self.task("none")

    def request_push(self, seed: bool = False, stream: bool = False) -> dict:
        """Ask for a push id and schedule (``seed``: the push that makes a seeded PS's model;
        ``stream``: one whose units come spread over the inner steps, which rounds do not wait for)."""
        self._t_push = time.monotonic()
        workers = {str(w): units for w, units in self.workers.items()}
        reply = self.leader.call("PushRequest", **self._me(), tokens=self.cluster_tokens, base=self.base,
                                 workers=workers, pull_s=self._pull_seconds(), stream=stream)
        if reply["status"] == "unknown":
            self.cluster_id = None
            return self.join()
        if reply["status"] == "done":
            self.done = True
            return self.task("none")
        if reply["status"] != "ok":
            self.stats["skipped"] += 1
            return self.task("none")
        self.plan = data_plan(reply)
        return self.task("push", push=reply["push"], schedule=reply["schedule"], base=self.base,
                         cluster=self.cluster_id, plan=self.plan, seed=seed, stream=stream and not seed)

    def seal(self, push: str, sent: bool) -> bool:
        """Ask the leader to seal ``push`` once every unit was ``sent``; True when sealed."""
        if not sent:
            self.stats["failed"] += 1
            return False
        try:
            done = self.leader.call("PushDone", **self._me(), push=push)
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

    def resolve(self, timeout: float) -> dict:
        """Learn the fate of the pending push: a pull-and-merge task once it has a result."""
        t0 = time.monotonic()
        try:
            fate = self.leader.call("WaitPush", timeout=timeout + 5.0, push=self.pending, wait=timeout)
        except RpcError as exc:
            log.warning("waiting for push %s: %s", self.pending, exc)
            return self.task("none")
        self.stats["wait_s"] += time.monotonic() - t0
        self.done = self.done or bool(fate.get("done"))
        if fate["state"] == "pending":
            return self.task("none")
        self.pending = None
        if fate["state"] in ("unknown", "failed"):
            return self.task("drop")  # never sealed: its progress is still local and goes into the next push
        self.stats[fate["state"]] += 1
        return self.task("pull", version=int(fate["version"]), merge=True, plan=self.plan)


def data_plan(reply: dict) -> dict:
    """The part of a leader reply the ranks need to move units: followers, their units, their key."""
    return {k: reply[k] for k in ("followers", "units", "key")}
