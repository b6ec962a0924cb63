"""JEEVES's schedules for HeteroPP plans across two DCs (heteropp/jeeves.py, plan_schedules.py):
the lists the runtime runs replay in the simulator to the greedy scheduler's own timeline, stay
in the plan's memory, and the memory-aware division is the fastest division it considers."""
from __future__ import annotations

import dataclasses
import json
import random

import pytest

from heteropp.cli import main
from heteropp.jeeves import cross_dc_boundaries, division_candidates, plan_pipeline, with_layers
from heteropp.plan import Plan, PlanError
from heteropp.plan_schedules import plan_schedules, schedule_pipeline, with_schedule
from heteropp.schedule import Schedule, ScheduleError, turn_order
from heteropp.simulator import simulate
from heteropp_cases import two_dc_plan


def _random_plan(seed: int, schedule: str):
    rng = random.Random(seed)
    dc1, dc2 = rng.choice([(1, 1), (2, 2), (1, 2), (3, 1)])
    return two_dc_plan(rng.choice([10, 1000, 20000]), rng.choice([0.005, 0.05, 5.0]), dp=rng.choice([1, 2, 3]),
                       microbatches=rng.choice([3, 6, 9]), dc_stages=(dc1, dc2), schedule=schedule)


def test_turn_order_takes_a_microbatch_of_every_replica_in_turn():
    assert turn_order([2, 3]) == [(0, 0), (1, 0), (0, 1), (1, 1), (1, 2)]
    assert turn_order([1]) == [(0, 0)]


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("schedule", ["jeeves", "comm-aware"])
def test_cross_dc_lists_replay_to_the_greedy_timeline_within_the_plans_memory(seed, schedule):
    plan = _random_plan(seed, schedule)
    pipe = schedule_pipeline(plan)
    greedy = simulate(pipe, "comm-aware")
    lists = plan_schedules(plan)
    assert len(lists) == plan.dp
    coordinated = tuple(cross_dc_boundaries(plan)) if schedule == "jeeves" else ()
    for sched in lists:
        assert sched.coordinated == coordinated and not sched.blocking_p2p
        assert Schedule.from_dict(json.loads(json.dumps(sched.to_dict()))) == sched  # through the JSON form
    replay = simulate(pipe, lists)
    assert replay.iteration_time == pytest.approx(greedy.iteration_time, rel=1e-12)
    assert replay.timeline == greedy.timeline and replay.comm_timeline == greedy.comm_timeline
    for i in range(plan.num_stages):
        assert replay.stage_peak_memory[i] <= plan.stage_memory(i) * (1 + 1e-9), f"stage {i}"


def test_turns_reorder_the_lists_and_the_turned_lists_replay():
    # a link four times slower than the replicas' compute: taking turns changes what the greedy
    # scheduler runs when, and the lists it ran replay to its timeline only with the turns
    plan = two_dc_plan(10, 0.004, dp=2, microbatches=8, schedule="jeeves")
    turned, free = plan_schedules(plan), plan_schedules(plan, "comm-aware")
    assert [s.actions for s in turned] != [s.actions for s in free]
    pipe = schedule_pipeline(plan)
    assert simulate(pipe, turned).timeline == simulate(pipe, "comm-aware").timeline


def test_coordinated_turns_serve_one_message_at_a_time_in_turn_order():
    # four replicas whose first forwards cross at once: in turns each arrives a crossing after
    # the previous (full bandwidth), where shared fairly all four arrive together at the end
    plan = two_dc_plan(10, 0.005, dp=4, microbatches=2, dc_stages=(1, 1))
    crossing = plan.model.p2p_bytes(1) / plan.cluster.inter_cluster.bandwidth
    coordinated = simulate(plan_pipeline(plan, coordinated=True), plan_schedules(plan, "1f1b"))
    fair = simulate(plan_pipeline(plan), plan_schedules(plan, "1f1b"))
    first_f = lambda res: min(t for (_, d, m, _, t) in res.comm_timeline if d == "F" and m == 0)
    assert first_f(coordinated) == pytest.approx(first_f(fair) - 3 * crossing, rel=1e-6)


def test_memory_aware_division_is_the_fastest_candidate_that_fits():
    plan = two_dc_plan(50000, 0.01, dp=2, microbatches=16, held=4.5)
    divided = with_schedule(plan, "jeeves")
    times = {}
    for lay in division_candidates([s.layers for s in plan.stages]):
        try:
            cand = with_layers(dataclasses.replace(plan, schedule="jeeves"), lay)
        except PlanError:
            continue
        times[tuple(lay)] = simulate(plan_pipeline(cand, coordinated=True), "comm-aware").iteration_time
    best = min(times, key=times.get)
    assert tuple(s.layers for s in divided.stages) == best
    assert best != tuple(s.layers for s in plan.stages)  # here the division pays (layers move to DC2)
    assert divided.estimate["iteration_time_s"] == pytest.approx(times[best])


def test_jeeves_gains_over_dapple_at_high_latency_and_stays_near_one_dc_at_low():
    # the paper's regime: a micro-batch's crossing about its compute (4 layers: 25 ms forward,
    # 50 ms backward; 128 KiB (fp32) at 8 MB/s, two replicas); 1 ms and 20 ms of latency
    for latency_us in (1000, 20000):
        plan = two_dc_plan(latency_us, 0.008, dp=2, microbatches=8)
        dapple = simulate(plan_pipeline(plan), plan_schedules(plan, "1f1b")).iteration_time
        jeeves = with_schedule(plan, "jeeves").estimate["iteration_time_s"]
        one_dc = two_dc_plan(latency_us, 0.008, dp=2, microbatches=8, one_dc=True)
        intra = simulate(schedule_pipeline(one_dc), plan_schedules(one_dc, "1f1b")[:1]).iteration_time
        assert jeeves <= (0.85 if latency_us < 10000 else 0.75) * dapple, latency_us
        assert jeeves <= (1.1 if latency_us < 10000 else 1.15) * intra, latency_us


def test_bad_schedules_are_refused_naming_the_value():
    plan = two_dc_plan(10, 1.0)
    with pytest.raises(ValueError, match="schedule 'zigzag'"):
        plan_schedules(plan, "zigzag")
    sched = dataclasses.replace(plan_schedules(plan, "jeeves")[0], coordinated=(3,))
    with pytest.raises(ScheduleError, match=r"coordinated boundaries \[3\]"):
        sched.validate()


def test_plan_and_simulate_commands_take_jeeves(tmp_path, capsys):
    import yaml

    plan = two_dc_plan(20000, 0.005, dp=4, microbatches=16)
    cluster = tmp_path / "two-dcs.yaml"
    cluster.write_text(yaml.safe_dump(plan.cluster.to_dict()))
    model = tmp_path / "model.yaml"
    model.write_text(yaml.safe_dump({k: v for k, v in plan.model.to_dict().items() if k != "name"}))
    out = tmp_path / "plan.json"
    assert main(["plan", "--cluster", str(cluster), "--model", str(model), "--gbs", str(plan.global_batch_tokens),
                 "--schedule", "auto", "--out", str(out)]) == 0
    planned = Plan.from_json(out)
    text = capsys.readouterr().out
    assert "schedule " in text
    if cross_dc_boundaries(planned):
        assert planned.schedule == "jeeves", text
    lists = tmp_path / "lists.json"
    assert main(["simulate", str(out), "--schedule-out", str(lists)]) == 0
    ran = [Schedule.from_dict(d) for d in json.loads(lists.read_text())] if planned.dp > 1 else \
        [Schedule.from_dict(json.loads(lists.read_text()))]
    assert ran == plan_schedules(planned)[:len(ran)]
    assert f"schedule {planned.schedule}: iteration" in capsys.readouterr().out


@pytest.mark.parametrize("dp", [1, 2, 3])
def test_pipeline_from_plan_shares_the_cross_dc_link_among_replicas(dp):
    # two stages in two DCs, one micro-batch per replica: every replica's activation, then its
    # gradient, crosses the one cross-DC link at once, so each crossing takes dp times one
    # message's bytes over the link's bandwidth (by hand: the cluster file's link, the model's
    # activation), plus the latency
    from heteropp.simulator import pipeline_from_plan

    plan = two_dc_plan(700, 0.005, dp=dp, microbatches=1, dc_stages=(1, 1))
    pipe = pipeline_from_plan(plan)
    assert pipe.microbatches == [1] * dp
    link = plan.cluster.inter_cluster
    crossing = link.latency + dp * plan.model.p2p_bytes(1) / link.bandwidth
    s0, s1 = pipe.stages
    expect = s0.fwd + crossing + s1.fwd + s1.bwd_input + s1.bwd_weight + crossing + s0.bwd_input + s0.bwd_weight \
        + max(s0.update, s1.update)
    assert simulate(pipe, plan_schedules(plan, "1f1b")[0]).iteration_time == pytest.approx(expect, rel=1e-9)


def test_cost_model_charges_every_replica_on_the_cross_dc_link():
    # the planner's blocking P2P term for a stage at the DC boundary: dp messages one after
    # another on the shared link (by hand), as the simulator has it; inside a DC each replica's
    # own NIC (one message)
    from heteropp.cost_model import stage_costs
    from heteropp.profile import ChipProfile

    plan = two_dc_plan(700, 0.005, dp=3, microbatches=2, dc_stages=(1, 2))
    cl, m = plan.cluster, plan.model
    profiles = {c.name: ChipProfile(c, m, cl.inter_node) for c in cl.chips}
    first, second, third = stage_costs(m, cl, profiles, plan.stage_tuples())
    n = m.p2p_bytes(1)
    cross = cl.inter_cluster.latency + 3 * n / cl.inter_cluster.bandwidth
    inner = cl.inter_node.latency + n / min(cl.inter_node.bandwidth, cl.chip("Y").nic_bandwidth)
    assert first.p2p == pytest.approx(cross, rel=1e-9)
    assert second.p2p == pytest.approx(cross + inner, rel=1e-9)
    assert third.p2p == pytest.approx(inner, rel=1e-9)
