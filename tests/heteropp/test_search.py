import pytest

from heteropp import ClusterSpec, HeteroAuto, ModelSpec, NoFeasiblePlan, parse_tokens
from heteropp.exhaustive import exhaustive_search

from heteropp_cases import CONFIGS
from heteropp_cases import small_case


@pytest.mark.parametrize("seed", range(16))
def test_search_finds_the_exhaustive_optimum(seed):
    model, cluster, gbs, alpha = small_case(seed)
    auto = HeteroAuto(model, cluster, gbs, alpha=alpha)
    try:
        exact = exhaustive_search(auto)
    except NoFeasiblePlan:
        with pytest.raises(NoFeasiblePlan):
            auto.search(two_stage=False)
        return
    found = auto.search(two_stage=False)
    assert found.objective == pytest.approx(exact.objective, rel=1e-9)
    # the expanded plan is valid and no slower than the paper-T objective (ceil layers)
    plan = auto.to_plan(found)
    assert plan.estimate["iteration_time_s"] <= found.objective * (1 + 1e-9)


def test_two_stage_never_worse_than_stage_one():
    model = ModelSpec.from_yaml(CONFIGS / "model-100b.yaml")
    cluster = ClusterSpec.from_yaml(CONFIGS / "cluster-exp-c-1.yaml")
    result = HeteroAuto(model, cluster, parse_tokens("4M")).search()
    assert result.objective <= result.stage1.objective
    # sub-groups of one chip type keep (tp, recompute) non-increasing along the pipeline
    for (g0, c0), (g1, c1) in zip(zip(result.groups, result.choices), zip(result.groups[1:], result.choices[1:])):
        if g0.chip.name == g1.chip.name:
            assert (c0.tp, c0.recompute) >= (c1.tp, c1.recompute)


def test_memory_descending_stage_order_and_all_chips_used():
    model = ModelSpec.from_yaml(CONFIGS / "model-100b.yaml")
    cluster = ClusterSpec.from_yaml(CONFIGS / "cluster-exp-b-1.yaml")
    auto = HeteroAuto(model, cluster, parse_tokens("2M"))
    plan = auto.to_plan(auto.search())
    mems = [cluster.chip(s.chip).memory for s in plan.stages]
    assert mems == sorted(mems, reverse=True)
    for chip in cluster.chips:
        assert sum(s.num_ranks for s in plan.stages if s.chip == chip.name) == chip.count


def test_memory_too_small_for_one_layer_names_the_chip():
    model = ModelSpec.from_yaml(CONFIGS / "model-100b.yaml")
    cluster = ClusterSpec.from_yaml(CONFIGS / "cluster-exp-a-1.yaml")
    tiny = ClusterSpec(chips=tuple(c if c.name != "C" else c.__class__(**{**c.__dict__, "memory": 1e9})
                                   for c in cluster.chips), inter_node=cluster.inter_node,
                       inter_cluster=cluster.inter_cluster)
    with pytest.raises(NoFeasiblePlan, match=r"chip 'C' cannot hold one layer"):
        HeteroAuto(model, tiny, parse_tokens("2M")).search()


def test_batch_not_divisible():
    model = ModelSpec.from_yaml(CONFIGS / "model-100b.yaml")
    cluster = ClusterSpec.from_yaml(CONFIGS / "cluster-exp-a-1.yaml")
    with pytest.raises(NoFeasiblePlan, match="not a multiple of seq=4096"):
        HeteroAuto(model, cluster, 4096 * 512 + 7)
    # 5 sequences on Exp-C: dp=5 divides no chip count, and at dp=1 chip B alone needs
    # 1024 / 8 = 128 stages, more than the 96 layers
    exp_c = ClusterSpec.from_yaml(CONFIGS / "cluster-exp-c-1.yaml")
    with pytest.raises(NoFeasiblePlan, match="pipeline too deep: B: 128 stages at tp=8"):
        HeteroAuto(model, exp_c, 5 * 4096).search()
