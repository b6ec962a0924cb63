"""dicomm on `dipu` tensors: in place (emu memory is host memory) and staged through host copies."""
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


def on_dipu(rank: int, world: int, _port: int) -> dict:
    import ditorch  # noqa: F401  (the dipu device, and dicomm as dipu's default backend)
    import torch.distributed as dist

    assert dist.Backend.default_device_backend_map.get("dipu") == "dicomm"
    out = {"host_addressable": bool(torch.dipu.is_host_addressable())}
    base = torch.arange(6, dtype=torch.float32) + 10 * rank
    x = base.to("dipu")
    dist.all_reduce(x)
    out["allreduce"] = x.cpu()
    y = torch.empty(world * 6, device="dipu")
    dist.all_gather_into_tensor(y, base.to("dipu"))
    out["allgather"] = y.cpu()
    z = (base * 2).to("dipu")
    w = torch.empty(6, device="dipu")
    peer = 1 - rank
    reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, z, peer), dist.P2POp(dist.irecv, w, peer)])
    for r in reqs:
        r.wait()
    out["p2p"] = w.cpu()
    # a non-contiguous dipu tensor: every other column of a matrix
    m = (torch.arange(12, dtype=torch.float32).view(3, 4) + rank).to("dipu")
    col = m[:, ::2]
    dist.all_reduce(col)
    out["strided"] = m.cpu()
    # split_group (needs the default group bound to an accelerator: dipu here)
    sg = dist.split_group(split_ranks=[[0], [1]])
    t = torch.tensor([rank + 5.0], device="dipu")
    dist.all_reduce(t, group=sg)
    out["split"] = t.item()
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("staging", ["0", "1"])
def test_dipu_tensors(staging):
    world = 2
    res = run_ranks(on_dipu, world, env={"DICOMM_FORCE_STAGING": staging, "TEST_BACKEND": "cpu:gloo,dipu:dicomm",
                                          "TEST_IMPORT_DITORCH": "1", "TEST_DEVICE_ID": "dipu:0"})
    bases = [torch.arange(6, dtype=torch.float32) + 10 * r for r in range(world)]
    for r in range(world):
        torch.testing.assert_close(res[r]["allreduce"], sum(bases))
        torch.testing.assert_close(res[r]["allgather"], torch.cat(bases))
        torch.testing.assert_close(res[r]["p2p"], bases[1 - r] * 2)
        m = torch.arange(12, dtype=torch.float32).view(3, 4) + r
        expect = m.clone()
        expect[:, ::2] = sum(torch.arange(12, dtype=torch.float32).view(3, 4)[:, ::2] + q for q in range(world))
        torch.testing.assert_close(res[r]["strided"], expect)
        assert res[r]["split"] == r + 5.0  # a group of one: its own value
