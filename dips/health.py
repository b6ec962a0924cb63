"""The leader's health monitor: removes clusters that stopped heartbeating, relaunches followers
that did (through the supervisor, for followers this leader launched), and brings lagging
followers forward."""
from __future__ import annotations

import logging
import threading
import time
import traceback

from diutil.untrusted import RateLimitedLog

from .leader_state import FollowerRecord, LeaderState
from .rounds import RoundRunner
from .rpc import RpcError
from .supervisor import FollowerSupervisor

log = logging.getLogger("dips.leader")

MISSED_HEARTBEATS = 3
RESTART_GRACE_S = 10.0  # a relaunched follower gets this long to register before it is judged again


class HealthMonitor:
    def __init__(self, state: LeaderState, rounds: RoundRunner, supervisor: FollowerSupervisor,
                 stop: threading.Event):
        self.state, self.cfg, self.rounds, self.supervisor, self.stop = state, state.cfg, rounds, supervisor, stop

    def loop(self) -> None:
        failures = RateLimitedLog(log)
        while not self.stop.wait(min(self.cfg.heartbeat_s, self.cfg.follower_heartbeat_s) / 2):
            try:
                self.tick()
            except Exception:  # a bug must not end the monitor: the next tick tries again
                failures.warning("health check failed:\n%s", traceback.format_exc())

    def tick(self) -> None:
        """One look at the clusters and followers: remove, relaunch, bring forward."""
        dead, lagging = self.check(time.monotonic())
        for f in dead:
            self._restart_follower(f)
        if lagging and len(self.state.followers) == self.cfg.n_followers:
            try:
                self.rounds.sync_followers(deadline_s=0.5)
            except TimeoutError:
                pass

    def check(self, now: float) -> tuple[list[FollowerRecord], bool]:
        """Remove silent clusters; return the silent followers and whether any follower lags."""
        st = self.state
        with st.cond:
            gone = [c.id for c in st.clusters.values() if now - c.last_hb > MISSED_HEARTBEATS * self.cfg.heartbeat_s]
            for cid in gone:
                st.remove_cluster(cid, f"no heartbeat for {MISSED_HEARTBEATS} intervals")
            dead = [f for f in st.followers.values()
                    if now - f.last_hb > MISSED_HEARTBEATS * self.cfg.follower_heartbeat_s
                    and now - f.restarted_at > RESTART_GRACE_S]
            lagging = st.complete < st.version or any(f.version < st.complete for f in st.followers.values())
        return dead, lagging

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
