"""DTensor's random ops on dipu are sharding-invariant: under torch's OffsetBasedRNGTracker, a
DTensor drawn with torch.distributed.tensor.rand/randn or filled by torch.nn.init has the full
value one process draws with the same ops on a plain dipu tensor, whether it is replicated or
sharded 2 or 4 ways, on a 1-D or a 2-D mesh (either mesh dim); and every rank's generator leaves
at the same state. (A dim sharded over two mesh dims is not: torch's tracker sizes each mesh
dim's shard from the whole dim, `_calc_first_shard_size`, so its offsets overlap, on CUDA too.)

The tracker starts a shard's draw at its shard index times the local size; dipu's counter-based
generator (tests/device/test_random.py) gives element i of a draw the value of counter offset + i,
so a Shard(0) shard is the full tensor's run of rows. A Shard(1) shard is the same row-major run
(the tracker's offsets know nothing of columns), laid out in the shard's own shape.
"""
from __future__ import annotations

import pytest
import torch

from launcher import run_ranks

SHAPE = (16, 8)  # local sizes 128, 64, 32: multiples of 4, as the tracker's offsets are


def draws(make):
    """The random ops a model's initialisation makes, each on a tensor `make()` gives."""
    out = []
    for fill in (lambda t: t.uniform_(-1, 1), lambda t: t.normal_(0, 2),
                 lambda t: torch.nn.init.trunc_normal_(t, std=0.02),
                 lambda t: torch.nn.init.kaiming_uniform_(t, a=5 ** 0.5),
                 lambda t: torch.nn.init.xavier_normal_(t)):
        t = make()
        fill(t)
        out.append(t)
    return out


def on_ranks(rank: int, world: int, _port: int) -> dict:
    import torch.distributed.tensor as dtensor
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    line = init_device_mesh("dipu", (world,))
    square = init_device_mesh("dipu", (2, 2))
    layouts = {"replicated": (line, [Replicate()]), "4 shards": (line, [Shard(0)]),
               "2 shards, replicated": (square, [Replicate(), Shard(0)]),
               "2 shards on the outer mesh dim": (square, [Shard(0), Replicate()])}
    res = {}
    for name, (mesh, placements) in layouts.items():
        torch.manual_seed(7)
        made = [dtensor.rand(SHAPE, device_mesh=mesh, placements=placements),
                dtensor.randn(SHAPE, device_mesh=mesh, placements=placements)]
        made += draws(lambda: dtensor.empty(SHAPE, device_mesh=mesh, placements=placements))
        res[name] = [t.full_tensor().cpu() for t in made]
        res[name + " state"] = torch.dipu.get_rng_state()
    torch.manual_seed(7)
    local = dtensor.rand(SHAPE, device_mesh=line, placements=[Shard(1)]).to_local()
    res["shard(1) local"] = local.cpu()
    res["one process"] = one_process()
    return res


def one_process() -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """The same ops on plain dipu tensors in this process (the 1-rank run)."""
    torch.manual_seed(7)
    full = [torch.rand(SHAPE, device="dipu"), torch.randn(SHAPE, device="dipu")]
    full += draws(lambda: torch.empty(SHAPE, device="dipu"))
    state = torch.dipu.get_rng_state()
    torch.manual_seed(7)
    flat = torch.rand(SHAPE[0] * SHAPE[1], device="dipu")
    return [t.cpu() for t in full], state, flat.cpu()


@pytest.mark.timeout(150)
def test_dtensor_draws_are_the_same_on_1_2_and_4_ranks():
    world = 4
    res = run_ranks(on_ranks, world, env={"TEST_BACKEND": "cpu:gloo,dipu:dicomm", "TEST_IMPORT_DITORCH": "1",
                                          "TEST_DEVICE_ID": "dipu:0"})
    full, state, flat = res[0]["one process"]
    assert not torch.equal(full[0], full[1])
    for r in range(world):
        for got, want in zip(res[r]["one process"][0], full):
            assert torch.equal(got, want), r
        for name in ("replicated", "4 shards", "2 shards, replicated", "2 shards on the outer mesh dim"):
            for k, (got, want) in enumerate(zip(res[r][name], full)):
                assert torch.equal(got, want), (r, name, k)
            assert torch.equal(res[r][name + " state"], state), (r, name)
        local = SHAPE[0] * SHAPE[1] // world
        assert torch.equal(res[r]["shard(1) local"].flatten(), flat[r * local:(r + 1) * local]), r
