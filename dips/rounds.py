"""The leader's round loop (Algorithm 1): when a round closes, what it decides (penalty, token
weights, clipping), the commit of the decision, and bringing every follower to the new version
(replaying logged decisions to a follower that is behind)."""
from __future__ import annotations

import json
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from diutil.untrusted import RateLimitedLog

from .leader_state import FollowerRecord, LeaderState, PushRecord
from .penalty import token_weights
from .rpc import RpcError

log = logging.getLogger("dips.leader")
RETRY_S, RETRY_MAX_S = 0.2, 10.0


class RoundRunner:
    def __init__(self, state: LeaderState, pool: ThreadPoolExecutor, stop: threading.Event):
        self.state, self.cfg, self.pool, self.stop = state, state.cfg, pool, stop

    def should_close(self, now: float) -> bool:
        """Algorithm 1's rule per mode (call with ``cond`` held)."""
        st = self.state
        if not st.collecting or st.complete < st.version:
            return False
        if self.cfg.mode == "async":
            return True
        if self.cfg.mode == "sync":
            pushed = {st.pushes[p].cluster for p in st.collecting}
            return set(st.clusters) <= pushed
        inflight = any(p.state == "requested" and not p.streamed and now - p.t < self.cfg.push_timeout_s
                       for p in st.pushes.values())
        return not inflight and now - st.last_seal >= st.grace.grace()

    def loop(self) -> None:
        st, pause, failures = self.state, RETRY_S, RateLimitedLog(log)
        while not self.stop.is_set():
            with st.cond:
                st.cond.wait(0.005)
                if not self.should_close(time.monotonic()):
                    continue
                pushes = [st.pushes[p] for p in st.collecting]
                st.collecting = []
            try:
                self.run(pushes)
                pause = RETRY_S
            except Exception as exc:  # only fails before its commit point: never let it kill the leader, retry
                failures.warning("round failed (%s: %s); its pushes go back to the next round, retrying in %.1f s",
                                 type(exc).__name__, exc, pause)
                with st.cond:
                    st.collecting = [p.id for p in pushes] + st.collecting
                self.stop.wait(pause)
                pause = min(2 * pause, RETRY_MAX_S)

    def run(self, pushes: list[PushRecord]) -> None:
        """Decide, commit and apply one round of sealed ``pushes``."""
        st, t0 = self.state, time.monotonic()
        tokens = {p.id: p.tokens for p in pushes}
        penalty_before = json.loads(json.dumps(st.penalty.state()))
        seed = st.seeding()
        if seed:  # version 1 of a seeded PS: the seeding cluster's parameters, as they are
            accepted = [p.id for p in pushes if p.cluster == st.seeder][:1]
            rejected, weights = [p.id for p in pushes if p.id not in accepted], {p: 1.0 for p in accepted}
        elif self.cfg.mode == "dips":
            decision = st.penalty.decide({p.id: p.norm for p in pushes}, tokens)
            accepted, rejected, weights = decision.accepted, decision.rejected, decision.weights
        else:
            accepted, rejected, weights = [p.id for p in pushes], [], token_weights(tokens)
        scale = stale_scale = 1.0
        penalized = bool(accepted) and not seed and self.cfg.mode == "dips"
        if penalized and self.cfg.clip_norm is not None:
            try:
                sq = list(self.pool.map(lambda f: f.client.call("Prepare", timeout=30, weights=weights),
                                        [st.followers[i] for i in range(self.cfg.n_followers)]))
            except RpcError:
                st.penalty.load_state(penalty_before)  # the round is retried: count its norms once
                raise
            scale = st.penalty.clip_scale(sum(r["sqnorm"] for r in sq) ** 0.5)
        if penalized:
            stale_scale = st.penalty.staleness_scale(weights, {p.id: st.version - p.base for p in pushes
                                                                if p.id in weights})
        with st.cond:
            undo = st.undo_point(pushes)
            version = st.record_decision(weights, scale * stale_scale, rejected, seed) if accepted else st.version
            for p in pushes:
                p.state, p.version = ("applied" if p.id in accepted else "rejected"), version
                if p.cluster in st.clusters:
                    st.clusters[p.cluster].base = version
            try:
                st.save()  # commit point
            except OSError:
                undo()
                st.penalty.load_state(penalty_before)  # the round is retried: count its norms once
                raise
        if rejected:
            log.warning("round %d rejected pushes %s (outliers)", version, rejected)
        if accepted:
            self.sync_followers(deadline_s=None)  # committed: wait for (restarted) followers, never redo
        else:
            st.discard(rejected)
        with st.cond:
            st.complete = version if accepted else st.complete
            st.forget_settled_pushes()
            st.persist()
            st.changed()
        st.grace.observe_cost(time.monotonic() - t0 + st.pull_s)
        # staleness: versions decided between a push's base and the one it is applied on top of
        st.rounds_log.append({"version": version, "t": time.time(), "accepted": len(accepted),
                              "rejected": len(rejected), "clusters": [p.cluster for p in pushes],
                              "staleness": [version - 1 - p.base for p in pushes if p.id in accepted],
                              "grace": st.grace.grace(), "scale": scale, "stale_scale": stale_scale})

    def sync_followers(self, deadline_s: float | None) -> None:
        """Bring every follower to the decided version by applying logged decisions in order.

        ``deadline_s=None`` waits as long as it takes (a dead follower is being relaunched).
        """
        st = self.state
        deadline = time.monotonic() + (deadline_s if deadline_s is not None else float("inf"))
        while not self.stop.is_set():
            with st.cond:
                target = st.version
                behind = [f for f in st.followers.values() if f.version < target]
                keep = st.keep_versions()
            if len(st.followers) == self.cfg.n_followers and not behind:
                return
            list(self.pool.map(lambda f: self._catch_up(f, target, keep), behind))
            if time.monotonic() > deadline:
                raise TimeoutError(f"followers {[f.index for f in behind]} did not reach version {target}")
            with st.cond:
                if any(f.version < target for f in st.followers.values()):
                    st.cond.wait(0.1)

    def _catch_up(self, f: FollowerRecord, target: int, keep: list[int]) -> None:
        st, v = self.state, f.version
        while v < target and v >= 0:
            d = st.decisions.get(v + 1)
            if d is None:
                log.error("follower %d is at version %d but the decision log starts at %s", f.index, v,
                          min(st.decisions, default=None))
                return
            try:
                reply = f.client.call("Apply", timeout=60, version=v + 1, weights=d["weights"], scale=d["scale"],
                                      drop=d["drop"], keep=keep, seed=d.get("seed", False))
            except RpcError as exc:
                log.warning("apply of version %d on follower %d failed: %s", v + 1, f.index, exc)
                return
            v = int(reply["version"])
            with st.cond:
                f.version = max(f.version, v)
