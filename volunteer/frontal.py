"""A frontal server (FS): takes a stage's input rows in, hands them to clients as tasks, and
keeps the task pool that lets any client finish what a departed one started.

Each FS owns an even segment of every micro-batch. A task is some of those rows:

    fwd   forward (on the last stage forward, loss and backward at once), carved for the
          asking client in proportion to its share of the stage's compute
    bwd   backward of rows whose forward is done but whose graph holder left or stalled:
          the client fetches the gradient from the backward servers, recomputes, finishes
    redo  the parameter gradient of rows a client had finished but never pushed to the
          shards (it left first): computed like bwd, pushed straight to the shards

The FS is the single authority on each row's backward: the first completion it hears is
accepted (loss, input gradient, and the client's right to push those rows' parameter
gradient); every later one is refused. Rows' input gradients go back to the previous stage's
backward servers once a segment is complete.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from typing import Callable

import torch

from .job import Job
from .ranges import Range, RowSet
from .roster import Roster
from .wire import Message, ProtocolError

log = logging.getLogger("volunteer.frontal")

IDLE_REPLY_AFTER = 0.5  # seconds a task request waits for work before the client is told to ask again


@dataclasses.dataclass
class Task:
    key: tuple[int, int, int]  # (step, frontal server, number)
    mb: int
    rows: Range
    kind: str
    state: str = "pending"  # pending -> running -> (forwarded -> awaiting) -> done
    attempt: int = 0
    assignee: bytes | None = None
    holder: bytes | None = None  # client that kept the forward graph
    deadline: float = math.inf
    given_to: set = dataclasses.field(default_factory=set)

    @property
    def step(self) -> int:
        return self.key[0]


@dataclasses.dataclass
class Segment:
    """This FS's rows of one micro-batch of one step."""

    rows: Range
    inputs: torch.Tensor
    targets: torch.Tensor | None
    arrived: RowSet = dataclasses.field(default_factory=RowSet)
    free: RowSet = dataclasses.field(default_factory=RowSet)  # arrived and not yet in a task
    done: RowSet = dataclasses.field(default_factory=RowSet)  # backward accepted
    grad_ready: RowSet = dataclasses.field(default_factory=RowSet)  # gradient waiting at the BS
    input_grad: torch.Tensor | None = None
    returned: bool = False


class FrontalServer:
    """The FS role's handlers and timers; ``send_client``/``send_server`` deliver messages."""

    def __init__(self, job: Job, stage: int, index: int, roster: Roster,
                 send_client: Callable[[bytes, Message], None], send_server: Callable[[str, Message], None],
                 clock: Callable[[], float], data: torch.Tensor | None = None):
        self.job, self.stage, self.index, self.roster = job, stage, index, roster
        self.send_client, self.send_server, self.clock = send_client, send_server, clock
        self.spec = job.stages[stage]
        self.first, self.last = stage == 0, stage == len(job.stages) - 1
        self.data = data
        self.segments: dict[tuple[int, int], Segment] = {}
        self.tasks: dict[tuple[int, int, int], Task] = {}
        self.next_task = 0
        self.accepted: dict[int, dict[bytes, RowSet]] = {}
        self.loss_sum: dict[int, float] = {}
        self.seg_done_sent: set[int] = set()
        self.committed: dict[int, set[int]] = {}
        self.freed_through = -1
        self.waiting: dict[bytes, float] = {}
        # rows of a redo task pending or running: every shard of the stage asks for the same
        # rows, and only a task lost with its client (or overdue) lets them be handed out again
        self.redo_queued: set[tuple[int, Range]] = set()
        self.losses: dict[int, float] = {}  # step -> loss, on the last stage's FS 0
        self._loss_parts: dict[int, list[tuple[float, int]]] = {}
        self.on_loss: Callable[[int, float], None] | None = None
        self._batches: dict[int, torch.Tensor] = {}
        if self.first:
            self._open_step(0)

    # -- state ---------------------------------------------------------------------------------
    @property
    def finished(self) -> bool:
        return self.freed_through >= self.job.steps - 1

    def _segment(self, step: int, mb: int) -> Segment:
        key = (step, mb)
        seg = self.segments.get(key)
        if seg is None:
            rows = self.job.owned_rows(self.spec.frontal, self.index, mb)
            n = rows[1] - rows[0]
            inputs = (torch.zeros((n, self.job.seq), dtype=torch.int64) if self.first
                      else torch.zeros(self.job.boundary_shape(n)))
            seg = Segment(rows, inputs, None)
            if self.first or self.last:
                tokens = self._batch(step)[rows[0]:rows[1]]
                if self.first:
                    seg.inputs = tokens[:, :-1].contiguous()
                if self.last:
                    seg.targets = tokens[:, 1:].contiguous()
            seg.input_grad = None if self.first else torch.zeros(self.job.boundary_shape(n))
            self.segments[key] = seg
        return seg

    def _batch(self, step: int) -> torch.Tensor:
        """The tokens of step ``step`` (a function of the seed and the step, as in every run)."""
        from dimodel.datasets import step_batch

        if step not in self._batches:
            self._batches[step] = step_batch(self.data, self.job.batch, self.job.seq, self.job.seed, step)
        return self._batches[step]

    def _open_step(self, step: int) -> None:
        """The first stage's inputs are the batch itself: all of its rows arrive at once."""
        for mb in range(self.job.microbatches):
            seg = self._segment(step, mb)
            seg.arrived.add(seg.rows)
            seg.free.add(seg.rows)
        self._serve_waiting()

    def _live_step(self, step: int) -> bool:
        return self.freed_through < step < self.job.steps

    # -- client messages -----------------------------------------------------------------------
    def on_request(self, client: bytes, msg: Message) -> None:
        if self.finished:
            self.send_client(client, Message("FINISHED", {}))
            return
        if not self._give_task(client):
            self.waiting.setdefault(client, self.clock())

    def on_forward_done(self, client: bytes, msg: Message) -> None:
        task = self._task(msg)
        if task is None or task.kind != "fwd" or task.state != "running" or task.assignee != client \
                or msg.int("attempt") != task.attempt:
            return  # a stale report of a task that was reissued; the rows are someone else's now
        task.state, task.holder, task.deadline = "forwarded", client, math.inf
        self._check_gradient(task)

    def on_backward_done(self, client: bytes, msg: Message) -> None:
        task = self._task(msg)
        if task is None and msg.fields["task"][0] <= self.freed_through:
            self.send_client(client, Message("REFUSE", {"task": msg.fields["task"]}))  # its step is over
            return
        if task is None or client not in task.given_to or task.kind == "redo":
            raise ProtocolError("BWD_DONE for a task this client was never given")
        seg = self.segments[(task.step, task.mb)]
        n = task.rows[1] - task.rows[0]
        loss = msg.float("loss") if self.last else 0.0
        grad = None if self.first else msg.tensor(0, torch.float32, self.job.boundary_shape(n), finite=True)
        if task.state == "done":
            self.send_client(client, Message("REFUSE", {"task": list(task.key)}))
            return
        task.state, task.deadline = "done", math.inf
        if grad is not None:
            lo = task.rows[0] - seg.rows[0]
            seg.input_grad[lo:lo + n] = grad
        seg.done.add(task.rows)
        self.accepted.setdefault(task.step, {}).setdefault(client, RowSet()).add(task.rows)
        self.loss_sum[task.step] = self.loss_sum.get(task.step, 0.0) + loss
        self.send_client(client, Message("ACCEPT", {"task": list(task.key)}))
        self._segment_progress(task.step, task.mb)

    # -- server messages -----------------------------------------------------------------------
    def on_activations(self, msg: Message) -> None:
        """Rows of the previous stage's output: this stage's input."""
        step, mb = msg.int("step", 0, self.job.steps - 1), msg.int("mb", 0, self.job.microbatches - 1)
        if not self._live_step(step):
            return
        seg = self._segment(step, mb)
        lo, hi = msg.int("start", seg.rows[0], seg.rows[1] - 1), msg.int("end", seg.rows[0] + 1, seg.rows[1])
        if hi <= lo:
            raise ProtocolError(f"ACT_FWD rows [{lo}, {hi}) are empty")
        rows = msg.tensor(0, torch.float32, self.job.boundary_shape(hi - lo), finite=True)
        new = RowSet([(lo, hi)])
        for r in seg.arrived.intersection((lo, hi)):
            new.remove(r)  # rows that came twice (a reissued forward upstream) keep their first copy
        for r in new:
            seg.inputs[r[0] - seg.rows[0]:r[1] - seg.rows[0]] = rows[r[0] - lo:r[1] - lo]
            seg.arrived.add(r)
            seg.free.add(r)
        self._serve_waiting()

    def on_gradient_ready(self, msg: Message) -> None:
        """A backward server holds the gradient of these rows (from the next stage)."""
        step, mb = msg.int("step", 0, self.job.steps - 1), msg.int("mb", 0, self.job.microbatches - 1)
        if not self._live_step(step) or (step, mb) not in self.segments:
            return
        seg = self.segments[(step, mb)]
        seg.grad_ready.add((msg.int("start", seg.rows[0], seg.rows[1] - 1), msg.int("end", seg.rows[0] + 1, seg.rows[1])))
        for task in self.tasks.values():
            if task.step == step and task.mb == mb and task.state == "forwarded":
                self._check_gradient(task)

    def on_redo(self, msg: Message) -> None:
        """A shard lacks the parameter gradient of these rows: hand them out again."""
        step = msg.int("step", 0, self.job.steps - 1)
        if not self._live_step(step):
            return
        for r in msg.ranges("rows", 0, self.job.batch):
            for mb in range(self.job.microbatches):
                seg_rows = self.job.owned_rows(self.spec.frontal, self.index, mb)
                lo, hi = max(r[0], seg_rows[0]), min(r[1], seg_rows[1])
                if lo < hi and (step, (lo, hi)) not in self.redo_queued:
                    self.redo_queued.add((step, (lo, hi)))
                    self._new_task(step, mb, (lo, hi), "redo")
        self._serve_waiting()

    def on_committed(self, msg: Message) -> None:
        step, shard = msg.int("step", 0, self.job.steps - 1), msg.int("shard", 0, len(self.spec.servers) - 1)
        self.committed.setdefault(step, set()).add(shard)
        while len(self.committed.get(self.freed_through + 1, ())) == len(self.spec.servers):
            self._free(self.freed_through + 1)

    def on_loss_part(self, msg: Message) -> None:
        step = msg.int("step", 0, self.job.steps - 1)
        parts = self._loss_parts.setdefault(step, [])
        parts.append((msg.float("loss_sum"), msg.int("tokens")))
        if len(parts) == len(self.spec.frontal):
            loss = sum(p[0] for p in parts) / sum(p[1] for p in parts)
            self.losses[step] = loss
            log.info("step %d loss %.6f", step, loss)
            if self.on_loss:
                self.on_loss(step, loss)

    # -- timers --------------------------------------------------------------------------------
    def tick(self) -> None:
        now = self.clock()
        for task in self.tasks.values():
            if task.state == "running" and (now > task.deadline or not self.roster.alive(task.assignee)):
                self._requeue(task, task.kind)
            elif task.state == "awaiting" and (now > task.deadline or not self.roster.alive(task.holder)):
                self._requeue(task, "bwd")
        for client, since in list(self.waiting.items()):
            if now - since > IDLE_REPLY_AFTER:
                del self.waiting[client]
                self.send_client(client, Message("FINISHED" if self.finished else "IDLE", {}))
        self._serve_waiting()

    # -- internals -----------------------------------------------------------------------------
    def _task(self, msg: Message) -> Task | None:
        key = msg.fields.get("task")
        if not (isinstance(key, list) and len(key) == 3 and all(isinstance(x, int) for x in key)):
            raise ProtocolError(f"{msg.op}.task = {key!r:.60}; expected [step, server, number]")
        return self.tasks.get(tuple(key))

    def _new_task(self, step: int, mb: int, rows: Range, kind: str) -> Task:
        task = Task((step, self.index, self.next_task), mb, rows, kind)
        self.next_task += 1
        self.tasks[task.key] = task
        return task

    def _requeue(self, task: Task, kind: str) -> None:
        log.info("task %s (%s rows %s) of %s goes back to the pool as %s", task.key, task.kind, task.rows,
                 (task.assignee or task.holder or b"?").decode(errors="replace"), kind)
        task.kind, task.state, task.attempt = kind, "pending", task.attempt + 1
        task.assignee, task.deadline = None, math.inf
        if kind == "redo":  # redo tasks are driven by the shards: they ask again if still missing
            task.state = "done"
            self.redo_queued.discard((task.step, task.rows))

    def _check_gradient(self, task: Task) -> None:
        seg = self.segments[(task.step, task.mb)]
        if task.state == "forwarded" and seg.grad_ready.covers(task.rows):
            task.state, task.deadline = "awaiting", self.clock() + self.job.task_timeout

    def _serve_waiting(self) -> None:
        for client in list(self.waiting):
            if self._give_task(client):
                del self.waiting[client]

    def _give_task(self, client: bytes) -> bool:
        task = self._pending_task() or self._carve(client)
        if task is None:
            return False
        seg = self.segments[(task.step, task.mb)]
        task.state, task.assignee = "running", client
        task.deadline = self.clock() + self.job.task_timeout
        task.given_to.add(client)
        lo, hi = task.rows[0] - seg.rows[0], task.rows[1] - seg.rows[0]
        tensors = [seg.inputs[lo:hi]] + ([seg.targets[lo:hi]] if self.last else [])
        self.send_client(client, Message("TASK", {
            "task": list(task.key), "step": task.step, "mb": task.mb, "start": task.rows[0], "end": task.rows[1],
            "attempt": task.attempt, "kind": task.kind}, tensors))
        return True

    def _runnable(self, step: int) -> bool:
        """Whether the parameters step ``step`` computes with are committed on every shard of
        the stage, so that a client can pull them now rather than sit on the task."""
        needed = max(0, step - 1) if self.job.delayed_updates else step
        return needed <= self.freed_through + 1

    def _pending_task(self) -> Task | None:
        pending = [t for t in self.tasks.values() if t.state == "pending" and self._runnable(t.step)]
        return min(pending, key=lambda t: (t.step, t.kind == "fwd", t.key)) if pending else None

    def _carve(self, client: bytes) -> Task | None:
        for (step, mb) in sorted(self.segments):
            seg = self.segments[(step, mb)]
            if not seg.free or not self._live_step(step) or not self._runnable(step):
                continue
            size = seg.rows[1] - seg.rows[0]
            want = max(1, math.ceil(size * self.roster.share(client)))
            rows = seg.free.first_run(want)
            seg.free.remove(rows)
            return self._new_task(step, mb, rows, "fwd")
        return None

    def _segment_progress(self, step: int, mb: int) -> None:
        seg = self.segments[(step, mb)]
        if not seg.returned and seg.done.covers(seg.rows):
            seg.returned = True
            if not self.first:
                prev = self.job.stages[self.stage - 1]
                for b, rows in self.job.owners(prev.backward, mb, seg.rows):
                    lo, hi = rows[0] - seg.rows[0], rows[1] - seg.rows[0]
                    self.send_server(prev.backward[b].name, Message(
                        "GRAD", {"step": step, "mb": mb, "start": rows[0], "end": rows[1]}, [seg.input_grad[lo:hi]]))
        if step in self.seg_done_sent:
            return
        segs = [self.segments.get((step, m)) for m in range(self.job.microbatches)]
        if all(s is not None and s.returned for s in segs):
            self.seg_done_sent.add(step)
            accepted = {c.decode(): rows.ranges() for c, rows in self.accepted.get(step, {}).items()}
            done = Message("SEG_DONE", {"step": step, "frontal": self.index, "accepted": accepted})
            for srv in self.spec.servers:
                self.send_server(srv.name, done)
            for c in self.roster.identities():
                self.send_client(c, done)
            if self.last:
                tokens = sum(s.rows[1] - s.rows[0] for s in segs) * self.job.seq
                self.send_server(self.spec.frontal[0].name, Message(
                    "LOSS", {"step": step, "loss_sum": self.loss_sum.get(step, 0.0), "tokens": tokens}))
            if self.first and step + 1 < self.job.steps:
                self._open_step(step + 1)

    def _free(self, step: int) -> None:
        self.freed_through = step
        for key in [k for k in self.segments if k[0] == step]:
            del self.segments[key]
        for key in [k for k in self.tasks if k[0] == step]:
            del self.tasks[key]
        self.accepted.pop(step, None)
        self.loss_sum.pop(step, None)
        self._batches.pop(step, None)
        self.redo_queued = {r for r in self.redo_queued if r[0] != step}
