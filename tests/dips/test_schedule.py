"""The greedy communication schedule against Appendix A's definition."""
import random

import pytest

from dips.schedule import greedy_schedule


def check_definition(worker_units, dest, steps):
    """Appendix A: steps are conflict-free, every unit goes once, each worker sends its units in
    order except where a conflict defers one, and a step is maximal: a worker left out of a step
    has no pending unit whose follower is free in that step."""
    pending = {w: list(u) for w, u in worker_units.items()}
    sent = []
    for step in steps:
        assert step, "empty step"
        assert len({f for _, _, f in step}) == len(step), f"two transfers to one follower in {step}"
        assert len({w for w, _, _ in step}) == len(step), f"a worker sends twice in {step}"
        busy = {f for _, _, f in step}
        for w, u, f in step:
            assert f == dest[u]
            # the earliest pending unit whose destination was free when this worker was visited
            earlier = pending[w][: pending[w].index(u)]
            assert all(dest[e] in busy for e in earlier), f"worker {w} skipped a sendable unit before {u}"
        active = {w for w, _, _ in step}
        for w, units in pending.items():
            if w not in active and units:
                assert all(dest[u] in busy for u in units), f"worker {w} idle although a follower was free"
        for w, u, _ in step:
            pending[w].remove(u)
            sent.append(u)
    assert sorted(sent) == sorted(u for us in worker_units.values() for u in us)
    assert not any(pending.values())


def test_hand_computed_conflict_is_deferred():
    # w0 holds units 0,1 and w1 holds 2,3; followers: 0->f0 1->f1 2->f0 3->f1
    steps = greedy_schedule({0: [0, 1], 1: [2, 3]}, [0, 1, 0, 1])
    assert steps == [[(0, 0, 0), (1, 3, 1)], [(0, 1, 1), (1, 2, 0)]]


def test_pipeline_layout_of_figure_6():
    # 8 layers over 2 PP workers and 4 followers (2 layers each): two transfers per step
    dest = [0, 0, 1, 1, 2, 2, 3, 3]
    steps = greedy_schedule({0: [0, 1, 2, 3], 1: [4, 5, 6, 7]}, dest)
    assert steps == [[(0, 0, 0), (1, 4, 2)], [(0, 1, 0), (1, 5, 2)], [(0, 2, 1), (1, 6, 3)], [(0, 3, 1), (1, 7, 3)]]


def test_step_size_is_min_of_workers_and_followers_when_layers_are_spread():
    # every worker's layers round-robin over followers: |W_t| = min(|M_t|, K)
    for m, k in [(2, 4), (4, 2), (3, 3), (5, 3)]:
        n = m * k * 2
        dest = [i % k for i in range(n)]
        wu = {w: list(range(w * n // m, (w + 1) * n // m)) for w in range(m)}
        steps = greedy_schedule(wu, dest)
        check_definition(wu, dest, steps)
        for step in steps[:-1]:
            active = sum(1 for w in wu if any(u in wu[w] for _, u, _ in step))
            assert len(step) <= min(m, k) and active == len(step)
        assert len(steps[0]) == min(m, k)


@pytest.mark.parametrize("seed", range(30))
def test_random_layouts_satisfy_definition(seed):
    rng = random.Random(seed)
    n, m, k = rng.randint(1, 24), rng.randint(1, 5), rng.randint(1, 6)
    dest = sorted(rng.randrange(k) for _ in range(n))  # contiguous ownership
    cuts = sorted(rng.sample(range(1, n), min(m - 1, n - 1))) if n > 1 else []
    bounds = [0, *cuts, n]
    wu = {w: list(range(bounds[w], bounds[w + 1])) for w in range(len(bounds) - 1)}
    check_definition(wu, dest, greedy_schedule(wu, dest))


def test_new_cluster_does_not_replan_others():
    dest = [0, 0, 1, 1]
    first = greedy_schedule({0: [0, 1, 2, 3]}, dest)
    greedy_schedule({0: [0, 1], 1: [2, 3]}, dest)  # another cluster arrives
    assert greedy_schedule({0: [0, 1, 2, 3]}, dest) == first


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="unit 5"):
        greedy_schedule({0: [5]}, [0, 1])
    with pytest.raises(ValueError, match="more than one worker"):
        greedy_schedule({0: [0], 1: [0]}, [0])


def _exhaustive_best(sizes: list[int], k: int) -> int:
    """The smallest possible largest run over every way to cut ``sizes`` into k contiguous runs."""
    import itertools

    n, best = len(sizes), None
    for cuts in itertools.combinations(range(1, n), k - 1):
        edges = (0, *cuts, n)
        worst = max(sum(sizes[a:b]) for a, b in zip(edges, edges[1:]))
        best = worst if best is None else min(best, worst)
    return best


@pytest.mark.parametrize("seed", range(40))
def test_units_balanced_by_bytes_match_exhaustive_search(seed):
    from dips.layout import ModelLayout

    rng = random.Random(seed)
    n = rng.randint(1, 9)
    # sizes as models have them: a few huge units (embedding, head) among many similar layers
    sizes = [rng.choice([rng.randint(1, 50), rng.randint(1000, 5000), rng.randint(100, 300)]) for _ in range(n)]
    k = rng.randint(1, n)
    layout = ModelLayout.of_specs([(f"u{i}.w", (s,)) for i, s in enumerate(sizes)])
    bounds = layout.partition(k)
    assert len(bounds) == k and bounds[0][0] == 0 and bounds[-1][1] == n
    assert all(a < b for a, b in bounds) and all(b == a2 for (_, b), (a2, _) in zip(bounds, bounds[1:]))
    assert max(sum(sizes[a:b]) for a, b in bounds) == _exhaustive_best(sizes, k)
