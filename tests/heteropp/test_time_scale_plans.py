"""The emulation time scale travels from `ditorch profile` through the plan to the run: chips
profiled at different scales do not make one cluster, a run uses its plan's scale (and refuses a
different one), and `ditorch plan` warns when the plan's ranks would outnumber the cores more
than the scale allows."""
from __future__ import annotations

import dataclasses

import pytest

from heteropp.cli import emulation_note
from heteropp.cluster import GB, ChipSpec, ClusterSpec, LinkSpec
from heteropp.model_spec import ModelSpec
from heteropp.search import HeteroAuto

MODEL = ModelSpec(n_layers=8, hidden=256, heads=4, kv_heads=2, ffn=704, vocab=256, seq=128)


def _chip(name: str, count: int, scale: float | None) -> ChipSpec:
    return ChipSpec(name=name, count=count, memory=80 * GB, chips_per_node=8, tp_max=2, intra_node_bandwidth=100 * GB,
                    hbm_bandwidth=1e12, nic_bandwidth=12.5 * GB, effective_tflops=100, emulated_time_scale=scale)


def _cluster(scales: dict[str, float | None], count: int = 2) -> ClusterSpec:
    return ClusterSpec(chips=tuple(_chip(n, count, s) for n, s in scales.items()),
                       inter_node=LinkSpec(12.5 * GB, 1e-5), inter_cluster=LinkSpec(1 * GB, 1e-4))


def _plan(cluster: ClusterSpec):
    auto = HeteroAuto(MODEL, cluster, 16 * 128)
    return auto.to_plan(auto.search())


def test_chips_profiled_at_different_time_scales_do_not_make_one_cluster():
    with pytest.raises(ValueError, match=r"different emulation time scales \{'A': 2.0, 'B': 3.0\}"):
        _cluster({"A": 2.0, "B": 3.0})
    assert _cluster({"A": 2.0, "B": 2.0}).emulated_time_scale == 2.0
    assert _cluster({"A": None, "B": None}).emulated_time_scale is None


@pytest.mark.parametrize("bad", [0.5, "2", True, float("inf")])
def test_a_profile_with_a_bad_time_scale_is_refused(bad):
    d = {**_chip("A", 1, None).to_dict(), "emulated_time_scale": bad}
    with pytest.raises(ValueError, match=f"emulated_time_scale must be a number >= 1, got {bad!r}"):
        ChipSpec.from_dict("A", d)


def test_the_time_scale_survives_the_yaml_and_the_plan_json(tmp_path):
    chip = _chip("A", 2, 2.5)
    assert ChipSpec.from_dict("A", chip.to_dict()) == chip
    plan = _plan(_cluster({"A": 2.5, "B": 2.5}))
    plan.to_json(tmp_path / "plan.json")
    from heteropp.plan import Plan

    assert Plan.from_json(tmp_path / "plan.json").cluster.emulated_time_scale == 2.5


def test_the_plan_warns_when_its_ranks_outnumber_cores_beyond_the_time_scale():
    plan = _plan(_cluster({"A": 1.0, "B": 1.0}, count=3))
    ranks = plan.num_chips
    assert ranks > 2
    note = emulation_note(plan, cores=2)
    assert note is not None and f"{ranks} emulated ranks" in note and f"--ranks {ranks}" in note
    fitting = dataclasses.replace(plan, cluster=_cluster({"A": ranks / 2, "B": ranks / 2}, count=3))
    assert emulation_note(fitting, cores=2) is None
    assert emulation_note(dataclasses.replace(plan, cluster=_cluster({"A": None, "B": None}, count=3)), cores=2) is None


def test_a_run_uses_its_plans_time_scale_and_refuses_another(monkeypatch):
    from heteropp.plan import PlanError
    from heteropp.runtime.trainer import run_time_scale

    plan = _plan(_cluster({"A": 2.0, "B": 2.0}))
    monkeypatch.delenv("DITORCH_TIME_SCALE", raising=False)
    assert run_time_scale(plan) == 2.0
    monkeypatch.setenv("DITORCH_TIME_SCALE", "2")
    assert run_time_scale(plan) == 2.0
    monkeypatch.setenv("DITORCH_TIME_SCALE", "3")
    with pytest.raises(PlanError, match="DITORCH_TIME_SCALE=3 but the plan's chips were profiled at time scale 2"):
        run_time_scale(plan)
    unprofiled = _plan(_cluster({"A": None, "B": None}))
    assert run_time_scale(unprofiled) == 3.0
    monkeypatch.delenv("DITORCH_TIME_SCALE")
    assert run_time_scale(unprofiled) == 1.0


def test_a_plans_links_run_at_its_chips_time_scale_in_the_simulator():
    """One micro-batch through two stages crosses the boundary twice (its activation, its
    gradient), both on the critical path: at time scale k each crossing takes k times the
    fleet's (latency + bytes / bandwidth), as the run's dicomm paces it."""
    from heteropp.plan import Plan, StagePlan
    from heteropp.placement import boundary_link, rank_places
    from heteropp.schedule import one_f_one_b
    from heteropp.simulator import pipeline_from_plan, simulate

    def iteration(scale: float | None) -> float:
        cluster = _cluster({"A": scale, "B": scale})
        plan = Plan(model=MODEL, cluster=cluster, global_batch_tokens=MODEL.seq, dp=1,
                    stages=(StagePlan("A", 1, 1, 4, 0, False, 0), StagePlan("B", 1, 1, 4, 4, False, 1)))
        assert rank_places(plan)[0].dc == "A" and rank_places(plan)[1].dc == "B"
        assert boundary_link(plan, 0) == LinkSpec(1 * GB, 1e-4)  # the cross-cluster link, narrower than the NICs
        return simulate(pipeline_from_plan(plan), one_f_one_b(2, 1, [False, False])).iteration_time

    crossing = 1e-4 + MODEL.p2p_bytes(1) / (1 * GB)
    assert iteration(300.0) - iteration(None) == pytest.approx(2 * crossing * (300 - 1), rel=1e-9)


def test_the_dp_ring_crosses_the_link_between_nodes_at_the_profiles_time_scale():
    """2 (dp - 1) ring steps, each a latency, and 2 (dp - 1) / dp of the gradients over the
    narrower of the link and the NIC, all times the time scale (as dicomm paces the run's ring)."""
    from heteropp.profile import ChipProfile

    chip = dataclasses.replace(_chip("A", 4, 10.0), nic_bandwidth=25 * GB)
    slow = ChipProfile(chip, MODEL, LinkSpec(1 * GB, 1e-5))
    assert slow._dp_sync_time(1e6, 4, 4) == pytest.approx(10 * (6 * 1e-5 + 1.5 * 4e6 / 1e9), rel=1e-12)
    nic_bound = ChipProfile(chip, MODEL, LinkSpec(100 * GB, 0))
    assert nic_bound._dp_sync_time(1e6, 4, 4) == pytest.approx(10 * 1.5 * 4e6 / 25e9, rel=1e-12)
