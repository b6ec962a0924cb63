"""A backward server (BS): collects the stage's output rows from clients, passes each complete
segment to the next stage's frontal servers, and brings gradients back to the clients that
produced the rows.

It remembers who produced which rows in a list of (start, end, client, task) nodes, the
paper's linked list: when the next stage returns the gradient of those rows, it goes to that
client, which still holds the forward graph. The BS also tells the frontal server that owns the
rows that their gradient is here, so that the FS can post the backward to the pool if that
client has left; a client taking such a task fetches the gradient with GET_GRAD.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Callable

import torch

from .job import Job
from .ranges import Range, RowSet
from .wire import Message, ProtocolError

log = logging.getLogger("volunteer.backward")


@dataclasses.dataclass
class Node:
    rows: Range
    client: bytes
    task: list
    sent: bool = False


@dataclasses.dataclass
class Segment:
    rows: Range
    outputs: torch.Tensor
    produced: RowSet = dataclasses.field(default_factory=RowSet)
    forwarded: bool = False
    nodes: list[Node] = dataclasses.field(default_factory=list)
    grad: torch.Tensor | None = None
    grad_rows: RowSet = dataclasses.field(default_factory=RowSet)


class BackwardServer:
    """The BS role's handlers."""

    def __init__(self, job: Job, stage: int, index: int, send_client: Callable[[bytes, Message], None],
                 send_server: Callable[[str, Message], None]):
        self.job, self.stage, self.index = job, stage, index
        self.send_client, self.send_server = send_client, send_server
        self.spec = job.stages[stage]
        self.last = stage == len(job.stages) - 1
        self.segments: dict[tuple[int, int], Segment] = {}
        self.committed: dict[int, set[int]] = {}
        self.freed_through = -1

    @property
    def finished(self) -> bool:
        return self.freed_through >= self.job.steps - 1

    def _segment(self, step: int, mb: int) -> Segment:
        seg = self.segments.get((step, mb))
        if seg is None:
            rows = self.job.owned_rows(self.spec.backward, self.index, mb)
            seg = self.segments[(step, mb)] = Segment(rows, torch.zeros(self.job.boundary_shape(rows[1] - rows[0])))
        return seg

    def _rows(self, msg: Message) -> tuple[int, int, Segment, Range] | None:
        if self.last:
            raise ProtocolError(f"{msg.op}: the last stage's backward servers take no activations or gradients")
        step, mb = msg.int("step", 0, self.job.steps - 1), msg.int("mb", 0, self.job.microbatches - 1)
        if step <= self.freed_through:
            return None
        seg = self._segment(step, mb)
        lo, hi = msg.int("start", 0, self.job.batch - 1), msg.int("end", 1, self.job.batch)
        if not (seg.rows[0] <= lo < hi <= seg.rows[1]):
            raise ProtocolError(f"{msg.op} rows [{lo}, {hi}) are not inside this server's rows {list(seg.rows)} "
                                f"of micro-batch {mb}")
        return step, mb, seg, (lo, hi)

    # -- from clients ----------------------------------------------------------------------------
    def on_activations(self, client: bytes, msg: Message) -> None:
        got = self._rows(msg)
        if got is None:
            return
        step, mb, seg, (lo, hi) = got
        rows = msg.tensor(0, torch.float32, self.job.boundary_shape(hi - lo), finite=True)
        task = msg.fields.get("task")
        if not (isinstance(task, list) and len(task) == 3 and all(isinstance(x, int) for x in task)):
            raise ProtocolError(f"ACT.task = {task!r:.60}; expected [step, server, number]")
        if seg.forwarded:
            return  # a reissued forward finished after the first copy went on; the first stands
        seg.outputs[lo - seg.rows[0]:hi - seg.rows[0]] = rows
        seg.produced.add((lo, hi))
        seg.nodes = [n for n in seg.nodes if n.rows[1] <= lo or n.rows[0] >= hi] + [Node((lo, hi), client, task)]
        if seg.produced.covers(seg.rows):
            seg.forwarded = True
            nxt = self.job.stages[self.stage + 1]
            for f, rows in self.job.owners(nxt.frontal, mb, seg.rows):
                a, b = rows[0] - seg.rows[0], rows[1] - seg.rows[0]
                self.send_server(nxt.frontal[f].name, Message(
                    "ACT_FWD", {"step": step, "mb": mb, "start": rows[0], "end": rows[1]}, [seg.outputs[a:b]]))

    def on_get_gradient(self, client: bytes, msg: Message) -> None:
        got = self._rows(msg)
        if got is None:
            return
        step, mb, seg, rows = got
        if not seg.grad_rows.covers(rows):
            raise ProtocolError(f"GET_GRAD rows {list(rows)} of step {step}: their gradient has not arrived")
        self._send_gradient(client, msg.fields.get("task"), step, mb, seg, rows)

    # -- from the next stage ---------------------------------------------------------------------
    def on_gradient(self, msg: Message) -> None:
        got = self._rows(msg)
        if got is None:
            return
        step, mb, seg, (lo, hi) = got
        grad = msg.tensor(0, torch.float32, self.job.boundary_shape(hi - lo), finite=True)
        if seg.grad is None:
            seg.grad = torch.zeros_like(seg.outputs)
        seg.grad[lo - seg.rows[0]:hi - seg.rows[0]] = grad
        seg.grad_rows.add((lo, hi))
        for node in seg.nodes:
            if not node.sent and seg.grad_rows.covers(node.rows):
                node.sent = True
                self._send_gradient(node.client, node.task, step, mb, seg, node.rows)
        for f, rows in self.job.owners(self.spec.frontal, mb, (lo, hi)):
            self.send_server(self.spec.frontal[f].name, Message(
                "GRAD_READY", {"step": step, "mb": mb, "start": rows[0], "end": rows[1]}))

    def _send_gradient(self, client: bytes, task, step: int, mb: int, seg: Segment, rows: Range) -> None:
        a, b = rows[0] - seg.rows[0], rows[1] - seg.rows[0]
        self.send_client(client, Message("BWD", {"task": task, "step": step, "mb": mb, "start": rows[0],
                                                 "end": rows[1]}, [seg.grad[a:b]]))

    def on_committed(self, msg: Message) -> None:
        step, shard = msg.int("step", 0, self.job.steps - 1), msg.int("shard", 0, len(self.spec.servers) - 1)
        self.committed.setdefault(step, set()).add(shard)
        while len(self.committed.get(self.freed_through + 1, ())) == len(self.spec.servers):
            self.freed_through += 1
            for key in [k for k in self.segments if k[0] == self.freed_through]:
                del self.segments[key]
