"""What the leader knows, under one lock: followers, clusters, pushes, the decision log and the
versions; and the metadata file that persists it (the commit point of every round).

The RPC service, the round runner and the health monitor (``leader_service.py``, ``rounds.py``,
``health.py``) read and change this state; none of them keeps state of its own.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from diutil.durable import write_text_atomic
from diutil.untrusted import RateLimitedLog

from .auth import JobToken
from .grace import GraceEstimator
from .layout import ModelLayout
from .penalty import PseudoGradientPenalty
from .rpc import RpcClient, RpcError, Tls

log = logging.getLogger("dips.leader")
_disk_log = RateLimitedLog(log)

DECISION_LOG = 64     # decisions always kept ...
MAX_DECISIONS = 1024  # ... and back to the oldest follower checkpoint, up to this many (~100 B each)
PUSH_FATES = 256      # settled pushes remembered (a cluster learns its push's fate late after an outage)


@dataclasses.dataclass
class FollowerRecord:
    index: int
    data: str
    ctrl: str
    version: int = -1
    ckpt: int = -1  # its latest checkpoint's version (from heartbeats): it replays from there
    last_hb: float = 0.0
    restarted_at: float = 0.0
    client: RpcClient | None = None


@dataclasses.dataclass
class ClusterRecord:
    id: str
    base: int
    tokens: int = 0
    last_hb: float = 0.0
    counted_at: float = 0.0  # wall time its tokens were last counted (join or sealed push)
    # Handed to the cluster at registration; every later call in its name must present it, so a
    # holder of the job token cannot speak for another cluster (leave, heartbeat, push for it).
    secret: str = ""


@dataclasses.dataclass
class PushRecord:
    id: str
    cluster: str
    tokens: int
    base: int
    state: str = "requested"  # requested -> sealed -> applied | rejected ; or failed
    norm: float = 0.0
    version: int = -1
    t: float = 0.0
    # Its units arrive spread over the cluster's inner steps: a round does not wait for it.
    streamed: bool = False


class LeaderState:
    """The leader's state. Hold ``cond`` to read or change it; call :meth:`changed` after a
    change others may wait for."""

    def __init__(self, config, layout: ModelLayout | None, follower_key: bytes, server_token: JobToken,
                 tls: Tls | None):
        self.cfg, self.follower_key = config, follower_key
        self.server_token, self.tls = server_token, tls
        self.layout: ModelLayout | None = None  # None until a seeding cluster brings it
        self.partition: list[tuple[int, int]] = []
        self.dest: list[int] = []
        self.seeder: str | None = None  # the cluster whose parameters become version 1 (seeded PS)
        if layout is not None:
            self.set_layout(layout)
        self.cond = threading.Condition(threading.RLock())
        self.followers: dict[int, FollowerRecord] = {}
        self.clusters: dict[str, ClusterRecord] = {}
        self.pushes: dict[str, PushRecord] = {}
        self.collecting: list[str] = []
        self.decisions: dict[int, dict] = {}
        self.version = 0            # last decided version
        self.complete = 0           # last version every follower has applied
        self.tokens_total = 0
        self.rounds_log: list[dict] = []  # per-round summary for benchmarks (not persisted)
        self.last_seal = 0.0
        self.pull_s = 0.0           # a cluster's last pull time (part of the round cost C_m)
        self.budget_reached_at: float | None = None
        self.penalty = PseudoGradientPenalty(config.alpha, config.beta, config.clip_norm, config.warmup_rounds,
                                             staleness_decay=config.staleness_decay)
        self.grace = GraceEstimator(config.initial_grace, max_grace=config.max_grace)
        self.wake: Callable[[], None] = lambda: None  # set by the RPC service: wakes WaitPush sleepers

    def set_layout(self, layout: ModelLayout) -> None:
        self.layout = layout
        self.partition = layout.partition(self.cfg.n_followers)
        self.dest = layout.owner_of_units(self.cfg.n_followers)

    # ------------------------------------------------------------ queries
    def ready(self) -> bool:
        return (self.layout is not None and len(self.followers) == self.cfg.n_followers
                and all(f.version >= self.complete for f in self.followers.values()))

    def seeding(self) -> bool:
        """A seeded PS whose version 1 (the first cluster's parameters) is not applied yet."""
        return self.cfg.seed_from_cluster and self.complete < 1

    def budget_done(self) -> bool:
        return self.cfg.token_budget is not None and self.tokens_total >= self.cfg.token_budget

    def data_plan(self) -> dict:
        """Where clusters send and read units: follower addresses, their units, their key."""
        return {"followers": [self.followers[i].data for i in range(self.cfg.n_followers)],
                "units": [list(b) for b in self.partition], "key": self.follower_key.decode()}

    def fate(self, push_id: str) -> dict | None:
        """What became of a push (None: its round has not closed yet)."""
        push = self.pushes.get(push_id)
        if push is None:
            return {"state": "unknown"}
        if push.state in ("applied", "rejected") and self.complete >= push.version:
            return {"state": push.state, "version": push.version, "done": self.budget_done()}
        if push.state == "failed":
            return {"state": "failed"}
        return None

    def keep_versions(self) -> list[int]:
        """Versions followers must keep: what clusters build on and pending pushes started from."""
        keep = {self.version, self.complete}
        keep |= {c.base for c in self.clusters.values()}
        keep |= {self.pushes[p].base for p in self.collecting}
        return sorted(keep)

    def status(self) -> dict:
        return {"version": self.version, "complete": self.complete, "tokens": self.tokens_total,
                "clusters": sorted(self.clusters), "followers": {str(i): f.version for i, f in self.followers.items()},
                "grace": round(self.grace.grace(), 4), "done": self.budget_done()}

    # ------------------------------------------------------------ changes
    def changed(self) -> None:
        """Wake the round loop and every waiting WaitPush (call with ``cond`` held)."""
        self.cond.notify_all()
        self.wake()

    def add_follower(self, rec: FollowerRecord) -> None:
        old = self.followers.get(rec.index)
        if old is not None and old.client is not None:
            old.client.close()
        rec.client = RpcClient("dips.Follower", rec.ctrl, self.server_token, self.tls)
        self.followers[rec.index] = rec

    def remove_cluster(self, cid: str, why: str) -> None:
        """Forget cluster ``cid`` (it left or went silent); its pushes still in flight fail."""
        if self.clusters.pop(cid, None) is None:
            return
        log.warning("cluster %s removed: %s", cid, why)
        for p in self.pushes.values():
            if p.cluster == cid and p.state == "requested":
                p.state = "failed"
        self.persist()
        self.changed()

    def record_decision(self, weights: dict, scale: float, drop: list[str], seed: bool = False) -> int:
        """Log a new version's decision; keep the log back to the oldest follower checkpoint.
        ``seed``: the one push in ``weights`` replaces the parameters (a seeded PS's version 1)."""
        self.version += 1
        self.decisions[self.version] = {"weights": weights, "scale": scale, "drop": drop,
                                        **({"seed": True} if seed else {})}
        oldest_ckpt = min((f.ckpt for f in self.followers.values()), default=self.version)
        floor = max(min(self.version - DECISION_LOG, oldest_ckpt), self.version - MAX_DECISIONS)
        for v in [v for v in self.decisions if v <= floor]:
            del self.decisions[v]
        return self.version

    def forget_settled_pushes(self) -> None:
        """Keep pushes in flight and the last PUSH_FATES settled ones (memory stays bounded)."""
        settled = [p for p, r in self.pushes.items() if r.state in ("applied", "rejected", "failed")]
        for p in settled[:-PUSH_FATES]:
            del self.pushes[p]

    def discard(self, pushes: list[str]) -> None:
        """Tell every follower to drop ``pushes`` (failed or rejected); best effort."""
        for f in list(self.followers.values()):
            call_follower(f, "Discard", pushes=pushes)

    # ------------------------------------------------------------ metadata
    def undo_point(self, pushes: list[PushRecord]) -> Callable[[], None]:
        """What undoes a round's decision on ``pushes`` (with ``cond`` held): its commit point
        is the metadata write, and a decision that could not be written was never made."""
        version, decisions = self.version, dict(self.decisions)
        fates = [(p, p.state, p.version) for p in pushes]
        bases = {c.id: c.base for c in self.clusters.values()}

        def undo() -> None:
            self.version, self.decisions = version, decisions
            for p, state, v in fates:
                p.state, p.version = state, v
            for cid, base in bases.items():
                if cid in self.clusters:
                    self.clusters[cid].base = base
        return undo

    def persist(self) -> None:
        """:meth:`save` where the write is not a commit point: a failure (a full disk) is
        reported and the leader carries on from memory; the next write saves it all."""
        try:
            self.save()
        except OSError as exc:
            _disk_log.warning("leader metadata not written (%s); carrying on from memory, the next write retries",
                              exc)

    def save(self) -> None:
        """Write the metadata file (with ``cond`` held): the commit point of a decision. Raises
        OSError (the disk is full, ...) with the file on disk unchanged."""
        if not self.cfg.metadata:
            return
        fates = [dataclasses.asdict(p) for p in self.pushes.values() if p.state != "requested"][-PUSH_FATES:]
        meta = {
            "version": self.version, "complete": self.complete, "tokens_total": self.tokens_total,
            "decisions": {str(v): d for v, d in self.decisions.items()}, "collecting": self.collecting,
            "clusters": [dataclasses.asdict(c) for c in self.clusters.values()], "pushes": fates,
            "followers": [{k: getattr(f, k) for k in ("index", "data", "ctrl")} for f in self.followers.values()],
            "penalty": self.penalty.state(), "grace": self.grace.state(),
        }
        if self.cfg.seed_from_cluster and self.layout is not None:
            meta["layout"] = self.layout.to_wire()  # the model came from a cluster: nowhere else to find it
        write_text_atomic(self.cfg.metadata, json.dumps(meta, separators=(",", ":")))

    def load(self) -> None:
        """Resume from the metadata file, if there is one."""
        if not self.cfg.metadata or not Path(self.cfg.metadata).exists():
            return
        try:
            meta = json.loads(Path(self.cfg.metadata).read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"leader metadata {self.cfg.metadata} is unreadable ({exc}); restore it from a "
                             "backup, or move it away to start a new job") from None
        if "layout" in meta and self.layout is None:
            self.set_layout(ModelLayout.from_wire(meta["layout"]))
        self.version, self.complete = meta["version"], meta["complete"]
        self.tokens_total = meta["tokens_total"]
        self.decisions = {int(v): d for v, d in meta["decisions"].items()}
        self.collecting = list(meta["collecting"])
        now = time.monotonic() + 3.0  # peers get a few seconds to find the restarted leader
        for c in meta["clusters"]:
            self.clusters[c["id"]] = ClusterRecord(**{**c, "last_hb": now})
        for p in meta["pushes"]:
            self.pushes[p["id"]] = PushRecord(**p)
        for f in meta["followers"]:
            self.add_follower(FollowerRecord(f["index"], f["data"], f["ctrl"], last_hb=now, restarted_at=now))
        self.penalty.load_state(meta["penalty"])
        self.grace.load_state(meta["grace"])
        log.info("leader resumed at version %d with %d clusters, %d pending pushes",
                 self.version, len(self.clusters), len(self.collecting))


def call_follower(f: FollowerRecord, name: str, **fields) -> dict:
    """A follower call whose failure is an answer (``ok: False``), not an exception."""
    if f.client is None:
        return {"ok": False, "err": "follower not connected"}
    try:
        return f.client.call(name, timeout=30, **fields)
    except RpcError as exc:
        return {"ok": False, "err": str(exc)}
