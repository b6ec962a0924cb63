"""Turn tools on from the environment, for running a training script unchanged.

``DITORCH_TOOLS`` lists tools separated by ``;``, each ``name`` or ``name:key=value,key=value``::

    DITORCH_TOOLS="autocompare:ops=mm|addmm|softmax,dtype=float64;time_ops"
    DITORCH_TOOLS="overflow_check"  DITORCH_TOOLS="capture:ops=addmm,max_calls=2"
    DITORCH_TOOLS="dtype_cast:map=bfloat16>float32+float16>float32,ops=softmax"
    DITORCH_TOOLS="fallback:ops=layer_norm"

Values: ``float64`` etc. name a dtype (for ``dtype``), ints and floats are numbers,
``true``/``false``/``none`` what they say, anything else a string (an op regex must not
contain ``,`` or ``;``). ``DITORCH_TOOLS_DIR`` (default ``ditorch_tools_out``) receives the
reports; ``time_ops`` also prints its table at exit. The tools are entered when
``ditorch.tools`` is imported (``import ditorch`` imports it when ``DITORCH_TOOLS`` is set;
``python -m ditorch.tools script.py`` does it for scripts that never import ditorch) and
exited at interpreter exit, which writes their reports.
"""
from __future__ import annotations

import atexit
import os
import sys
from pathlib import Path
from typing import Any

import torch

from ditorch.tools.autocompare import autocompare
from ditorch.tools.capture import capture
from ditorch.tools.dtype_cast import dtype_cast
from ditorch.tools.fallback import fallback
from ditorch.tools.overflow_check import overflow_check
from ditorch.tools.time_ops import time_ops
from ditorch.tools.tool_mode import ToolMode

TOOLS = {"autocompare": autocompare, "overflow_check": overflow_check, "capture": capture,
         "time_ops": time_ops, "dtype_cast": dtype_cast, "fallback": fallback}

_active: list[ToolMode] = []


def _dtype(name: str) -> torch.dtype:
    value = getattr(torch, name.strip(), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"DITORCH_TOOLS: {name!r} is not a torch dtype (e.g. float32, bfloat16)")
    return value


def _value(key: str, text: str) -> Any:
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if low == "none":
        return None
    if key == "dtype":
        return _dtype(text)
    if key == "map":
        pairs = {}
        for item in text.split("+"):
            if ">" not in item:
                raise ValueError(f"DITORCH_TOOLS: map entry {item!r}: expected SOURCE>TARGET, e.g. bfloat16>float32")
            src, dst = item.split(">", 1)
            pairs[_dtype(src)] = _dtype(dst)
        return pairs
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse(spec: str, out_dir: str | os.PathLike = "ditorch_tools_out") -> list[ToolMode]:
    """Build (not enter) the tools a ``DITORCH_TOOLS`` value names."""
    out = Path(out_dir)
    tools: list[ToolMode] = []
    for item in filter(None, (part.strip() for part in spec.split(";"))):
        name, _, opts = item.partition(":")
        name = name.strip()
        if name not in TOOLS:
            raise ValueError(f"DITORCH_TOOLS: unknown tool {name!r}; expected one of {', '.join(TOOLS)}")
        kwargs: dict[str, Any] = {}
        for opt in filter(None, (o.strip() for o in opts.split(","))):
            key, eq, text = opt.partition("=")
            if not eq:
                raise ValueError(f"DITORCH_TOOLS: option {opt!r} of {name}: expected key=value")
            kwargs[key.strip()] = _value(key.strip(), text.strip())
        if name == "dtype_cast":
            if "map" not in kwargs:
                raise ValueError("DITORCH_TOOLS: dtype_cast needs map=SOURCE>TARGET, e.g. map=bfloat16>float32")
            kwargs["mapping"] = kwargs.pop("map")
        defaults = {"autocompare": {"out_dir": out}, "overflow_check": {"out_dir": out},
                    "capture": {"path": out / "capture"}, "time_ops": {"path": out / "time_ops.csv"}}
        for key, value in defaults.get(name, {}).items():
            kwargs.setdefault(key, value)
        try:
            tools.append(TOOLS[name](**kwargs))
        except TypeError as exc:
            raise ValueError(f"DITORCH_TOOLS: bad option for {name}: {exc}") from None
    return tools


def activate_from_environment() -> list[ToolMode]:
    """Enter the tools named by ``DITORCH_TOOLS`` (once per process); they exit at exit."""
    spec = os.environ.get("DITORCH_TOOLS", "").strip()
    if not spec or _active:
        return list(_active)
    tools = parse(spec, os.environ.get("DITORCH_TOOLS_DIR", "ditorch_tools_out"))
    for tool in tools:
        tool.__enter__()
        _active.append(tool)
    atexit.register(_deactivate)
    return list(_active)


def _deactivate() -> None:
    while _active:
        tool = _active.pop()
        tool.__exit__(None, None, None)
        if isinstance(tool, time_ops):
            print(tool.table(), file=sys.stderr)
