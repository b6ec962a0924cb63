"""DiComm over the `rdma` transport on a real verbs device (run inside the qemu soft-RoCE
guest: scripts/rdma_vm/run_tests.sh). Reuses the DiComm suite's collective checks (every op and
dtype against torch reductions) with DICOMM_TRANSPORT=rdma, and adds point-to-point messages from
1 B to 64 MiB, many outstanding messages, dipu tensors, and a peer that dies.
Outside the guest these tests skip; test_fallback.py covers that side."""
from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "comm"))  # the DiComm suite's helpers
from launcher import run_ranks  # noqa: E402
from test_collectives import check_all  # noqa: E402

from .conftest import rdma_usable  # noqa: E402

pytestmark = [
    pytest.mark.rdma,
    pytest.mark.skipif(not rdma_usable(), reason="needs a usable verbs device (run scripts/rdma_vm/run_tests.sh)"),
]

RDMA = {"DICOMM_TRANSPORT": "rdma"}


PERIOD = 65521  # prime: a piece landing at any chunk-sized (power-of-two) offset shows


def pattern(numel: int, seed: int) -> torch.Tensor:
    """Bytes that differ per seed and repeat only every PERIOD bytes. The period is computed
    once and tiled, so 64 MiB costs a copy rather than int64 arithmetic over 512 MiB (seconds
    under the guest's TCG)."""
    i = torch.arange(min(numel, PERIOD), dtype=torch.int64)
    period = ((i * 13 + (i >> 11) + seed * 31) % 251).to(torch.uint8)
    return period.repeat(-(-numel // PERIOD))[:numel].contiguous() if numel > PERIOD else period


P2P_SIZES = [1, 7, 4096, 32 << 10, (32 << 10) + 1, 1 << 20, 64 << 20]


def p2p_sizes(rank: int, world: int, _port: int) -> dict:
    """In each pair (0, 1), (2, 3), ... at once, the even rank sends each size to the odd one,
    which checks it and answers with its own pattern."""
    import torch.distributed as dist

    bad = []
    peer = rank ^ 1
    for k, n in enumerate(P2P_SIZES):
        if rank % 2 == 0:
            dist.send(pattern(n, k + rank), dst=peer)
            back = torch.empty(n, dtype=torch.uint8)
            dist.recv(back, src=peer)
            if not torch.equal(back, pattern(n, 100 + k + peer)):
                bad.append(("echo", n))
        else:
            got = torch.empty(n, dtype=torch.uint8)
            dist.recv(got, src=peer)
            want = pattern(n, k + peer)
            if not torch.equal(got, want):
                bad.append(("recv", n, int((got != want).nonzero()[0])))
            dist.send(pattern(n, 100 + k + rank), dst=peer)
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    return {"bad": bad, "transports": sorted({backend.transport_of(p) for p in range(world) if p != rank})}


MANY_SIZES = [1, 100, 4000, 32 << 10, 40000, 300000]


def many_outstanding(rank: int, world: int, _port: int) -> dict:
    """Every rank posts 150 isends to and 150 irecvs from every other rank before waiting."""
    import torch.distributed as dist

    count = 150
    sends, recvs, reqs = [], {}, []
    for m in range(count):
        for p in range(world):
            if p == rank:
                continue
            n = MANY_SIZES[(m + rank + p) % len(MANY_SIZES)]
            t = pattern(n, 1000 * rank + 10 * p + m)
            sends.append(t)
            reqs.append(dist.isend(t, dst=p, tag=m))
            r = torch.empty(n, dtype=torch.uint8)
            recvs[(p, m)] = r
            reqs.append(dist.irecv(r, src=p, tag=m))
    for q in reqs:
        q.wait()
    bad = [(p, m) for (p, m), r in recvs.items() if not torch.equal(r, pattern(r.numel(), 1000 * p + 10 * rank + m))]
    return {"bad": bad, "messages": len(recvs)}


def peer_dies(rank: int, world: int) -> dict:
    """The last rank exits without a word; the others' pending and later ops must fail fast."""
    import os

    import torch.distributed as dist

    dist.barrier()
    victim = world - 1
    if rank == victim:
        time.sleep(1.0)
        os._exit(3)
    t0 = time.monotonic()
    try:
        if rank == 0:
            dist.recv(torch.empty(4), src=victim)
        else:
            dist.all_reduce(torch.ones(1000))
        err = None
    except Exception as e:  # noqa: BLE001
        err = str(e)
    elapsed = time.monotonic() - t0
    try:
        dist.all_reduce(torch.ones(1))
        later = None
    except Exception as e:  # noqa: BLE001
        later = str(e)
    dist.destroy_process_group()
    return {"error": err, "elapsed": elapsed, "later": later}


def dipu_over_rdma(rank: int) -> dict:
    """dipu tensors on the emu vendor are host memory: the NIC writes straight into them."""
    import ditorch  # noqa: F401
    import torch.distributed as dist

    x = (torch.arange(1 << 18, dtype=torch.float32) + rank).to("dipu")  # 1 MiB: rendezvous path
    dist.all_reduce(x)
    y = torch.empty(1 << 18, device="dipu")
    peer = rank ^ 1
    reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, (x * (rank + 2)).contiguous(), peer),
                                   dist.P2POp(dist.irecv, y, peer)])
    for r in reqs:
        r.wait()
    return {"allreduce": x.cpu(), "p2p": y.cpu(), "host_addressable": bool(torch.dipu.is_host_addressable())}


def progress(rank: int, what: str, t0: float) -> None:
    """The guest is slow (TCG): say what each rank is doing, so a stuck step shows."""
    print(f"[rank {rank} +{time.monotonic() - t0:6.1f}s] {what}", file=sys.stderr, flush=True)


def suite(rank: int, world: int, port: int) -> dict:
    """One job: spawning ranks and importing torch (~45 s under TCG) dominates, so one set of
    ranks runs every check: collectives, many outstanding, p2p 1 B..64 MiB in pairs, dipu
    tensors, and last a peer that dies."""
    t0 = time.monotonic()
    out = {}
    progress(rank, "collectives", t0)
    out["collectives"] = check_all(rank, world, port)
    progress(rank, "many outstanding", t0)
    out["many"] = many_outstanding(rank, world, port)
    progress(rank, "p2p sizes", t0)
    out["p2p"] = p2p_sizes(rank, world, port)
    progress(rank, "dipu tensors", t0)
    out["dipu"] = dipu_over_rdma(rank)
    progress(rank, "peer dies", t0)
    out["dies"] = peer_dies(rank, world)
    progress(rank, "done", t0)
    return out


@pytest.mark.timeout(1500)
def test_dicomm_suite_over_rdma() -> None:
    """4 ranks: every op and dtype (the DiComm suite's check_all), 150 outstanding messages per
    peer, point-to-point messages from 1 B to 64 MiB in two pairs at once, dipu tensors, and
    last a peer that dies. All data checked."""
    import glob

    if not glob.glob(str(Path(__file__).resolve().parents[2] / "ditorch_ext" / "_C*.so")):
        pytest.fail("the dipu device layer is not built (scripts/setup_env.sh builds it)")
    world = 4
    # TEST_IMPORT_DITORCH: the dipu device, so dicomm serves its tensors too
    env = {**RDMA, "DICOMM_CHUNK_BYTES": "65536", "TEST_IMPORT_DITORCH": "1"}
    results = run_ranks(suite, world, env=env, op_timeout_s=300, wall_timeout_s=1400, expect_exit={world - 1})
    survivors = range(world - 1)  # the last rank exits in peer_dies, unreported
    assert set(results) >= set(survivors)
    total = sum(torch.arange(1 << 18, dtype=torch.float32) + r for r in range(world))
    for r in survivors:
        out = results[r]
        assert out["collectives"]["transports"] == ["rdma"], (r, out["collectives"])
        assert out["collectives"]["checks"] > 300, (r, out["collectives"])
        assert out["many"]["bad"] == [] and out["many"]["messages"] == 150 * (world - 1), (r, out["many"])
        assert out["p2p"]["bad"] == [] and out["p2p"]["transports"] == ["rdma"], (r, out["p2p"])
        torch.testing.assert_close(out["dipu"]["allreduce"], total)
        torch.testing.assert_close(out["dipu"]["p2p"], total * ((r ^ 1) + 2))
        assert out["dipu"]["host_addressable"], (r, out["dipu"])
    dies = {r: results[r]["dies"] for r in survivors}
    assert dies[0]["error"] and "recv from rank 3" in dies[0]["error"] and "rdma" in dies[0]["error"], dies[0]
    for r in (1, 2):
        assert dies[r]["error"] and "allreduce" in dies[r]["error"] and "rank 3" in dies[r]["error"], dies[r]
    for r, d in dies.items():
        # detected by the transport (retry exceeded), long before the 300 s op timeout
        assert d["elapsed"] < 60, (r, d)
        assert d["later"] and "rank 3" in d["later"], (r, d)
