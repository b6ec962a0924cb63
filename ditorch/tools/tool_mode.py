"""The base of every tool: a ``TorchDispatchMode`` that sees each ATen op (backward ops
included, since the autograd engine carries the mode stack into its threads), picks the ops
it acts on by name, and works as a context manager or a decorator.

While no tool is entered nothing is hooked: a dispatch mode lives on the mode stack only
between ``__enter__`` and ``__exit__``.
"""
from __future__ import annotations

import csv
import dataclasses
import functools
import json
import logging
import math
import os
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, TypeVar

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ditorch.tools.op_selection import OpPatterns, OpSelector

logger = logging.getLogger("ditorch.tools")
F = TypeVar("F", bound=Callable[..., Any])


@dataclasses.dataclass(frozen=True)
class OpCall:
    """Where an op sits in the stream the tool saw: ``index`` counts every op since the tool
    was created; ``phase`` is 'backward' when the autograd engine runs it, ``node`` then names
    the autograd node (e.g. ``MmBackward0``)."""

    index: int
    op: str
    phase: str
    node: str

    @property
    def label(self) -> str:
        """``addmm_17``: the op's packet name and index, used as a directory name."""
        return f"{self.op.split('::')[-1].split('.')[0]}_{self.index}"


class ToolMode(TorchDispatchMode):
    """Subclasses implement ``handle(func, args, kwargs, call)`` and may override ``finish``."""

    skip_noncomparable = False

    def __init__(self, ops: OpPatterns = None, skip: OpPatterns = None):
        super().__init__()
        self.selector = OpSelector(ops, skip, skip_noncomparable=self.skip_noncomparable)
        self.ops_seen = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        index = self.ops_seen
        self.ops_seen += 1
        if not self.selector(func):
            return func(*args, **kwargs)
        node = torch._C._current_autograd_node()
        call = OpCall(index, func.name(), "backward" if node is not None else "forward", node.name() if node is not None else "")
        return self.handle(func, args, kwargs, call)

    def handle(self, func, args: tuple, kwargs: dict, call: OpCall) -> Any:  # pragma: no cover
        raise NotImplementedError

    def __exit__(self, exc_type, exc, tb):
        result = super().__exit__(exc_type, exc, tb)
        self.finish()
        return result

    def finish(self) -> None:
        """Called on every exit (write reports here)."""

    def __call__(self, fn: F) -> F:
        """Use the tool as a decorator: every call of ``fn`` runs inside it."""
        if not callable(fn):
            raise TypeError(f"{type(self).__name__} decorates a callable, got {fn!r}")

        @functools.wraps(fn)
        def wrapper(*a, **k):
            with self:
                return fn(*a, **k)

        return wrapper  # type: ignore[return-value]


def write_records(records: Iterable[Any], path: str | os.PathLike) -> Path:
    """Write dataclass records as CSV (``.csv``) or a JSON list (``.json``)."""
    path = Path(path)
    rows = [dataclasses.asdict(r) if dataclasses.is_dataclass(r) else dict(r) for r in records]
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".json":
        def clean(v):  # JSON has no inf/nan; write them as strings
            return str(v) if isinstance(v, float) and not math.isfinite(v) else v
        path.write_text(json.dumps([{k: clean(v) for k, v in row.items()} for row in rows], indent=1) + "\n")
    elif path.suffix == ".csv":
        with open(path, "w", newline="") as f:
            if rows:
                writer = csv.DictWriter(f, fieldnames=list(rows[0]))
                writer.writeheader()
                writer.writerows(rows)
    else:
        raise ValueError(f"report path {str(path)!r}: expected a .csv or .json file name")
    return path
