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

:class:`Leader` wires four parts, one role each: the state and its metadata
(``leader_state.py``), the RPC handlers (``leader_service.py``), the round loop (``rounds.py``)
and the health monitor (``health.py``), plus the supervisor of the followers it launches
(``supervisor.py``).
"""
from __future__ import annotations

import dataclasses
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from diutil.address import advertised
from .auth import CLUSTER_KEY_LABEL, FOLLOWER_KEY_LABEL, JobToken
from .curve import KeyPair
from .health import HealthMonitor
from .layout import ModelLayout
from .leader_service import LeaderService
from .leader_state import LeaderState
from .model import initial_parameters, load_initial
from .rounds import RoundRunner
from .rpc import Tls
from .supervisor import FollowerLaunch, FollowerSupervisor

MODES = ("dips", "sync", "async")


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
    staleness_decay: float = 0.0  # a push s versions stale is scaled by (1 + s) ** -decay (dips mode)
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
    init: str | None = None  # ... or any model's parameters from this file (followers read it too) ...
    seed_from_cluster: bool = False  # ... or the first cluster to join brings the model and its values

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode {self.mode!r}; expected one of {MODES}")
        if sum((self.model is not None, self.init is not None, self.seed_from_cluster)) != 1:
            raise ValueError("give the PS a model config, an --init file of parameters or --seed-from-cluster "
                             "(exactly one)")
        if self.n_followers < 1:
            raise ValueError(f"n_followers={self.n_followers}; expected >= 1")
        if not self.max_cluster_tokens_per_s > 0:
            raise ValueError(f"max_cluster_tokens_per_s={self.max_cluster_tokens_per_s}; expected > 0")
        if self.launch_followers and len(self.launch_followers) != self.n_followers:
            raise ValueError(f"{len(self.launch_followers)} follower addresses to launch for {self.n_followers} "
                             "followers; give one per follower or none")
        if self.launch_followers and not self.server_token_file:
            raise ValueError("launching followers needs the server token's file (server_token_file)")



class Leader:
    """The leader PS. ``token``: the job token clusters hold; ``server_token``: the secret the
    leader and its followers share (registering a follower and every call to a follower need it)."""

    def __init__(self, config: LeaderConfig, token: JobToken, server_token: JobToken, tls: Tls | None = None):
        if token.matches(server_token.secret):
            raise ValueError("the server token equals the job token: clusters could act as followers; "
                             "make a separate one with `ditorch ps token`")
        self.cfg = config
        layout = None  # seeded from a cluster: the first one to join brings it
        if not config.seed_from_cluster:
            initial = load_initial(config.init) if config.init else initial_parameters(config.model, config.seed)
            layout = ModelLayout.of_specs([(n, tuple(t.shape)) for n, t in initial.items()])
            del initial
        self.state = LeaderState(config, layout, KeyPair.derive(server_token, FOLLOWER_KEY_LABEL).public,
                                 server_token, tls)
        self.state.load()
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=max(4, config.n_followers))
        self.service = LeaderService(self.state, token, server_token, KeyPair.derive(token, CLUSTER_KEY_LABEL).public,
                                     self._pool, tls)
        self.rpc = self.service.rpc
        self.address = advertised(self.rpc.address, config.advertise, None)
        root = Path(config.checkpoint_root)
        self.supervisor = FollowerSupervisor(
            [FollowerLaunch(i, b, str(root / f"follower-{i}")) for i, b in enumerate(config.launch_followers)],
            self.address, config.server_token_file or "",
            tls_args(tls) + (["--init", str(Path(config.init).resolve())] if config.init else []))
        self.supervisor.start_all(known=set(self.state.followers))
        self.rounds = RoundRunner(self.state, self._pool, self._stop)
        self.monitor = HealthMonitor(self.state, self.rounds, self.supervisor, self._stop)
        self._threads = [threading.Thread(target=fn, daemon=True, name=f"dips-leader-{name}")
                         for name, fn in (("rounds", self.rounds.loop), ("monitor", self.monitor.loop))]
        for t in self._threads:
            t.start()

    # what benchmarks and tools read
    @property
    def partition(self) -> list[tuple[int, int]]:
        return self.state.partition

    @property
    def rounds_log(self) -> list[dict]:
        return self.state.rounds_log

    @property
    def budget_reached_at(self) -> float | None:
        return self.state.budget_reached_at

    @property
    def tokens_total(self) -> int:
        return self.state.tokens_total

    def status(self) -> dict:
        with self.state.cond:
            return self.state.status()

    def stop(self) -> None:
        self._stop.set()
        self.rpc.stop()
        for t in self._threads:
            t.join(timeout=5)
        self.supervisor.stop()
        self._pool.shutdown(wait=False, cancel_futures=True)


def tls_args(tls: Tls | None) -> list[str]:
    """Command-line options that give a launched follower the leader's TLS files."""
    if tls is None:
        return []
    return ["--tls-ca", tls.ca, "--tls-cert", tls.cert, "--tls-key", tls.key]
