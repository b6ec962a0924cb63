"""Leader PS: the control flow of Di-PS (gRPC).

It registers followers and clusters and watches their heartbeats, answers push requests with a
per-cluster communication schedule (Appendix A), seals completed pushes with the followers,
closes rounds after a grace time (Algorithm 1), runs the pseudo-gradient penalty, and tells the
followers to apply the outer step. Every round's decision is logged in the metadata file (kept
well under 100 KB), which is the commit point: a follower that restarts from an older checkpoint
is brought forward by replaying logged decisions, and a restarted leader resumes from it.

Modes share this code: ``dips`` (grace time + penalty), ``sync`` (DiLoCo: a round closes when
every live cluster has pushed) and ``async`` (asynchronous DiLoCo: every push is applied at once,
no penalty), so the baselines run under one harness.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .address import advertised, split
from .auth import CLUSTER_KEY_LABEL, FOLLOWER_KEY_LABEL, JobToken
from .curve import KeyPair
from .grace import GraceEstimator
from .layout import ModelLayout
from .model import initial_parameters, load_initial
from .penalty import PseudoGradientPenalty, token_weights
from .rpc import RpcClient, RpcError, RpcServer, Tls
from .schedule import greedy_schedule
from .supervisor import FollowerLaunch, FollowerSupervisor

log = logging.getLogger("dips.leader")

MODES = ("dips", "sync", "async")
DECISION_LOG = 64     # decisions always kept ...
MAX_DECISIONS = 1024  # ... and back to the oldest follower checkpoint, up to this many (~100 B each)
PUSH_FATES = 256


@dataclasses.dataclass
class LeaderConfig:
    model: dict | None  # a LLaMA config (with ``seed``) ...
    n_followers: int
    bind: str = "127.0.0.1:7000"
    advertise: str | None = None  # what launched followers dial (default: bind, or routable if wildcard)
    mode: str = "dips"
    seed: int = 0
    outer_lr: float = 0.7
    outer_momentum: float = 0.8
    alpha: float = 0.02
    beta: float = 3.0
    clip_norm: float | None = 1.0
    warmup_rounds: int = 3
    initial_grace: float = 0.05
    max_grace: float = 5.0
    heartbeat_s: float = 1.0
    follower_heartbeat_s: float = 1.0
    push_timeout_s: float = 10.0
    token_budget: int | None = None
    # the most tokens per second one cluster is believed to consume: a push claiming more than
    # this rate since the cluster's last sealed push is refused (it would dominate the average)
    max_cluster_tokens_per_s: float = 1e7
    metadata: str | None = None
    restart_followers: bool = True
    # followers this leader runs itself (data addresses; follower i gets launch_followers[i]) and
    # relaunches from <checkpoint_root>/follower-<i> when they die; needs the server token's file
    launch_followers: tuple[str, ...] = ()
    checkpoint_root: str = "dips-followers"
    server_token_file: str | None = None
    init: str | None = None  # ... or any model's parameters from this file (followers read it too)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode {self.mode!r}; expected one of {MODES}")
        if (self.model is None) == (self.init is None):
            raise ValueError("give the PS a model config or an --init file of parameters (exactly one)")
        if self.n_followers < 1:
            raise ValueError(f"n_followers={self.n_followers}; expected >= 1")
        if not self.max_cluster_tokens_per_s > 0:
            raise ValueError(f"max_cluster_tokens_per_s={self.max_cluster_tokens_per_s}; expected > 0")
        if self.launch_followers and len(self.launch_followers) != self.n_followers:
            raise ValueError(f"{len(self.launch_followers)} follower addresses to launch for {self.n_followers} "
                             "followers; give one per follower or none")
        if self.launch_followers and not self.server_token_file:
            raise ValueError("launching followers needs the server token's file (server_token_file)")


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


class Leader:
    """The leader PS. ``token``: the job token clusters hold; ``server_token``: the secret the
    leader and its followers share (registering a follower and every call to a follower need it)."""

    def __init__(self, config: LeaderConfig, token: JobToken, server_token: JobToken, tls: Tls | None = None):
        if token.matches(server_token.secret):
            raise ValueError("the server token equals the job token: clusters could act as followers; "
                             "make a separate one with `ditorch ps token`")
        self.cfg, self.token, self.server_token, self.tls = config, token, server_token, tls
        self.cluster_key = KeyPair.derive(token, CLUSTER_KEY_LABEL).public
        self.follower_key = KeyPair.derive(server_token, FOLLOWER_KEY_LABEL).public
        initial = load_initial(config.init) if config.init else initial_parameters(config.model, config.seed)
        self.layout = ModelLayout.of_specs([(n, tuple(t.shape)) for n, t in initial.items()])
        del initial
        self.partition = self.layout.partition(config.n_followers)
        self.dest = self.layout.owner_of_units(config.n_followers)
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
        self.budget_reached_at: float | None = None
        self.penalty = PseudoGradientPenalty(config.alpha, config.beta, config.clip_norm, config.warmup_rounds)
        self.grace = GraceEstimator(config.initial_grace, max_grace=config.max_grace)
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=max(4, config.n_followers))
        self._load_metadata()
        clusters, servers = (token,), (server_token,)
        handlers = {
            "RegisterCluster": (self._register_cluster, clusters), "Heartbeat": (self._heartbeat, clusters),
            "PushRequest": (self._push_request, clusters), "PushDone": (self._push_done, clusters),
            "Plan": (self._plan, clusters),
            "Status": (self._status, clusters + servers),
            "RegisterFollower": (self._register_follower, servers),
            "FollowerHeartbeat": (self._follower_heartbeat, servers),
        }
        access = {n: h[1] for n, h in handlers.items()} | {"WaitPush": clusters}
        self.rpc = RpcServer("dips.Leader", {n: h[0] for n, h in handlers.items()}, access, bind=config.bind,
                             threads=16, tls=tls, waits={"WaitPush": self._wait_push})
        self.address = advertised(config.bind.rsplit(":", 1)[0] + f":{self.rpc.port}", config.advertise, None)
        root = Path(config.checkpoint_root)
        self.supervisor = FollowerSupervisor(
            [FollowerLaunch(i, b, str(root / f"follower-{i}")) for i, b in enumerate(config.launch_followers)],
            self.address, config.server_token_file or "",
            tls_args(tls) + (["--init", str(Path(config.init).resolve())] if config.init else []))
        self.supervisor.start_all(known=set(self.followers))
        self._threads = [threading.Thread(target=f, daemon=True, name=f"dips-leader-{f.__name__}")
                         for f in (self._round_loop, self._monitor_loop)]
        for t in self._threads:
            t.start()

    # ------------------------------------------------------------ metadata
    def _save_metadata(self) -> None:
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
        path = Path(self.cfg.metadata)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(meta, separators=(",", ":")))
        os.replace(tmp, path)

    def _load_metadata(self) -> None:
        if not self.cfg.metadata or not Path(self.cfg.metadata).exists():
            return
        meta = json.loads(Path(self.cfg.metadata).read_text())
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
            rec = FollowerRecord(f["index"], f["data"], f["ctrl"], last_hb=now, restarted_at=now)
            rec.client = RpcClient("dips.Follower", rec.ctrl, self.server_token, self.tls)
            self.followers[rec.index] = rec
        self.penalty.load_state(meta["penalty"])
        self.grace.load_state(meta["grace"])
        log.info("leader resumed at version %d with %d clusters, %d pending pushes",
                 self.version, len(self.clusters), len(self.collecting))

    # ------------------------------------------------------------ handlers
    def _register_follower(self, msg: dict) -> dict:
        with self.cond:
            index = msg.get("index")
            if index is None:
                free = [i for i in range(self.cfg.n_followers) if i not in self.followers]
                if not free:
                    raise ValueError(f"all {self.cfg.n_followers} follower slots are taken")
                index = free[0]
            index = int(index)
            if self.cfg.init and msg.get("fingerprint") != self.layout.fingerprint:
                raise ValueError(f"this PS serves model {self.layout.fingerprint} from --init; the follower has "
                                 f"{msg.get('fingerprint') or 'no --init'}: give it the leader's --init file")
            if not 0 <= index < self.cfg.n_followers:
                raise ValueError(f"follower index {index}; expected 0..{self.cfg.n_followers - 1}")
            old = self.followers.get(index)
            if old is not None and old.client is not None:
                old.client.close()
            rec = FollowerRecord(index, _address(msg["data"]), _address(msg["ctrl"]), int(msg.get("version", -1)),
                                 time.monotonic())
            rec.client = RpcClient("dips.Follower", rec.ctrl, self.server_token, self.tls)
            self.followers[index] = rec
            log.info("follower %d registered (data %s, version %d)", index, rec.data, rec.version)
            model = {"model": self.cfg.model, "seed": self.cfg.seed} if self.cfg.model else {}
            return {"index": index, **model, "fingerprint": self.layout.fingerprint,
                    "units": list(self.partition[index]), "lr": self.cfg.outer_lr,
                    "momentum": self.cfg.outer_momentum, "hb": self.cfg.follower_heartbeat_s,
                    "cluster_key": self.cluster_key.decode()}

    def _ready(self) -> bool:
        return (len(self.followers) == self.cfg.n_followers
                and all(f.version >= self.complete for f in self.followers.values()))

    def _register_cluster(self, msg: dict) -> dict:
        if msg.get("fingerprint") != self.layout.fingerprint:
            raise ValueError(f"model fingerprint {msg.get('fingerprint')!r} does not match the PS model "
                             f"({self.layout.fingerprint}, {sum(len(u.tensors) for u in self.layout.units)} tensors): "
                             "the cluster's named_parameters() must have the PS's names and shapes")
        with self.cond:
            if not self._ready():
                return {"status": "not_ready"}
            cid = str(msg.get("name") or uuid.uuid4().hex[:8])
            self.clusters[cid] = ClusterRecord(cid, self.complete, last_hb=time.monotonic(), counted_at=time.time())
            log.info("cluster %s joined at version %d", cid, self.complete)
            self._save_metadata()
            return {"status": "ok", "id": cid, "version": self.complete, "hb": self.cfg.heartbeat_s,
                    **self._data_plan()}

    def _data_plan(self) -> dict:
        return {"followers": [self.followers[i].data for i in range(self.cfg.n_followers)],
                "units": [list(b) for b in self.partition], "key": self.follower_key.decode()}

    def _follower_heartbeat(self, msg: dict) -> dict:
        with self.cond:
            rec = self.followers.get(int(msg["id"]))
            if rec is None:
                return {"known": False}
            rec.last_hb, rec.version, rec.ckpt = time.monotonic(), int(msg["version"]), int(msg.get("ckpt", -1))
            return {"known": True}

    def _heartbeat(self, msg: dict) -> dict:
        now = time.monotonic()
        with self.cond:
            rec = self.clusters.get(str(msg["id"]))
            if rec is None:
                return {"known": False}
            rec.last_hb = now
            return {"known": True, "version": self.complete, "done": self._budget_done()}

    def _budget_done(self) -> bool:
        return self.cfg.token_budget is not None and self.tokens_total >= self.cfg.token_budget

    def _push_request(self, msg: dict) -> dict:
        cid = str(msg["id"])
        with self.cond:
            rec = self.clusters.get(cid)
            if rec is None:
                return {"status": "unknown"}
            rec.last_hb = time.monotonic()
            if self._budget_done():
                return {"status": "done"}
            if not self._ready():
                return {"status": "not_ready"}
            if "pull_s" in msg:
                self._pull_s = float(msg["pull_s"])
            workers = {int(w): [int(u) for u in units] for w, units in msg["workers"].items()}
            held = sorted(u for units in workers.values() for u in units)
            if held != list(range(len(self.layout.units))):
                raise ValueError(f"push of cluster {cid} covers units {held}; expected all "
                                 f"{len(self.layout.units)} units exactly once")
            base = int(msg["base"])
            if base != rec.base:  # e.g. its last pull failed: it must re-join from the latest version
                log.warning("cluster %s pushes against version %d; the PS expects %d: it re-joins", cid, base, rec.base)
                return {"status": "unknown"}
            push = PushRecord(uuid.uuid4().hex[:12], cid, self._checked_tokens(rec, msg["tokens"]), base,
                              t=time.monotonic())
            self.pushes[push.id] = push
            steps = greedy_schedule(workers, self.dest)
            return {"status": "ok", "push": push.id, "schedule": steps, **self._data_plan()}  # followers may have moved

    def _checked_tokens(self, rec: ClusterRecord, tokens) -> int:
        """A push's consumed-token count, bounded by what the cluster could have consumed since
        its tokens were last counted: the count is the push's averaging weight."""
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            raise ValueError(f"push of cluster {rec.id}: tokens={tokens!r}; expected a whole count >= 0")
        elapsed = max(0.0, time.time() - rec.counted_at)
        bound = self.cfg.max_cluster_tokens_per_s * (elapsed + 1.0)  # a second of slack for clock steps
        if tokens > bound:
            raise ValueError(f"push of cluster {rec.id}: {tokens} tokens in {elapsed:.1f} s since its tokens were "
                             f"last counted; at most {bound:.0f} at {self.cfg.max_cluster_tokens_per_s:g} tokens/s "
                             f"(--max-cluster-tokens-per-s)")
        return tokens

    def _push_done(self, msg: dict) -> dict:
        with self.cond:
            push = self.pushes.get(str(msg["push"]))
            if push is None or push.cluster != str(msg["id"]) or push.state != "requested":
                raise ValueError(f"push {msg['push']!r} of cluster {msg['id']!r} is not awaiting completion")
            followers = [self.followers[i] for i in range(self.cfg.n_followers)]
        replies = list(self._pool.map(lambda f: _try(f.client, "Seal", push=push.id), followers))
        errors = [r.get("err", "unknown error") for r in replies if not r.get("ok")]
        with self.cond:
            if errors or push.state != "requested":
                push.state = "failed"
                self._pool.submit(self._discard, [push.id])
                log.warning("push %s of cluster %s failed: %s", push.id, push.cluster, "; ".join(errors))
                return {"status": "failed", "err": "; ".join(errors) or "cluster removed"}
            push.state, push.norm = "sealed", sum(r["norm"] for r in replies)
            self.collecting.append(push.id)
            now = time.monotonic()
            self.last_seal = now
            self.grace.observe_arrival(now)
            self.tokens_total += push.tokens
            if self._budget_done() and self.budget_reached_at is None:
                self.budget_reached_at = time.time()
            self.clusters[push.cluster].tokens += push.tokens
            self.clusters[push.cluster].counted_at = time.time()
            self._save_metadata()
            self._changed()
            return {"status": "sealed"}

    def _discard(self, pushes: list[str]) -> None:
        for f in list(self.followers.values()):
            _try(f.client, "Discard", pushes=pushes)

    async def _wait_push(self, msg: dict) -> dict:
        """The fate of a push, waiting up to ``wait`` seconds (30 at most) for its round; the wait
        holds no thread (it sleeps on the RPC server's event loop)."""
        deadline = time.monotonic() + min(float(msg.get("wait", 0)), 30.0)
        while True:
            with self.cond:
                fate = self._fate(str(msg["push"]))
            left = deadline - time.monotonic()
            if fate is not None or left <= 0:
                return fate or {"state": "pending"}
            await self.rpc.changed(left)

    def _fate(self, push_id: str) -> dict | None:
        push = self.pushes.get(push_id)
        if push is None:
            return {"state": "unknown"}
        if push.state in ("applied", "rejected") and self.complete >= push.version:
            return {"state": push.state, "version": push.version, "done": self._budget_done()}
        if push.state == "failed":
            return {"state": "failed"}
        return None

    def _changed(self) -> None:
        """Wake the round loop and every waiting WaitPush (call with ``cond`` held)."""
        self.cond.notify_all()
        self.rpc.notify()

    def _plan(self, msg: dict) -> dict:
        """Where to read the latest complete parameters from (observers: evaluation, tools)."""
        with self.cond:
            if not self._ready():
                raise ValueError("followers are not ready yet")
            return {"version": self.complete, **self._data_plan()}

    def _status(self, msg: dict) -> dict:
        with self.cond:
            return {"version": self.version, "complete": self.complete, "tokens": self.tokens_total,
                    "clusters": sorted(self.clusters), "followers": {str(i): f.version for i, f in self.followers.items()},
                    "grace": round(self.grace.grace(), 4), "done": self._budget_done()}

    # --------------------------------------------------------------- rounds
    def _should_close(self, now: float) -> bool:
        if not self.collecting or self.complete < self.version:
            return False
        if self.cfg.mode == "async":
            return True
        if self.cfg.mode == "sync":
            pushed = {self.pushes[p].cluster for p in self.collecting}
            return set(self.clusters) <= pushed
        inflight = any(p.state == "requested" and now - p.t < self.cfg.push_timeout_s for p in self.pushes.values())
        return not inflight and now - self.last_seal >= self.grace.grace()

    def _round_loop(self) -> None:
        while not self._stop.is_set():
            with self.cond:
                self.cond.wait(0.005)
                if not self._should_close(time.monotonic()):
                    continue
                pushes = [self.pushes[p] for p in self.collecting]
                self.collecting = []
            try:
                self._run_round(pushes)
            except Exception:  # only fails before its commit point: never let it kill the leader, retry
                log.exception("round failed; its pushes go back to the next round")
                with self.cond:
                    self.collecting = [p.id for p in pushes] + self.collecting
                time.sleep(0.2)

    def _run_round(self, pushes: list[PushRecord]) -> None:
        t0 = time.monotonic()
        tokens = {p.id: p.tokens for p in pushes}
        penalty_before = json.loads(json.dumps(self.penalty.state()))
        if self.cfg.mode == "dips":
            decision = self.penalty.decide({p.id: p.norm for p in pushes}, tokens)
            accepted, rejected, weights = decision.accepted, decision.rejected, decision.weights
        else:
            accepted, rejected, weights = [p.id for p in pushes], [], token_weights(tokens)
        scale = 1.0
        if accepted and self.cfg.mode == "dips" and self.cfg.clip_norm is not None:
            try:
                sq = list(self._pool.map(lambda f: f.client.call("Prepare", timeout=30, weights=weights),
                                         [self.followers[i] for i in range(self.cfg.n_followers)]))
            except RpcError:
                self.penalty.load_state(penalty_before)  # the round is retried: count its norms once
                raise
            scale = self.penalty.clip_scale(sum(r["sqnorm"] for r in sq) ** 0.5)
        with self.cond:
            if accepted:
                self.version += 1
                self.decisions[self.version] = {"weights": weights, "scale": scale, "drop": rejected}
                oldest_ckpt = min((f.ckpt for f in self.followers.values()), default=self.version)
                floor = max(min(self.version - DECISION_LOG, oldest_ckpt), self.version - MAX_DECISIONS)
                for v in [v for v in self.decisions if v <= floor]:
                    del self.decisions[v]
            version = self.version
            for p in pushes:
                p.state, p.version = ("applied" if p.id in accepted else "rejected"), version
                if p.cluster in self.clusters:
                    self.clusters[p.cluster].base = version
            self._save_metadata()  # commit point
        if rejected:
            log.warning("round %d rejected pushes %s (outliers)", version, rejected)
        if accepted:
            self._sync_followers(deadline_s=None)  # committed: wait for (restarted) followers, never redo
        else:
            self._discard(rejected)
        with self.cond:
            self.complete = version if accepted else self.complete
            self._save_metadata()
            self._changed()
        self.grace.observe_cost(time.monotonic() - t0 + getattr(self, "_pull_s", 0.0))
        self.rounds_log.append({"version": version, "t": time.time(), "accepted": len(accepted),
                                "rejected": len(rejected), "clusters": [p.cluster for p in pushes],
                                "grace": self.grace.grace(), "scale": scale})

    def _keep_versions(self) -> list[int]:
        keep = {self.version, self.complete}
        keep |= {c.base for c in self.clusters.values()}
        keep |= {self.pushes[p].base for p in self.collecting}
        return sorted(keep)

    def _sync_followers(self, deadline_s: float | None) -> None:
        """Bring every follower to ``self.version`` by applying logged decisions in order.

        ``deadline_s=None`` waits as long as it takes (a dead follower is being relaunched).
        """
        deadline = time.monotonic() + (deadline_s if deadline_s is not None else float("inf"))
        while not self._stop.is_set():
            with self.cond:
                target = self.version
                behind = [f for f in self.followers.values() if f.version < target]
                keep = self._keep_versions()
            if len(self.followers) == self.cfg.n_followers and not behind:
                return
            list(self._pool.map(lambda f: self._catch_up(f, target, keep), behind))
            if time.monotonic() > deadline:
                raise TimeoutError(f"followers {[f.index for f in behind]} did not reach version {target}")
            with self.cond:
                if any(f.version < target for f in self.followers.values()):
                    self.cond.wait(0.1)

    def _catch_up(self, f: FollowerRecord, target: int, keep: list[int]) -> None:
        v = f.version
        while v < target and v >= 0:
            d = self.decisions.get(v + 1)
            if d is None:
                log.error("follower %d is at version %d but the decision log starts at %s", f.index, v,
                          min(self.decisions, default=None))
                return
            try:
                reply = f.client.call("Apply", timeout=60, version=v + 1, weights=d["weights"], scale=d["scale"],
                                      drop=d["drop"], keep=keep)
            except RpcError as exc:
                log.warning("apply of version %d on follower %d failed: %s", v + 1, f.index, exc)
                return
            v = int(reply["version"])
            with self.cond:
                f.version = max(f.version, v)

    # -------------------------------------------------------------- monitor
    def _monitor_loop(self) -> None:
        while not self._stop.wait(min(self.cfg.heartbeat_s, self.cfg.follower_heartbeat_s) / 2):
            now = time.monotonic()
            with self.cond:
                gone = [c for c in self.clusters.values() if now - c.last_hb > 3 * self.cfg.heartbeat_s]
                for c in gone:
                    del self.clusters[c.id]
                    log.warning("cluster %s removed: no heartbeat for 3 intervals", c.id)
                    for p in self.pushes.values():
                        if p.cluster == c.id and p.state == "requested":
                            p.state = "failed"
                if gone:
                    self._save_metadata()
                    self._changed()
                dead = [f for f in self.followers.values()
                        if now - f.last_hb > 3 * self.cfg.follower_heartbeat_s and now - f.restarted_at > 10.0]
                lagging = self.complete < self.version or any(f.version < self.complete for f in self.followers.values())
            for f in dead:
                self._restart_follower(f)
            if lagging and len(self.followers) == self.cfg.n_followers:
                try:
                    self._sync_followers(deadline_s=0.5)
                except TimeoutError:
                    pass

    def _restart_follower(self, f: FollowerRecord) -> None:
        f.restarted_at = time.monotonic()
        try:  # heartbeats lost but the follower answers: it is alive, do not start a second one
            f.client.call("Status", timeout=1.0)
            f.last_hb = time.monotonic()
            return
        except RpcError:
            pass
        if not self.cfg.restart_followers or not self.supervisor.manages(f.index):
            log.error("follower %d stopped heartbeating; not restarting it (%s)", f.index,
                      "restart disabled" if self.supervisor.manages(f.index) else "this leader did not launch it")
            return
        log.warning("follower %d stopped heartbeating; restarting it from its latest checkpoint", f.index)
        self.supervisor.start(f.index)

    def status(self) -> dict:
        return self._status({})

    def stop(self) -> None:
        self._stop.set()
        self.rpc.stop()
        for t in self._threads:
            t.join(timeout=5)
        self.supervisor.stop()
        self._pool.shutdown(wait=False, cancel_futures=True)


def _try(client: RpcClient | None, name: str, **fields) -> dict:
    if client is None:
        return {"ok": False, "err": "follower not connected"}
    try:
        return client.call(name, timeout=30, **fields)
    except RpcError as exc:
        return {"ok": False, "err": str(exc)}


def _address(value) -> str:
    """A HOST:PORT a peer sent, checked before it is stored and dialled."""
    if not isinstance(value, str) or len(value) > 300:
        raise ValueError(f"address {str(value)[:80]!r}; expected HOST:PORT")
    split(value)
    return value


def tls_args(tls: Tls | None) -> list[str]:
    """Command-line options that give a launched follower the leader's TLS files."""
    if tls is None:
        return []
    return ["--tls-ca", tls.ca, "--tls-cert", tls.cert, "--tls-key", tls.key]
