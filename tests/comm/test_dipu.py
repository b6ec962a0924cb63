"""dicomm on `dipu` tensors: in place (emu memory is host memory) and staged through host copies;
with the memory protected from the host (DITORCH_EMU_PROTECT_MEMORY=1), every group stages, and a
transport that touched dipu memory directly would crash. A group whose ranks run different
vendors (the native vendor over cpu beside emu: a GPU's code path beside emulated chips) trains
as one."""
from __future__ import annotations

import glob
import os

import pytest
import torch

from launcher import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.skipif(
    not glob.glob(os.path.join(ROOT, "ditorch_ext", "_C*.so")),
    reason="the dipu device layer (ditorch_ext/_C*.so) is not built",
)


def dipu_checks(rank: int, world: int, group) -> dict:
    import torch.distributed as dist

    out = {}
    base = torch.arange(6, dtype=torch.float32) + 10 * rank
    x = base.to("dipu")
    dist.all_reduce(x, group=group)
    out["allreduce"] = x.cpu()
    y = torch.empty(world * 6, device="dipu")
    dist.all_gather_into_tensor(y, base.to("dipu"), group=group)
    out["allgather"] = y.cpu()
    z = (base * 2).to("dipu")
    w = torch.empty(6, device="dipu")
    peer = 1 - rank
    reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, z, peer, group), dist.P2POp(dist.irecv, w, peer, group)])
    for r in reqs:
        r.wait()
    out["p2p"] = w.cpu()
    # a non-contiguous dipu tensor: every other column of a matrix
    m = (torch.arange(12, dtype=torch.float32).view(3, 4) + rank).to("dipu")
    dist.all_reduce(m[:, ::2], group=group)
    out["strided"] = m.cpu()
    return out


def on_dipu(rank: int, world: int, _port: int) -> dict:
    import ditorch  # noqa: F401  (the dipu device, and dicomm as dipu's default backend)
    import torch.distributed as dist

    assert dist.Backend.default_device_backend_map.get("dipu") == "dicomm"
    res = {"host_addressable": bool(torch.dipu.is_host_addressable())}
    res["in_place"] = dipu_checks(rank, world, None)
    # a group created with staging forced: the path of a vendor whose memory the host can't address
    os.environ["DICOMM_FORCE_STAGING"] = "1"
    staged = dist.new_group([0, 1], backend="cpu:gloo,dipu:dicomm")
    res["staged"] = dipu_checks(rank, world, staged)
    # split_group (needs the default group bound to an accelerator: dipu here)
    sg = dist.split_group(split_ranks=[[0], [1]])
    t = torch.tensor([rank + 5.0], device="dipu")
    dist.all_reduce(t, group=sg)
    res["split"] = t.item()
    return res


@pytest.mark.timeout(120)
@pytest.mark.parametrize("protect", ["0", "1"])
def test_dipu_tensors_in_place_and_staged(protect):
    world = 2
    res = run_ranks(on_dipu, world, env={"TEST_BACKEND": "cpu:gloo,dipu:dicomm", "TEST_IMPORT_DITORCH": "1",
                                          "TEST_DEVICE_ID": "dipu:0", "DITORCH_EMU_PROTECT_MEMORY": protect})
    bases = [torch.arange(6, dtype=torch.float32) + 10 * r for r in range(world)]
    for r in range(world):
        assert res[r]["host_addressable"] == (protect == "0")
        for mode in ("in_place", "staged"):
            out = res[r][mode]
            torch.testing.assert_close(out["allreduce"], sum(bases), msg=mode)
            torch.testing.assert_close(out["allgather"], torch.cat(bases), msg=mode)
            torch.testing.assert_close(out["p2p"], bases[1 - r] * 2, msg=mode)
            m = torch.arange(12, dtype=torch.float32).view(3, 4) + r
            expect = m.clone()
            expect[:, ::2] = sum(torch.arange(12, dtype=torch.float32).view(3, 4)[:, ::2] + q for q in range(world))
            torch.testing.assert_close(out["strided"], expect, msg=mode)
        assert res[r]["split"] == r + 5.0  # a group of one: its own value


def mixed_vendor_checks(rank: int, world: int, _port: int) -> dict:
    import ditorch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    res = {"vendor": ditorch.vendor_name(), "host_addressable": bool(torch.dipu.is_host_addressable())}
    res["ops"] = dipu_checks(rank, world, None)
    b = torch.full((4,), float(rank + 1), device="dipu")
    dist.broadcast(b, src=1)
    res["broadcast"] = b.cpu()
    out = torch.empty(3, device="dipu")
    dist.reduce_scatter_tensor(out, (torch.arange(6, dtype=torch.float32) * (rank + 1)).to("dipu"))
    res["reduce_scatter"] = out.cpu()
    # One DDP step: the model is the same on both ranks, each rank its own batch.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    ddp = DistributedDataParallel(model.to("dipu"))
    batch = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    ddp(batch.to("dipu")).pow(2).mean().backward()
    res["grads"] = [p.grad.cpu() for p in ddp.module.parameters()]
    return res


@pytest.mark.timeout(150)
def test_a_group_of_two_vendors_trains_as_one():
    """Rank 0 runs the native vendor over cpu (device memory the host may not address: every
    tensor staged through pinned host copies, ordered by stream events), rank 1 emu (in place)."""
    world = 2
    res = run_ranks(mixed_vendor_checks, world, env={"TEST_BACKEND": "cpu:gloo,dipu:dicomm", "TEST_IMPORT_DITORCH": "1",
                                                     "TEST_DEVICE_ID": "dipu:0"},
                    rank_env={0: {"DITORCH_VENDOR": "cpu"}, 1: {"DITORCH_VENDOR": "emu"}})
    assert [(res[r]["vendor"], res[r]["host_addressable"]) for r in range(world)] == [("cpu", False), ("emu", True)]
    bases = [torch.arange(6, dtype=torch.float32) + 10 * r for r in range(world)]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    for r in range(world):
        model(torch.randn(4, 8, generator=torch.Generator().manual_seed(r))).pow(2).mean().backward()
    mean_grads = [p.grad / world for p in model.parameters()]  # DDP averages over the ranks
    full = sum(torch.arange(6, dtype=torch.float32) * (q + 1) for q in range(world))
    for r in range(world):
        out = res[r]["ops"]
        torch.testing.assert_close(out["allreduce"], sum(bases))
        torch.testing.assert_close(out["allgather"], torch.cat(bases))
        torch.testing.assert_close(out["p2p"], bases[1 - r] * 2)
        torch.testing.assert_close(res[r]["broadcast"], torch.full((4,), 2.0))
        torch.testing.assert_close(res[r]["reduce_scatter"], full[3 * r:3 * r + 3])
        for got, want in zip(res[r]["grads"], mean_grads):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
