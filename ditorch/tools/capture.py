"""Capture an op's inputs and outputs to disk, and replay a capture on a device.

A capture is a directory ``<op>_<index>/`` holding ``meta.json`` (op overload, phase,
autograd node, device, chip), ``inputs.pt`` (``{"args", "kwargs"}`` with tensors on CPU in
the layout the op saw: same sizes and strides) and ``outputs.pt`` (the list of tensors the
call returned, then those it wrote in place without returning them). Gradients are captured
through the backward ops that compute them (phase ``backward``).
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any, Optional

import torch
from torch.utils._pytree import tree_map

from ditorch.tools.comparison import Difference, compare
from ditorch.tools.op_selection import OpPatterns
from ditorch.tools.tensors import bitwise_equal, copy_with_layout, hidden, op_results, tensors_of, to_host
from ditorch.tools.tool_mode import OpCall, ToolMode, logger

_LOAD_GLOBALS = [torch.memory_format, torch.layout]


def _active_chip() -> Optional[str]:
    """The chip this process emulates (``set_chip()`` or ``DITORCH_CHIP``); None without the device layer."""
    ext = sys.modules.get("ditorch_ext")
    current = getattr(ext, "current", None)
    return current()[0].name if current is not None else None


def _devices_of(tree: Any) -> list[str]:
    return sorted({str(t.device) for t in tensors_of(tree)})


def save_op_call(directory: Path, func: torch._ops.OpOverload, call: OpCall, inputs_host: Any,
                 outputs: list, extra: Optional[dict] = None) -> Path:
    """Write one capture. ``inputs_host`` must already be a CPU copy taken before the op ran
    (in-place ops overwrite their inputs); ``outputs`` is the call's ``op_results``."""
    directory.mkdir(parents=True, exist_ok=True)
    args, kwargs = inputs_host
    torch.save({"args": args, "kwargs": kwargs}, directory / "inputs.pt")
    torch.save(to_host(outputs), directory / "outputs.pt")
    meta = {
        "op": f"{func.namespace}::{func._opname}",
        "overload": func._overloadname,
        "index": call.index,
        "phase": call.phase,
        "autograd_node": call.node,
        "devices": _devices_of(outputs) or None,
        "chip": _active_chip(),
        "random": torch.Tag.nondeterministic_seeded in func.tags,
        "torch": torch.__version__,
        **(extra or {}),
    }
    (directory / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    return directory


class capture(ToolMode):
    """Save inputs/outputs of the selected ops under ``path`` (one directory per call).

    ``ops`` defaults to every op, which writes a lot; ``max_calls`` bounds the number of
    captures per op name (None: no bound). ``saved`` lists the directories written.
    """

    def __init__(self, path: str | os.PathLike = "ditorch_capture", ops: OpPatterns = None,
                 skip: OpPatterns = None, max_calls: Optional[int] = None):
        super().__init__(ops, skip)
        if max_calls is not None and (not isinstance(max_calls, int) or max_calls < 1):
            raise ValueError(f"capture: max_calls must be a positive int or None, got {max_calls!r}")
        self.path = Path(path)
        self.max_calls = max_calls
        self.saved: list[Path] = []
        self._per_op: dict[str, int] = {}

    def handle(self, func, args, kwargs, call):
        count = self._per_op.get(call.op, 0)
        if self.max_calls is not None and count >= self.max_calls:
            return func(*args, **kwargs)
        self._per_op[call.op] = count + 1
        with hidden():
            inputs = to_host((args, kwargs))
        out = func(*args, **kwargs)
        with hidden():
            self.saved.append(save_op_call(self.path / call.label, func, call, inputs,
                                           op_results(func, args, kwargs, out)))
        return out

    def finish(self) -> None:
        if self.saved:
            logger.info("capture: %d op calls saved under %s", len(self.saved), self.path)


@dataclasses.dataclass
class ReplayResult:
    """Outcome of re-running one capture: ``identical`` is the bit-for-bit verdict over all
    tensor outputs; ``differences`` holds the numerical distance of each output."""

    directory: str
    op: str
    device: str
    identical: bool
    differences: list[Difference]
    note: str = ""


def resolve_op(name: str, overload: str) -> torch._ops.OpOverload:
    """``("aten::addmm", "default")`` -> ``torch.ops.aten.addmm.default``."""
    if "::" not in name:
        raise ValueError(f"capture meta: op {name!r} is not a qualified name like 'aten::addmm'")
    ns, packet = name.split("::", 1)
    try:
        return getattr(getattr(getattr(torch.ops, ns), packet), overload)
    except AttributeError:
        raise ValueError(f"capture meta: no op {name}.{overload} in this torch ({torch.__version__})") from None


def load_capture(directory: str | os.PathLike) -> tuple[dict, tuple, dict, Any]:
    """(meta, args, kwargs, outputs) of a capture directory; tensors on CPU."""
    directory = Path(directory)
    missing = [n for n in ("meta.json", "inputs.pt", "outputs.pt") if not (directory / n).is_file()]
    if missing:
        raise FileNotFoundError(f"{directory}: not a capture directory (missing {', '.join(missing)})")
    meta = json.loads((directory / "meta.json").read_text())
    with torch.serialization.safe_globals(_LOAD_GLOBALS):
        inputs = torch.load(directory / "inputs.pt", weights_only=True)
        outputs = torch.load(directory / "outputs.pt", weights_only=True)
    return meta, tuple(inputs["args"]), dict(inputs["kwargs"]), outputs


def replay(directory: str | os.PathLike, device: str | torch.device = "cpu") -> ReplayResult:
    """Re-run a captured op on ``device`` with the captured inputs (same layout) and compare
    its outputs with the captured ones bit for bit."""
    device = torch.device(device)
    meta, args, kwargs, expected = load_capture(directory)
    func = resolve_op(meta["op"], meta.get("overload", "default"))
    captured_types = {torch.device(d).type for d in (meta.get("devices") or [])}

    def move(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return copy_with_layout(x, device)
        if isinstance(x, torch.device) and x.type in captured_types:  # e.g. a device= kwarg
            return device
        return x

    args, kwargs = tree_map(move, (args, kwargs))
    out = func(*args, **kwargs)
    got, want = op_results(func, args, kwargs, out), tensors_of(expected)
    notes = []
    if meta.get("random"):
        notes.append("random op: outputs depend on the generator state")
    if device.type != "cpu" and meta.get("chip") != _active_chip():
        notes.append(f"captured on chip {meta.get('chip')}, replayed on chip {_active_chip()}")
    note = "; ".join(notes)
    if len(got) != len(want):
        return ReplayResult(str(directory), func.name(), str(device), False, [],
                            f"{len(got)} tensor outputs, capture has {len(want)}")
    identical = all(bitwise_equal(g, w) for g, w in zip(got, want))
    diffs = [compare(g, w, 0.0, 0.0) for g, w in zip(got, want)]
    return ReplayResult(str(directory), func.name(), str(device), identical, diffs, note)


def find_captures(root: str | os.PathLike) -> list[Path]:
    """``root`` itself if it is a capture, else its capture subdirectories (sorted by index)."""
    root = Path(root)
    if (root / "meta.json").is_file():
        return [root]
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: no such capture directory")
    found = [p.parent for p in root.rglob("meta.json")]
    if not found:
        raise FileNotFoundError(f"{root}: contains no captures (no meta.json below it)")

    def index(p: Path) -> tuple:
        try:
            return (json.loads((p / "meta.json").read_text()).get("index", 0), str(p))
        except (OSError, ValueError):
            return (0, str(p))
    return sorted(found, key=index)


__all__ = ["capture", "replay", "ReplayResult", "load_capture", "find_captures", "save_op_call"]
