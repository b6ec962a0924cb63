"""The search space and its memory model: which (TP, recompute) options a group of chips has at a
DP size, how many layers per stage each can hold at its place in the pipeline, and the P2P time
between stages. It records why options were ruled out, for ``explain``."""
from __future__ import annotations

from typing import Sequence

from ..cluster import GB, ChipSpec, ClusterSpec
from ..cost_model import boundary_transfer_time
from ..model_spec import ModelSpec
from ..profile import ChipProfile
from .results import Group, NoFeasiblePlan


class StageOption:
    """A (tp, recompute) choice for a group at a fixed DP size, with what a leaf needs precomputed:
    ``s`` stages, ``c`` compute time per layer and micro-batch, ``u`` update time per layer,
    ``w`` the bottleneck time per layer ((b - alpha) c + u), memory per layer (``state``, ``act``
    per micro-batch in flight, ``work``), and ``m_ub`` the most layers memory could ever allow."""

    __slots__ = ("tp", "r", "s", "c", "u", "w", "state", "act", "work", "key", "m_ub")

    def __init__(self, tp, r, s, c, u, w, state, act, work, key, m_ub):
        self.tp, self.r, self.s, self.c, self.u, self.w = tp, r, s, c, u, w
        self.state, self.act, self.work, self.key, self.m_ub = state, act, work, key, m_ub


class SearchSpace:
    """One model, cluster and batch (in sequences): options per group, memory limits, P2P terms."""

    def __init__(self, model: ModelSpec, cluster: ClusterSpec, batch: int, alpha: float, blocking_p2p: bool):
        self.model, self.cluster, self.batch, self.alpha, self.blocking_p2p = model, cluster, batch, alpha, blocking_p2p
        self.profiles = {c.name: ChipProfile(c, model, cluster.inter_node) for c in cluster.chips}
        # pipeline order: descending memory (ties: the order given)
        self.types = sorted(cluster.chips, key=lambda c: -c.memory)
        self.why: dict[str, object] = {}  # what ruled options out, for explain()
        self.leaves = 0  # layer-sharding evaluations
        self._boundary_cache: dict[tuple, float] = {}
        self._options_cache: dict[tuple, list[StageOption]] = {}

    def reset(self) -> None:
        """Forget cached options and the leaf count (each search is timed from scratch)."""
        self.leaves = 0
        self._options_cache.clear()

    def dp_candidates(self, groups: Sequence[Group]) -> list[int]:
        out = []
        for dp in range(1, self.batch + 1):
            if self.batch % dp:
                continue
            if all(any(g.count % (tp * dp) == 0 for tp in g.chip.tp_sizes()) for g in groups):
                out.append(dp)
        if not out:
            counts = {g.chip.name: g.count for g in groups}
            raise NoFeasiblePlan(
                f"divisibility: no DP size divides both the batch of {self.batch} sequences and every chip "
                f"count / TP size (chip counts {counts})"
            )
        return out

    def options(self, group: Group, dp: int) -> list[StageOption]:
        key = (group.chip.name, group.count, dp)
        opts = self._options_cache.get(key)
        if opts is None:
            opts = self._options_cache[key] = self._make_options(group, dp)
        return opts

    def _make_options(self, group: Group, dp: int) -> list[StageOption]:
        m, chip, prof = self.model, group.chip, self.profiles[group.chip.name]
        b = self.batch // dp
        opts = []
        for tp in chip.tp_sizes():
            if group.count % (tp * dp) or m.kv_heads % tp:
                continue
            s = group.count // (tp * dp)
            if s > m.n_layers:
                # TP sizes ascend, so the last record per chip is its shallowest pipeline
                self.why[f"stages:{group.chip.name}"] = (
                    f"{group.chip.name}: {s} stages at tp={tp}, dp={dp} exceed {m.n_layers} layers", tp == chip.tp_sizes()[-1])
                continue
            lt = prof.layer_times(tp)
            u = prof.update_time(tp, dp)
            for r in (False, True):
                c = lt.compute(r)
                # per layer: its state, and when recomputing, its share of one micro-batch's
                # activations that the stage's recompute re-materialises at once
                state = m.state_bytes(1, tp, dp, False, False)
                if r:
                    state += m.recompute_bytes(1, tp, chip.activation_per_layer(tp))
                act = m.activation_bytes(1, tp, r, chip.activation_per_layer(tp))
                work = m.working_bytes(tp, False)
                cap = chip.usable_memory - work
                m_ub = int(cap // (state + act)) if cap > 0 else 0
                if m_ub < 1:
                    need = (state + act + work) / GB
                    self.why.setdefault(
                        f"mem:{chip.name}:{tp}:{r}",
                        f"memory: one layer at tp={tp}, recompute={r}, dp={dp} needs {need:.1f} GB on chip "
                        f"{chip.name!r}, which has {chip.usable_memory / GB:.1f} GB usable",
                    )
                    continue
                opts.append(StageOption(tp, r, s, c, u, (b - self.alpha) * c + u, state, act, work, (tp, r), m_ub))
        # most layer capacity per unit of bottleneck time first: good incumbents early
        opts.sort(key=lambda o: -o.s / o.w)
        return opts

    def max_layers(self, group: Group, o: StageOption, dp: int, suffix: int, first: bool, last: bool) -> int:
        """Layers per stage the group's worst stage can hold (0: not even one), with ``suffix``
        stages after the group (so its first stage keeps that many more micro-batches in flight)."""
        m, cap = self.model, group.chip.usable_memory
        b = self.batch // dp
        inflight = min(suffix + o.s, b)
        head_here = last and o.s == 1
        fixed = o.work + (m.working_bytes(o.tp, True) - o.work if head_here else 0.0)
        fixed += (m.embedding_params if first else 0) / o.tp * (6 + 12 / dp)
        fixed += (m.head_params if head_here else 0) / o.tp * (6 + 12 / dp)
        k = int((cap - fixed) // (o.state + inflight * o.act)) if cap > fixed else 0
        if last and o.s > 1:  # the pipeline's last stage: one micro-batch in flight, but the head
            fixed_l = m.working_bytes(o.tp, True) + m.head_params / o.tp * (6 + 12 / dp)
            k = min(k, int((cap - fixed_l) // (o.state + o.act)) if cap > fixed_l else 0)
        return k

    def boundary(self, a: ChipSpec, b: ChipSpec, tp_a: int, tp_b: int, dp: int) -> float:
        key = (a.name, b.name, tp_a, tp_b, dp)
        t = self._boundary_cache.get(key)
        if t is None:
            t = boundary_transfer_time(self.model, self.cluster.link_between(a.name, b.name), tp_a, tp_b,
                                       a.nic_bandwidth, b.nic_bandwidth,
                                       shared_by=dp if self.cluster.link_shared(a.name, b.name) else 0)
            self._boundary_cache[key] = t
        return t

    def p2p_terms(self, groups: Sequence[Group], opts: Sequence[StageOption], dp: int) -> tuple[list[float], list[float]]:
        """Per group: the largest per-stage blocking-P2P time and the sum over its stages, with
        ``dp`` replicas (which share a cross-cluster link).

        A stage sends one message to each neighbour per micro-batch (activation forward,
        gradient backward)."""
        G = len(groups)
        if not self.blocking_p2p:
            z = [0.0] * G
            return z, z
        pmax, psum = [], []
        for gi in range(G):
            chip, o = groups[gi].chip, opts[gi]
            inner = self.boundary(chip, chip, o.tp, o.tp, dp)
            left = self.boundary(chip, groups[gi - 1].chip, o.tp, opts[gi - 1].tp, dp) if gi > 0 else 0.0
            right = self.boundary(chip, groups[gi + 1].chip, o.tp, opts[gi + 1].tp, dp) if gi + 1 < G else 0.0
            s = o.s
            if s == 1:
                pmax.append(left + right)
                psum.append(left + right)
                continue
            first, last = left + inner, inner + right
            pmax.append(max(first, last, 2 * inner if s > 2 else 0.0))
            psum.append(first + last + 2 * inner * (s - 2))
        return pmax, psum
