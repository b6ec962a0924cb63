"""A parameter shard: every server of a stage holds an even piece of the stage's flat parameter
vector, sums the clients' gradients for it and applies the optimizer on the CPU.

Clients push, per step, the gradient of all rows they finished together with those rows; a
push is counted only if none of its rows is counted already, so each row contributes exactly
once. From the frontal servers' SEG_DONE the shard knows which client owes which rows; rows
whose client has left, or has not pushed within ``push_timeout``, are asked of the owning FS
again (REDO). When every row of the batch is counted the shard steps (AdamW on its piece)
and serves the new version to clients that asked for it.

What a client may push is bounded (docs/volunteer.md, threat model): only rows a frontal server
handed to that client and accepted from it (SEG_DONE), or rows this shard asked to be redone;
only for the step being summed or the next ``MAX_STEPS_AHEAD``; and with a gradient whose norm
per row is finite and, once ``NORM_WARMUP`` pushes were accepted, at most ``NORM_BETA`` times
the median of the recent ones (as Di-PS filters pseudo-gradients). A push that arrives before
every frontal server's SEG_DONE for its step waits for them (one per client and step).
"""
from __future__ import annotations

import collections
import logging
import statistics
from typing import Callable

import torch

from .job import Job, shard_bounds
from .ranges import RowSet
from .roster import Roster
from .wire import Message, ProtocolError

log = logging.getLogger("volunteer.shard")

MAX_STEPS_AHEAD = 2      # pushes and pulls beyond version + this are refused, not kept
NORM_WARMUP = 8          # accepted pushes before the median bound applies
NORM_BETA = 10.0         # a push's norm per row may be at most this times the recent median
NORM_WINDOW = 64         # recent per-row norms the median is taken over
MAX_NORM_PER_ROW = 1e6   # always: far above any honest gradient, far below float32 overflow in AdamW


class ParameterShard:
    """The shard role's handlers and timers."""

    def __init__(self, job: Job, stage: int, index: int, initial: torch.Tensor, roster: Roster,
                 send_client: Callable[[bytes, Message], None], send_server: Callable[[str, Message], None],
                 clock: Callable[[], float]):
        self.job, self.stage, self.index, self.roster = job, stage, index, roster
        self.send_client, self.send_server, self.clock = send_client, send_server, clock
        self.spec = job.stages[stage]
        self.total = initial.numel()
        lo, hi = shard_bounds(self.total, len(self.spec.servers), index)
        self.param = torch.nn.Parameter(initial[lo:hi].clone())
        self.optimizer = torch.optim.AdamW([self.param], lr=job.lr, weight_decay=job.weight_decay)
        self.version = 0
        self.grads: dict[int, torch.Tensor] = {}
        self.counted: dict[int, RowSet] = {}
        self.owed: dict[int, dict[str, RowSet]] = {}
        self.seg_done: dict[int, set[int]] = {}
        self.seg_done_at: dict[int, float] = {}
        self.redo_asked: dict[tuple[int, tuple[int, int]], float] = {}
        self.pulls: dict[bytes, int] = {}  # client -> the version it waits for (its latest pull)
        self.early: dict[tuple[int, bytes], Message] = {}  # pushes waiting for their step's SEG_DONEs
        self.norms: collections.deque[float] = collections.deque(maxlen=NORM_WINDOW)
        self.pushes_refused = 0
        self.previous: tuple[int, torch.Tensor] | None = None  # with delayed updates, step s computes on s - 1
        self.applied: list[torch.Tensor] | None = None  # set to [] to keep each step's summed gradient

    @property
    def size(self) -> int:
        return self.param.numel()

    def on_push(self, client: bytes, msg: Message) -> None:
        step = msg.int("step", 0, self.job.steps - 1)
        rows = msg.ranges("rows", 0, self.job.batch)
        grad = msg.tensor(0, torch.float32, (self.size,), finite=True)
        reason = self._refusal(client, step, rows)
        if reason == "wait":  # its SEG_DONEs are on their way: judged when they are in
            self.early[(step, client)] = msg
            return
        if reason is None:
            reason = self._norm_refusal(grad, rows, redone=self._asked_again(step, rows))
        if reason:
            self.pushes_refused += 1
            log.info("refused a push of step %d rows %s from %s: %s", step, rows, client.decode(errors="replace"), reason)
            self.send_client(client, Message("PUSHED", {"step": step, "ok": False, "reason": reason}))
            return
        counted = self.counted.setdefault(step, RowSet())
        if step not in self.grads:
            self.grads[step] = torch.zeros(self.size)
        self.grads[step] += grad
        for r in rows:
            counted.add(r)
        self.send_client(client, Message("PUSHED", {"step": step, "ok": True}))
        self._apply_ready()

    def _refusal(self, client: bytes, step: int, rows: list[tuple[int, int]]) -> str | None:
        """Why a push of ``rows`` for ``step`` by ``client`` cannot be counted (None: it can;
        "wait": not before its step's SEG_DONEs arrive)."""
        if step < self.version:
            return f"step {step} is already applied"
        if step > self.version + MAX_STEPS_AHEAD:
            return f"step {step} is more than {MAX_STEPS_AHEAD} ahead of the step being summed ({self.version})"
        if not rows:
            return "no rows"
        counted = self.counted.get(step, RowSet())
        if any(counted.intersects(r) for r in rows):
            return "some rows are counted already"
        handed = self.owed.get(step, {}).get(client.decode(errors="replace"), RowSet())
        if all(handed.covers(r) for r in rows) or self._asked_again(step, rows):
            return None
        if len(self.seg_done.get(step, ())) < len(self.spec.frontal):
            return "wait"
        return "some rows were not handed to this client"

    def _judge_early(self, step: int) -> None:
        for client, msg in [(k[1], self.early.pop(k)) for k in [k for k in self.early if k[0] == step]]:
            self.on_push(client, msg)

    def _asked_again(self, step: int, rows: list[tuple[int, int]]) -> bool:
        """Whether every range of ``rows`` lies in rows this shard asked to be redone."""
        redo = RowSet()
        for s, r in self.redo_asked:
            if s == step:
                redo.add(r)
        return all(redo.covers(r) for r in rows)

    def _norm_refusal(self, grad: torch.Tensor, rows: list[tuple[int, int]], redone: bool) -> str | None:
        """Why ``grad``'s size is not believable for ``rows`` (None: it is); an accepted norm
        joins the statistics. A redone push, a second client's answer for rows whose first push
        was refused or lost, is held to the absolute bound only: a gradient that really is that
        large must not be redone forever."""
        n_rows = sum(hi - lo for lo, hi in rows)
        per_row = float(torch.linalg.vector_norm(grad.double())) / n_rows
        bound = MAX_NORM_PER_ROW
        if len(self.norms) >= NORM_WARMUP and not redone:
            bound = min(bound, NORM_BETA * max(statistics.median(self.norms), 1e-12))
        if not per_row <= bound:
            return f"gradient norm per row {per_row:.3g} exceeds {bound:.3g}"
        self.norms.append(per_row)
        return None

    def on_pull(self, client: bytes, msg: Message) -> None:
        version = msg.int("version", 0, min(self.job.steps, self.version + MAX_STEPS_AHEAD))
        self.pulls[client] = version  # a client waits for one version: its latest pull replaces the others
        self._serve_pulls()

    def on_segment_done(self, msg: Message) -> None:
        step, fs = msg.int("step", 0, self.job.steps - 1), msg.int("frontal", 0, len(self.spec.frontal) - 1)
        if step < self.version:
            return  # applied already: every row was counted
        accepted = msg.fields.get("accepted")
        if not isinstance(accepted, dict) or len(accepted) > 1 << 16:
            raise ProtocolError("SEG_DONE.accepted must map client names to row ranges")
        owed = self.owed.setdefault(step, {})
        for client, _ in accepted.items():
            rows = Message("SEG_DONE", {"r": accepted[client]}).ranges("r", 0, self.job.batch)
            for r in rows:
                owed.setdefault(str(client)[:256], RowSet()).add(r)
        self.seg_done.setdefault(step, set()).add(fs)
        self.seg_done_at[step] = self.clock()
        self._judge_early(step)  # pushes that came before it: judged now

    def tick(self) -> None:
        """Ask again for rows whose gradient will not come: their client left or is overdue."""
        now = self.clock()
        for step, done in self.seg_done.items():
            if step < self.version or len(done) < len(self.spec.frontal):
                continue
            overdue = now - self.seg_done_at[step] > self.job.push_timeout
            counted = self.counted.setdefault(step, RowSet())
            for client, rows in self.owed.get(step, {}).items():
                if not (overdue or not self.roster.alive(client.encode())):
                    continue
                for r in rows:
                    for missing in _minus(r, counted):
                        key = (step, missing)
                        if now - self.redo_asked.get(key, -float("inf")) < self.job.task_timeout:
                            continue
                        self.redo_asked[key] = now
                        log.info("step %d rows %s of %s are missing from shard %d; asking for a redo",
                                 step, list(missing), client, self.index)
                        for srv in self.spec.frontal:
                            self.send_server(srv.name, Message("REDO", {"step": step, "rows": [list(missing)]}))

    def _apply_ready(self) -> None:
        while self.counted.get(self.version, RowSet()).covers((0, self.job.batch)):
            step = self.version
            if self.job.delayed_updates:
                self.previous = (self.version, self.param.detach().clone())
            self.param.grad = self.grads.pop(step)
            if self.applied is not None:
                self.applied.append(self.param.grad.clone())
            self.optimizer.step()
            self.param.grad = None
            self.version += 1
            for d in (self.counted, self.owed, self.seg_done, self.seg_done_at):
                d.pop(step, None)
            self._judge_early(step)  # still waiting: told the step is applied
            self.redo_asked = {k: v for k, v in self.redo_asked.items() if k[0] != step}
            committed = Message("COMMITTED", {"step": step, "shard": self.index})
            for srv in self.spec.servers:
                self.send_server(srv.name, committed)
        self._serve_pulls()

    def _serve_pulls(self) -> None:
        for client, version in list(self.pulls.items()):
            if version <= self.version:
                v, piece = ((version, self.previous[1]) if self.previous and self.previous[0] == version
                            else (self.version, self.param.detach()))
                self.send_client(client, Message("PARAMS", {"version": v, "shard": self.index}, [piece]))
                del self.pulls[client]


def _minus(r: tuple[int, int], counted: RowSet) -> list[tuple[int, int]]:
    left = RowSet([r])
    for c in counted.intersection(r):
        left.remove(c)
    return list(left)
