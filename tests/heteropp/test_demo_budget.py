"""The demo's time budget (examples/demo_budget.py): a phase's predicted seconds and the sizing of
every phase's work to a budget, against hand-computed cases; the time-scale calibration's next
scale (heteropp/runtime/keep_up.py) against hand-computed raises; and each rank's lateness as the
demo reads it from what an emulated process prints at exit."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from heteropp.runtime.keep_up import RAISE_MARGIN, TRAINING_MARGIN, between, next_scale, search

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
try:
    from demo_budget import Host, Phase, demo_phases, size_phases
finally:
    sys.path.pop(0)

HOST = Host(time_scale=10.0, start_s=2.0, cpu_factor=1.0)
# P: a start-up (2 s) + 1 s per step (0.1 chip-s x time scale 10); Q: 1 s per step of host work
P = Phase("1/2", "p", "step", starts=1.0, chip_s=0.1, floor=2, default=10, most=20)
Q = Phase("2/2", "q", "step", host_s=1.0, floor=1, default=5, most=5)


def test_a_phase_costs_its_start_ups_and_its_units_at_the_time_scale_and_the_hosts_speed():
    phase = Phase("3/9", "x", "step", starts=2.0, chip_s=0.05, host_s=0.5, fixed_s=3.0, fixed_chip_s=0.2)
    slow = Host(time_scale=100.0, start_s=4.0, cpu_factor=3.0)
    # 2 x 4 s + 3 x 3 s + 100 x 0.2 s + 6 x (100 x 0.05 s + 3 x 0.5 s)
    assert phase.seconds(6, slow) == pytest.approx(8 + 9 + 20 + 6 * (5 + 1.5))


def test_the_sizing_grows_every_phase_by_one_factor_while_the_budget_holds():
    # defaults: 2 + 10 + 5 = 17 s; P grows alone past Q's most: 13 steps fill 20 s exactly
    sizing = size_phases([P, Q], HOST, 20.0)
    assert sizing.units == {"1/2": 13, "2/2": 5}
    assert sizing.total_s == pytest.approx(20.0) and sizing.over_s == 0
    # a factor of 0.4 gives P 4 and Q 2 (8 s); 0.5 would give P 5 (9 s)
    assert size_phases([P, Q], HOST, 8.0).units == {"1/2": 4, "2/2": 2}
    # past every phase's most nothing grows further
    assert size_phases([P, Q], HOST, 1000.0).units == {"1/2": 20, "2/2": 5}


def test_when_even_the_floors_do_not_fit_the_sizing_keeps_them_and_says_by_how_much():
    sizing = size_phases([P, Q], HOST, 4.0)  # floors: 2 + 2 + 1 = 5 s
    assert sizing.units == {"1/2": 2, "2/2": 1}
    assert sizing.over_s == pytest.approx(1.0)


def test_a_phase_follows_anothers_units_and_keeps_to_its_multiples():
    steps = Phase("a", "train", "step", chip_s=0.1, floor=8, default=16, most=48)
    reference = Phase("b", "reference", "step", host_s=0.5, same_units_as="a")
    outer = Phase("c", "ps", "step", chip_s=0.1, floor=8, default=8, most=16, multiple_of=4)
    # 1 s per step, the reference 0.5 s, Di-PS 1 s: at a factor of 25/16, 25 steps (25 + 12.5 s)
    # and Di-PS 12 (12.5 rounded down to a multiple of 4) = 49.5 s; 26 steps would be 51 s
    sizing = size_phases([steps, reference, outer], HOST, 50.0)
    assert sizing.units == {"a": 25, "b": 25, "c": 12}
    assert sizing.total_s == pytest.approx(49.5)


def test_a_smaller_batch_shrinks_each_units_cost_as_its_phase_follows_the_batch():
    pipeline = Phase("3/9", "train", "step", starts=1.0, chip_s=0.1, batch="pipeline")
    tokens = Phase("4/9", "reference", "step", host_s=1.0, batch="tokens")
    fixed = Phase("9/9", "volunteers", "step", host_s=1.0)
    # half of 8 micro-batches through 3 stages: (4 + 2) / (8 + 2) of a step's micro-batch times
    assert pipeline.seconds(5, HOST, 0.5) == pytest.approx(2.0 + 5 * 1.0 * 0.6)
    assert tokens.seconds(5, HOST, 0.5) == pytest.approx(2.5)
    assert fixed.seconds(5, HOST, 0.5) == pytest.approx(5.0)
    with pytest.raises(ValueError, match="batch share 0 is invalid"):
        pipeline.seconds(5, HOST, 0)


def test_the_sizing_keeps_the_largest_batch_whose_floors_fit():
    train = Phase("a", "train", "step", chip_s=0.1, floor=8, default=16, most=48, batch="pipeline")
    extra = Phase("b", "volunteers", "step", host_s=1.0, floor=2, default=2, most=2)
    # floors at the whole batch: 8 x 1 s + 2 s = 10 s; at half: 8 x 0.6 s + 2 s = 6.8 s
    whole = size_phases([train, extra], HOST, 12.0, batches=(0.5, 1.0))
    assert whole.batch == 1.0 and whole.units == {"a": 10, "b": 2}
    half = size_phases([train, extra], HOST, 9.0, batches=(0.5, 1.0))
    # 11 steps at 0.6 s (6.6 s) + 2 s fit 9 s; 12 would be 9.2 s
    assert half.batch == 0.5 and half.units == {"a": 11, "b": 2} and half.over_s == 0
    neither = size_phases([train, extra], HOST, 5.0, batches=(1.0, 0.5))
    assert neither.batch == 0.5 and neither.units == {"a": 8, "b": 2}
    assert neither.over_s == pytest.approx(1.8)
    with pytest.raises(ValueError, match=r"batches=\[1.5\] is invalid"):
        size_phases([train], HOST, 5.0, batches=(1.5,))


def _hetero_demo():
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    try:
        import hetero_demo
    finally:
        sys.path.pop(0)
    return hetero_demo


def test_profiles_run_at_their_own_share_of_trainings_time_scale(monkeypatch):
    phase = Phase("1/9", "profiles", "repeat", starts=1.0, chip_s=0.1, fixed_chip_s=0.5, time_scale_share=0.5)
    # 2 s start-up + 0.5 chip-s at 10 x 0.5 + 2 x 0.1 chip-s at 5
    assert phase.seconds(2, HOST) == pytest.approx(2.0 + 2.5 + 1.0)
    profile_time_scale = _hetero_demo().profile_time_scale
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    # 4 ranks on 2 cores get half a core each; a TP 2 profile's 2 ranks a whole one
    assert profile_time_scale(170.0, 4, 2) == 85.0
    assert profile_time_scale(440.0, 4, 2) == 220.0
    # no more ranks than cores: a core each either way
    assert profile_time_scale(170.0, 2, 1) == 170.0
    # 8 ranks against a TP 4 profile's 4 on 2 cores: half; a profile never runs above training's scale
    assert profile_time_scale(300.0, 8, 4) == 150.0
    assert profile_time_scale(300.0, 2, 4) == 300.0
    with pytest.raises(ValueError, match="time_scale_share=0"):
        Phase("1/9", "x", "repeat", time_scale_share=0)


def test_a_chip_whose_host_fell_behind_at_the_profiles_scale_is_measured_again_at_trainings(monkeypatch):
    hetero_demo = _hetero_demo()
    from heteropp.runtime.profiler import LATE_WARNING

    # what `ditorch profile` prints for a TP size whose host fell behind
    late_at = {"85": "    " + LATE_WARNING.format(percent=3.6, scale=85.0) + ": that wait ..."}
    scales = []

    def fake_run(cmd, env, step, check=True, lines=None):
        scale = cmd[cmd.index("--time-scale") + 1]
        scales.append(scale)
        lines += ["  1     0.31     0.61\n", late_at.get(scale, "  2     0.33     0.62\n")]
        return 0

    monkeypatch.setattr(hetero_demo, "run", fake_run)
    hetero_demo.profile_chip(["ditorch", "profile"], "A", (85.0, 170.0), {})
    assert scales == ["85", "170"]
    scales.clear()
    hetero_demo.profile_chip(["ditorch", "profile"], "B", (90.0, 170.0), {})
    assert scales == ["90"]
    scales.clear()
    hetero_demo.profile_chip(["ditorch", "profile"], "C", (85.0, 85.0), {})
    assert scales == ["85"]


def test_bad_phases_and_budgets_are_refused_with_the_value_named():
    with pytest.raises(ValueError, match="floor=5, default=3"):
        Phase("1/9", "x", "step", floor=5, default=3, most=8)
    with pytest.raises(ValueError, match="multiples of 4"):
        Phase("8/9", "x", "step", floor=6, default=8, most=16, multiple_of=4)
    with pytest.raises(ValueError, match=r"Host.time_scale=0"):
        Host(time_scale=0, start_s=1.0, cpu_factor=1.0)
    with pytest.raises(ValueError, match="budget_s=nan"):
        size_phases([P], HOST, float("nan"))
    with pytest.raises(ValueError, match="'zz', which is not a phase"):
        size_phases([Phase("a", "x", "step", same_units_as="zz")], HOST, 10.0)


def test_the_demos_phases_at_the_calibration_hosts_scale_predict_its_measured_run():
    # The README's `make demo` from a fresh clone at time scale 160 (1.2 s start-ups, the host
    # probe 0.99x; the profiles at half that scale, chip B's again at 160), at the work its budget
    # gave (3 repeats, 15 steps, HSR 2 steps, Di-PS 8, volunteers 10): each phase's measured seconds.
    measured = {"1/9": 68, "2/9": 1, "3/9": 109, "4/9": 11, "5/9": 2, "6/9": 2, "7/9": 60, "8/9": 76, "9/9": 71}
    units = {"1/9": 3, "2/9": 1, "3/9": 15, "4/9": 15, "5/9": 1, "6/9": 1, "7/9": 2, "8/9": 8, "9/9": 10}
    host = Host(160.0, 1.2, 0.99)
    for phase in demo_phases(3, True, True, True, profile_time_scale_share=0.5):
        assert phase.seconds(units[phase.step], host) == pytest.approx(measured[phase.step], rel=0.1, abs=1.0), phase


def test_the_calibration_raises_the_scale_by_the_latest_ranks_lateness():
    # 10% late at 70: 70 x 1.1 x margin, rounded up to two digits
    expected = 70 * 1.1 * RAISE_MARGIN
    assert next_scale(70.0, [0.0, 0.10, 0.03]) >= expected
    assert next_scale(70.0, [0.0, 0.10, 0.03]) < expected + 1.0
    # barely late still rises by at least 5%
    assert next_scale(100.0, [0.021]) >= 105.0
    with pytest.raises(ValueError, match="expected fractions >= 0"):
        next_scale(70.0, [-0.5])
    # a burst of another job's work (10x late) raises the scale at most twofold
    assert next_scale(80.0, [10.0]) == 160.0


def test_the_calibration_narrows_down_to_the_lowest_scale_that_kept_up():
    # a host that needs scale 100: a rank at scale s is (100 / s - 1) late below it
    def measure(scale: float) -> list[float]:
        return [0.0, max(0.0, 100.0 / scale - 1.0)]

    result = search(measure, 60.0, rounds=8)
    scales = [s for s, _ in result.tried]
    # 60 is 67% late: 60 x 1.67 x 1.15 = 115, rounded up to two digits 120 (also the twofold
    # cap); then geometric means rounded up: between 60 and 120 85 (18% late), between 85 and
    # 120 101 -> 110 (kept up), between 85 and 110 96.7 -> 97 (3% late), between 97 and 110
    # 103 -> 110, no scale between: training at 110 x 1.1 = 121 -> 130
    assert scales == [60.0, 120.0, 85.0, 110.0, 97.0]
    assert result.kept_up and result.time_scale == 130.0 and TRAINING_MARGIN == 1.1
    # a host that keeps up at the start is not searched below it
    assert search(lambda s: [0.0], 200.0, rounds=8).tried == [(200.0, [0.0])]
    # nothing kept up: the last scale tried, flagged
    stuck = search(lambda s: [1.0], 50.0, rounds=3)
    assert not stuck.kept_up and stuck.time_scale == 200.0 and [s for s, _ in stuck.tried] == [50.0, 100.0, 200.0]


def test_every_emulated_rank_states_its_lateness_at_exit_and_the_demo_reads_it(tmp_path):
    import os
    import subprocess

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    try:
        from hetero_demo import rank_lateness
    finally:
        sys.path.pop(0)
    script = ("import torch, ditorch\n"
              "x = torch.ones(64, 64, device='dipu')\n"
              "x = x @ x / 64\n"
              "torch.dipu.synchronize()\n")
    env = dict(os.environ, DITORCH_CHIP="A", DITORCH_TIME_SCALE="20000", DITORCH_LATE_REPORT="all", RANK="3")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    late = rank_lateness(done.stderr.splitlines())
    # at a time scale of 20000 each kernel lasts a tenth of a second or more, far longer than the
    # host's work between two: a report of about 0%, which only DITORCH_LATE_REPORT=all prints
    assert list(late) == [3] and late[3][0] == "A" and 0 <= late[3][1] < 2, done.stderr
    quiet = subprocess.run([sys.executable, "-c", script], env={k: v for k, v in env.items()
                                                                 if k != "DITORCH_LATE_REPORT"},
                           capture_output=True, text=True, timeout=120)
    assert rank_lateness(quiet.stderr.splitlines()) == {}, quiet.stderr
