"""The rdma transport driven directly (no backend), through tests/comm_rdma/transport_check.cpp:
data checked byte by byte against an independently computed pattern. Runs inside the rdma
guest; scripts/rdma_vm/run_tests.sh builds the program on the host first."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "comm"))
from diutil.address import free_port  # noqa: E402

from .conftest import check_binary, rdma_usable  # noqa: E402

pytestmark = [
    pytest.mark.rdma,
    pytest.mark.skipif(not rdma_usable(), reason="needs a usable verbs device (run scripts/rdma_vm/run_tests.sh)"),
    pytest.mark.skipif(check_binary() is None, reason="build it first: tests/comm_rdma/build_transport_check.sh"),
]


def run_check(mode: str, world: int, transport: str = "rdma", timeout: float = 300) -> list[str]:
    port = free_port()
    procs = [subprocess.Popen([str(check_binary()), transport, str(r), str(world), str(port), mode],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    victim = world - 1 if mode == "die" else None
    for r, (p, out) in enumerate(zip(procs, outs)):
        if r != victim:
            assert p.returncode == 0, f"rank {r} exit {p.returncode}:\n{out}"
    return outs


@pytest.mark.timeout(400)
def test_registration_cache_survives_address_reuse() -> None:
    """Tensors freed and reallocated at the same addresses between sends: a registration kept
    for the old pages would move stale bytes; every round's data is checked."""
    outs = run_check("reuse", 2)
    assert all("ok" in o for o in outs), outs


@pytest.mark.timeout(400)
def test_many_outstanding_at_transport_level_4_ranks() -> None:
    outs = run_check("many", 4)
    assert all("ok" in o for o in outs), outs


@pytest.mark.timeout(200)
def test_dead_peer_at_transport_level() -> None:
    outs = run_check("die", 2)
    assert "retry counter exceeded" in outs[0] and "rank 1" in outs[0], outs[0]
