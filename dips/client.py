"""OuterClient: the Di-PS side of one training cluster.

Every ``inner_steps`` calls of :meth:`OuterClient.step` (collective over the cluster's ranks) the
cluster pushes its parameters (BF16, one message per layer unit) to the followers, waits for the
round to close and pulls the new global parameters. Which rank holds which units is a
:class:`ParameterView`: in a data-parallel cluster (:class:`ReplicatedModel`) rank 0 holds every
unit; in a pipeline cluster (``ditorch.ps_pipeline.PipelineStages``) each stage's owning rank
holds its stage's units and pushes them itself, following the leader's schedule (Appendix A)
with a barrier per step.

The cluster's rank 0 is its *speaker* (``leader_speaker.py``): it alone talks to the leader
(gRPC) and tells the other ranks what to do next (one small object broadcast over a gloo group,
so the training groups' backend does not matter). Units move over ZeroMQ
(``unit_transfer.py``); this file runs the in-cluster rounds. If the leader cannot be reached the
outer step is skipped and inner training goes on; the speaker reconnects in the background
(heartbeats) and never blocks on a dead leader. A push whose fate is unknown (the leader died after sealing it) is resolved later:
its result is merged as theta_new + (theta_local - theta_pushed), so inner steps taken since are
kept and nothing is counted twice.

Compressed (``push_codec``/``pull_codec`` other than ``bf16``, ``dips.codec``): a push carries the
pseudo-gradient (the global values the cluster holds minus its parameters) plus the *residual*
that earlier compressed pushes dropped, encoded (``sparseloco``: the residual times
``codec.DECAY``, SparseLoCo's decaying accumulator); what the encoding drops becomes the next
residual (error feedback), kept in ``state_dir`` across restarts once the push is sealed. A
pull carries the encoded difference between the new version and the values the cluster holds,
which it adds to them (the followers track those values per cluster, so what a pull's encoding
drops comes with the next pull; a BF16 pull of the whole values when they do not know them,
e.g. after a restart).

Streamed (``fragments`` > 1, after Streaming DiLoCo): the outer step takes the snapshot and
encodes the push at once, but sends its units in ``fragments`` parts spread over the next inner
steps (part j at inner step j*H/fragments), so the link carries the push while the cluster
computes, and seals it once the last part is acknowledged; the next outer step waits for that
push's round, pulls and merges (the inner progress made since the snapshot is kept) and starts
the next stream. The push is one push with one base version (the leader's bookkeeping and
staleness count are those of any push); the leader does not hold a round for a streamed push in
flight.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Protocol

import torch
import torch.distributed as dist

from diutil.durable import write_atomic

from .auth import JobToken
from .codec import Codec
from .follower_state import WHOLE
from .layout import ModelLayout
from .leader_speaker import LeaderSpeaker, data_plan
from .rpc import Tls
from .unit_transfer import UnitTransfer

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
                 tls: Tls | None = None, push_codec: str | Codec = "bf16", pull_codec: str | Codec = "bf16",
                 state_dir: str | os.PathLike | None = None, fragments: int = 1):
        if inner_steps < 1:
            raise ValueError(f"inner_steps={inner_steps}; expected >= 1")
        if not 1 <= fragments <= inner_steps:
            raise ValueError(f"fragments={fragments}; expected 1..inner_steps ({inner_steps})")
        self.fragments = fragments
        self._stream: dict | None = None  # the streamed push in flight
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
        self.round_timeout_s = round_timeout_s
        self.inner_count = 0
        self.tokens_pending = 0      # tokens consumed since the last sealed push
        self.tokens_total = 0
        self.done = False            # the leader's token budget is spent
        self.base = -1               # the global version the parameters started from
        self.plan: dict = {}         # the leader's data plan of the latest task
        self._snapshot: dict[str, torch.Tensor] = {}     # this worker's units as pushed (BF16, or FP32 when compressed)
        self.push_codec = Codec.parse_push(push_codec)
        self.pull_codec = Codec.parse(pull_codec) if isinstance(pull_codec, str) else pull_codec
        self.state_dir = None if state_dir is None else os.fspath(state_dir)
        self._held: dict[str, torch.Tensor] = {}      # global values of this worker's units at ``base``, as decoded
        self._pulled: dict[str, torch.Tensor] | None = None  # what the latest pull decoded, held once every rank has it
        self.residual: dict[int, torch.Tensor] = self._load_residual()  # unit -> what compression dropped, flat
        self._next_residual: dict[int, torch.Tensor] = {}  # the residual of the push in flight
        self.stats = {"pushed": 0, "failed": 0, "skipped": 0, "applied": 0, "rejected": 0, "push_s": 0.0,
                      "wait_s": 0.0, "pull_s": 0.0, "push_bytes": 0, "pull_bytes": 0,
                      "pulls": 0}
        self.transfer = UnitTransfer(self.token, self.layout, transfer_timeout_s, self.stats)
        self._closed: dict | None = None   # what close() reported
        # the cluster's rank 0 speaks to the leader for it
        self.speaker = (LeaderSpeaker(leader, self.token, tls, name, self.layout, self.workers, heartbeat_s, self.stats,
                                      lambda: self.transfer.last_pull_s) if self.rank == 0 else None)
        if join:
            self._round(lambda: self.speaker.join())

    # ----------------------------------------------------------- training API
    def step(self, tokens: int = 0) -> bool:
        """Count one inner step (``tokens`` consumed on this rank); every H steps run the outer step.

        Returns True when the model's parameters were replaced by new global ones.
        """
        self.inner_count += 1
        self.tokens_pending += int(tokens)
        self.tokens_total += int(tokens)
        outer = self.inner_count % self.inner_steps == 0
        if self._stream is not None:
            self._stream_step(outer)
        if not outer:
            return False
        cluster_tokens = self.view.cluster_tokens(self.tokens_pending)
        if self.speaker is not None:
            self.speaker.cluster_tokens = cluster_tokens
        if self.fragments == 1:
            return self._round(lambda: self.speaker.outer_step())
        # the last streamed push's round (sealed a while ago), then the next stream at once
        updated = self._round(lambda: self.speaker.outer_step(wait_s=self.round_timeout_s, stream=True))
        if updated and not self.done:
            self._round(lambda: self.speaker.outer_step(stream=True))
        return updated

    def join(self, timeout_s: float = 30.0) -> bool:
        """(Re)join the PS, retrying until ``timeout_s``; collective over the cluster's ranks.

        Returns True once the model holds the global parameters of its base version.
        """
        deadline = time.monotonic() + timeout_s
        while True:  # a seeding push still waiting for its round is resolved, not pushed again
            joined = self._round(lambda: self.speaker.join() if self.speaker.pending is None
                                 else self.speaker.outer_step())
            give_up = self._share(time.monotonic() > deadline)
            if joined or give_up:
                return joined
            time.sleep(0.2)

    def close(self, leave: bool = True, timeout_s: float = 60.0) -> dict:
        """Finish the outer step in flight, then stop heartbeating and, with ``leave``, tell the
        leader the cluster departs (best effort), so rounds stop counting on it at once.

        A push the leader sealed but has not committed yet is waited for, up to ``timeout_s`` (an
        outer step's own wait, ``round_timeout_s``, may be shorter), so a cluster that exits right
        after its last outer step leaves nothing behind; nothing is pulled. Returns (and logs, on
        the speaker) what became of the cluster's pushes: ``pushed`` (sealed), ``applied``,
        ``rejected``, ``failed``, ``skipped`` outer steps, ``version`` (the global version the
        cluster last pulled or had its last push committed in) and ``pending`` (a push still
        uncommitted at the bound, or None). Only the speaker (the cluster's rank 0) knows the
        leader's side; other ranks get their own counters. Safe to call twice."""
        if self._closed is not None:
            return self._closed
        if self._stream is not None:  # never sealed: the leader lets it lapse, followers drop its units
            log.info("cluster %s leaves with streamed push %s unsent", self.name, self._stream["task"]["push"])
            self._stream, self._next_residual = None, {}
        fate = None
        if self.speaker is not None:
            fate = self.speaker.finish(timeout_s)
            self.speaker.close(leave)
        self.transfer.close()
        version = self.base
        if fate is not None and fate.get("state") in ("applied", "rejected"):
            version = max(version, int(fate["version"]))
        self._closed = {**{k: self.stats[k] for k in ("pushed", "applied", "rejected", "failed", "skipped")},
                        "version": version,
                        "pending": fate["push"] if fate is not None and fate["state"] == "pending" else None}
        if self.speaker is not None:
            log.info("cluster %s leaves: %s", self.name or self.speaker.cluster_id, self._closed)
            if self._closed["pending"] is not None:
                log.warning("cluster %s leaves with push %s uncommitted after %.0f s: the leader may still "
                            "commit it", self.name, self._closed["pending"], timeout_s)
        return self._closed

    def __enter__(self) -> "OuterClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

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
        task = self._share(control() if self.speaker is not None else None)
        self.done = task["done"]
        if task.get("consumed"):  # the tokens counted so far went into a sealed push (or a join)
            self.tokens_pending = 0
        if task["do"] == "push" and task.get("stream"):
            self._start_stream(task)
            return False
        if task["do"] == "push":
            sent = self._all_ok(self._push_units(task))
            sealed = self._share(self.speaker.seal(task["push"], sent) if self.speaker is not None else None)
            if not sealed:
                self._snapshot, self._next_residual = {}, {}
                return False
            self._commit_residual()
            self.tokens_pending = 0
            task = self._share(self.speaker.resolve(self.round_timeout_s) if self.speaker is not None else None)
            self.done = task["done"]
        if task["do"] == "drop":
            self._snapshot = {}
        if task["do"] != "pull":
            return False
        self.plan = self.transfer.plan = task["plan"]
        new = self._pull_units(task["version"], task["merge"], task.get("cluster"))
        if not self._all_ok(new is not None):
            return False
        if self._pulled is not None:
            self._held, self._pulled = self._pulled, None
        self.view.install(new)
        self.base = task["version"]
        if self.speaker is not None:
            self.speaker.pulled(self.base)
        if task["merge"]:
            self._snapshot = {}
        return True

    def _push_units(self, task: dict) -> bool:
        """This worker's units, sent in the schedule's steps with a barrier after each."""
        send, waiting = self._prepare_push(task), {}
        ok = self._send_steps(task, task["schedule"], send, waiting)
        return self.transfer.await_acks(task["push"], waiting) and ok

    def _prepare_push(self, task: dict):
        """Snapshot this worker's units (and encode them when compressing); the function that
        sends one unit to a follower's address and returns its request id."""
        self.plan = self.transfer.plan = task["plan"]
        full = self.view.full()
        if self._compresses(task):
            self._snapshot = full
            payloads, sqnorms = self._encode_push(full)

            def send(unit: int, address: str) -> str:
                return self.transfer.send_payload(task, unit, address, payloads[unit], str(self.push_codec),
                                                  sqnorms[unit])
        else:
            self._snapshot = {n: t.to(torch.bfloat16) for n, t in full.items()}

            def send(unit: int, address: str) -> str:
                return self.transfer.send_unit(task, unit, address, self._snapshot)
        return send

    def _send_steps(self, task: dict, steps: list, send, waiting: dict[str, set]) -> bool:
        """Send this worker's units of schedule ``steps``; with several workers, wait for the
        acknowledgements and a barrier after each step. ``waiting`` collects the rest to await."""
        ok = True
        for step in steps:
            for worker, unit, follower in step:
                if worker == self.view.worker:
                    address = self.plan["followers"][follower]
                    waiting.setdefault(address, set()).add(send(unit, address))
            if len(self.workers) > 1:  # pairs of a step must not collide with the next step's
                ok = self.transfer.await_acks(task["push"], waiting) and ok
                waiting.clear()
                dist.barrier(group=self._ctl)
        return ok

    # ------------------------------------------------------- streaming
    def _start_stream(self, task: dict) -> None:
        """Snapshot and encode the push now; send its first part (the rest follow the inner steps)."""
        steps = task["schedule"]
        parts = max(1, min(self.fragments, len(steps)))
        self._stream = {"task": task, "send": self._prepare_push(task), "waiting": {}, "ok": True, "sent": 0,
                        "parts": [steps[len(steps) * j // parts: len(steps) * (j + 1) // parts] for j in range(parts)],
                        "start": self.inner_count, "tokens": self.tokens_pending}
        self._stream_step(False)

    def _stream_step(self, outer: bool) -> None:
        """Send the parts due by this inner step; seal the push one inner step after its last
        part went (or at the outer step, whichever comes first)."""
        s = self._stream
        offset, parts = self.inner_count - s["start"], s["parts"]
        while s["sent"] < len(parts) and offset >= s["sent"] * self.inner_steps // len(parts):
            s["ok"] = self._send_steps(s["task"], parts[s["sent"]], s["send"], s["waiting"]) and s["ok"]
            s["sent"] += 1
        last_due = (len(parts) - 1) * self.inner_steps // len(parts)
        if s["sent"] == len(parts) and (offset > last_due or outer):
            self._finish_stream()

    def _finish_stream(self) -> None:
        s, self._stream = self._stream, None
        task = s["task"]
        sent = self._all_ok(self.transfer.await_acks(task["push"], s["waiting"]) and s["ok"])
        sealed = self._share(self.speaker.seal(task["push"], sent) if self.speaker is not None else None)
        if not sealed:  # its progress is still local and goes into the next push
            self._snapshot, self._next_residual = {}, {}
            return
        self._commit_residual()
        self.tokens_pending -= s["tokens"]  # what came since the snapshot goes into the next push

    def _pull_units(self, version: int, merge: bool, cluster: str | None = None) -> dict[str, torch.Tensor] | None:
        """This worker's units at ``version`` (merged with inner progress since the push); None
        when a pull failed. Collective (the merge reads the current parameters)."""
        local = self.view.full() if merge else {}
        self._pulled = None
        if self.view.worker is None:
            return {}
        new = None
        tracked = cluster if self.pull_codec.lossy else None  # followers track what it holds
        if tracked is not None and self.base >= 0 and self._holds_mine():
            change = self.transfer.pull(version, self.my_units, self.pull_codec, since=self.base, cluster=tracked)
            if change is None and not self.transfer.refused:
                return None
            if change is not None:
                new = {n: self._held[n] + d for n, d in change.items()}
        if new is None:  # the whole values: nothing held yet, or the followers do not know it
            whole = self.pull_codec.whole if tracked is not None else None
            new = self.transfer.pull(version, self.my_units, whole, since=WHOLE, cluster=tracked)
            if new is None:
                return None
        if self.push_codec.lossy or self.pull_codec.lossy:
            self._pulled = dict(new)
        if merge:
            for n in new:
                new[n] = new[n] + (local[n] - self._snapshot[n].float())
        return new

    # ------------------------------------------------------- compression
    def _holds_mine(self) -> bool:
        return all(t.name in self._held for u in self.my_units for t in self.layout.units[u].tensors)

    def _compresses(self, task: dict) -> bool:
        """Whether this push travels compressed: a seed carries parameters, and a pseudo-gradient
        needs the global values the cluster started from."""
        return self.push_codec.lossy and not task.get("seed") and self._holds_mine()

    def _encode_push(self, full: dict[str, torch.Tensor]) -> tuple[dict[int, bytes], dict[int, float]]:
        """Each of this worker's units: its pseudo-gradient plus residual (times the codec's decay),
        encoded, and the pseudo-gradient's squared norm (what the outlier filter scores); what the encoding drops
        is the residual of this push (kept once it is sealed)."""
        payloads: dict[int, bytes] = {}
        sqnorms: dict[int, float] = {}
        self._next_residual = {}
        for u in self.my_units:
            spec = self.layout.units[u]
            x = torch.cat([(self._held[t.name] - full[t.name]).reshape(-1) for t in spec.tensors])
            sqnorms[u] = float((x.double() ** 2).sum())
            if u in self.residual:  # SparseLoCo's accumulator decays: e <- decay e + pseudo-gradient
                x = x + self.residual[u] * self.push_codec.decay
            payloads[u], decoded = self.push_codec.round_trip(x)
            self._next_residual[u] = x - decoded
        return payloads, sqnorms

    def _residual_path(self) -> str | None:
        if self.state_dir is None or self.view.worker is None:
            return None
        return os.path.join(self.state_dir, f"residual-w{self.view.worker}.pt")

    def _commit_residual(self) -> None:
        """The sealed push's residual replaces the last one, on disk too (it is the cluster's state)."""
        if not self._next_residual:
            return
        self.residual, self._next_residual = self._next_residual, {}
        path = self._residual_path()
        if path is not None:
            os.makedirs(self.state_dir, exist_ok=True)
            state = {"fingerprint": self.layout.fingerprint, "units": self.residual}
            write_atomic(path, lambda tmp: torch.save(state, tmp))

    def _load_residual(self) -> dict[int, torch.Tensor]:
        """The residual a previous run of this worker left in ``state_dir`` (empty without one, or
        when it belongs to another model)."""
        path = self._residual_path()
        if path is None or not os.path.exists(path):
            return {}
        state = torch.load(path, weights_only=True)
        if state.get("fingerprint") != self.layout.fingerprint:
            log.warning("residual %s belongs to another model (fingerprint %s, expected %s); starting from none",
                        path, state.get("fingerprint"), self.layout.fingerprint)
            return {}
        sizes = {u: sum(t.numel for t in self.layout.units[u].tensors) for u in self.my_units}
        out = {int(u): r.float() for u, r in state["units"].items() if sizes.get(int(u)) == r.numel()}
        if len(out) != len(state["units"]):
            log.warning("residual %s: %d of its units do not fit this worker's units; they are dropped",
                        path, len(state["units"]) - len(out))
        log.info("worker %s resumes the residual of %d units from %s", self.view.worker, len(out), path)
        return out

    def fetch_global(self) -> int | None:
        """Load the latest complete global parameters into a one-process model (no outer step)."""
        if not isinstance(self.view, ReplicatedModel) or self.many:
            raise ValueError("fetch_global reads the whole model into one process: give the client an nn.Module "
                             "and no process group")
        st = self.speaker.leader.call("Plan")
        self.plan = self.transfer.plan = data_plan(st)
        new = self.transfer.pull(int(st["version"]), range(len(self.layout.units)))
        if new is None:
            return None
        with torch.no_grad():
            for n, p in self.params.items():
                p.copy_(new[n].to(p.dtype))
        return int(st["version"])
