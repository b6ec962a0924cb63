"""The same chip's profile on one host under two time scales, and with a busy process on every
core, gives the same layer times (within 5%) and the same plan: a chip's time is its datasheet's,
not the host's, as long as the host keeps up (docs/device.md, "Speed")."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from heteropp.cluster import ChipSpec, ClusterSpec, LinkSpec
from heteropp.model_spec import ModelSpec
from heteropp.runtime.profiler import chip_description, host_ratio, profile_tp
from heteropp.search import HeteroAuto
from heteropp_cases import CONFIGS

KEYS = ("fwd", "bwd", "update")


def _plan_layout(profiles: dict[str, dict]) -> list:
    """The plan HeteroAuto makes for two chips of each profiled type."""
    chips = tuple(ChipSpec.from_dict(name, {**desc, "count": 2}) for name, desc in profiles.items())
    link = LinkSpec(bandwidth=1e9, latency=50e-6)
    auto = HeteroAuto(SPEC, ClusterSpec(chips=chips, inter_node=link, inter_cluster=link), 16 * SPEC.seq)
    plan = auto.to_plan(auto.search())
    return [(s.chip, s.tp, s.dp, s.layers, s.recompute) for s in plan.stages] + [plan.num_microbatches]


SPEC = ModelSpec.load(CONFIGS / "llama-tiny.yaml", seq=128)


@pytest.fixture(scope="module")
def ratio() -> float:
    return host_ratio("A", SPEC)


def _profile(chip: str, time_scale: float) -> tuple[dict, float]:
    """The chip's profile at ``time_scale``, or at the first of its doublings at which the host
    keeps up: a loaded host (the other tests' ranks, the busy processes) needs a larger scale,
    which is what the time scale is for."""
    for _ in range(4):
        result = profile_tp(chip, SPEC, 1, memory_scale=0.01, repeats=3, time_scale=time_scale)
        if result["host_late_percent"] < 5:
            return result, time_scale
        time_scale *= 2
    raise AssertionError(f"the host fell behind up to time scale {time_scale / 2:g}: {result}")


@pytest.mark.slow
def test_layer_times_and_plans_do_not_depend_on_the_time_scale_or_the_hosts_load(ratio):
    # One rank of chip A just keeps up at `ratio`; the busy processes (and this machine's other
    # work) leave the rank a fraction of a core, so the loaded run takes a far larger scale.
    quiet_a, low = _profile("A", 6 * ratio)
    quiet = {"A": quiet_a, "C": _profile("C", low)[0]}
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)]
    try:
        loaded, high = _profile("A", 2 * low)
    finally:
        for p in busy:
            p.kill()
            p.wait()
    assert high >= 2 * low
    for key in KEYS:
        assert loaded[key] == pytest.approx(quiet["A"][key], rel=0.05), (key, quiet["A"], loaded)
    # C is a third of A: the profiles still say so
    assert quiet["C"]["fwd"] / quiet["A"]["fwd"] == pytest.approx(3.0, rel=0.05)
    plans = [_plan_layout({"A": chip_description("A", {1: a}, 0.01), "C": chip_description("C", {1: quiet["C"]}, 0.01)})
             for a in (quiet["A"], loaded)]
    assert plans[0] == plans[1]


def _profile_behind(chip: str, time_scale: float) -> dict:
    """The chip's profile at ``time_scale``, or at the first of its halvings (down to 1, the
    datasheet's speed) at which the device waits for the host over a fifth of its time: the
    ratio is one measurement, and the host's speed when it was taken is not the host's now."""
    while True:
        result = profile_tp(chip, SPEC, 1, memory_scale=0.01, repeats=3, time_scale=time_scale)
        if result["host_late_percent"] > 20 or time_scale == 1.0:
            return result
        time_scale = max(1.0, time_scale / 2)


@pytest.mark.slow
def test_a_host_that_falls_behind_is_left_out_of_the_layer_times(ratio):
    """Below the scale at which the host keeps up, the device waits for the host much of the
    time; the profile leaves those waits out and measures the chip as at a scale that keeps up."""
    keeps_up, _ = _profile("A", 6 * ratio)
    behind = _profile_behind("A", max(1.0, ratio / 2))
    assert behind["host_late_percent"] > 20, behind  # the host did fall behind
    for key in ("fwd", "bwd"):
        assert behind[key] == pytest.approx(keeps_up[key], rel=0.05), (key, keeps_up, behind)
