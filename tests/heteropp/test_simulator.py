import dataclasses

import pytest

from heteropp import ClusterSpec, HeteroAuto, ModelSpec, parse_tokens
from heteropp.schedule import Schedule, fine_grained, gpipe, one_f_one_b
from heteropp.simulator import LinkModel, Pipeline, StageModel, pipeline_from_plan, simulate

from heteropp_cases import CONFIGS, small_case


def _uniform(S, f=1.0, bi=1.0, bw=1.0, nbytes=0.0, bandwidth=1e12, latency=0.0, b=6, **kw):
    stages = [StageModel(fwd=f, bwd_input=bi, bwd_weight=bw, recompute_time=f, recompute=False, act_bytes=1.0,
                         full_act_bytes=0.0) for _ in range(S)]
    links = [LinkModel(nbytes, bandwidth, latency) for _ in range(S - 1)]
    return Pipeline(stages, links, [b], **kw)


def test_1f1b_and_gpipe_match_the_textbook_formula():
    # S uniform stages, free links: (b + S - 1) * (f + b_full)
    S, b = 4, 6
    for sched in (one_f_one_b(S, b), gpipe(S, b)):
        res = simulate(_uniform(S, b=b), sched)
        assert res.iteration_time == pytest.approx((b + S - 1) * 3.0)
        assert res.bubble_fraction == pytest.approx((S - 1) / (b + S - 1))


def test_1f1b_holds_warmup_microbatches_gpipe_holds_all():
    S, b = 4, 6
    r1 = simulate(_uniform(S, b=b), one_f_one_b(S, b))
    rg = simulate(_uniform(S, b=b), gpipe(S, b))
    assert r1.stage_peak_memory == [4.0, 3.0, 2.0, 1.0]
    assert rg.stage_peak_memory == [6.0] * 4


def test_link_latency_and_bandwidth_delay_the_pipeline():
    # two stages, one message each way per micro-batch of 1e9 bytes at 1e9 B/s plus 0.5 s
    S, b = 2, 1
    res = simulate(_uniform(S, b=b, nbytes=1e9, bandwidth=1e9, latency=0.5), one_f_one_b(S, b, blocking_p2p=False))
    # F0 (1) -> send 1.5 -> F1 (1) + B1 (2) -> send 1.5 -> B0 (2)
    assert res.iteration_time == pytest.approx(1 + 1.5 + 3 + 1.5 + 2)


def test_every_stage_steps_after_the_last_backward_of_the_pipeline():
    # F0 0-1, F1 1-2, B1 2-3 (stage 1 done at 3), B0 3-4: the global norm needs both, so stage
    # 1's 5 s update starts at 4, not at its own end at 3
    st = [StageModel(1.0, 1.0, 0.0, 0.0, False, 1.0, 0.0, update=u) for u in (1.0, 5.0)]
    res = simulate(Pipeline(st, [LinkModel(0.0, 1e12, 0.0)], [1]), one_f_one_b(2, 1))
    assert res.pipeline_time == pytest.approx(4.0)
    assert res.iteration_time == pytest.approx(4.0 + 5.0)


def test_shared_link_fair_vs_coordinated():
    # two replicas send one activation over a shared link at the same moment
    st = [StageModel(1.0, 1.0, 0.0, 0.0, False, 1.0, 0.0) for _ in range(2)]
    shared = [LinkModel(1e9, 1e9, 0.0, shared=True)]
    fair = simulate(Pipeline(st, shared, [1, 1]), [one_f_one_b(2, 1, blocking_p2p=False)] * 2)
    coord = simulate(Pipeline(st, shared, [1, 1], coordinated=True), [one_f_one_b(2, 1, blocking_p2p=False)] * 2)
    # fair: both activations arrive at 1 + 2 s; coordinated: at 2 s and 3 s, so replica 0 ends earlier
    fwd_arrivals = sorted(t for (_, d, _, _, t) in fair.comm_timeline if d == "F")
    assert fwd_arrivals == [pytest.approx(3.0)]
    assert [t for (_, d, _, _, t) in coord.comm_timeline if d == "F"] == [pytest.approx(2.0)]


def test_comm_aware_lists_replay_to_the_same_timeline():
    S, b = 4, 8
    pipe = _uniform(S, b=b, nbytes=5e8, bandwidth=1e9, latency=0.3)
    greedy = simulate(pipe, "comm-aware")
    sched = Schedule.from_dict(greedy.schedules[0].to_dict())  # through the JSON form
    replay = simulate(pipe, sched)
    assert replay.iteration_time == pytest.approx(greedy.iteration_time)
    assert replay.timeline == greedy.timeline


def test_comm_aware_respects_the_memory_budget_and_beats_1f1b_on_slow_links():
    S, b = 4, 12
    stages = [StageModel(1.0, 1.0, 1.0, 1.0, False, 1.0, 0.0, act_limit=4.0) for _ in range(S)]
    links = [LinkModel(1e9, 1e9, 2.0) for _ in range(S - 1)]
    pipe = Pipeline(stages, links, [b])
    greedy = simulate(pipe, "comm-aware")
    base = simulate(pipe, one_f_one_b(S, b, blocking_p2p=False))
    assert max(greedy.stage_peak_memory) <= 4.0
    assert greedy.iteration_time < base.iteration_time


def test_fine_grained_is_not_slower_than_1f1b():
    S, b = 4, 8
    pipe = _uniform(S, b=b, nbytes=1e9, bandwidth=1e9, latency=0.1)
    assert simulate(pipe, fine_grained(S, b)).iteration_time <= simulate(pipe, one_f_one_b(S, b)).iteration_time


@pytest.mark.parametrize("seed", range(6))
def test_cost_model_and_simulator_agree_on_1f1b_plans(seed):
    # P2P small against compute (the paper's regime: 100 MB-class messages, seconds of compute);
    # with slow links and blocking P2P the 1F1B cycle couples neighbours and T underestimates
    # (docs/heteropp.md, "cost model vs simulator")
    model, cluster, gbs, _ = small_case(100 + seed)
    # and a small optimizer step: the paper's T adds the bottleneck stage's own update, while the
    # run ends at the pipeline's end plus the slowest update; large updates make that gap visible
    # (the DP ring crosses the link between nodes, bounded by the NICs: both fast)
    fast = dataclasses.replace(cluster.inter_node, bandwidth=100e9)
    cluster = dataclasses.replace(cluster, inter_node=fast, inter_cluster=fast, chips=tuple(
        dataclasses.replace(c, nic_bandwidth=100e9, hbm_bandwidth=1e13) for c in cluster.chips))
    auto = HeteroAuto(model, cluster, gbs, alpha=1.0)
    try:
        plan = auto.to_plan(auto.search())
    except ValueError:
        pytest.skip("no plan fits this random case")
    rc = [s.recompute for s in plan.stages]
    res = simulate(pipeline_from_plan(plan), one_f_one_b(plan.num_stages, plan.num_microbatches, rc))
    assert res.iteration_time == pytest.approx(plan.estimate["iteration_time_s"], rel=0.05)
    for i in range(plan.num_stages):  # 1F1B memory equals the planner's formula
        assert res.stage_peak_memory[i] == pytest.approx(plan.stage_memory(i), rel=1e-9)


def test_cost_model_and_simulator_agree_on_a_paper_plan():
    model = ModelSpec.from_yaml(CONFIGS / "model-100b.yaml")
    cluster = ClusterSpec.from_yaml(CONFIGS / "cluster-exp-c-1.yaml")
    auto = HeteroAuto(model, cluster, parse_tokens("4M"))
    plan = auto.to_plan(auto.search())
    res = simulate(pipeline_from_plan(plan), one_f_one_b(plan.num_stages, plan.num_microbatches,
                                                         [s.recompute for s in plan.stages]))
    assert res.iteration_time == pytest.approx(plan.estimate["iteration_time_s"], rel=0.05)


def test_schedule_validation_errors():
    s = one_f_one_b(2, 2)
    d = s.to_dict()
    d["actions"][0] = [a for a in d["actions"][0] if a != "0B1"]
    with pytest.raises(ValueError, match="0B1"):
        Schedule.from_dict(d)
    with pytest.raises(ValueError, match="bad action"):
        Schedule.from_dict({**s.to_dict(), "actions": [["0X1"], []]})
