"""Reading what a peer sent: JSON headers bounded in size and nesting, with no NaN or Infinity,
and their fields checked for type and range before anything uses them.

Every server of the project (the Di-PS leader and followers, the volunteer servers) reads its
headers through :func:`json_object` and its fields through the checkers below, so a hostile
peer's input ends as one :class:`BadMessage` (a ``ValueError``) that names the field and what was
expected, never as an exception that escapes a server's loop. ``RateLimitedLog`` keeps a peer that
repeats bad input from filling the log.
"""
from __future__ import annotations

import json
import logging
import math
import threading
import time
from typing import Any

_MISSING = object()


class BadMessage(ValueError):
    """A peer's message that is malformed or out of range (the text says which field and why)."""


def _no_constants(name: str) -> Any:
    raise BadMessage(f"{name} is not a JSON number this protocol accepts; expected a finite number")


def _finite(literal: str) -> float:
    value = float(literal)
    if not math.isfinite(value):
        raise BadMessage(f"{literal[:40]} is out of range; expected a finite number")
    return value


def _depth(value: Any, limit: int) -> int:
    """Nesting depth of ``value``, counting stops beyond ``limit`` (iterative: no recursion)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (dict, list)):
            deepest = max(deepest, d)
            if deepest > limit:
                return deepest
            stack.extend((c, d + 1) for c in (v.values() if isinstance(v, dict) else v))
    return deepest


def _first_non_text(value: Any) -> str:
    """Which string of ``value`` is not Unicode text: a lone surrogate, which JSON's ``\\ud800``
    escapes can carry but UTF-8 cannot."""
    def bad(s: Any) -> bool:
        if not isinstance(s, str):
            return False
        try:
            s.encode()
        except UnicodeEncodeError:
            return True
        return False

    stack = [value]
    while stack:
        v = stack.pop()
        for key, child in (v.items() if isinstance(v, dict) else enumerate(v) if isinstance(v, list) else ()):
            if bad(key):
                return f"a key ({_shown(key)})"
            if bad(child):
                return f"field {_shown(key)}" if isinstance(key, str) else "a list element"
            stack.append(child)
    return "a string"


def check_text(value: Any, what: str) -> None:
    """Raise :class:`BadMessage` when a string in ``value`` (keys included) is not Unicode text,
    so nothing a peer sent fails later in ``encode()``, a path or a log line."""
    try:
        json.dumps(value, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        raise BadMessage(f"{what}: {_first_non_text(value)} holds a lone surrogate; "
                         f"expected Unicode text") from None


def json_object(data: bytes | str, what: str, max_bytes: int, max_depth: int = 8, text: bool = True) -> dict:
    """The JSON object in ``data`` (``what`` names the message in errors): at most ``max_bytes``,
    nested at most ``max_depth`` deep, numbers finite, and (``text``) every string Unicode text
    (:func:`check_text`; a server that must check a token first passes False and checks after)."""
    if len(data) > max_bytes:
        raise BadMessage(f"{what} is {len(data)} bytes; expected at most {max_bytes}")
    try:
        value = json.loads(data, parse_constant=_no_constants, parse_float=_finite)
    except RecursionError:
        raise BadMessage(f"{what} is nested deeper than {max_depth} levels") from None
    except BadMessage as exc:
        raise BadMessage(f"{what}: {exc}") from None
    except ValueError as exc:  # not JSON, not UTF-8, or an integer of over 4300 digits
        raise BadMessage(f"{what} is not JSON this protocol accepts: {str(exc)[:200]}") from None
    if not isinstance(value, dict):
        raise BadMessage(f"{what} is a JSON {type(value).__name__}; expected an object")
    if _depth(value, max_depth) > max_depth:
        raise BadMessage(f"{what} is nested deeper than {max_depth} levels")
    if text:
        check_text(value, what)
    return value


def _required(msg: dict, key: str) -> Any:
    if key not in msg:
        raise BadMessage(f"field {key!r} is missing")
    return msg[key]


def _shown(value: Any) -> str:
    return repr(value)[:40]


def integer(msg: dict, key: str, lo: int, hi: int, default: Any = _MISSING) -> int:
    """Field ``key``: a JSON integer in [lo, hi] (a bool or a float is refused)."""
    if msg.get(key) is None and default is not _MISSING:  # absent or null: the default
        return default
    v = _required(msg, key)
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise BadMessage(f"field {key!r} is {_shown(v)}; expected an integer in [{lo}, {hi}]")
    return v


def number(msg: dict, key: str, lo: float, hi: float, default: Any = _MISSING) -> float:
    """Field ``key``: a finite JSON number in [lo, hi]."""
    if msg.get(key) is None and default is not _MISSING:  # absent or null: the default
        return default
    v = _required(msg, key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not lo <= v <= hi:
        raise BadMessage(f"field {key!r} is {_shown(v)}; expected a number in [{lo:g}, {hi:g}]")
    return float(v)


def text(msg: dict, key: str, max_chars: int, default: Any = _MISSING, min_chars: int = 1) -> str:
    """Field ``key``: a string of min_chars..max_chars characters."""
    if msg.get(key) is None and default is not _MISSING:  # absent or null: the default
        return default
    v = _required(msg, key)
    if not isinstance(v, str) or not min_chars <= len(v) <= max_chars:
        raise BadMessage(f"field {key!r} is {_shown(v)}; expected a string of {min_chars}..{max_chars} characters")
    return v


def integers(msg: dict, key: str, lo: int, hi: int, max_len: int, distinct: bool = False) -> list[int]:
    """Field ``key``: a list of at most ``max_len`` integers in [lo, hi] (``distinct``: no repeats)."""
    v = _required(msg, key)
    if not isinstance(v, list) or len(v) > max_len:
        raise BadMessage(f"field {key!r} is {_shown(v)}; expected a list of at most {max_len} integers")
    for x in v:
        if isinstance(x, bool) or not isinstance(x, int) or not lo <= x <= hi:
            raise BadMessage(f"field {key!r} holds {_shown(x)}; expected integers in [{lo}, {hi}]")
    if distinct and len(set(v)) != len(v):
        raise BadMessage(f"field {key!r} names an entry more than once: {_shown(v)}")
    return v


class RateLimitedLog:
    """At most ``per_window`` warnings per ``window_s`` seconds; the rest are counted and the count
    is reported with the next warning that gets through."""

    def __init__(self, logger: logging.Logger, per_window: int = 100, window_s: float = 60.0):
        self.logger, self.per_window, self.window_s = logger, per_window, window_s
        self._lock = threading.Lock()
        self._start, self._count, self._dropped = 0.0, 0, 0

    def warning(self, fmt: str, *args: Any) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._start >= self.window_s:
                self._start, self._count = now, 0
            self._count += 1
            if self._count > self.per_window:
                self._dropped += 1
                return
            dropped, self._dropped = self._dropped, 0
        if dropped:
            fmt += f" ({dropped} similar warnings suppressed)"
        self.logger.warning(fmt, *args)
