"""Runs one stage's action list for one training step: the interpreter of heteropp.schedule.

Actions and what they do here:

- ``RECV_F``/``RECV_B``: post the receive; the compute that consumes it waits for it (the
  wait shows in the trace as a WAIT event), so transfers overlap whatever runs in between.
- ``F``: forward. On a recompute stage it runs without building the graph and keeps only its
  input; ``R`` re-runs it with the graph just before the backward.
- ``B``: full backward; ``I``: input gradients now, weight gradients of every projection queued;
  ``W``: the queued weight gradients.
- ``SEND_F``/``SEND_B``: post the send once the device has finished the tensor; over a
  coordinated cross-DC boundary, queue it (copied to host memory) for this rank's turn on the
  link (link_turns.py).

With ``blocking`` (a schedule with blocking sends: 1F1B and GPipe as Megatron and DAPPLE run
them), the transfers posted between two computes all complete before the next compute starts,
as Megatron's batched point-to-point does (posting them together keeps a send that waits for
its receiver from deadlocking against that receiver's own send).

On the last stage ``F`` computes the micro-batch's mean token loss; its backward is seeded
with ``loss_scale`` (1 / micro-batches of the global batch), so the summed gradients are the
gradient of the global batch's mean loss.
"""
from __future__ import annotations

import contextlib
from typing import Sequence

import torch

from heteropp.schedule import Action

from .boundary import BACKWARD, FORWARD, PendingRecv, StageBoundary
from .link_turns import LinkTurns
from .stage_model import StageModule
from .trace import TraceRecorder, now


class _Received:
    """A receive a blocking schedule already completed."""

    def __init__(self, tensor: torch.Tensor):
        self._tensor = tensor

    def wait(self) -> torch.Tensor:
        return self._tensor


class StageExecutor:
    """Interprets ``actions`` (this stage's list) on ``module``."""

    def __init__(self, module: StageModule, actions: Sequence[Action], prev: StageBoundary | None,
                 next_: StageBoundary | None, recompute: bool, device: torch.device, loss_scale: float,
                 autocast_dtype: torch.dtype | None = None, trace: TraceRecorder | None = None,
                 blocking: bool = False, turns: dict[str, LinkTurns] | None = None):
        self.module, self.actions = module, list(actions)
        self.prev, self.next = prev, next_
        self.blocking = blocking
        self.turns = dict(turns or {})  # direction -> this rank's turns on a coordinated boundary
        self.recompute, self.device, self.loss_scale = recompute, device, loss_scale
        self.autocast_dtype = autocast_dtype
        self.trace = trace or TraceRecorder(0, 0, enabled=False)
        self._sync = getattr(torch.get_device_module(device.type), "synchronize", lambda: None)

    def run(self, step: int, tokens: Sequence[torch.Tensor] | None, targets: Sequence[torch.Tensor] | None) -> list[float]:
        """One step over the list; returns the last stage's per-micro-batch losses (else [])."""
        self._step = step
        self._tokens, self._targets = tokens, targets
        self._inputs: dict[int, torch.Tensor] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self._recvs: dict[tuple[str, int], PendingRecv] = {}
        self._sends: list = []
        self._unsettled: list = []  # blocking: sends posted since the last compute
        losses: dict[int, float] = {}
        for turns in self.turns.values():
            turns.start()
        ran = False
        try:
            for a in self.actions:
                if self.blocking and a.kind not in ("SEND_F", "SEND_B", "RECV_F", "RECV_B"):
                    self._settle()
                self._action_start = now()
                getattr(self, "_do_" + a.kind)(a.mb, losses)
                self.trace.record(str(a), a.kind, self._action_start, now(), step=step, mb=a.mb)
            ran = True
        finally:
            for turns in self.turns.values():
                turns.finish() if ran else turns.abandon()
        for w in self._sends:
            w.wait()
        if self.module.store.pending:
            raise RuntimeError(f"stage {self.trace.stage}: weight gradients of micro-batches {self.module.store.pending} "
                               f"were never computed (an I without its W)")
        return [losses[m] for m in sorted(losses)]

    # -- transfers ---------------------------------------------------------------------------
    def _do_RECV_F(self, mb: int, losses) -> None:
        self._recvs[(FORWARD, mb)] = self.prev.post_recv(FORWARD, mb)

    def _do_RECV_B(self, mb: int, losses) -> None:
        self._recvs[(BACKWARD, mb)] = self.next.post_recv(BACKWARD, mb)

    def _do_SEND_F(self, mb: int, losses) -> None:
        self._send(self.next, FORWARD, mb, self._outputs[mb].detach())

    def _do_SEND_B(self, mb: int, losses) -> None:
        self._send(self.prev, BACKWARD, mb, self._inputs.pop(mb).grad)

    def _send(self, boundary: StageBoundary, direction: str, mb: int, tensor: torch.Tensor) -> None:
        pieces = boundary.pieces(direction, mb, tensor)
        self._sync()  # the device has finished the pieces before anything sends them
        turns = self.turns.get(direction)
        if turns is not None:
            # In host memory, where dicomm sends from anyway: a device tensor's send reads it
            # once the device's queued work is done (dicomm's Staging.cpp), which on the turns'
            # thread would be whatever this stage computes by then, not these finished pieces.
            turns.put(mb, [(piece.cpu(), dst) for piece, dst in pieces])
            return
        works = boundary.post(direction, mb, pieces)
        self._sends += works
        if self.blocking:
            self._unsettled += works

    def _settle(self) -> None:
        """Blocking schedules: complete every transfer posted since the last compute (a WAIT
        event in the trace when it takes time)."""
        if not self._unsettled and not self._recvs:
            return
        start = now()
        for w in self._unsettled:
            w.wait()
        self._unsettled = []
        for key, pending in list(self._recvs.items()):
            if not isinstance(pending, _Received):
                self._recvs[key] = _Received(pending.wait())
        end = now()
        if end - start > 0:
            self.trace.record(f"{self.trace.stage}WAIT_P2P", "WAIT", start, end, step=self._step, mb=-1)

    def _received(self, direction: str, mb: int) -> torch.Tensor:
        """Wait for a posted receive; the wait is its own trace event, the compute starts after."""
        start = now()
        t = self._recvs.pop((direction, mb)).wait()
        self._action_start = now()
        self.trace.record(f"{self.trace.stage}WAIT_{direction}{mb}", "WAIT", start, self._action_start,
                          step=self._step, mb=mb)
        return t

    # -- compute -----------------------------------------------------------------------------
    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def _forward(self, mb: int, x: torch.Tensor) -> torch.Tensor:
        with self._autocast():
            return self.module(x, self._targets[mb] if self.module.is_last else None)

    def _do_F(self, mb: int, losses) -> None:
        if self.module.is_first:
            x = self._tokens[mb]
        else:
            x = self._received(FORWARD, mb)
            x.requires_grad_(not self.recompute)
        self._inputs[mb] = x
        with torch.set_grad_enabled(not self.recompute):
            out = self._forward(mb, x)
        self._sync()
        if self.module.is_last:
            losses[mb] = out.item()
        self._outputs[mb] = out

    def _do_R(self, mb: int, losses) -> None:
        x = self._inputs[mb]
        if not self.module.is_first:
            x.requires_grad_(True)
        self._outputs[mb] = self._forward(mb, x)
        self._sync()

    def _backward(self, mb: int) -> None:
        out = self._outputs.pop(mb)
        if self.module.is_last:
            grad = torch.full_like(out, self.loss_scale)
        else:
            grad = self._received(BACKWARD, mb)
        torch.autograd.backward(out, grad)
        self._sync()
        if self.module.is_first:
            self._inputs.pop(mb)

    def _do_B(self, mb: int, losses) -> None:
        self._backward(mb)

    def _do_I(self, mb: int, losses) -> None:
        with self.module.store.deferring(mb):
            self._backward(mb)

    def _do_W(self, mb: int, losses) -> None:
        self.module.store.flush(mb)
        self._sync()
