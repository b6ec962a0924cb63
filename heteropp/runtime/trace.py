"""Each rank's actions with start and end times, written as Chrome trace JSON (Perfetto,
chrome://tracing) and read back by ``ditorch simulate --measured``.

One process row per stage (``pid``), one thread row per rank (``tid``); every event is a
complete event (``"ph": "X"``) named like its action (``1F3``), with the step, micro-batch and
kind in ``args``. Times are wall-clock (``time.time``), which hosts keep in step with NTP; the
file is shifted so the first event starts at 0.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any


class TraceRecorder:
    """Collects this rank's events; ``events()`` returns them as Chrome trace dicts."""

    def __init__(self, rank: int, stage: int, enabled: bool = True):
        self.rank, self.stage, self.enabled = rank, stage, enabled
        self._events: list[dict[str, Any]] = []

    def record(self, name: str, kind: str, start: float, end: float, **args: Any) -> None:
        if self.enabled:
            self._events.append({"name": name, "cat": kind, "ph": "X", "pid": self.stage, "tid": self.rank,
                                 "ts": start * 1e6, "dur": (end - start) * 1e6, "args": {"kind": kind, **args}})

    def events(self) -> list[dict[str, Any]]:
        return list(self._events)


def write_chrome_trace(path: str | Path, events: list[dict[str, Any]], stage_names: list[str]) -> Path:
    """Merge all ranks' events into one trace file, shifted to start at 0."""
    t0 = min((e["ts"] for e in events), default=0.0)
    shifted = [dict(e, ts=round(e["ts"] - t0, 3), dur=round(e["dur"], 3)) for e in events]
    meta = [{"name": "process_name", "ph": "M", "pid": i, "args": {"name": f"stage {i} {n}"}}
            for i, n in enumerate(stage_names)]
    meta += [{"name": "thread_name", "ph": "M", "pid": e["pid"], "tid": e["tid"], "args": {"name": f"rank {e['tid']}"}}
             for e in {(e["pid"], e["tid"]): e for e in events}.values()]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"traceEvents": meta + shifted, "displayTimeUnit": "ms"}))
    return path


def now() -> float:
    return time.time()
