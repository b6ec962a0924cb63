"""A parameter shard: every server of a stage holds an even piece of the stage's flat parameter
vector, sums the clients' gradients for it and applies the optimizer on the CPU.

Clients push, per step, the gradient of all rows they finished together with those rows; a
push is counted only if none of its rows is counted already, so each row contributes exactly
once. From the frontal servers' SEG_DONE the shard knows which client owes which rows; rows
whose client has left, or has not pushed within ``push_timeout``, are asked of the owning FS
again (REDO). When every row of the batch is counted the shard steps (AdamW on its piece)
and serves the new version to clients that asked for it.
"""
from __future__ import annotations

import logging
from typing import Callable

import torch

from .job import Job, shard_bounds
from .ranges import RowSet
from .roster import Roster
from .wire import Message, ProtocolError

log = logging.getLogger("volunteer.shard")


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
        self.pulls: list[tuple[bytes, int]] = []
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
        counted = self.counted.setdefault(step, RowSet()) if step >= self.version else None
        reason = None
        if counted is None:
            reason = f"step {step} is already applied"
        elif not rows:
            reason = "no rows"
        elif any(counted.intersects(r) for r in rows):
            reason = "some rows are counted already"
        if reason:
            self.pushes_refused += 1
            log.info("refused a push of step %d rows %s from %s: %s", step, rows, client.decode(errors="replace"), reason)
            self.send_client(client, Message("PUSHED", {"step": step, "ok": False, "reason": reason}))
            return
        if step not in self.grads:
            self.grads[step] = torch.zeros(self.size)
        self.grads[step] += grad
        for r in rows:
            counted.add(r)
        self.send_client(client, Message("PUSHED", {"step": step, "ok": True}))
        self._apply_ready()

    def on_pull(self, client: bytes, msg: Message) -> None:
        self.pulls.append((client, msg.int("version", 0, self.job.steps)))
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
            self.redo_asked = {k: v for k, v in self.redo_asked.items() if k[0] != step}
            committed = Message("COMMITTED", {"step": step, "shard": self.index})
            for srv in self.spec.servers:
                self.send_server(srv.name, committed)
        self._serve_pulls()

    def _serve_pulls(self) -> None:
        keep = []
        for client, version in self.pulls:
            if version <= self.version:
                v, piece = ((version, self.previous[1]) if self.previous and self.previous[0] == version
                            else (self.version, self.param.detach()))
                self.send_client(client, Message("PARAMS", {"version": v, "shard": self.index}, [piece]))
            else:
                keep.append((client, version))
        self.pulls = keep


def _minus(r: tuple[int, int], counted: RowSet) -> list[tuple[int, int]]:
    left = RowSet([r])
    for c in counted.intersection(r):
        left.remove(c)
    return list(left)
