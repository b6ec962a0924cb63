"""A client: any device, reliable or not, that computes for one stage for as long as it likes.

It asks the stage's frontal servers for tasks in turn, runs them on its copy of the stage, and
keeps the forward graphs of the rows it sent on, so that when the backward servers return their
gradient it finishes the backward without recomputing. Per step it sums the parameter
gradients of the rows the frontal servers accepted from it and pushes that sum, in shards, to
every server of the stage; then it pulls the next version of the parameters. It can stop at
any moment: whatever it had not finished is in the servers' task pool.

A client is four parts with one role each: its links to the stage's servers with their
heartbeats (``server_links.py``), its copy of the stage and a task's arithmetic on it
(``stage_compute.py``), the pulls of its parameters (``parameter_pull.py``), and this file: the
tasks it holds and the messages that move them.
"""
from __future__ import annotations

import dataclasses
import logging
import secrets
import threading
import time
from typing import Callable

import torch
import zmq

from .job import Job
from .parameter_pull import ParameterPull
from .ranges import RowSet
from .security import JobKeys
from .server_links import ServerLinks
from .stage_compute import StageCompute
from .wire import Message, ProtocolError

log = logging.getLogger("volunteer.client")

LEAVE_LINGER_MS = 1000  # how long a leaving client keeps trying to deliver its LEAVE
MAX_GRAPHS = 4  # forward graphs kept at once (memory, as 1F1B bounds in-flight micro-batches)


@dataclasses.dataclass
class Work:
    """A task the client holds: its rows, input and, once computed, its forward graph."""

    key: tuple[int, int, int]
    step: int
    mb: int
    rows: tuple[int, int]
    kind: str
    attempt: int
    x: torch.Tensor
    targets: torch.Tensor | None
    graph: tuple[torch.Tensor, torch.Tensor] | None = None  # (input leaf, output)
    grad: torch.Tensor | None = None
    grad_rows: RowSet = dataclasses.field(default_factory=RowSet)


class Departed(Exception):
    """Raised by a fault-injection hook: the client vanishes at once, sending nothing more."""


class Client:
    """Client ``name`` of ``stage``; ``run()`` computes until the job finishes or ``stop()``."""

    def __init__(self, job: Job, stage: int, name: str, keys: JobKeys, flops: float = 1e12,
                 emulate_flops: float | None = None, leave_after: float | None = None,
                 fault: Callable[[str], None] | None = None, link: tuple[float, float] | None = None,
                 device: str = "cpu"):
        self.job, self.stage, self.name = job, stage, name
        self.flops, self.leave_after = flops, leave_after
        self.fault = fault or (lambda point: None)  # fault injection: raises Departed at a point
        self.spec = job.stages[stage]
        self.first, self.last = stage == 0, stage == len(job.stages) - 1
        self.links = ServerLinks(job, stage, f"c:{name}:{secrets.token_hex(4)}".encode(), keys, link)
        self.frontal, self.backward = self.links.frontal, self.links.backward
        self.compute = StageCompute(job, stage, device, emulate_flops)
        self.pull = ParameterPull(self.compute.numel, len(self.links.sockets))
        self.work: dict[tuple[int, int, int], Work] = {}
        self.parked: list[Work] = []  # tasks waiting for a newer version of the parameters
        # finished tasks whose gradient waits for the FS's verdict: key -> (step, rows, gradient, sent at)
        self.awaiting_accept: dict[tuple[int, int, int], tuple[int, tuple[int, int], torch.Tensor, float]] = {}
        self.grads: dict[int, torch.Tensor] = {}
        self.rows: dict[int, RowSet] = {}
        self.seg_done: dict[int, set[int]] = {}
        self.pushed: set[int] = set()
        self.asking: int | None = None  # frontal server asked for a task, awaiting its answer
        self.next_fs = secrets.randbelow(len(self.frontal))
        self.finished_by: set[int] = set()
        self.stop_event = threading.Event()
        self.tasks_done = 0

    # -- the loop ------------------------------------------------------------------------------
    def run(self) -> int:
        """Compute until every frontal server says the job is finished; returns tasks done."""
        started = time.monotonic()
        self.links.broadcast(Message("HELLO", {"flops": self.flops}))
        self._pull(0)
        poller = zmq.Poller()
        for s in self.links.sockets:
            poller.register(s, zmq.POLLIN)
        self.links.start_heartbeats()
        graceful = False
        try:
            while not self.stop_event.is_set() and len(self.finished_by) < len(self.frontal):
                if self.leave_after is not None and time.monotonic() - started > self.leave_after:
                    break
                busy = self._step_once()
                for sock, _ in poller.poll(0 if busy else 20):
                    self._receive(sock)
            graceful = len(self.finished_by) < len(self.frontal)
        except Departed:
            log.info("%s departs without warning", self.name)
        finally:
            self.links.stop_heartbeats()
            if graceful:  # say so: the servers hand its work to others at once
                log.info("%s leaves", self.name)
                self.links.broadcast(Message("LEAVE", {}))
            self.close(LEAVE_LINGER_MS if graceful else 0)
        return self.tasks_done

    def stop(self) -> None:
        """Leave at the next chance, telling the servers (a graceful departure)."""
        self.stop_event.set()

    def close(self, linger_ms: int = 0) -> None:
        self.links.close(linger_ms)

    def _step_once(self) -> bool:
        """Do one piece of local work, if any is ready; True when something was done."""
        now = time.monotonic()
        for key in [k for k, e in self.awaiting_accept.items() if now - e[3] > self.job.task_timeout]:
            del self.awaiting_accept[key]  # no verdict came (the FS refused the message): the rows are not ours
        self._apply_version()
        for w in list(self.work.values()):
            if w.grad is not None and w.grad_rows.covers(w.rows) and self._can_compute(w):
                self._finish_backward(w)
                return True
        for w in list(self.parked):
            if self._can_compute(w):
                self.parked.remove(w)
                self._start(w)
                return True
        self._push_finished_steps()
        if self.asking is None and not self.parked and len(self._graphs()) < MAX_GRAPHS:
            self.asking = self.next_fs
            self.next_fs = (self.next_fs + 1) % len(self.frontal)
            self.links.send(self.frontal[self.asking], Message("REQ_TASK", {}))
        return False

    def _graphs(self) -> list[Work]:
        return [w for w in self.work.values() if w.graph is not None]

    def _required_version(self, step: int) -> int:
        return max(0, step - 1) if self.job.delayed_updates else step

    def _can_compute(self, w: Work) -> bool:
        """Whether the parameters for ``w`` are installed. A client newer than a late backward or
        redo of an earlier step needs (only with delayed updates, under churn) uses its own:
        the shards keep just the version before the current one."""
        need = self._required_version(w.step)
        if self.pull.version >= need:
            return True
        self._pull(need)
        return False

    # -- receiving -----------------------------------------------------------------------------
    def _receive(self, sock: zmq.Socket) -> None:
        frames = sock.recv_multipart()
        try:
            msg = Message.decode(frames)
            self.links.cross(msg)
            handler = getattr(self, f"_on_{msg.op.lower()}", None)
            if handler is None:
                raise ProtocolError(f"unexpected {msg.op!r}")
            handler(sock, msg)
        except ProtocolError as exc:
            log.warning("%s refused a message: %s", self.name, exc)

    def _on_task(self, sock: zmq.Socket, msg: Message) -> None:
        self.asking = None
        step, mb = msg.int("step", 0, self.job.steps - 1), msg.int("mb", 0, self.job.microbatches - 1)
        lo, hi = msg.int("start", 0, self.job.batch - 1), msg.int("end", 1, self.job.batch)
        if not (self.job.microbatch_rows(mb)[0] <= lo < hi <= self.job.microbatch_rows(mb)[1]):
            raise ProtocolError(f"TASK rows [{lo}, {hi}) are outside micro-batch {mb}")
        kind = msg.str("kind")
        if kind not in ("fwd", "bwd", "redo"):
            raise ProtocolError(f"TASK.kind = {kind!r}; expected fwd, bwd or redo")
        n = hi - lo
        x = (msg.tensor(0, torch.int64, (n, self.job.seq)) if self.first
             else msg.tensor(0, torch.float32, self.job.boundary_shape(n), finite=True))
        targets = msg.tensor(1, torch.int64, (n, self.job.seq)) if self.last else None
        key = tuple(msg.fields["task"]) if isinstance(msg.fields.get("task"), list) else None
        if key is None or len(key) != 3:
            raise ProtocolError("TASK.task must be [step, server, number]")
        w = Work(key, step, mb, (lo, hi), kind, msg.int("attempt"), x, targets)
        if self._can_compute(w):
            self._start(w)
        else:
            self.parked.append(w)

    def _on_idle(self, sock: zmq.Socket, msg: Message) -> None:
        self.asking = None

    def _on_finished(self, sock: zmq.Socket, msg: Message) -> None:
        if sock not in self.frontal:
            raise ProtocolError("FINISHED from a server that hands out no tasks")
        self.asking = None
        self.finished_by.add(self.frontal.index(sock))

    def _on_bwd(self, sock: zmq.Socket, msg: Message) -> None:
        key = tuple(msg.fields.get("task") or ())
        w = self.work.get(key)
        if w is None:
            return  # a graph this client gave up (its step ended elsewhere)
        lo, hi = msg.int("start", w.rows[0], w.rows[1] - 1), msg.int("end", w.rows[0] + 1, w.rows[1])
        g = msg.tensor(0, torch.float32, self.job.boundary_shape(hi - lo), finite=True)
        if w.grad is None:
            w.grad = torch.zeros(self.job.boundary_shape(w.rows[1] - w.rows[0]))
        w.grad[lo - w.rows[0]:hi - w.rows[0]] = g
        w.grad_rows.add((lo, hi))

    def _on_accept(self, sock: zmq.Socket, msg: Message) -> None:
        entry = self.awaiting_accept.pop(tuple(msg.fields.get("task") or ()), None)
        if entry is None:
            return
        step, rows, grads, _ = entry
        if step in self.grads:
            self.grads[step] += grads
        else:
            self.grads[step] = grads
        self.rows.setdefault(step, RowSet()).add(rows)

    def _on_refuse(self, sock: zmq.Socket, msg: Message) -> None:
        self.awaiting_accept.pop(tuple(msg.fields.get("task") or ()), None)

    def _on_seg_done(self, sock: zmq.Socket, msg: Message) -> None:
        step = msg.int("step", 0, self.job.steps - 1)
        self.seg_done.setdefault(step, set()).add(msg.int("frontal", 0, len(self.frontal) - 1))
        if len(self.seg_done[step]) == len(self.frontal):  # the step is over here: drop its graphs
            for key in [k for k, w in self.work.items() if w.step == step]:
                del self.work[key]

    def _on_pushed(self, sock: zmq.Socket, msg: Message) -> None:
        if not msg.fields.get("ok"):
            log.info("%s: a push of step %s was refused (%s)", self.name, msg.fields.get("step"), msg.fields.get("reason"))

    def _on_params(self, sock: zmq.Socket, msg: Message) -> None:
        version = msg.int("version", 0, self.job.steps)
        shard = self.links.sockets.index(sock)
        lo, hi = self.pull.bounds(shard)
        self.pull.received(version, shard, msg.tensor(0, torch.float32, (hi - lo,), finite=True))

    # -- parameters ----------------------------------------------------------------------------
    def _pull(self, version: int) -> None:
        if self.pull.ask(version):
            self.links.broadcast(Message("PULL", {"version": version}))

    def _apply_version(self) -> None:
        """Install the version pulled once it is complete and no forward graph depends on the old
        one; ask again when every shard answered without one."""
        version = self.pull.complete()
        if version is None:
            if self.pull.answered_without_one():
                target, self.pull.pulling = self.pull.pulling, None
                self._pull(target)
            return
        if self._graphs() or self.awaiting_accept:
            return
        self.compute.install(self.pull.take(version))

    # -- compute -------------------------------------------------------------------------------
    def _start(self, w: Work) -> None:
        if w.kind == "fwd" and not self.last:
            self._forward(w)
        elif w.kind == "fwd" or self.last:
            self._forward_backward_last(w)
        else:  # bwd / redo on an inner stage: the gradient comes from the backward servers
            self.work[w.key] = w
            for b, rows in self.job.owners(self.spec.backward, w.mb, w.rows):
                self.links.send(self.backward[b], Message("GET_GRAD", {"task": list(w.key), "step": w.step,
                                                                       "mb": w.mb, "start": rows[0], "end": rows[1]}))

    def _forward(self, w: Work) -> None:
        self.fault("forward")
        with self.compute.paced(w.rows, 1 / 3):
            x = self.compute.leaf(w.x)
            y = self.compute.forward(x)
        w.graph = (x, y)
        self.work[w.key] = w
        out = y.detach().cpu()
        for b, rows in self.job.owners(self.spec.backward, w.mb, w.rows):
            self.links.send(self.backward[b], Message("ACT", {"task": list(w.key), "step": w.step, "mb": w.mb,
                                                              "start": rows[0], "end": rows[1]},
                                                      [out[rows[0] - w.rows[0]:rows[1] - w.rows[0]]]))
        self.links.send(self.frontal[w.key[1]], Message("FWD_DONE", {"task": list(w.key), "attempt": w.attempt}))

    def _forward_backward_last(self, w: Work) -> None:
        """The last stage: forward, loss and backward in one task."""
        self.fault("forward")
        with self.compute.paced(w.rows, 1.0):
            x = self.compute.leaf(w.x)
            loss_sum = self.compute.loss_sum(x, w.targets)
            grads = self.compute.backward(x, loss_sum / (self.job.batch * self.job.seq), None)  # its share of the batch mean
        self._report(w, grads, float(loss_sum.detach()))

    def _finish_backward(self, w: Work) -> None:
        self.fault("backward")
        del self.work[w.key]
        with self.compute.paced(w.rows, 2 / 3 if w.graph is not None else 1.0):
            if w.graph is not None:
                x, y = w.graph
            else:  # another client's forward: recompute it
                x = self.compute.leaf(w.x)
                y = self.compute.forward(x)
            grads = self.compute.backward(x, y, w.grad)
        self._report(w, grads, 0.0)

    def _report(self, w: Work, grads: tuple[torch.Tensor | None, torch.Tensor], loss_sum: float) -> None:
        input_grad, flat = grads
        self.tasks_done += 1
        if w.kind == "redo":  # the shards asked for exactly these rows: push them now
            self._push(w.step, [list(w.rows)], flat)
            return
        self.awaiting_accept[w.key] = (w.step, w.rows, flat, time.monotonic())
        self.links.send(self.frontal[w.key[1]], Message("BWD_DONE", {"task": list(w.key), "attempt": w.attempt,
                                                                    "loss": loss_sum},
                                                        [] if input_grad is None else [input_grad]))

    def _push_finished_steps(self) -> None:
        for step, done in self.seg_done.items():
            if step in self.pushed or len(done) < len(self.frontal):
                continue
            if any(e[0] == step for e in self.awaiting_accept.values()):
                continue
            self.pushed.add(step)
            rows = self.rows.pop(step, None)
            grads = self.grads.pop(step, None)
            if rows:
                self._push(step, rows.ranges(), grads)

    def _push(self, step: int, rows: list[list[int]], flat: torch.Tensor) -> None:
        for i, sock in enumerate(self.links.sockets):
            self.fault("push")  # between shards too: a client may leave having pushed to some
            lo, hi = self.pull.bounds(i)
            self.links.send(sock, Message("PUSH", {"step": step, "rows": rows}, [flat[lo:hi]]))
