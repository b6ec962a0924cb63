"""heteropp.measured reads a runtime trace into the simulator's terms, checked on a hand-built
trace whose iteration times, busy times and memory peaks are known."""
from __future__ import annotations

import json

import pytest

from heteropp.measured import read_trace


def _event(stage, rank, kind, step, start_s, dur_s, mb=0, **args):
    return {"name": f"{stage}{kind}{mb}", "cat": kind, "ph": "X", "pid": stage, "tid": rank,
            "ts": start_s * 1e6, "dur": dur_s * 1e6, "args": {"kind": kind, "step": step, "mb": mb, **args}}


def test_iteration_busy_time_and_peaks(tmp_path):
    events = []
    # three steps of 2 stages (stage 1 has TP ranks 1 and 2); steps last 1.0, 2.0 and 4.0 s
    for step, (t0, length) in enumerate([(0.0, 1.0), (1.0, 2.0), (3.0, 4.0)]):
        events.append(_event(0, 0, "F", step, t0, 0.1 * length))
        events.append(_event(0, 0, "B", step, t0 + 0.2 * length, 0.2 * length))
        events.append(_event(0, 0, "WAIT", step, t0 + 0.4 * length, 0.3 * length))
        events.append(_event(1, 1, "F", step, t0 + 0.1 * length, 0.3 * length))
        events.append(_event(1, 2, "F", step, t0 + 0.1 * length, 0.35 * length))  # not the stage's first rank
        for stage, rank in ((0, 0), (1, 1), (1, 2)):
            events.append(_event(stage, rank, "UPDATE", step, t0 + 0.8 * length, 0.2 * length, mb=-1,
                                 cpu_s=0.5, p2p_bytes=100, peak_bytes=1000 * (rank + 1) + step))
    (tmp_path / "t.json").write_text(json.dumps({"traceEvents": events}))
    m = read_trace(tmp_path / "t.json", num_stages=2)
    assert m.iteration_times == pytest.approx([1.0, 2.0, 4.0])
    assert m.iteration_time == pytest.approx(3.0)  # median of the steps after the first
    assert m.stage_busy == pytest.approx([0.3 * 3.0, 0.3 * 3.0])  # compute only, each stage's first rank
    assert m.cpu_per_step == pytest.approx(1.5) and m.p2p_bytes_per_step == 300
    assert m.stage_peak_bytes == [1002, 3002]
    assert m.step in (1, 2) and {row[1] for row in m.timeline} == {"F", "B", "UPDATE"}
    with pytest.raises(ValueError, match="the trace has stages \\[0, 1\\], the plan 3"):
        read_trace(tmp_path / "t.json", num_stages=3)
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="not a ditorch runtime trace"):
        read_trace(tmp_path / "bad.json")


def test_a_stage_that_starts_its_next_step_early_is_not_counted_twice(tmp_path):
    # Every 2 s stage 0 runs F at 0-0.5 and steps at 1-2; stage 1 steps first (0.6-0.8) and
    # posts its next step's receive at 0.9, 1.1 s before stage 0's next F: each step spans 3 s
    # from its first event to its last, but the job takes one every 2 s.
    events = []
    for step in range(4):
        t0 = 2.0 * step
        events.append(_event(0, 0, "F", step, t0, 0.5))
        events.append(_event(0, 0, "UPDATE", step, t0 + 1.0, 1.0, mb=-1))
        events.append(_event(1, 1, "WAIT", step, t0 - 1.1 if step else t0, 1.2 if step else 0.1))
        events.append(_event(1, 1, "F", step, t0 + 0.5, 0.1))
        events.append(_event(1, 1, "UPDATE", step, t0 + 0.6, 0.2, mb=-1))
    (tmp_path / "t.json").write_text(json.dumps({"traceEvents": events}))
    m = read_trace(tmp_path / "t.json", num_stages=2)
    assert m.iteration_times == pytest.approx([2.0, 2.0, 2.0, 2.0])
    assert m.iteration_time == pytest.approx(2.0)
