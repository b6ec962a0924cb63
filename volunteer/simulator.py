"""Event-driven simulator of batches on volunteer stages, for three ways of living with devices
that leave: the task pool (this system), SWARM-like rerouting without a pool, and a synchronous
pipeline that restarts the batch.

Every stage's participants (its servers, which compute too, and its clients) take work as they
become free: backward work first, then forward rows of the oldest micro-batch, carved in
proportion to their speed (``pool`` and ``swarm``) or fixed slices (``sync``). A forward's
output crosses to the next stage once its whole micro-batch is done; the last stage does
forward and backward at once; gradients come back the same way, and each backward is done by
the participant that holds the forward graph. A departing device takes its running task, its
held graphs and its unpushed gradient sum with it; the others notice ``detect`` seconds later:

    pool   the stage redoes just that work: a forward again, or a backward that first
           recomputes the forward from the activation the frontal server kept
    swarm  no pool keeps the activations: lost rows start again from the first stage and go
           through every stage (the downstream work done for them is wasted)
    sync   the batch restarts, without the device (it returns for the next batch)
"""
from __future__ import annotations

import dataclasses
import math
import random
from typing import Sequence

SYSTEMS = ("pool", "swarm", "sync")


@dataclasses.dataclass(frozen=True)
class Participant:
    """A device computing for one stage: seconds per row of forward+backward over the stage's
    layers, and what moving a task's input in and its output out costs: ``delay`` seconds per
    task and ``row_transfer`` seconds per row (both hops together; a server's own side is free)."""

    name: str
    stage: int
    row_seconds: float
    delay: float
    row_transfer: float
    unreliable: bool = False


@dataclasses.dataclass(frozen=True)
class Scenario:
    participants: tuple[Participant, ...]
    boundary_seconds: tuple[float, ...]  # a whole micro-batch across each stage boundary
    microbatches: int
    microbatch_rows: int
    detect: float  # seconds from a departure until the servers act on it

    @property
    def stages(self) -> int:
        return 1 + max(p.stage for p in self.participants)


@dataclasses.dataclass
class _Task:
    stage: int
    group: int
    rows: int
    kind: str  # "f" forward, "fb" last stage, "b" backward with the graph, "rb" recompute + backward
    ready: float
    owner: str | None = None


class _Batch:
    """One batch from time ``start`` with the given departure times (absolute)."""

    def __init__(self, sc: Scenario, system: str, start: float, depart: dict[str, float], members: Sequence[Participant]):
        self.sc, self.system, self.depart = sc, system, depart
        self.members = {p.name: p for p in members}
        self.free = {p.name: start for p in members}
        self.dead: set[str] = set()
        self.tasks: list[_Task] = []
        self.expected: dict[int, int] = {}  # group -> rows it still counts
        self.fwd_done: dict[tuple[int, int], int] = {}
        self.bwd_done: dict[tuple[int, int], int] = {}
        self.released: set[tuple[str, int, int]] = set()  # ("f" | "b", stage, group) passed on
        self.free_rows: dict[tuple[int, int], tuple[int, float]] = {}  # (stage, group) -> (rows, ready)
        self.holders: dict[tuple[int, int], list[tuple[str, int]]] = {}  # graphs awaiting their gradient
        self.pushed: dict[str, list[tuple[int, int]]] = {}  # (stage, rows) of finished backward per device
        self.end = start
        self.next_group = 0
        for _ in range(sc.microbatches):
            self._new_group(sc.microbatch_rows, start)

    # -- work creation ---------------------------------------------------------------------
    def _new_group(self, rows: int, ready: float) -> None:
        g = self.next_group
        self.next_group += 1
        self.expected[g] = rows
        self._forward_ready(0, g, ready)

    def _forward_ready(self, stage: int, g: int, ready: float) -> None:
        rows = self.expected[g]
        if self.system == "sync":  # fixed slices, in proportion to each device's rate of rows
            members = [p for p in self.members.values() if p.stage == stage]
            for p, n in zip(members, _split(rows, [1 / (p.row_seconds + p.row_transfer) for p in members])):
                if n:
                    self.tasks.append(_Task(stage, g, n, self._fwd_kind(stage), ready, p.name))
        else:
            self.free_rows[(stage, g)] = (rows, ready)

    def _fwd_kind(self, stage: int) -> str:
        return "fb" if stage == self.sc.stages - 1 else "f"

    # -- the loop ----------------------------------------------------------------------------
    def run(self) -> float:
        while (choice := self._next()) is not None:
            name, task, start = choice
            p = self.members[name]
            finish = start + self._duration(p, task)
            if finish > self.depart.get(name, math.inf):
                self._departs(name, task)
                continue
            self.free[name] = finish
            self._complete(p, task, finish)
        if any(self.bwd_done.get((0, g), 0) < n for g, n in self.expected.items() if n > 0):
            raise RuntimeError("the simulated batch could not finish: a stage lost every participant")
        return self.end

    def _next(self) -> tuple[str, _Task, float] | None:
        """The (participant, task) that can start first; devices gone by then leave first."""
        while True:
            best = None
            for name, p in self.members.items():
                if name in self.dead:
                    continue
                leaves = self.depart.get(name, math.inf)
                for task in self._candidates(p):
                    start = max(self.free[name], task.ready)
                    key = (start, task.kind not in ("b", "rb"), task.group)
                    if start < leaves and (best is None or key < best[0]):
                        best = (key, name, task)
            horizon = best[0][0] if best else -math.inf  # with nothing left to do, no one is missed
            gone = [n for n in self.members if n not in self.dead and self.depart.get(n, math.inf) <= horizon]
            if not gone:
                break
            for n in gone:
                self._departs(n, None)
        if best is None:
            return None
        _, name, task = best
        if task in self.tasks:
            self.tasks.remove(task)
        else:  # forward rows carved for this participant
            rows, ready = self.free_rows.pop((task.stage, task.group))
            if rows > task.rows:
                self.free_rows[(task.stage, task.group)] = (rows - task.rows, ready)
        return name, task, best[0][0]

    def _candidates(self, p: Participant) -> list[_Task]:
        out = [t for t in self.tasks if t.stage == p.stage and t.owner in (None, p.name)]
        if self.system != "sync":
            live = [m for m in self.members.values() if m.stage == p.stage and m.name not in self.dead]
            share = (1 / p.row_seconds) / sum(1 / m.row_seconds for m in live)
            for (stage, g), (rows, ready) in self.free_rows.items():
                if stage == p.stage:
                    want = max(1, math.ceil(self.sc.microbatch_rows * share))
                    out.append(_Task(stage, g, min(rows, want), self._fwd_kind(stage), ready))
        return out

    def _duration(self, p: Participant, t: _Task) -> float:
        compute = {"f": 1 / 3, "b": 2 / 3, "fb": 1.0, "rb": 1.0}[t.kind] * t.rows * p.row_seconds
        moves = p.delay + t.rows * p.row_transfer  # rows in, rows (or their gradient) out
        return compute + moves

    # -- completion ----------------------------------------------------------------------------
    def _complete(self, p: Participant, t: _Task, at: float) -> None:
        if t.group < 0:  # a redone gradient sum: nothing waits on it but the end of the batch
            self.end = max(self.end, at)
            return
        if t.kind == "f":
            self.holders.setdefault((t.stage, t.group), []).append((p.name, t.rows))
            self.fwd_done[(t.stage, t.group)] = self.fwd_done.get((t.stage, t.group), 0) + t.rows
        else:
            self.pushed.setdefault(p.name, []).append((t.stage, t.rows))
            self.bwd_done[(t.stage, t.group)] = self.bwd_done.get((t.stage, t.group), 0) + t.rows
            self.end = max(self.end, at)
        self._release(t.stage, t.group, at)

    def _release(self, stage: int, g: int, at: float) -> None:
        """Pass a micro-batch on once a stage has all of its rows: forward to the next stage,
        gradients to the graphs the previous stage holds."""
        sc = self.sc
        n = self.expected[g]
        if stage < sc.stages - 1 and self.fwd_done.get((stage, g), 0) >= n and ("f", stage, g) not in self.released:
            self.released.add(("f", stage, g))
            self._forward_ready(stage + 1, g, at + sc.boundary_seconds[stage])
        if stage > 0 and self.bwd_done.get((stage, g), 0) >= n and ("b", stage, g) not in self.released:
            self.released.add(("b", stage, g))
            ready = at + sc.boundary_seconds[stage - 1]
            for holder, rows in self.holders.pop((stage - 1, g), []):
                if holder in self.dead or self.depart.get(holder, math.inf) <= ready:
                    self._lost(stage - 1, g, rows, max(ready, self.depart.get(holder, 0.0) + sc.detect), "b")
                else:
                    self.tasks.append(_Task(stage - 1, g, rows, "b", ready, holder))

    # -- departures ----------------------------------------------------------------------------
    def _departs(self, name: str, running: _Task | None) -> None:
        """``name`` leaves at its departure time with its running task, the backward work it
        holds and its gradient sum, which it would have pushed at the end of the step."""
        noticed = self.depart[name] + self.sc.detect
        self.dead.add(name)
        if running is not None:
            self._lost(running.stage, running.group, running.rows, noticed, running.kind)
        for t in [t for t in self.tasks if t.owner == name]:
            self.tasks.remove(t)
            self._lost(t.stage, t.group, t.rows, max(t.ready, noticed), t.kind)
        # graphs whose gradient has not come yet are found lost when it comes (_release)
        for stage, rows in self.pushed.pop(name, []):
            if self.system == "swarm":
                self._new_group(rows, noticed)
            else:
                kind = "fb" if stage == self.sc.stages - 1 else "rb"
                self.tasks.append(_Task(stage, -1, rows, kind, noticed))

    def _lost(self, stage: int, g: int, rows: int, ready: float, kind: str) -> None:
        if g < 0:  # a redone gradient sum: do it again
            self.tasks.append(_Task(stage, g, rows, kind, ready))
        elif self.system == "swarm":  # the rows start over from the first stage
            self.expected[g] -= rows
            for k in range(self.sc.stages):
                self._release(k, g, ready)
            self._new_group(rows, ready)
        elif kind in ("f", "fb"):  # the rows go back to the stage's pool
            rest, r = self.free_rows.get((stage, g), (0, ready))
            self.free_rows[(stage, g)] = (rest + rows, max(r, ready) if rest == 0 else r)
        else:  # a backward becomes recompute + backward, for anyone at the stage
            self.tasks.append(_Task(stage, g, rows, "rb", ready))


def _split(rows: int, speed: Sequence[float]) -> list[int]:
    total = sum(speed)
    exact = [rows * s / total for s in speed]
    out = [math.floor(e) for e in exact]
    for i in sorted(range(len(speed)), key=lambda i: exact[i] - out[i], reverse=True)[: rows - sum(out)]:
        out[i] += 1
    return out


def batch_time(sc: Scenario, system: str, depart: dict[str, float]) -> float:
    """Seconds one batch takes under ``system`` when devices leave at the given times."""
    if system not in SYSTEMS:
        raise ValueError(f"system={system!r}; expected one of {SYSTEMS}")
    if system != "sync":
        return _Batch(sc, system, 0.0, depart, sc.participants).run()
    members, start = list(sc.participants), 0.0
    while True:  # restart without the first device to leave, until a batch runs through
        end = _Batch(sc, "sync", start, {}, members).run()
        leaving = [(t, p) for p in members if start <= (t := depart.get(p.name, math.inf)) < end]
        if not leaving:
            return end
        t, p = min(leaving, key=lambda x: x[0])
        members = [m for m in members if m is not p]
        start = t + sc.detect


def mean_batch_time(sc: Scenario, system: str, disconnect: float, batches: int, seed: int = 0) -> float:
    """Mean over ``batches`` batches in which each unreliable participant leaves with probability
    ``disconnect``, at a uniform time within the batch, and is back for the next one."""
    rng = random.Random(seed)
    clean = batch_time(sc, system, {})
    total = 0.0
    for _ in range(batches):
        depart = {p.name: rng.uniform(0, clean) for p in sc.participants if p.unreliable and rng.random() < disconnect}
        total += batch_time(sc, system, depart)
    return total / batches
