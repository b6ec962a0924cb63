"""Without a usable verbs device (any machine outside the rdma guest), dicomm must not pick
rdma: it says so once and the peers use tcp/shm; forcing rdma is a clear error."""
from __future__ import annotations

import datetime
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "comm"))
from launcher import run_ranks  # noqa: E402

from .conftest import ROOT, rdma_usable  # noqa: E402

pytestmark = pytest.mark.skipif(rdma_usable(), reason="a verbs device is usable here: the rdma tests cover it")


def _built() -> list[str]:
    out = subprocess.run([sys.executable, "-c", "import dicomm; print(','.join(dicomm.transports_built()))"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().split(",")


def test_says_why_rdma_is_off_once_in_the_debug_log() -> None:
    """Quiet by default (every process on a machine without RDMA would print it), said once
    with DICOMM_DEBUG=INFO."""
    if "rdma" not in _built():
        pytest.skip("dicomm was built without libibverbs headers: no rdma transport to fall back from")
    code = ("import dicomm\n"
            "for _ in range(3): assert 'rdma' not in dicomm.transports_usable()\n"
            "print(dicomm.transports_usable())\n")
    for debug, times in (("", 0), ("INFO", 1)):
        env = dict(os.environ, DICOMM_DEBUG=debug)
        out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                             env=env)
        assert out.returncode == 0, out.stderr
        assert out.stderr.count("rdma transport not usable") == times, (debug, out.stderr)
        assert "tcp" in out.stdout


def auto_and_forced(rank: int, world: int, port: int) -> dict:
    import torch
    import torch.distributed as dist

    dist.init_process_group("dicomm", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    transports = sorted({backend.transport_of(p) for p in range(world) if p != rank})
    t = torch.full((4,), float(rank + 1))
    dist.all_reduce(t)
    # a group that demands rdma must fail at creation, naming the transport
    import os

    os.environ["DICOMM_TRANSPORT"] = "rdma"
    try:
        dist.new_group([0, 1], backend="dicomm")
        forced = None
    except Exception as e:  # noqa: BLE001
        forced = str(e)
    dist.destroy_process_group()
    return {"transports": transports, "sum": t.tolist(), "forced": forced}


@pytest.mark.timeout(180)
def test_auto_uses_tcp_or_shm_and_forcing_rdma_fails_clearly() -> None:
    if "rdma" not in _built():
        pytest.skip("dicomm was built without libibverbs headers")
    results = run_ranks(auto_and_forced, 2, init=False)
    for r in (0, 1):
        assert results[r]["transports"] and "rdma" not in results[r]["transports"], results[r]
        assert results[r]["sum"] == [3.0] * 4
        assert results[r]["forced"] and "rdma" in results[r]["forced"] and "not usable" in results[r]["forced"], results[r]
