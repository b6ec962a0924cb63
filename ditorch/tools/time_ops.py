"""TimeMeasure: wall time of each ATen op, aggregated per op and phase."""
from __future__ import annotations

import dataclasses
import os
import time
from typing import Optional

import torch

from ditorch.tools.op_selection import OpPatterns
from ditorch.tools.tool_mode import OpCall, ToolMode, write_records


@dataclasses.dataclass
class OpTiming:
    op: str
    phase: str
    calls: int = 0
    total_us: float = 0.0
    max_us: float = 0.0

    @property
    def mean_us(self) -> float:
        return self.total_us / self.calls if self.calls else 0.0


def _device_types(args: tuple, kwargs: dict) -> set[str]:
    """Non-CPU device types among the tensor arguments (top level and tensor lists): cheaper
    than a full pytree walk, which would cost more than many of the ops being timed."""
    found: set[str] = set()
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            found.add(value.device.type)
        elif isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
            found.update(v.device.type for v in value if isinstance(v, torch.Tensor))
    found.discard("cpu")
    found.discard("meta")
    return found


def _synchronize(devices: set[str]) -> None:
    for device_type in devices:
        module = getattr(torch, device_type, None)
        sync = getattr(module, "synchronize", None)
        if callable(sync):
            sync()


class time_ops(ToolMode):
    """Time every selected op. Ops on a non-CPU device are bracketed by that device's
    ``synchronize()`` so asynchronous kernels are timed to completion (which serializes the
    device: the timings are per-op costs, not the overlapped step time).

    ``timings`` maps (op, phase) to ``OpTiming``; ``table()`` formats them; ``path`` (a .csv or
    .json name) is written on exit.
    """

    def __init__(self, ops: OpPatterns = None, skip: OpPatterns = None,
                 path: Optional[str | os.PathLike] = None):
        super().__init__(ops, skip)
        self.path = path
        self.timings: dict[tuple[str, str], OpTiming] = {}

    def handle(self, func, args, kwargs, call: OpCall):
        devices = _device_types(args, kwargs)
        if devices:
            _synchronize(devices)
        start = time.perf_counter_ns()
        out = func(*args, **kwargs)
        if devices:
            _synchronize(devices)
        elapsed = (time.perf_counter_ns() - start) / 1e3
        key = (call.op, call.phase)
        rec = self.timings.get(key)
        if rec is None:
            rec = self.timings[key] = OpTiming(call.op, call.phase)
        rec.calls += 1
        rec.total_us += elapsed
        rec.max_us = max(rec.max_us, elapsed)
        return out

    def rows(self) -> list[OpTiming]:
        """Timings sorted by total time, largest first."""
        return sorted(self.timings.values(), key=lambda r: -r.total_us)

    def table(self, top: Optional[int] = 20) -> str:
        rows = self.rows()
        total = sum(r.total_us for r in rows) or 1.0
        shown = rows if top is None else rows[:top]
        width = max([len("op")] + [len(r.op) for r in shown])
        lines = [f"{'op':<{width}}  {'phase':<8} {'calls':>6} {'total ms':>10} {'mean us':>10} {'max us':>10} {'share':>6}"]
        for r in shown:
            lines.append(f"{r.op:<{width}}  {r.phase:<8} {r.calls:>6} {r.total_us / 1e3:>10.3f} {r.mean_us:>10.1f} "
                         f"{r.max_us:>10.1f} {100 * r.total_us / total:>5.1f}%")
        if top is not None and len(rows) > top:
            lines.append(f"... {len(rows) - top} more ops")
        lines.append(f"total {total / 1e3:.3f} ms over {sum(r.calls for r in rows)} op calls")
        return "\n".join(lines)

    def finish(self) -> None:
        if self.path is not None and self.timings:
            write_records([{**dataclasses.asdict(r), "mean_us": r.mean_us} for r in self.rows()], self.path)
