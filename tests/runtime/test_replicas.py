"""heteropp/runtime/replicas.py: the digests that compare DP replicas tell apart any change of
a parameter's values, shape or dtype, and name exactly the parameters that differ. (The check
across processes runs in test_ps_pipeline's and test_exactness's DP 2 cases.)"""
from __future__ import annotations

import random

import torch

from heteropp.runtime.replicas import diverged, parameter_digests


INT_OF_SIZE = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def _params(rng: random.Random) -> list[tuple[str, torch.Tensor]]:
    shapes = [(), (1,), (3,), (2, 5), (4, 1, 3)]
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    return [(f"p{i}", torch.randn(rng.choice(shapes), generator=g).to(rng.choice(dtypes))) for i in range(8)]


def test_equal_tensors_have_equal_digests_and_any_one_ulp_change_is_seen():
    rng = random.Random(0)
    for _ in range(50):
        named = _params(rng)
        copy = [(n, t.clone()) for n, t in named]
        assert torch.equal(parameter_digests(named), parameter_digests(copy))
        i = rng.randrange(len(named))
        bits = copy[i][1].reshape(-1).view(INT_OF_SIZE[copy[i][1].element_size()])
        bits[rng.randrange(bits.numel())] ^= 1  # one unit in the last place
        assert diverged([n for n, _ in named], [parameter_digests(named), parameter_digests(copy)]) == [named[i][0]]


def test_same_bytes_in_another_shape_or_dtype_differ():
    t = torch.arange(6, dtype=torch.float32)
    as_int = t.view(torch.int32)
    assert parameter_digests([("a", t)])[0] != parameter_digests([("a", t.reshape(2, 3))])[0]
    assert parameter_digests([("a", t)])[0] != parameter_digests([("a", as_int)])[0]


def test_diverged_names_every_parameter_that_differs_on_any_replica():
    names = ["a", "b", "c", "d"]
    same = torch.tensor([1, 2, 3, 4])
    assert diverged(names, [same, same.clone(), same.clone()]) == []
    assert diverged(names, [same, torch.tensor([1, 9, 3, 4]), torch.tensor([1, 2, 3, 7])]) == ["b", "d"]
