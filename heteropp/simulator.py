"""Event-driven pipeline simulator: runs a schedule (per-stage action lists) on a pipeline
of heterogeneous stages joined by alpha-beta links, for one or many DP replicas.

Compute: each stage runs one action at a time, in its list's order, starting it when its
input has arrived (forward: the activation from the previous stage; backward: the gradient
from the next). Communication: a SEND puts a message on the channel (replica, boundary,
direction); a channel sends its messages in order, one at a time, over a physical link that
takes ``latency + bytes / bandwidth``. With ``ack_wait`` a channel's next message starts only
after the previous one was acknowledged (one round trip later), as blocking sends do. Links
marked ``shared`` are one physical link per direction for all replicas (a cross-DC link):
concurrent messages share its bandwidth equally (processor sharing), or, with
``coordinated``, are served one at a time in a global round-robin order over replicas with a
non-blocking hand-off (JEEVES section 3.3). Memory: a counter per stage adds a micro-batch's
stored activations at its forward (and the re-materialised ones at R) and frees them when
its backward ends. Update: every stage steps after the last backward of the whole pipeline
(the global gradient norm is a collective over all stages), so the iteration ends at the
pipeline's end plus the slowest stage's update.

``schedule="comm-aware"`` runs JEEVES's greedy scheduler instead of fixed lists: an idle
stage runs a ready backward first, else the next forward if its input has arrived and the
memory counter allows; the actions it ran are returned as per-stage lists (a ``Schedule``)
that replay to the same timeline.
"""
from __future__ import annotations

import collections
import dataclasses
import heapq
import math
from typing import Sequence

from typing import TYPE_CHECKING

from .schedule import Action, Schedule, turn_order

if TYPE_CHECKING:
    from .plan import Plan


@dataclasses.dataclass(frozen=True)
class StageModel:
    """One pipeline stage as the simulator sees it (times per micro-batch, bytes per chip)."""

    fwd: float
    bwd_input: float
    bwd_weight: float
    recompute_time: float
    recompute: bool
    act_bytes: float  # what a micro-batch leaves stored after its forward
    full_act_bytes: float  # what R re-materialises (recompute stages)
    static_bytes: float = 0.0
    capacity: float = math.inf
    update: float = 0.0
    act_limit: float = math.inf  # activation budget the comm-aware scheduler respects
    name: str = ""

    def duration(self, kind: str) -> float:
        return {"F": self.fwd, "R": self.recompute_time, "I": self.bwd_input, "W": self.bwd_weight,
                "B": self.bwd_input + self.bwd_weight}[kind]


@dataclasses.dataclass(frozen=True)
class LinkModel:
    """The boundary between stage i and i+1: message size and alpha-beta parameters."""

    nbytes: float
    bandwidth: float
    latency: float
    shared: bool = False  # one link per direction for all replicas (cross-DC)


@dataclasses.dataclass
class Pipeline:
    stages: list[StageModel]
    links: list[LinkModel]
    microbatches: list[int]  # per replica
    ack_wait: bool = False
    coordinated: bool = False
    handoff: float = 0.0  # coordinated hand-off delay (a signal inside the DC)

    def __post_init__(self) -> None:
        if len(self.links) != len(self.stages) - 1:
            raise ValueError(f"pipeline: {len(self.stages)} stages need {len(self.stages) - 1} links, got {len(self.links)}")
        if not self.microbatches or min(self.microbatches) < 1:
            raise ValueError(f"pipeline: every replica needs >= 1 micro-batch, got {self.microbatches}")


@dataclasses.dataclass
class SimResult:
    iteration_time: float
    pipeline_time: float  # end of the last compute, before the optimizer update
    bubble_fraction: float
    stage_busy: list[float]  # replica 0, seconds of compute
    stage_peak_memory: list[float]  # bytes per chip, max over replicas
    timeline: list[tuple[int, str, int, float, float]]  # replica 0: (stage, kind, mb, start, end); UPDATE has mb -1
    comm_timeline: list[tuple[int, str, int, float, float]]  # replica 0: (boundary, dir, mb, start, arrival)
    schedules: list[Schedule] | None = None  # per replica, what ran (comm-aware)


class _Link:
    """Processor-sharing link."""

    __slots__ = ("bw", "active", "t_last", "version", "lat")

    def __init__(self, bw: float, lat: float):
        self.bw, self.lat = bw, lat
        self.active: dict[int, float] = {}
        self.t_last = 0.0
        self.version = 0

    def advance(self, now: float) -> None:
        if self.active:
            share = (now - self.t_last) * self.bw / len(self.active)
            for k in self.active:
                self.active[k] -= share
        self.t_last = now


class Simulator:
    """One run of a pipeline under a schedule; see the module docstring."""

    def __init__(self, pipeline: Pipeline, schedule: Schedule | Sequence[Schedule] | str):
        self.p = pipeline
        S, R = len(pipeline.stages), len(pipeline.microbatches)
        self.S, self.R = S, R
        self.greedy = schedule == "comm-aware"
        if self.greedy:
            self.lists = [[[] for _ in range(S)] for _ in range(R)]
        else:
            if isinstance(schedule, str):
                raise ValueError(f"unknown schedule {schedule!r}; give a Schedule or 'comm-aware'")
            scheds = [schedule] * R if isinstance(schedule, Schedule) else list(schedule)
            if len(scheds) != R:
                raise ValueError(f"{len(scheds)} schedules for {R} replicas")
            for r, sc in enumerate(scheds):
                if sc.num_stages != S or sc.num_microbatches != pipeline.microbatches[r]:
                    raise ValueError(
                        f"schedule {sc.name!r} is for {sc.num_stages} stages x {sc.num_microbatches} micro-batches, "
                        f"replica {r} has {S} stages x {pipeline.microbatches[r]}"
                    )
                sc.validate([st.recompute for st in pipeline.stages])
            self.lists = [[list(lst) for lst in sc.actions] for sc in scheds]
            self.blocking = scheds[0].blocking_p2p
        if self.greedy:
            self.blocking = False

    # ------------------------------------------------------------------------------------
    def run(self) -> SimResult:
        p, S, R = self.p, self.S, self.R
        self.now = 0.0
        self.heap: list = []
        self.seq = 0
        self.idx = [[0] * S for _ in range(R)]
        self.busy = [[False] * S for _ in range(R)]
        self.blocked_on: list[list[tuple | None]] = [[None] * S for _ in range(R)]
        self.arrived: dict[tuple, float] = {}
        self.fdone = [[0] * S for _ in range(R)]  # forwards finished (greedy)
        self.bnext = [[0] * S for _ in range(R)]  # next backward micro-batch (greedy, in order)
        self.fnext = [[0] * S for _ in range(R)]
        self.mem = [[0.0] * S for _ in range(R)]
        self.peak = [[0.0] * S for _ in range(R)]
        self.end = [[0.0] * S for _ in range(R)]
        self.busy_time = [0.0] * S
        self.timeline: list = []
        self.comm: list = []
        self.pending: list[list[collections.deque]] = [[collections.deque() for _ in range(S)] for _ in range(R)]
        # channels and links
        self.chan_q: dict[tuple, collections.deque] = {}
        self.chan_busy: dict[tuple, bool] = {}
        self.chan_free: dict[tuple, float] = {}
        self.links: dict[tuple, _Link] = {}
        self.msg_info: dict[int, tuple] = {}
        self.msg_id = 0
        self.msg_start: dict[int, float] = {}
        self.coord: dict[int, dict] = {}
        for i, lk in enumerate(p.links):
            if lk.shared and p.coordinated:
                for d in ("F", "B"):
                    self.coord[(i, d)] = {"order": turn_order(p.microbatches), "pos": 0, "ready": {}, "busy": False, "free": 0.0}
        for r in range(R):
            for s in range(S):
                self._step(r, s)
        while self.heap:
            t, _, kind, payload = heapq.heappop(self.heap)
            self.now = t
            getattr(self, "_on_" + kind)(*payload)
        for r in range(R):
            for s in range(S):
                if self.idx[r][s] < len(self.lists[r][s]) or (self.greedy and self.bnext[r][s] < p.microbatches[r]):
                    raise RuntimeError(
                        f"simulation deadlocked: replica {r} stage {s} stopped at "
                        f"{self.lists[r][s][self.idx[r][s]] if self.idx[r][s] < len(self.lists[r][s]) else 'greedy'}"
                    )
        pipe_end = max(max(row) for row in self.end)
        # The global gradient norm is summed over every stage before any stage steps, so all
        # updates start once the last backward of the whole pipeline is done.
        it = pipe_end + max(st.update for st in p.stages)
        # Drawn as the measured timeline draws it: each stage's update from the pipeline's end.
        self.timeline.extend((s, "UPDATE", -1, pipe_end, pipe_end + st.update)
                             for s, st in enumerate(p.stages) if st.update > 0)
        bubble = 1.0 - sum(self.busy_time) / (S * pipe_end) if pipe_end > 0 else 0.0
        peaks = [max(self.peak[r][s] for r in range(R)) + p.stages[s].static_bytes for s in range(S)]
        scheds = None
        if self.greedy:
            scheds = [Schedule("comm-aware", S, p.microbatches[r], self.lists[r], blocking_p2p=False) for r in range(R)]
        return SimResult(it, pipe_end, bubble, self.busy_time, peaks, self.timeline, self.comm, scheds)

    # -- events ---------------------------------------------------------------------------------
    def _push(self, t: float, kind: str, *payload) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, payload))

    def _on_compute_done(self, r: int, s: int, a: Action) -> None:
        st = self.p.stages[s]
        self.busy[r][s] = False
        self.end[r][s] = self.now
        if a.kind == "F":
            self.fdone[r][s] += 1
        if a.kind in ("B", "W"):
            self.mem[r][s] -= st.act_bytes + (st.full_act_bytes if st.recompute else 0.0)
        self._step(r, s)

    def _on_arrive(self, mid: int) -> None:
        r, src, dst, d, m, _ = self.msg_info[mid]
        self.arrived[(r, dst, d, m)] = self.now
        if r == 0:
            self.comm.append((min(src, dst), d, m, self.msg_start.pop(mid), self.now))
        self._step(r, dst)
        if self.blocked_on[r][src] is not None:
            self._step(r, src)

    def _on_tx_done(self, mid: int) -> None:
        r, src, dst, d, m, boundary = self.msg_info[mid]
        lk = self.p.links[boundary]
        self._push(self.now + lk.latency, "arrive", mid)
        key = (r, boundary, d)
        if lk.shared and self.p.coordinated:
            c = self.coord[(boundary, d)]
            c["busy"] = False
            self._push(self.now + self.p.handoff, "coord_free", boundary, d)
            return
        self.chan_busy[key] = False
        self.chan_free[key] = self.now + (2 * lk.latency if self.p.ack_wait else 0.0)
        self._push(self.chan_free[key], "chan_free", key)

    def _on_chan_free(self, key: tuple) -> None:
        self._try_channel(key)

    def _on_coord_free(self, boundary: int, d: str) -> None:
        self._try_coord(boundary, d)

    def _on_link(self, key: tuple, version: int) -> None:
        link = self.links[key]
        if version != link.version:
            return
        link.advance(self.now)
        done = [mid for mid, rem in link.active.items() if rem <= 1.0]  # bytes: float slack
        for mid in done:
            del link.active[mid]
        self._reschedule(key)
        for mid in done:
            self._on_tx_done(mid)

    # -- communication ------------------------------------------------------------------------
    def _send(self, r: int, s: int, d: str, m: int) -> int:
        boundary, dst = (s, s + 1) if d == "F" else (s - 1, s - 1)
        self.msg_id += 1
        mid = self.msg_id
        self.msg_info[mid] = (r, s, dst, d, m, boundary)
        lk = self.p.links[boundary]
        if lk.shared and self.p.coordinated:
            self.coord[(boundary, d)]["ready"][(r, m)] = mid
            self._try_coord(boundary, d)
        else:
            key = (r, boundary, d)
            self.chan_q.setdefault(key, collections.deque()).append(mid)
            self._try_channel(key)
        return mid

    def _start_tx(self, mid: int, link_key: tuple, lk) -> None:
        self.msg_start[mid] = self.now
        link = self.links.get(link_key)
        if link is None:
            link = self.links[link_key] = _Link(lk.bandwidth, lk.latency)
        link.advance(self.now)
        link.active[mid] = lk.nbytes
        self._reschedule(link_key)

    def _reschedule(self, link_key: tuple) -> None:
        link = self.links[link_key]
        link.version += 1
        if link.active:
            rem = min(link.active.values())
            self._push(self.now + max(rem, 0.0) * len(link.active) / link.bw, "link", link_key, link.version)

    def _try_channel(self, key: tuple) -> None:
        q = self.chan_q.get(key)
        if not q or self.chan_busy.get(key) or self.now < self.chan_free.get(key, 0.0) - 1e-15:
            return
        mid = q.popleft()
        self.chan_busy[key] = True
        r, boundary, d = key
        lk = self.p.links[boundary]
        self._start_tx(mid, ("shared", boundary, d) if lk.shared else key, lk)

    def _try_coord(self, boundary: int, d: str) -> None:
        c = self.coord[(boundary, d)]
        if c["busy"] or c["pos"] >= len(c["order"]):
            return
        nxt = c["order"][c["pos"]]
        mid = c["ready"].pop(nxt, None)
        if mid is None:
            return  # the next message in the global order is not ready yet
        c["pos"] += 1
        c["busy"] = True
        self._start_tx(mid, ("shared", boundary, d), self.p.links[boundary])

    # -- compute -----------------------------------------------------------------------------
    def _ready(self, r: int, s: int, a: Action) -> bool:
        if a.kind == "F":
            return s == 0 or (r, s, "F", a.mb) in self.arrived
        if a.kind in ("I", "B", "R"):
            return s == self.S - 1 or (r, s, "B", a.mb) in self.arrived
        return True

    def _choose(self, r: int, s: int) -> list[Action]:
        """JEEVES's greedy rule: a ready backward first, else a forward the memory allows."""
        st, b = self.p.stages[s], self.p.microbatches[r]
        S = self.S
        m = self.bnext[r][s]
        if m < b and m < self.fdone[r][s] and (s == S - 1 or (r, s, "B", m) in self.arrived):
            self.bnext[r][s] += 1
            out = [Action(s, "RECV_B", m)] if s < S - 1 else []
            out += [Action(s, "R", m)] if st.recompute else []
            out.append(Action(s, "B", m))
            return out + ([Action(s, "SEND_B", m)] if s > 0 else [])
        m = self.fnext[r][s]
        if m < b and (s == 0 or (r, s, "F", m) in self.arrived):
            held = self.mem[r][s]
            if held == 0 or held + st.act_bytes <= st.act_limit:
                self.fnext[r][s] += 1
                out = [Action(s, "RECV_F", m)] if s > 0 else []
                out.append(Action(s, "F", m))
                return out + ([Action(s, "SEND_F", m)] if s < S - 1 else [])
        return []

    def _step(self, r: int, s: int) -> None:
        if self.busy[r][s]:
            return
        lst = self.lists[r][s]
        while True:
            if self.idx[r][s] >= len(lst):
                if not self.greedy:
                    return
                more = self._choose(r, s)
                if not more:
                    return
                lst.extend(more)
            a = lst[self.idx[r][s]]
            if a.kind in ("SEND_F", "SEND_B"):
                if self.blocked_on[r][s] is None:
                    mid = self._send(r, s, a.kind[-1], a.mb)
                    if self.blocking:
                        self.blocked_on[r][s] = ("sent", mid)
                        return
                else:
                    mid = self.blocked_on[r][s][1]
                    r_, src, dst, d, m, _ = self.msg_info[mid]
                    if (r, dst, d, m) not in self.arrived:
                        return
                    self.blocked_on[r][s] = None
                self.idx[r][s] += 1
                continue
            if a.kind in ("RECV_F", "RECV_B"):
                if self.blocking and (r, s, a.kind[-1], a.mb) not in self.arrived:
                    self.blocked_on[r][s] = ("recv", None)
                    return
                self.blocked_on[r][s] = None
                self.idx[r][s] += 1
                continue
            if not self._ready(r, s, a):
                self.blocked_on[r][s] = ("input", None)
                return
            self.blocked_on[r][s] = None
            st = self.p.stages[s]
            dur = st.duration(a.kind)
            if a.kind == "F":
                self.mem[r][s] += st.act_bytes
            elif a.kind == "R":
                self.mem[r][s] += st.full_act_bytes
            self.peak[r][s] = max(self.peak[r][s], self.mem[r][s])
            self.busy[r][s] = True
            self.idx[r][s] += 1
            if r == 0:
                self.busy_time[s] += dur
                self.timeline.append((s, a.kind, a.mb, self.now, self.now + dur))
            self._push(self.now + dur, "compute_done", r, s, a)
            return


def pipeline_from_plan(plan: "Plan", blocking_ack: bool = False) -> Pipeline:
    """The simulator's view of a HeteroPP plan: stage times from the chip profiles, P2P over
    the cluster's links (the busiest TP endpoint's shard, as the cost model; at the profiles'
    time scale, as an emulated run's dicomm paces them), memory per chip.

    A boundary over the cross-DC link (``placement.boundary_shared``) is one link per direction
    that every TP piece of every DP replica crosses, as the run's is: it carries each
    micro-batch's whole activation, and the pipeline has every replica (processor sharing
    between them); a plan without one has one replica, as all replicas run alike."""
    from .placement import boundary_link, boundary_shared
    from .profile import ChipProfile

    m, cl = plan.model, plan.cluster
    profiles = {c.name: ChipProfile(c, m, cl.inter_node) for c in cl.chips}
    S, b = plan.num_stages, plan.num_microbatches
    stages = []
    for i, st in enumerate(plan.stages):
        prof = profiles[st.chip]
        lt = prof.layer_times(st.tp)
        n = st.layers
        embed_fwd, embed_bwd, head_fwd, head_bwd = prof.end_times(st.tp)
        # the forward's work outside the layers: the position tables, and the embedding or the head
        extra_fwd = prof.stage_time(st.tp) + (embed_fwd if i == 0 else 0.0) + (head_fwd if i == S - 1 else 0.0)
        end_bwd = (embed_bwd if i == 0 else 0.0) + (head_bwd if i == S - 1 else 0.0)
        stages.append(StageModel(
            fwd=n * lt.fwd + extra_fwd, bwd_input=n * lt.bwd_input + end_bwd / 2, bwd_weight=n * lt.bwd_weight + end_bwd / 2,
            recompute_time=n * lt.recompute + extra_fwd, recompute=st.recompute,
            act_bytes=m.activation_bytes(n, st.tp, st.recompute, cl.chip(st.chip).activation_per_layer(st.tp)),
            full_act_bytes=0.0,
            static_bytes=plan.stage_memory(i, inflight=0), capacity=cl.chip(st.chip).usable_memory,
            update=prof.stage_update_time(st.tp, st.dp, n), name=st.chip,
            act_limit=cl.chip(st.chip).usable_memory - plan.stage_memory(i, inflight=0),
        ))
    # The links as the run has them (heteropp/placement.py, the model dicomm's emulated links
    # follow): in the time of the plan's chips, so at the time scale their profiles ran at.
    scale = cl.emulated_time_scale or 1.0
    links = []
    for i in range(S - 1):
        lk = boundary_link(plan, i, scale)
        tp = min(plan.stages[i].tp, plan.stages[i + 1].tp)
        shared = boundary_shared(plan, i)
        nbytes = m.p2p_bytes(tp) * (tp if shared else 1)
        links.append(LinkModel(nbytes=nbytes, bandwidth=lk.bandwidth, latency=lk.latency, shared=shared))
    replicas = plan.dp if any(lk.shared for lk in links) else 1
    return Pipeline(stages=stages, links=links, microbatches=[b] * replicas, ack_wait=blocking_ack)


def simulate(pipeline: Pipeline, schedule: Schedule | Sequence[Schedule] | str) -> SimResult:
    """Run ``schedule`` (lists, or 'comm-aware' for JEEVES's greedy scheduler) on ``pipeline``."""
    return Simulator(pipeline, schedule).run()
