"""A follower's state and its push state machine, with no sockets and no threads of its own:
what the data server and the leader's RPCs do to it, each under one lock.

A push moves staged (its units arrive one by one) -> sealed (complete, on disk, its
pseudo-gradient norm known) -> applied by a round (or discarded) -> retired, its file deleted,
once a checkpoint covers that round. The parameters (``theta``), the outer optimizer's momentum
and the BF16 bases clusters pull (and push against) are versioned by the rounds applied.

A push carries either a cluster's parameters (BF16; the pseudo-gradient is the base minus them)
or, compressed (``dips.codec``), its pseudo-gradient itself, as the follower decoded it, with the
squared norm of each unit's uncompressed pseudo-gradient as the cluster reports it (what the
outlier filter scores: the norm of what a compressed push carries grows over a cluster's first
pushes as error feedback's residual fills).

A compressed pull sends a cluster the encoded difference between a version and what that cluster
holds, which the follower tracks per cluster (its *view*: the values the cluster decoded, at the
version it says it holds); what the encoding drops stays in the difference of the next pull
(error feedback on pulls). A view starts from a whole BF16 pull; without one a compressed pull
is refused and the cluster pulls whole."""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from typing import Any

import torch

from .codec import Codec
from .follower_disk import FollowerDisk
from .layout import WIRE_DTYPE, ModelLayout
from .outer_optimizer import NesterovOuter

log = logging.getLogger("dips.follower")

STALE_UNSEALED_S = 120.0
WHOLE = -1  # a compressed pull's ``since`` when the cluster holds nothing: the values themselves
MAX_VIEWS = 64  # clusters whose held values a follower tracks for compressed pulls (least recent goes)


class FollowerState:
    """The units ``unit_range`` of ``layout``; at most ``max_unsealed_pushes`` pushes staged at once."""

    def __init__(self, disk: FollowerDisk, layout: ModelLayout, unit_range: range, optimizer: NesterovOuter,
                 max_unsealed_pushes: int, name: str):
        self.disk, self.layout, self.unit_range, self.opt = disk, layout, unit_range, optimizer
        self.max_unsealed_pushes, self.name = max_unsealed_pushes, name
        self.lock = threading.RLock()
        self.version = -1
        self.ckpt_version = -1
        self.theta: dict[str, torch.Tensor] = {}
        self.momentum: dict[str, torch.Tensor] = {}
        self.bases: dict[int, dict[str, torch.Tensor]] = {}
        self.staged: dict[str, dict] = {}   # push id -> {base, cluster, form, units{u: {name: tensor}}, t}
        self.sealed: dict[str, dict] = {}   # push id -> {base, params{name: bf16}} or {base, delta{name: fp32}}
        self.awaiting_seed = False          # a seeded PS at version 0: the first push must carry parameters
        self.applied_at: dict[str, int] = {}  # push id -> version whose checkpoint retires it
        # cluster -> version -> unit -> the flat FP32 values that cluster holds (at most two versions)
        self.views: OrderedDict[str, dict[int, dict[int, torch.Tensor]]] = OrderedDict()

    # -- start
    def load(self, initial: dict[str, torch.Tensor] | None) -> None:
        """The newest checkpoint and the pushes sealed since, or version 0 from ``initial``
        (None: a seeded PS, zeros until the seeding round)."""
        with self.lock:
            found = self.disk.load_latest_checkpoint()
            applied: dict[str, int] = {}
            if found:
                path, state = found
                self.theta, self.momentum = state["theta"], state["momentum"]
                self.bases = {int(v): b for v, b in state["bases"].items()}
                self.version = self.ckpt_version = int(state["version"])
                applied = {p: int(v) for p, v in state.get("applied", {}).items()}
            else:
                mine = [t for u in self.unit_range for t in self.layout.units[u].tensors]
                if initial is None:
                    self.theta = {t.name: torch.zeros(t.shape) for t in mine}
                else:
                    self.theta = {t.name: initial[t.name].float().clone() for t in mine}
                self.version = 0
                self.awaiting_seed = initial is None
                self.bases = {0: {n: t.to(WIRE_DTYPE) for n, t in self.theta.items()}}
            # pushes sealed since the checkpoint: the leader replays their rounds; those the
            # checkpoint already applied wait to be retired
            for push, rec in self.disk.load_pushes().items():
                if push in applied:
                    self.applied_at[push] = applied[push]
                else:
                    self.sealed[push] = rec
            log.info("%s starts at version %d (%s, %d sealed pushes)", self.name, self.version,
                     path.name if found else "initial parameters", len(self.sealed))

    # -- the data flow
    def stage(self, unit: int, push: str, base: int, cluster: Any, tensors: dict[str, torch.Tensor],
              form: str = "params", sqnorm: float | None = None) -> None:
        """One checked unit of a push: its parameters (``form`` "params") or its decoded
        pseudo-gradient ("delta", with the reported ``sqnorm`` of the uncompressed one);
        ValueError naming why it is refused."""
        with self.lock:
            if form == "delta" and self.awaiting_seed and self.version == 0:
                raise ValueError(f"push {push}: the PS awaits its seed, which carries parameters (bf16), "
                                 "not a compressed pseudo-gradient")
            if base not in self.bases:
                raise ValueError(f"push {push}: base version {base} is not held (held: {sorted(self.bases)})")
            if push in self.sealed:
                raise ValueError(f"push {push} is already sealed")
            if push not in self.staged and len(self.staged) >= self.max_unsealed_pushes:
                raise ValueError(f"{len(self.staged)} pushes are staged and not sealed, the most this follower holds "
                                 "(--max-unsealed-pushes); retry later")
            rec = self.staged.setdefault(push, {"base": base, "cluster": cluster, "form": form, "units": {},
                                                "t": time.monotonic()})
            if rec["base"] != base:
                raise ValueError(f"push {push}: base {base} differs from its earlier units' base {rec['base']}")
            if rec["form"] != form:
                raise ValueError(f"push {push}: a unit of {form} among units of {rec['form']}")
            rec["units"][unit] = tensors
            if form == "delta":
                rec.setdefault("sqnorms", {})[unit] = float(sqnorm)

    def drop_stale(self, now: float) -> None:
        """Forget pushes whose units stopped coming (a cluster that died mid-push)."""
        with self.lock:
            for p in [p for p, r in self.staged.items() if now - r["t"] > STALE_UNSEALED_S]:
                log.warning("%s dropped unsealed push %s after %.0f s", self.name, p, STALE_UNSEALED_S)
                del self.staged[p]

    def pull(self, version: int, units: list[int], cluster: str | None = None) -> list[list[torch.Tensor]]:
        """The BF16 parameters of ``units`` at ``version``, unit by unit; ``cluster``'s view of
        them starts there."""
        with self.lock:
            params = self._held(version, units)
            out = [[params[t.name] for t in self.layout.units[u].tensors] for u in units]
            if cluster is not None:
                view = self._view(cluster)
                view.setdefault(version, {}).update({u: torch.cat([t.reshape(-1).float() for t in ts])
                                                     for u, ts in zip(units, out)})
                self._forget_older(view, version)
            return out

    def pull_change(self, version: int, since: int, units: list[int], cluster: str, codec: Codec) -> list[bytes]:
        """``units`` at ``version`` for ``cluster``, which holds them at ``since``: the encoded
        difference from what it holds, one payload per unit; its view moves to what it decodes.
        ``since`` = ``WHOLE``: the cluster holds nothing, the values themselves are encoded (a
        compressed join) and its view starts there."""
        with self.lock:
            params = self._held(version, units)
            new = {u: torch.cat([params[t.name].reshape(-1).float() for t in self.layout.units[u].tensors])
                   for u in units}
            held = ({u: torch.zeros_like(new[u]) for u in units} if since == WHOLE
                    else self.views.get(cluster, {}).get(since, {}))
            missing = [u for u in units if u not in held]
            if missing:
                raise ValueError(f"{self.name} does not know what cluster {cluster[:40]!r} holds of units "
                                 f"{missing[:8]} at version {since}: pull them whole")
            old = {u: held[u] for u in units}
        # encoded outside the lock: versions and views are replaced, never changed in place
        coded = {u: codec.round_trip(new[u] - old[u]) for u in units}
        if not codec.fixed_size:  # nonzero: more changed entries than a BF16 unit's bytes are a whole pull
            over = [u for u in units if len(coded[u][0]) > WIRE_DTYPE.itemsize * new[u].numel()]
            if over:
                raise ValueError(f"{self.name}: {codec} pulls of units {over[:8]} would be larger than the units "
                                 f"in BF16 (too many values changed since version {since}: a leader with outer "
                                 f"momentum, or a cluster many versions behind): pull them whole")
        with self.lock:
            view = self._view(cluster)
            view.setdefault(version, {}).update({u: old[u] + coded[u][1] for u in units})
            self._forget_older(view, version if since == WHOLE else since)
        return [coded[u][0] for u in units]

    def _view(self, cluster: str) -> dict[int, dict[int, torch.Tensor]]:
        view = self.views.setdefault(cluster, {})
        self.views.move_to_end(cluster)
        while len(self.views) > MAX_VIEWS:
            self.views.popitem(last=False)
        return view

    @staticmethod
    def _forget_older(view: dict, version: int) -> None:
        """A cluster that pulls from ``version`` holds no older one."""
        for v in [v for v in view if v < version]:
            del view[v]

    def _held(self, version: int, units: list[int]) -> dict[str, torch.Tensor]:
        params = self.bases.get(version)
        if params is None:
            raise ValueError(f"version {version} is not held (held: {sorted(self.bases)})")
        for u in units:
            if u not in self.unit_range:
                raise ValueError(f"unit {u} is not owned by {self.name}")
        return params

    # -- the leader's control flow
    def seal(self, push: str) -> dict:
        with self.lock:
            if push in self.sealed:
                return {"ok": True, "norm": self._scored_norm(push)}
            rec = self.staged.get(push)
            if rec is None:
                return {"ok": False, "err": f"{self.name} holds no unit of push {push}"}
            missing = [u for u in self.unit_range if u not in rec["units"]]
            if missing:
                return {"ok": False, "err": f"push {push} is partial: {self.name} lacks units {missing}"}
            params = {n: t for u in self.unit_range for n, t in rec["units"][u].items()}
            sqnorm = sum(rec["sqnorms"][u] for u in self.unit_range) if rec["form"] == "delta" else None
            try:
                self.disk.save_push(push, rec["base"], params, rec["form"], sqnorm)
            except OSError as exc:  # not sealed: the push stays staged and the leader fails it
                log.error("%s could not seal push %s: %s", self.name, push, exc)
                return {"ok": False, "err": f"{self.name} could not write push {push}: {exc}"}
            del self.staged[push]
            self.sealed[push] = {"base": rec["base"], rec["form"]: params, "sqnorm": sqnorm}
            return {"ok": True, "norm": self._scored_norm(push)}

    def prepare(self, weights: dict[str, float]) -> dict:
        with self.lock:
            return {"sqnorm": _norm(self._average(weights)) ** 2}

    def apply(self, msg: dict) -> tuple[dict, bool]:
        """Round ``msg["version"]``: the outer step over the weighted pushes (or a seed), then the
        pushes it names retire once checkpointed and the bases nothing needs are dropped. Returns
        the reply and whether the round was applied now (not already)."""
        version = int(msg["version"])
        with self.lock:
            if self.version >= version:
                return {"version": self.version}, False
            if self.version != version - 1:
                raise ValueError(f"{self.name} is at version {self.version}; cannot apply {version}")
            if msg.get("seed"):  # a seeded PS's version 1: the seeding cluster's parameters, as sent
                self._install_seed(msg["weights"])
            else:
                delta = self._average(msg["weights"])
                scale = float(msg.get("scale", 1.0))
                if scale != 1.0:
                    for d in delta.values():
                        d.mul_(scale)
                self.opt.step(self.theta, delta, self.momentum)
            self.version = version
            self.awaiting_seed = False
            self.bases[version] = {n: t.to(WIRE_DTYPE) for n, t in self.theta.items()}
            for push in list(msg["weights"]) + list(msg.get("drop", [])):
                if self.sealed.pop(push, None) is not None:
                    self.applied_at[push] = version
            # A push still waiting for its round needs its base whatever the leader's list says:
            # a restarted follower replaying old rounds gets the list of the round run now.
            keep = {int(v) for v in msg.get("keep", [])} | {version}
            keep |= {rec["base"] for rec in [*self.sealed.values(), *self.staged.values()]}
            for v in [v for v in self.bases if v not in keep]:
                del self.bases[v]
        return {"version": version}, True

    def discard(self, pushes: list[str]) -> dict:
        with self.lock:
            for push in pushes:
                self.staged.pop(push, None)
                if self.sealed.pop(push, None) is not None:
                    self.applied_at[push] = self.version
        return {}

    def status(self) -> dict:
        with self.lock:
            return {"version": self.version, "ckpt": self.ckpt_version, "sealed": len(self.sealed)}

    # -- checkpoints
    def snapshot(self) -> dict[str, Any]:
        """The latest version, copied (versions applied while a checkpoint is written are skipped)."""
        with self.lock:
            return {"version": self.version, "theta": {n: t.clone() for n, t in self.theta.items()},
                    "momentum": {n: t.clone() for n, t in self.momentum.items()},
                    "bases": {str(v): b for v, b in self.bases.items()},
                    "applied": dict(self.applied_at)}  # applied, files kept until every checkpoint covers them

    def checkpointed(self, version: int) -> list[str]:
        """Every kept checkpoint covers ``version`` (the oldest kept one is of it): the pushes that
        retires (their files may go). The leader keeps its decisions back to this version, so a
        follower can replay from any kept checkpoint."""
        with self.lock:
            self.ckpt_version = version
            done = [p for p, v in self.applied_at.items() if v <= version]
            for p in done:
                del self.applied_at[p]
            return done

    # -- internals
    def _scored_norm(self, push: str) -> float:
        """What the outlier filter scores: the norm of the push's pseudo-gradient (as reported,
        for a compressed one)."""
        sq = self.sealed[push].get("sqnorm")
        return _norm(self._pseudo_gradient(push)) if sq is None else sq ** 0.5

    def _pseudo_gradient(self, push: str) -> dict[str, torch.Tensor]:
        rec = self.sealed[push]
        if "delta" in rec:
            return rec["delta"]
        base = self.bases.get(rec["base"])
        if base is None:
            raise ValueError(f"push {push}: base version {rec['base']} is no longer held")
        return {n: base[n].float() - p.float() for n, p in rec["params"].items()}

    def _average(self, weights: dict[str, float]) -> dict[str, torch.Tensor]:
        delta: dict[str, torch.Tensor] = {n: torch.zeros_like(t) for n, t in self.theta.items()}
        for push, w in weights.items():
            if push not in self.sealed:
                raise ValueError(f"push {push} is not sealed on {self.name}")
            for n, d in self._pseudo_gradient(push).items():
                delta[n].add_(d, alpha=float(w))
        return delta

    def _install_seed(self, weights: dict) -> None:
        if len(weights) != 1 or next(iter(weights)) not in self.sealed:
            raise ValueError(f"a seed decision names one sealed push; got {sorted(weights)[:4]}")
        params = self.sealed[next(iter(weights))].get("params")
        if params is None:
            raise ValueError(f"seed push {next(iter(weights))} carries a pseudo-gradient, not parameters")
        self.theta = {n: params[n].float() for n in self.theta}
        self.momentum = {}


def _norm(tensors: dict[str, torch.Tensor]) -> float:
    return float(torch.sqrt(sum((t.double() ** 2).sum() for t in tensors.values())))
