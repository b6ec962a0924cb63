"""The leader's RPC handlers: what clusters and followers may ask, each checked before the state
changes (roles per method, names, addresses, token counts, push coverage)."""
from __future__ import annotations

import hmac
import logging
import secrets
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from diutil import untrusted
from diutil.address import split
from .auth import JobToken, issue_push_id
from .layout import ModelLayout
from .leader_state import ClusterRecord, FollowerRecord, LeaderState, PushRecord, call_follower
from .rpc import RpcServer, Tls
from .schedule import greedy_schedule

log = logging.getLogger("dips.leader")

MAX_NAME_CHARS = 128
MAX_VERSION = 2 ** 62
MAX_WAIT_S = 30.0
MAX_PULL_S = 24 * 3600.0


class LeaderService:
    """Serves ``dips.Leader`` on ``state``: clusters present the job token, followers the server
    token. ``WaitPush`` sleeps on the server's event loop (no thread per waiting cluster)."""

    def __init__(self, state: LeaderState, token: JobToken, server_token: JobToken, cluster_key: bytes,
                 pool: ThreadPoolExecutor, tls: Tls | None):
        self.state, self.cfg, self.cluster_key, self.pool = state, state.cfg, cluster_key, pool
        self.server_token = server_token
        clusters, servers = (token,), (server_token,)
        handlers = {
            "RegisterCluster": (self.register_cluster, clusters), "Heartbeat": (self.heartbeat, clusters),
            "Leave": (self.leave, clusters),
            "PushRequest": (self.push_request, clusters), "PushDone": (self.push_done, clusters),
            "Plan": (self.plan, clusters), "Status": (self.status, clusters + servers),
            "RegisterFollower": (self.register_follower, servers),
            "FollowerHeartbeat": (self.follower_heartbeat, servers),
        }
        access = {n: h[1] for n, h in handlers.items()} | {"WaitPush": clusters}
        self.rpc = RpcServer("dips.Leader", {n: h[0] for n, h in handlers.items()}, access, bind=self.cfg.bind,
                             threads=16, tls=tls, waits={"WaitPush": self.wait_push})
        state.wake = self.rpc.notify

    # ------------------------------------------------------------ followers
    def register_follower(self, msg: dict) -> dict:
        st = self.state
        with st.cond:
            if st.layout is None:
                return {"status": "wait"}  # a seeded PS learns its model from the first cluster
            index = untrusted.integer(msg, "index", 0, self.cfg.n_followers - 1, default=None)
            if index is None:
                free = [i for i in range(self.cfg.n_followers) if i not in st.followers]
                if not free:
                    raise ValueError(f"all {self.cfg.n_followers} follower slots are taken")
                index = free[0]
            if self.cfg.init and msg.get("fingerprint") != st.layout.fingerprint:
                raise ValueError(f"this PS serves model {st.layout.fingerprint} from --init; the follower has "
                                 f"{msg.get('fingerprint') or 'no --init'}: give it the leader's --init file")
            rec = FollowerRecord(index, _address(msg["data"]), _address(msg["ctrl"]),
                                 untrusted.integer(msg, "version", -1, MAX_VERSION, default=-1),
                                 last_hb=time.monotonic())
            st.add_follower(rec)
            log.info("follower %d registered (data %s, version %d)", index, rec.data, rec.version)
            if self.cfg.model:
                model = {"model": self.cfg.model, "seed": self.cfg.seed}
            elif self.cfg.seed_from_cluster:  # zeros until the seeding round makes version 1
                model = {"layout": st.layout.to_wire()}
            else:
                model = {}
            return {"status": "ok", "index": index, **model, "fingerprint": st.layout.fingerprint,
                    "units": list(st.partition[index]), "lr": self.cfg.outer_lr,
                    "momentum": self.cfg.outer_momentum, "hb": self.cfg.follower_heartbeat_s,
                    "cluster_key": self.cluster_key.decode()}

    def follower_heartbeat(self, msg: dict) -> dict:
        index = untrusted.integer(msg, "id", 0, self.cfg.n_followers - 1)
        version = untrusted.integer(msg, "version", -1, MAX_VERSION)
        ckpt = untrusted.integer(msg, "ckpt", -1, MAX_VERSION, default=-1)
        with self.state.cond:
            rec = self.state.followers.get(index)
            if rec is None:
                return {"known": False}
            rec.last_hb, rec.version, rec.ckpt = time.monotonic(), version, ckpt
            return {"known": True}

    # ------------------------------------------------------------- clusters
    def register_cluster(self, msg: dict) -> dict:
        st = self.state
        with st.cond:
            if st.layout is None:
                if "layout" not in msg:
                    return {"status": "layout"}  # the PS has no model yet: this cluster will seed it
                layout = ModelLayout.from_wire(msg["layout"])
                if layout.fingerprint != msg.get("fingerprint"):
                    raise ValueError(f"the cluster's layout has fingerprint {layout.fingerprint}, not the "
                                     f"{str(msg.get('fingerprint'))[:40]!r} it claims")
                st.set_layout(layout)
                log.info("model of %d tensors in %d units taken from the first cluster (%s)",
                         sum(len(u.tensors) for u in layout.units), len(layout.units), layout.fingerprint)
                st.persist()
        if msg.get("fingerprint") != st.layout.fingerprint:
            raise ValueError(f"model fingerprint {msg.get('fingerprint')!r} does not match the PS model "
                             f"({st.layout.fingerprint}, {sum(len(u.tensors) for u in st.layout.units)} tensors): "
                             "the cluster's named_parameters() must have the PS's names and shapes")
        name = untrusted.text(msg, "name", MAX_NAME_CHARS, default=None)
        with st.cond:
            if not st.ready():
                return {"status": "not_ready"}
            cid = name or uuid.uuid4().hex[:8]
            held = st.clusters.get(cid)
            if held is not None and not _same_secret(msg, held):
                raise PermissionError(f"cluster name {cid!r} is held by a live cluster; a cluster re-joins under "
                                      "its name with the secret it was given, or waits until the holder's "
                                      "heartbeats lapse")
            seed = st.seeding()
            if seed and st.seeder not in (None, cid) and st.seeder in st.clusters:
                return {"status": "not_ready"}  # another cluster is seeding the PS
            secret = secrets.token_hex(16)
            st.clusters[cid] = ClusterRecord(cid, st.complete, last_hb=time.monotonic(), counted_at=time.time(),
                                             secret=secret)
            if seed:
                st.seeder = cid
            log.info("cluster %s joined at version %d%s", cid, st.complete, " to seed the PS" if seed else "")
            st.persist()
            return {"status": "ok", "id": cid, "secret": secret, "version": st.complete, "hb": self.cfg.heartbeat_s,
                    "seed": seed, **st.data_plan()}

    def _caller(self, msg: dict) -> tuple[str, ClusterRecord | None]:
        """The cluster a call speaks for, checked against its registration secret (call with
        ``cond`` held); None when no cluster of that id is registered."""
        cid = untrusted.text(msg, "id", MAX_NAME_CHARS)
        rec = self.state.clusters.get(cid)
        if rec is not None and not _same_secret(msg, rec):
            raise PermissionError(f"cluster {cid!r}: the secret given at its registration is missing or wrong")
        return cid, rec

    def heartbeat(self, msg: dict) -> dict:
        with self.state.cond:
            _, rec = self._caller(msg)
            if rec is None:
                return {"known": False}
            rec.last_hb = time.monotonic()
            return {"known": True, "version": self.state.complete, "done": self.state.budget_done()}

    def leave(self, msg: dict) -> dict:
        """A cluster departs on purpose: rounds stop waiting for it at once, not after its
        heartbeats lapse (sync DiLoCo would otherwise stall for that long)."""
        with self.state.cond:
            cid, rec = self._caller(msg)
            self.state.remove_cluster(cid, "it left")
            return {"known": rec is not None}

    def push_request(self, msg: dict) -> dict:
        st = self.state
        with st.cond:
            cid, rec = self._caller(msg)
            if rec is None:
                return {"status": "unknown"}
            rec.last_hb = time.monotonic()
            if st.budget_done():
                return {"status": "done"}
            if not st.ready():
                return {"status": "not_ready"}
            if "pull_s" in msg:
                st.pull_s = untrusted.number(msg, "pull_s", 0.0, MAX_PULL_S)
            workers = self._checked_workers(cid, msg["workers"])
            base = untrusted.integer(msg, "base", -1, MAX_VERSION)
            if base != rec.base:  # e.g. its last pull failed: it must re-join from the latest version
                log.warning("cluster %s pushes against version %d; the PS expects %d: it re-joins", cid, base, rec.base)
                return {"status": "unknown"}
            tokens = self._checked_tokens(rec, msg["tokens"])
            # one push in flight per cluster: a new request supersedes one it gave up on
            stale = [p.id for p in st.pushes.values() if p.cluster == cid and p.state == "requested"]
            for p in stale:
                st.pushes[p].state = "failed"
            if stale:
                self.pool.submit(st.discard, stale)
            streamed = msg.get("stream", False)
            if not isinstance(streamed, bool):
                raise ValueError(f"stream {str(streamed)[:40]}; expected true or false")
            push = PushRecord(issue_push_id(self.server_token, cid), cid, tokens, base, t=time.monotonic(),
                              streamed=streamed)
            st.pushes[push.id] = push
            steps = greedy_schedule(workers, st.dest)
            return {"status": "ok", "push": push.id, "schedule": steps, **st.data_plan()}  # followers may have moved

    def _checked_workers(self, cid: str, workers) -> dict[int, list[int]]:
        n = len(self.state.layout.units)
        if not isinstance(workers, dict) or not 0 < len(workers) <= n:
            raise ValueError(f"push of cluster {cid}: workers must map 1..{n} worker ids to their units")
        out = {}
        for w in workers:
            if not (w.isdigit() and len(w) <= 9):
                raise ValueError(f"push of cluster {cid}: worker {w[:20]!r}; expected a worker number")
            out[int(w)] = untrusted.integers(workers, w, 0, n - 1, n)
        held = sorted(u for units in out.values() for u in units)
        if held != list(range(n)):
            raise ValueError(f"push of cluster {cid} covers units {held[:8]}{'...' if len(held) > 8 else ''}; "
                             f"expected all {n} units exactly once")
        return out

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

    def push_done(self, msg: dict) -> dict:
        st = self.state
        with st.cond:
            cid, _ = self._caller(msg)
            push = st.pushes.get(untrusted.text(msg, "push", MAX_NAME_CHARS))
            if push is None or push.cluster != cid or push.state != "requested":
                raise ValueError(f"push {str(msg['push'])[:40]!r} of cluster {cid[:40]!r} is not awaiting completion")
            followers = [st.followers[i] for i in range(self.cfg.n_followers)]
        replies = list(self.pool.map(lambda f: call_follower(f, "Seal", push=push.id), followers))
        errors = [r.get("err", "unknown error") for r in replies if not r.get("ok")]
        with st.cond:
            if errors or push.state != "requested":
                push.state = "failed"
                self.pool.submit(st.discard, [push.id])
                log.warning("push %s of cluster %s failed: %s", push.id, push.cluster, "; ".join(errors))
                return {"status": "failed", "err": "; ".join(errors) or "cluster removed"}
            push.state, push.norm = "sealed", sum(r["norm"] for r in replies)
            st.collecting.append(push.id)
            now = time.monotonic()
            st.last_seal = now
            st.grace.observe_arrival(now)
            st.tokens_total += push.tokens
            if st.budget_done() and st.budget_reached_at is None:
                st.budget_reached_at = time.time()
            st.clusters[push.cluster].tokens += push.tokens
            st.clusters[push.cluster].counted_at = time.time()
            st.persist()
            st.changed()
            return {"status": "sealed"}

    async def wait_push(self, msg: dict) -> dict:
        """The fate of a push, waiting up to ``wait`` seconds (30 at most) for its round; the wait
        holds no thread (it sleeps on the RPC server's event loop)."""
        wait = untrusted.number(msg, "wait", 0.0, float(2 ** 31), default=0.0)
        deadline = time.monotonic() + min(wait, MAX_WAIT_S)
        push = untrusted.text(msg, "push", MAX_NAME_CHARS)
        while True:
            with self.state.cond:
                fate = self.state.fate(push)
            left = deadline - time.monotonic()
            if fate is not None or left <= 0:
                return fate or {"state": "pending"}
            await self.rpc.changed(left)

    # ------------------------------------------------------------ observers
    def plan(self, msg: dict) -> dict:
        """Where to read the latest complete parameters from (observers: evaluation, tools)."""
        with self.state.cond:
            if not self.state.ready() or self.state.seeding():
                raise ValueError("followers are not ready yet (or the PS is not seeded yet)")
            return {"version": self.state.complete, **self.state.data_plan()}

    def status(self, msg: dict) -> dict:
        with self.state.cond:
            return self.state.status()


def _same_secret(msg: dict, rec: ClusterRecord) -> bool:
    """Whether ``msg`` carries the secret ``rec`` was registered with (constant-time compare)."""
    given = msg.get("secret")
    return isinstance(given, str) and bool(rec.secret) and hmac.compare_digest(given.encode(), rec.secret.encode())


def _address(value) -> str:
    """A HOST:PORT a peer sent, checked before it is stored and dialled."""
    if not isinstance(value, str) or len(value) > 300:
        raise ValueError(f"address {str(value)[:80]!r}; expected HOST:PORT")
    split(value)
    return value
