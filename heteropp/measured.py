"""A measured run, read from the Chrome trace the HeteroPP runtime writes (``--trace``), in the
simulator's terms: iteration time, per-stage busy time and one step's timeline. Pure Python, so
``ditorch simulate --measured`` needs no torch."""
from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path

COMPUTE = ("F", "R", "I", "W", "B")


@dataclasses.dataclass
class MeasuredRun:
    iteration_time: float  # median seconds per step over the steps after the first
    iteration_times: list[float]  # every step: from the previous step's end to its own
    stage_busy: list[float]  # median seconds of compute per step, each stage's first rank
    timeline: list[tuple[int, str, int, float, float]]  # (stage, kind, mb, start, end) of the median step
    step: int  # the step the timeline shows
    cpu_per_step: float  # median CPU seconds of all ranks together per step
    p2p_bytes_per_step: float  # stage-boundary bytes all ranks sent per step
    stage_peak_bytes: list[float]  # device memory high-water mark per stage (its ranks' maximum)


def read_trace(path: str | Path, num_stages: int | None = None) -> MeasuredRun:
    """Parse a runtime trace; ``num_stages`` (the plan's) is checked against it."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
        events = [e for e in data["traceEvents"] if e.get("ph") == "X"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: not a ditorch runtime trace ({exc})") from None
    if not events:
        raise ValueError(f"{path}: the trace has no events")
    stages = sorted({e["pid"] for e in events})
    if num_stages is not None and stages != list(range(num_stages)):
        raise ValueError(f"{path}: the trace has stages {stages}, the plan {num_stages}")
    first_rank = {s: min(e["tid"] for e in events if e["pid"] == s) for s in stages}
    by_step: dict[int, list[dict]] = {}
    for e in events:
        by_step.setdefault(int(e["args"]["step"]), []).append(e)
    steps = sorted(by_step)
    spans = {k: (min(e["ts"] for e in by_step[k]), max(e["ts"] + e["dur"] for e in by_step[k])) for k in steps}
    # A step's time is from the previous step's end to its own (the first: its span). A stage
    # whose update is short starts the next step while another still steps, so a step's own
    # span counts that overlap twice; the period between ends is what the job's throughput is.
    times = [(spans[k][1] - (spans[steps[i - 1]][1] if i else spans[k][0])) * 1e-6 for i, k in enumerate(steps)]
    step_time = dict(zip(steps, times))
    steady = steps[1:] or steps
    median = statistics.median(step_time[k] for k in steady)
    shown = min(steady, key=lambda k: abs(step_time[k] - median))
    busy = []
    for s in stages:
        per_step = [sum(e["dur"] for e in by_step[k] if e["pid"] == s and e["tid"] == first_rank[s]
                        and e["args"]["kind"] in COMPUTE) * 1e-6 for k in steady]
        busy.append(statistics.median(per_step))
    t0 = spans[shown][0]
    timeline = sorted(
        (e["pid"], e["args"]["kind"], int(e["args"].get("mb", -1)), (e["ts"] - t0) * 1e-6, (e["ts"] + e["dur"] - t0) * 1e-6)
        for e in by_step[shown]
        if e["tid"] == first_rank[e["pid"]] and e["args"]["kind"] in COMPUTE + ("UPDATE",))
    updates = {k: [e["args"] for e in by_step[k] if e["args"]["kind"] == "UPDATE"] for k in steady}
    cpu = statistics.median(sum(u.get("cpu_s", 0.0) for u in updates[k]) for k in steady)
    sent = statistics.median(sum(u.get("p2p_bytes", 0) for u in updates[k]) for k in steady)
    peaks = [max((e["args"].get("peak_bytes", 0) for e in events if e["pid"] == s and e["args"]["kind"] == "UPDATE"),
                 default=0) for s in stages]
    return MeasuredRun(median, times, busy, timeline, shown, cpu, sent, peaks)
