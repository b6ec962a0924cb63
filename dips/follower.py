"""Follower PS: owns a contiguous slice of layer units and runs the outer optimizer on it.

A follower is four parts with one role each: its state and push state machine
(``follower_state.py``: staged -> sealed -> applied -> retired), its disk (``follower_disk.py``:
sealed pushes and checkpoints), its data server (``follower_data.py``: clusters push and pull
units over ZeroMQ), and this file, which registers with the leader, answers the leader's control
flow (gRPC: Seal a push, Prepare/Apply a round, Discard pushes), heartbeats and checkpoints.

Durability: a sealed push is written to disk before Seal returns, and stays there until a
checkpoint that includes the round which consumed it is written. Checkpoints are written in the
background every ``checkpoint_every`` outer steps (the last ``keep_checkpoints`` kept); a slow
disk never queues more than one: the writer snapshots the latest version when it is free. A
follower restarted from its latest checkpoint is behind the leader by the rounds applied since;
the leader replays them from its decision log, so no accepted push is lost.
"""
from __future__ import annotations

import logging
import os
import threading
import time

import torch

from diutil import address

from .auth import FOLLOWER_KEY_LABEL, JobToken
from .curve import KeyPair
from .follower_data import FollowerDataServer
from .follower_disk import FollowerDisk
from .follower_state import FollowerState
from .layout import ModelLayout
from .leader_state import MAX_DECISIONS
from .model import initial_parameters, load_initial
from .outer_optimizer import NesterovOuter
from .rpc import RpcClient, RpcError, RpcServer, Tls

log = logging.getLogger("dips.follower")


# Rounds wait for every follower, so a follower that restarts is at most one checkpoint interval
# (plus a snapshot in progress) behind; the leader keeps up to MAX_DECISIONS decisions back to the
# oldest checkpoint, so bounding the interval at half that guarantees it can replay its way back.
# (No peer could send it a checkpoint instead: followers hold disjoint slices of the model.)
MAX_CHECKPOINT_EVERY = MAX_DECISIONS // 2
CHECKPOINT_RETRY_S, CHECKPOINT_RETRY_MAX_S = 1.0, 60.0


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
        self.disk = FollowerDisk(checkpoint_dir)
        if not 1 <= checkpoint_every <= MAX_CHECKPOINT_EVERY or keep_checkpoints < 1:
            raise ValueError(f"checkpoint_every={checkpoint_every}, keep_checkpoints={keep_checkpoints}; expected "
                             f"1 <= checkpoint_every <= {MAX_CHECKPOINT_EVERY} and keep_checkpoints >= 1")
        self.keep_checkpoints, self.heartbeat_s, self.checkpoint_every = keep_checkpoints, heartbeat_s, checkpoint_every
        # memory a cluster can make this follower hold: staged pushes (each at most its slice)
        # and queued messages (each at most MAXMSGSIZE) are bounded in number
        self.max_unsealed_pushes = max_unsealed_pushes
        self.index = index if index is not None else self.disk.read_index()
        self.state: FollowerState | None = None  # once registered
        self.data: FollowerDataServer | None = None
        self._registering = threading.Lock()  # RPCs wait for the state while registration loads it
        self._stop = threading.Event()
        self._failure: str | None = None  # why this follower stopped serving (see failure())
        self._ckpt_wanted = threading.Event()  # a version worth checkpointing was applied
        self._threads: list[threading.Thread] = []
        handlers = {"Seal": self._seal, "Prepare": self._prepare, "Apply": self._apply,
                    "Discard": self._discard, "Status": self._status}
        self.rpc = RpcServer("dips.Follower", handlers, {n: (server_token,) for n in handlers},
                             bind=address.join(address.split(bind)[0], 0), tls=tls)
        self.ctrl = address.join(address.split(self.advertise)[0], self.rpc.port)
        self.leader = RpcClient("dips.Leader", leader, server_token, tls)
        self._register()
        if self.state is not None:
            self.data = FollowerDataServer(self.state, server_token, self.keys, self.cluster_key, bind)
        for fn in (self._heartbeat_loop, self._checkpoint_loop):
            self._spawn(fn)

    @property
    def version(self) -> int:
        """The last round applied here."""
        return self._live().version

    def _live(self) -> FollowerState:
        with self._registering:
            if self.state is None:
                raise ValueError(f"follower {self.index} is not registered with the leader")
            return self.state

    def _spawn(self, fn) -> None:
        t = threading.Thread(target=fn, daemon=True, name=f"dips-follower-{fn.__name__}")
        t.start()
        self._threads.append(t)

    # ---------------------------------------------------------- registration
    def _register(self) -> None:
        """Register with the leader and load this follower's state, RPCs held off throughout: the
        leader starts replaying rounds as soon as it knows the version on disk, and an Apply must
        not find the state half-loaded."""
        with self._registering:
            reply = None
            while not self._stop.is_set():
                try:
                    reply = self.leader.call("RegisterFollower", index=self.index, data=self.advertise,
                                             ctrl=self.ctrl, version=self.disk.latest_version(),
                                             fingerprint=self._init_fingerprint)
                    if reply.get("status") == "ok":
                        break
                    time.sleep(self.heartbeat_s)  # "wait": a seeded PS has no model until a cluster joins
                except RpcError as exc:
                    if not exc.unavailable:
                        raise ValueError(f"the leader refused this follower: {exc}") from None
                    time.sleep(self.heartbeat_s)
            if reply is None or reply.get("status") != "ok":
                return  # stopped before the leader took it
            self.index = reply["index"]
            self.heartbeat_s = min(self.heartbeat_s, float(reply.get("hb", self.heartbeat_s)))  # the leader's rules
            self.disk.write_index(self.index)
            if "layout" in reply:  # a seeded PS: zeros until the seeding round
                initial, layout = None, ModelLayout.from_wire(reply["layout"])
            else:
                initial = self._initial(reply)
                layout = ModelLayout.of_specs([(n, tuple(t.shape)) for n, t in initial.items()])
            self.layout = layout
            self.cluster_key = reply["cluster_key"].encode()
            start, stop = reply["units"]
            self.unit_range = range(start, stop)
            self.state = FollowerState(self.disk, layout, self.unit_range, NesterovOuter(reply["lr"], reply["momentum"]),
                                       self.max_unsealed_pushes, name=f"follower {self.index}")
            self.state.load(initial)
            self._init = None  # the --init file's other slices are not this follower's to keep
            log.info("follower %d owns units %s at version %d", self.index, [start, stop], self.state.version)

    def _initial(self, reply: dict) -> dict[str, torch.Tensor]:
        """Version 0: the leader's LLaMA config and seed, or this follower's --init file (the
        leader checked at registration that it is the model it serves)."""
        if "model" in reply:
            return initial_parameters(reply["model"], reply["seed"])
        return self._init

    # ---------------------------------------------------------- control flow
    def _seal(self, msg: dict) -> dict:
        return self._live().seal(str(msg["push"]))

    def _prepare(self, msg: dict) -> dict:
        return self._live().prepare(msg["weights"])

    def _apply(self, msg: dict) -> dict:
        reply, applied = self._live().apply(msg)
        if applied and int(msg["version"]) % self.checkpoint_every == 0:
            self._ckpt_wanted.set()
        return reply

    def _discard(self, msg: dict) -> dict:
        return self._live().discard(msg["pushes"])

    def _status(self, msg: dict) -> dict:
        return self._live().status()

    # ---------------------------------------------------------- checkpointing and heartbeats
    def _checkpoint_loop(self) -> None:
        """Checkpoints in the background. A failed write (a full disk) is reported and retried with
        growing pauses; meanwhile the sealed pushes stay on disk, so nothing is lost."""
        pause = CHECKPOINT_RETRY_S
        while not self._stop.is_set():
            if not self._ckpt_wanted.wait(0.1):
                continue
            self._ckpt_wanted.clear()
            try:
                state = self._live()
                snap = state.snapshot()
                self.disk.save_checkpoint(snap, self.keep_checkpoints)
                for push in state.checkpointed(self.disk.oldest_kept_version()):
                    self.disk.delete_push(push)
                pause = CHECKPOINT_RETRY_S
            except Exception as exc:
                log.error("follower %s: checkpoint not written (%s); sealed pushes stay on disk, retrying in %.0f s",
                          self.index, exc, pause, exc_info=not isinstance(exc, OSError))
                self._ckpt_wanted.set()
                self._stop.wait(pause)
                pause = min(2 * pause, CHECKPOINT_RETRY_MAX_S)

    def failure(self) -> str | None:
        """Why this follower can no longer serve (a data thread ended), or None while it can."""
        return self._failure

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            if self.data is not None and not self.data.alive():
                # Stop heartbeating: the leader relaunches a follower whose heartbeats stop.
                self._failure = "a data-server thread ended (see the log above)"
                log.error("follower %s: %s; it stops heartbeating", self.index, self._failure)
                return
            try:
                status = self._live().status()
                reply = self.leader.call("FollowerHeartbeat", timeout=2.0, id=self.index, version=status["version"],
                                         ckpt=status["ckpt"])
                if not reply.get("known", True):
                    self.leader.call("RegisterFollower", index=self.index, data=self.advertise,
                                     ctrl=self.ctrl, version=status["version"])
            except RpcError:
                pass  # leader down: keep trying, never block the data flow

    def wait(self) -> None:
        while not self._stop.wait(0.5):
            pass

    def stop(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self.rpc.stop()
        for t in self._threads:
            t.join(timeout=2)
        self.leader.close()
        if self.data is not None:
            self.data.stop()
