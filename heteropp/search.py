"""HeteroAuto: the strategy search of the H2 paper (section 4.3).

For each DP size s_dp dividing the batch B, a DFS picks for every chip group a TP size
s_tp (a power of two up to TP_MAX) and a recompute switch r; the group's pipeline depth
follows from N = s_pp * s_tp * s_dp. Groups run in pipeline order of descending chip memory
(the early, warm-up-heavy stages go to the big-memory chips). At each leaf the layer-sharding
heuristic picks layers per stage k_g for every group: an initial assignment that equalises
stage time, refined one layer at a time within each group's memory limit. The objective is
the paper's T (``cost_model``), with P2P between stages.

Two stages (the paper's refinement): the first searches one group per chip type and fixes
s_dp; the second splits each big chip type into sub-groups of ``subgroup_size`` chips that
may each pick their own TP, recompute and layers, with (TP, r) non-increasing along the
pipeline inside a chip type.

Pruning: the DFS walks the pipeline from its end so the number of in-flight micro-batches
(and so the memory limit) of each group is known when it is chosen; a branch stops when the
remaining groups cannot hold all layers even at their best, or when a lower bound on T (the
continuous relaxation of the stage-time balance) already exceeds the best plan found.
"""
from __future__ import annotations

import dataclasses
import math
import time
from typing import Sequence

from .cluster import GB, ClusterSpec, ChipSpec
from .cost_model import boundary_transfer_time, stage_costs, pipeline_time
from .model_spec import ModelSpec
from .plan import Plan, StagePlan
from .profile import ChipProfile




_EXACT_STAGE_TWO_NODES = 100  # stage two is an exact branch and bound while it visits fewer nodes


class _OverBudget(Exception):
    """A branch and bound that would visit more nodes than it was allowed."""


class NoFeasiblePlan(ValueError):
    """No plan satisfies the constraints; the message names the binding one."""


@dataclasses.dataclass(frozen=True)
class Group:
    """Chips the search treats as one unit: one TP size, recompute switch and layer count."""

    chip: ChipSpec
    count: int
    index: int  # position in pipeline order


@dataclasses.dataclass(frozen=True)
class GroupChoice:
    tp: int
    recompute: bool
    stages: int
    layers_per_stage: int  # k: ceil of the group's layers over its stages
    layers: int  # the group's exact layer total


@dataclasses.dataclass
class SearchResult:
    """The best configuration found and how the search went."""

    dp: int
    groups: list[Group]
    choices: list[GroupChoice]
    objective: float  # the paper's T for the configuration (ceil layers per stage)
    leaves: int = 0
    seconds: float = 0.0
    stage1: "SearchResult | None" = None


class _Option:
    """A (tp, r) choice for a group at a fixed dp, with everything the leaf needs precomputed."""

    __slots__ = ("tp", "r", "s", "c", "u", "w", "state", "act", "work", "key", "m_ub")

    def __init__(self, tp, r, s, c, u, w, state, act, work, key, m_ub):
        self.tp, self.r, self.s, self.c, self.u, self.w = tp, r, s, c, u, w
        self.state, self.act, self.work, self.key, self.m_ub = state, act, work, key, m_ub


class HeteroAuto:
    """The search over one model, cluster and global batch.

    ``alpha`` is the bubble coefficient (1: 1F1B). ``blocking_p2p`` charges stage sends to
    the stage (Megatron 1F1B); without it P2P is assumed overlapped.
    """

    def __init__(self, model: ModelSpec, cluster: ClusterSpec, global_batch_tokens: int, alpha: float = 1.0,
                 blocking_p2p: bool = True, subgroup_size: int = 128):
        if global_batch_tokens % model.seq:
            raise NoFeasiblePlan(
                f"divisibility: global batch of {global_batch_tokens} tokens is not a multiple of seq={model.seq}"
            )
        self.model = model
        self.cluster = cluster
        self.gbs_tokens = global_batch_tokens
        self.batch = global_batch_tokens // model.seq  # B, in sequences (micro-batch size 1)
        self.alpha = alpha
        self.blocking_p2p = blocking_p2p
        self.subgroup_size = subgroup_size
        self.profiles = {c.name: ChipProfile(c, model) for c in cluster.chips}
        # pipeline order: descending memory (ties: the order given)
        self.types = sorted(cluster.chips, key=lambda c: -c.memory)
        self._why: dict[str, str] = {}
        self._boundary_cache: dict[tuple, float] = {}
        self._options_cache: dict[tuple, list] = {}
        self.leaves = 0  # layer-sharding evaluations of the last search

    # -- public -----------------------------------------------------------------------------
    def search(self, two_stage: bool = True) -> SearchResult:
        """Run stage one (and, by default, stage two) and return the best configuration."""
        t0 = time.perf_counter()
        self.leaves = 0
        self._options_cache.clear()  # each search is timed from scratch
        groups = [Group(c, c.count, i) for i, c in enumerate(self.types)]
        first = self._search_groups(groups, self._dp_candidates(groups), incumbent=None)
        if first is None:
            raise NoFeasiblePlan(self._explain())
        first.leaves = self.leaves
        best = first
        if two_stage:
            sub = self._split(first.dp)
            if len(sub) > len(groups):
                # the exact branch and bound while it stays small, else the local search
                try:
                    second = self._search_groups(sub, [first.dp], first.objective,
                                                 node_budget=_EXACT_STAGE_TWO_NODES) or first
                except _OverBudget:
                    second = self._refine(sub, first)
                if second.objective < first.objective:
                    best = second
        best = dataclasses.replace(best, stage1=first, leaves=self.leaves)
        best.seconds = time.perf_counter() - t0
        return best

    def to_plan(self, result: SearchResult, schedule: str = "1f1b") -> Plan:
        """Expand a search result into stages with exact layer and rank ranges."""
        stages: list[StagePlan] = []
        layer, rank = 0, 0
        for g, ch in zip(result.groups, result.choices):
            # a group with fewer layers than s * k gives the shortfall to its earliest stages,
            # which hold the most warm-up micro-batches
            short = ch.stages * ch.layers_per_stage - ch.layers
            for j in range(ch.stages):
                n = ch.layers_per_stage - (1 if j < short else 0)
                stages.append(StagePlan(chip=g.chip.name, tp=ch.tp, dp=result.dp, layers=n, first_layer=layer,
                                        recompute=ch.recompute, first_rank=rank, group=g.index))
                layer += n
                rank += ch.tp * result.dp
        plan = Plan(model=self.model, cluster=self.cluster, global_batch_tokens=self.gbs_tokens, dp=result.dp,
                    stages=tuple(stages), alpha=self.alpha, schedule=schedule)
        costs = stage_costs(self.model, self.cluster, self.profiles, plan.stage_tuples(), self.blocking_p2p)
        t = pipeline_time(costs, plan.num_microbatches, self.alpha)
        estimate = {
            "iteration_time_s": t,
            "objective_s": result.objective,
            "tokens_per_chip_per_s": self.gbs_tokens / (t * plan.num_chips),
            "stage_time_s": [c.per_microbatch for c in costs],
            "search_seconds": result.seconds,
            "search_leaves": result.leaves,
        }
        plan = dataclasses.replace(plan, estimate=estimate)
        plan.validate()
        return plan

    # -- internals ----------------------------------------------------------------------------
    def _dp_candidates(self, groups: Sequence[Group]) -> list[int]:
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

    def _split(self, dp: int) -> list[Group]:
        out: list[Group] = []
        n = self.subgroup_size
        for c in self.types:
            if n and c.count > n and c.count % n == 0 and any(n % (tp * dp) == 0 for tp in c.tp_sizes()):
                out.extend(Group(c, n, 0) for _ in range(c.count // n))
            else:
                out.append(Group(c, c.count, 0))
        return [dataclasses.replace(g, index=i) for i, g in enumerate(out)]

    def _options(self, group: Group, dp: int) -> list[_Option]:
        key = (group.chip.name, group.count, dp)
        opts = self._options_cache.get(key)
        if opts is None:
            opts = self._options_cache[key] = self._make_options(group, dp)
        return opts

    def _make_options(self, group: Group, dp: int) -> list[_Option]:
        m, chip, prof = self.model, group.chip, self.profiles[group.chip.name]
        b = self.batch // dp
        opts = []
        for tp in chip.tp_sizes():
            if group.count % (tp * dp) or m.kv_heads % tp:
                continue
            s = group.count // (tp * dp)
            if s > m.n_layers:
                # TP sizes ascend, so the last record per chip is its shallowest pipeline
                self._why[f"stages:{group.chip.name}"] = (
                    f"{group.chip.name}: {s} stages at tp={tp}, dp={dp} exceed {m.n_layers} layers", tp == chip.tp_sizes()[-1])
                continue
            lt = prof.layer_times(tp)
            u = prof.update_time(tp, dp)
            for r in (False, True):
                c = lt.compute(r)
                state = m.state_bytes(1, tp, dp, False, False)
                act = m.activation_bytes(1, tp, r, chip.activation_per_layer(tp))
                work = m.working_bytes(tp, r, False)
                cap = chip.usable_memory - work
                m_ub = int(cap // (state + act)) if cap > 0 else 0
                if m_ub < 1:
                    need = (state + act + work) / GB
                    self._why.setdefault(
                        f"mem:{chip.name}:{tp}:{r}",
                        f"memory: one layer at tp={tp}, recompute={r}, dp={dp} needs {need:.1f} GB on chip "
                        f"{chip.name!r}, which has {chip.usable_memory / GB:.1f} GB usable",
                    )
                    continue
                opts.append(_Option(tp, r, s, c, u, (b - self.alpha) * c + u, state, act, work,
                                    (tp, r), m_ub))
        # most layer capacity per unit of bottleneck time first: good incumbents early
        opts.sort(key=lambda o: -o.s / o.w)
        return opts

    def _max_layers(self, group: Group, o: _Option, dp: int, suffix: int, first: bool, last: bool) -> int:
        """Layers per stage the group's worst stage can hold (0: not even one)."""
        m, cap = self.model, group.chip.usable_memory
        b = self.batch // dp
        inflight = min(suffix + o.s, b)
        head_here = last and o.s == 1
        fixed = o.work + (m.working_bytes(o.tp, o.r, True) - o.work if head_here else 0.0)
        fixed += (m.embedding_params if first else 0) / o.tp * (6 + 12 / dp)
        fixed += (m.head_params if head_here else 0) / o.tp * (6 + 12 / dp)
        k = int((cap - fixed) // (o.state + inflight * o.act)) if cap > fixed else 0
        if last and o.s > 1:  # the pipeline's last stage: one micro-batch in flight, but the head
            fixed_l = m.working_bytes(o.tp, o.r, True) + m.head_params / o.tp * (6 + 12 / dp)
            k = min(k, int((cap - fixed_l) // (o.state + o.act)) if cap > fixed_l else 0)
        return k

    def _boundary(self, a: ChipSpec, b: ChipSpec, tp_a: int, tp_b: int) -> float:
        key = (a.name, b.name, tp_a, tp_b)
        t = self._boundary_cache.get(key)
        if t is None:
            t = boundary_transfer_time(self.model, self.cluster.link_between(a.name, b.name), tp_a, tp_b,
                                       a.nic_bandwidth, b.nic_bandwidth)
            self._boundary_cache[key] = t
        return t

    def _p2p_terms(self, groups: Sequence[Group], opts: Sequence[_Option]) -> tuple[list[float], list[float]]:
        """Per group: the largest per-stage blocking-P2P time and the sum over its stages.

        A stage sends one message to each neighbour per micro-batch (activation forward,
        gradient backward)."""
        G = len(groups)
        if not self.blocking_p2p:
            z = [0.0] * G
            return z, z
        pmax, psum = [], []
        for gi in range(G):
            chip, o = groups[gi].chip, opts[gi]
            inner = self._boundary(chip, chip, o.tp, o.tp)
            left = self._boundary(chip, groups[gi - 1].chip, o.tp, opts[gi - 1].tp) if gi > 0 else 0.0
            right = self._boundary(chip, groups[gi + 1].chip, o.tp, opts[gi + 1].tp) if gi + 1 < G else 0.0
            s = o.s
            if s == 1:
                pmax.append(left + right)
                psum.append(left + right)
                continue
            first, last = left + inner, inner + right
            pmax.append(max(first, last, 2 * inner if s > 2 else 0.0))
            psum.append(first + last + 2 * inner * (s - 2))
        return pmax, psum

    def _objective(self, b: int, opts: Sequence[_Option], ks: Sequence[int], pmax, psum) -> float:
        bm = b - self.alpha
        worst = 0.0
        total = 0.0
        for o, k, pm, ps in zip(opts, ks, pmax, psum):
            a = bm * (k * o.c + pm) + k * o.u
            if a > worst:
                worst = a
            total += o.s * k * o.c + ps
        return worst + self.alpha * total

    def _shard_layers(self, b: int, opts: Sequence[_Option], caps: Sequence[int], pmax, psum) -> tuple[float, list[int]] | None:
        """Layers per stage k_g for every group, exactly optimal for T (None: no fit).

        T = max_g(a_g k_g + p_g) + alpha * sum_g s_g c_g k_g (+ constants), with
        sum_g s_g k_g >= L and 1 <= k_g <= caps_g. The optimum's bottleneck is one of the levels
        a_g k + p_g; for each level from the lowest feasible one up, the cheapest cover of L
        stage-layers under it is a small bounded-knapsack DP (min_cost_cover). Levels stop
        once the level plus the cheapest cover at any level cannot beat the best found; with
        alpha = 0 the lowest feasible level is the answer.
        """
        L, G = self.model.n_layers, len(opts)
        if sum(o.s * m for o, m in zip(opts, caps)) < L or sum(o.s for o in opts) > L:
            return None
        bm = b - self.alpha
        a = [bm * o.c + o.u for o in opts]
        p = [bm * pm for pm in pmax]
        # no cover, at any level, costs less than all L layers on the cheapest group
        floor_term = self.alpha * (L * min(o.c for o in opts) + sum(psum))
        levels = sorted({a[i] * k + p[i] for i in range(G) for k in range(1, caps[i] + 1)})
        best: tuple[float, list[int]] | None = None
        for level in levels:
            if best is not None and level + floor_term >= best[0]:
                break
            lims = [min(caps[i], int((level - p[i]) / a[i] * (1 + 1e-12) + 1e-9)) for i in range(G)]
            if min(lims) < 1 or sum(o.s * k for o, k in zip(opts, lims)) < L:
                continue
            # the fractional cover bounds every integer one; greedy meets the bound unless the
            # last group it fills overshoots, and only then is the DP needed
            bound, greedy = _greedy_cover(L, opts, lims)
            if best is not None and level + self.alpha * (bound + sum(psum)) >= best[0]:
                continue
            cover = greedy if greedy[0] <= bound * (1 + 1e-12) else _min_cost_cover(L, opts, lims)
            if cover is None:
                continue
            value = self._objective(b, opts, cover[1], pmax, psum)
            if best is None or value < best[0]:
                best = (value, cover[1])
            if self.alpha == 0:
                break
        return best

    def _search_groups(self, groups: list[Group], dps: Sequence[int], incumbent: float | None,
                       same_type_order: bool = False, node_budget: int | None = None) -> SearchResult | None:
        """DFS over (tp, r) per group for each dp, from the pipeline's last group to its first."""
        L, alpha = self.model.n_layers, self.alpha
        best_val = math.inf if incumbent is None else incumbent
        best: SearchResult | None = None
        G = len(groups)
        visited = 0  # nodes of the branch and bound (its work, against node_budget)

        def root_bound(dp: int) -> float:
            oo = [self._options(g, dp) for g in groups]
            if any(not o for o in oo):
                return math.inf
            return L / sum(max(o.s / o.w for o in x) for x in oo) + alpha * L * min(o.c for x in oo for o in x)

        for dp in sorted(dps, key=root_bound):  # promising dp first: a good incumbent prunes more
            b = self.batch // dp
            all_opts = [self._options(g, dp) for g in groups]
            if any(not o for o in all_opts):
                continue
            # optimistic stand-ins for the groups not chosen yet (the pipeline's prefix):
            # best layers-per-bottleneck-time rate, most layers memory could allow, cheapest layer
            rest_rate = [0.0] * (G + 1)
            rest_layers = [0] * (G + 1)
            rest_c = [math.inf] * (G + 1)
            for i in range(G):
                oo = all_opts[i]
                rest_rate[i + 1] = rest_rate[i] + max(o.s / o.w for o in oo)
                rest_layers[i + 1] = rest_layers[i] + max(o.s * o.m_ub for o in oo)
                rest_c[i + 1] = min(rest_c[i], min(o.c for o in oo))
            if L / rest_rate[G] + alpha * L * rest_c[G] >= best_val:
                continue
            chosen: list = [None] * G
            caps = [0] * G

            def bound(gi: int) -> float:
                """Lower bound on T: groups gi+1.. chosen (rate s/w up to s*k layers), the rest
                optimistic; the bottleneck level theta solves sum min(s*k, theta*s/w) >= L."""
                segs = sorted((caps[j] * chosen[j].w, chosen[j].s / chosen[j].w, chosen[j].s * caps[j])
                              for j in range(gi + 1, G))
                rate = rest_rate[gi + 1] + sum(x[1] for x in segs)
                full = 0.0  # layers of groups already saturated at their memory limit
                theta = 0.0
                for sat, r, n in segs:
                    theta = (L - full) / rate
                    if theta <= sat * (1 + 1e-12):  # L / (1 / w) can round above L * w
                        break
                    full += n
                    rate -= r
                    if full >= L:  # the groups saturated so far already hold every layer
                        theta = sat
                        break
                else:
                    theta = (L - full) / rate if rate > 0 else math.inf
                c_min = min([rest_c[gi + 1]] + [chosen[j].c for j in range(gi + 1, G)])
                stage_sum = sum(chosen[j].s * chosen[j].c for j in range(gi + 1, G))  # k >= 1 everywhere
                return theta + alpha * max(L * c_min, stage_sum)

            def dfs(gi: int, suffix_stages: int, layers_ub: int) -> None:
                nonlocal best_val, best
                nonlocal visited
                visited += 1
                if node_budget is not None and visited > node_budget:
                    raise _OverBudget()
                if gi < 0:
                    self.leaves += 1
                    opts = list(chosen)
                    pmax, psum = self._p2p_terms(groups, opts)
                    res = self._shard_layers(b, opts, caps, pmax, psum)
                    if res is None:
                        self._why.setdefault("layers", "memory: the chosen stages cannot hold all layers")
                        return
                    val, ks = res
                    if val < best_val - 1e-12:
                        best_val = val
                        best = SearchResult(dp=dp, groups=list(groups), choices=_choices(opts, ks, L), objective=val)
                    return
                g = groups[gi]
                same_next = same_type_order and gi + 1 < G and groups[gi + 1].chip.name == g.chip.name
                for o in all_opts[gi]:
                    if same_next and o.key < chosen[gi + 1].key:  # (tp, r) non-increasing along a chip type
                        continue
                    if suffix_stages + o.s > L:
                        continue
                    k = self._max_layers(g, o, dp, suffix_stages, first=gi == 0, last=gi == G - 1)
                    if k < 1:
                        continue
                    ub = layers_ub + o.s * k
                    if ub + rest_layers[gi] < L:
                        continue
                    chosen[gi], caps[gi] = o, k
                    if bound(gi - 1) < best_val:
                        dfs(gi - 1, suffix_stages + o.s, ub)
                chosen[gi] = None

            dfs(G - 1, 0, 0)
        return best

    def _evaluate(self, groups: Sequence[Group], opts: Sequence[_Option], dp: int) -> tuple[float, list[int]] | None:
        """Memory limits by position, P2P terms and layer sharding for one full assignment."""
        G, L = len(groups), self.model.n_layers
        caps, suffix = [0] * G, 0
        for gi in range(G - 1, -1, -1):
            o = opts[gi]
            if suffix + o.s > L:
                return None
            caps[gi] = self._max_layers(groups[gi], o, dp, suffix, first=gi == 0, last=gi == G - 1)
            if caps[gi] < 1:
                return None
            suffix += o.s
        self.leaves += 1
        pmax, psum = self._p2p_terms(groups, opts)
        return self._shard_layers(self.batch // dp, opts, caps, pmax, psum)

    def _refine(self, groups: list[Group], first: SearchResult) -> SearchResult:
        """Stage two: sub-groups start from their chip type's stage-one choice; a sub-group at a
        time switches to the (tp, r) that lowers T most, keeping (tp, r) non-increasing along the
        pipeline inside a chip type, until no switch helps (a local search: the full product
        over 16 sub-groups is out of reach, and stage one already fixed dp)."""
        dp, L = first.dp, self.model.n_layers
        all_opts = [self._options(g, dp) for g in groups]
        by_type = {g.chip.name: (ch.tp, ch.recompute) for g, ch in zip(first.groups, first.choices)}
        cur = []
        for g, oo in zip(groups, all_opts):
            match = [o for o in oo if o.key == by_type[g.chip.name]]
            if not match:  # the sub-group size does not allow the type's choice
                return first
            cur.append(match[0])
        res = self._evaluate(groups, cur, dp)
        if res is None:
            return first
        best_val, best_ks = res
        G = len(groups)
        improved = True
        while improved:
            improved = False
            move = None
            for gi in range(G):
                lo = cur[gi + 1].key if gi + 1 < G and groups[gi + 1].chip.name == groups[gi].chip.name else None
                hi = cur[gi - 1].key if gi > 0 and groups[gi - 1].chip.name == groups[gi].chip.name else None
                for o in all_opts[gi]:
                    if o is cur[gi] or (lo is not None and o.key < lo) or (hi is not None and o.key > hi):
                        continue
                    trial = cur[:gi] + [o] + cur[gi + 1:]
                    r = self._evaluate(groups, trial, dp)
                    if r is not None and r[0] < best_val - 1e-9:
                        best_val, best_ks, move = r[0], r[1], (gi, o)
            if move is not None:
                cur[move[0]] = move[1]
                improved = True
        return SearchResult(dp=dp, groups=list(groups), choices=_choices(cur, best_ks, L), objective=best_val)

    def _explain(self) -> str:
        mem = [v for k, v in self._why.items() if k.startswith("mem:")]
        # the binding constraint: a chip type that cannot hold one layer in any configuration
        for c in self.types:
            keys = [k for k in self._why if k.startswith(f"mem:{c.name}:")]
            tps = c.tp_sizes()
            if keys and len(keys) >= 2 * len([t for t in tps if self.model.kv_heads % t == 0]):
                last = self._why[max(keys, key=lambda k: (int(k.split(':')[2]), k.split(':')[3] == 'True'))]
                return f"no plan fits: chip {c.name!r} cannot hold one layer in any configuration ({last})"
        if "layers" in self._why:
            return ("no plan fits: memory: in every configuration some chip type's stages cannot hold their share "
                    f"of the {self.model.n_layers} layers with the warm-up micro-batches of 1F1B"
                    + (f"; e.g. {mem[0]}" if mem else ""))
        deep = [v for k, v in self._why.items() if k.startswith("stages:")]
        if deep:
            deep.sort(key=lambda v: not v[1])  # a chip too deep even at its largest TP binds
            return f"no plan fits: pipeline too deep: {deep[0][0]}"
        return "no plan fits: " + ("; ".join(str(v) for v in list(self._why.values())[:3])
                                   or "no configuration passed the constraints")


def _greedy_cover(L: int, opts: Sequence[_Option], lims: Sequence[int]) -> tuple[float, tuple[float, list[int]]]:
    """(fractional lower bound, greedy integer cover) of min sum_g s_g c_g k_g, 1 <= k_g <=
    lims_g, sum_g s_g k_g >= L: one layer per stage everywhere, then the cheapest groups first."""
    ks = [1] * len(opts)
    bound = sum(o.s * o.c for o in opts)
    need = L - sum(o.s for o in opts)
    cost = bound
    for i in sorted(range(len(opts)), key=lambda i: opts[i].c):
        if need <= 0:
            break
        o = opts[i]
        room = (lims[i] - 1) * o.s
        take = min(room, need)
        bound += take * o.c
        add = -(-take // o.s)
        ks[i] += add
        cost += add * o.s * o.c
        need -= add * o.s
    return bound, (cost, ks)


def _min_cost_cover(L: int, opts: Sequence[_Option], lims: Sequence[int]) -> tuple[float, list[int]] | None:
    """min sum_g s_g c_g k_g over 1 <= k_g <= lims_g with sum_g s_g k_g >= L: a DP over the
    stage-layers covered so far (capped at L), group by group."""
    inf = math.inf
    cost = [inf] * (L + 1)
    cost[0] = 0.0
    parents = []
    for o, lim in zip(opts, lims):
        if lim < 1:
            return None
        s, step = o.s, o.s * o.c
        new, came_from = [inf] * (L + 1), [None] * (L + 1)
        for x in range(L + 1):
            cx = cost[x]
            if cx == inf:
                continue
            for k in range(1, lim + 1):
                y = x + s * k
                if y > L:
                    y = L
                v = cx + step * k
                if v < new[y]:
                    new[y], came_from[y] = v, (x, k)
                if y == L:
                    break  # more layers only cost more
        parents.append(came_from)
        cost = new
    if cost[L] == inf:
        return None
    ks, y = [], L
    for came_from in reversed(parents):
        y, k = came_from[y]
        ks.append(k)
    return cost[L], ks[::-1]


def _choices(opts: Sequence[_Option], ks: Sequence[int], L: int) -> list[GroupChoice]:
    """Exact layer totals: trim the surplus of s * k over L from the slowest groups first."""
    layers = [o.s * k for o, k in zip(opts, ks)]
    surplus = sum(layers) - L
    order = sorted(range(len(opts)), key=lambda i: -opts[i].c)
    for i in order:
        if surplus <= 0:
            break
        cut = min(surplus, opts[i].s - 1, layers[i] - opts[i].s)
        layers[i] -= cut
        surplus -= cut
    return [GroupChoice(o.tp, o.r, o.s, k, n) for o, k, n in zip(opts, ks, layers)]
