import pytest

from heteropp import ClusterSpec, HeteroAuto, ModelSpec, NoFeasiblePlan, parse_tokens
from heteropp.exhaustive import exhaustive_search

from heteropp_cases import CONFIGS, broad_case, small_case


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


@pytest.mark.parametrize("seed", range(200))
def test_search_finds_the_exhaustive_optimum_on_broad_cases(seed):
    """Measured (non-analytic) layer times, odd chip counts, 2-16 layers, tight memory: the
    stage-one search returns exactly the optimum of exhaustive enumeration."""
    model, cluster, gbs, alpha = broad_case(seed)
    auto = HeteroAuto(model, cluster, gbs, alpha=alpha)
    try:
        exact = exhaustive_search(auto)
    except NoFeasiblePlan:
        with pytest.raises(NoFeasiblePlan):
            auto.search(two_stage=False)
        return
    assert auto.search(two_stage=False).objective == pytest.approx(exact.objective, rel=1e-9)


@pytest.mark.slow
def test_stage_two_refines_sub_groups_towards_their_optimum():
    """Chip types split into 2-6 sub-groups of 4 chips (stage two searches those exactly): over
    random cases the result equals the best of stage one and the exhaustive optimum over the
    sub-groups at stage one's dp, and improves on stage one wherever that optimum does."""
    improved = gaps = 0
    for seed in range(40):
        model, cluster, gbs, alpha = small_case(seed)
        auto = HeteroAuto(model, cluster, gbs, alpha=alpha, subgroup_size=4)
        try:
            result = auto.search(two_stage=True)
        except NoFeasiblePlan:
            continue
        sub = auto._split(result.stage1.dp)
        if len(sub) == len(result.stage1.groups) or len(sub) > 6:
            continue
        try:
            exact = exhaustive_search(auto, groups=sub, dps=[result.stage1.dp], max_leaves=300_000)
        except ValueError:
            continue  # too large to enumerate
        optimum = min(exact.objective, result.stage1.objective)
        assert result.objective >= optimum * (1 - 1e-9), seed
        if exact.objective < result.stage1.objective * (1 - 1e-6):
            assert result.objective < result.stage1.objective, f"seed {seed}: stage two missed an improvement"
            improved += 1
        assert result.objective == pytest.approx(optimum, rel=1e-9), seed
        gaps += 1
    assert gaps >= 5 and improved >= 1, (gaps, improved)


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
