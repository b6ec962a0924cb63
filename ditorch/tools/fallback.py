"""Fallback: run chosen ops on the CPU (copy in, run, copy back)."""
from __future__ import annotations

from typing import Any, Optional

import torch

from ditorch.tools.op_selection import OpPatterns
from ditorch.tools.tensors import run_converted, tensors_of
from ditorch.tools.tool_mode import OpCall, ToolMode


class fallback(ToolMode):
    """Run the ops matching ``ops`` on ``device`` (CPU by default): device tensors are copied
    there, the op runs, fresh outputs are copied back to the device of the inputs, and tensors
    the op writes (in-place, ``out=``) receive the new values. A ``device=`` argument naming
    the original device is rewritten too. ``calls`` counts ops moved. Use it to tell a broken
    device kernel from a broken model: if falling back fixes the numbers, the kernel was wrong.
    """

    def __init__(self, ops: OpPatterns, skip: OpPatterns = None, device: str | torch.device = "cpu"):
        if ops is None:
            raise ValueError("fallback: name the ops to run on the CPU, e.g. ops='layer_norm|softmax'")
        super().__init__(ops, skip)
        self.device = torch.device(device)
        self.calls = 0

    def handle(self, func, args, kwargs, call: OpCall):
        origin: Optional[torch.device] = next(
            (t.device for t in tensors_of((args, kwargs)) if t.device != self.device), None)
        if origin is None:
            for value in list(args) + list(kwargs.values()):  # factory ops: device= kwarg only
                if isinstance(value, torch.device) and value != self.device:
                    origin = value
        if origin is None:
            return func(*args, **kwargs)
        self.calls += 1

        def convert(t: torch.Tensor):
            return t.to(self.device) if t.device == origin else None

        def convert_leaf(x: Any) -> Any:
            return self.device if isinstance(x, torch.device) and x == origin else x

        return run_converted(func, args, kwargs, convert, lambda t: t.to(origin), convert_leaf)
