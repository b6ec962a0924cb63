"""The allreduce of a group on one host through one shared-memory segment (SharedSegment.h):
results against a CPU reduction of every rank's input, on sizes spanning several rounds; the
same bits on every rank; refusals and failures named; nothing left in /dev/shm."""
from __future__ import annotations

import glob
import os
import random
import time

import pytest
import torch

from emulated_hosts import can_make_hosts, emulated_hosts
from launcher import error_of, run_ranks

CHUNK = 1 << 20  # SharedSegment::kChunkBytes
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int32, torch.int64, torch.uint8]


def cases(seed: int, count: int) -> list[tuple[int, torch.dtype, str]]:
    """Random (numel, dtype, op): sizes from 0 to a few rounds of the segment, on and off the
    round and part boundaries."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        dtype = rng.choice(DTYPES)
        per_round = CHUNK // torch.tensor([], dtype=dtype).element_size()
        numel = rng.choice([0, 1, 2, 3, rng.randrange(4, 5000), per_round - 1, per_round, per_round + 1,
                            rng.randrange(per_round, 3 * per_round + 7)])
        ops = ["sum", "max", "min"] + (["avg"] if dtype.is_floating_point else ["band", "bxor"])
        out.append((numel, dtype, rng.choice(ops)))
    return out


def rank_input(seed: int, rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    if dtype.is_floating_point:
        return torch.randn(numel, generator=g).to(dtype)
    hi = 256 if dtype == torch.uint8 else 1000
    return torch.randint(0, hi, (numel,), generator=g, dtype=torch.int64).to(dtype)


def reference(inputs: list[torch.Tensor], op: str) -> torch.Tensor:
    """The reduction computed on the CPU in float64 (or int64) from every rank's input."""
    dtype = inputs[0].dtype
    wide = torch.stack([t.to(torch.float64 if dtype.is_floating_point else torch.int64) for t in inputs])
    if op == "sum":
        out = wide.sum(0)
    elif op == "avg":
        out = wide.mean(0)
    elif op == "max":
        out = wide.max(0).values
    elif op == "min":
        out = wide.min(0).values
    else:
        out = wide[0].clone()
        for t in wide[1:]:
            out = out & t if op == "band" else out ^ t
    if dtype == torch.uint8 and op == "sum":
        out = out % 256
    return out.to(dtype)


def reduce_cases(rank: int, world: int, _port: int) -> dict:
    import torch.distributed as dist
    from torch.distributed import ReduceOp

    ops = {"sum": ReduceOp.SUM, "avg": ReduceOp.AVG, "max": ReduceOp.MAX, "min": ReduceOp.MIN,
           "band": ReduceOp.BAND, "bxor": ReduceOp.BXOR}
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    wrong, checked = [], 0
    for i, (numel, dtype, op) in enumerate(cases(world, 40)):
        inputs = [rank_input(i, r, numel, dtype) for r in range(world)]
        t = inputs[rank].clone()
        dist.all_reduce(t, op=ops[op])
        want = reference(inputs, op)
        tol = {torch.bfloat16: 3e-2, torch.float16: 3e-3, torch.float32: 1e-5, torch.float64: 1e-12}.get(dtype, 0)
        if not torch.allclose(t.double(), want.double(), rtol=tol, atol=tol * world):
            wrong.append(f"{op} {numel} x {dtype}")
        # every rank holds the same bits: gather rank 0's result and compare exactly
        mine = t.view(torch.uint8) if t.numel() else t
        theirs = mine.clone()
        dist.broadcast(theirs, src=0)
        if not torch.equal(mine, theirs):
            wrong.append(f"{op} {numel} x {dtype}: differs from rank 0's bits")
        checked += 1
    return {"algorithm": backend.allreduce_algorithm, "members": backend.host_segment_members, "wrong": wrong,
            "checked": checked, "left": glob.glob("/dev/shm/dicomm-*")}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [2, 3])
def test_shared_allreduce_matches_a_cpu_reduction(world):
    results = run_ranks(reduce_cases, world)
    for r, out in results.items():
        assert out["algorithm"] == "shared", (r, out)
        assert out["members"] == list(range(world)), (r, out["members"])
        assert out["checked"] == 40 and out["wrong"] == [], (r, out["wrong"])
        assert out["left"] == [], f"segment files left in /dev/shm: {out['left']}"


@pytest.mark.timeout(300)
@pytest.mark.skipif(can_make_hosts() is not None, reason=str(can_make_hosts()))
def test_two_level_allreduce_reduces_within_each_host_through_its_segment():
    """Two emulated hosts x two ranks, two levels forced: each host's ranks reduce-scatter and
    allgather through their own segment, the rails cross over tcp; the same random cases
    against the CPU reduction, the same bits everywhere."""
    with emulated_hosts(2) as hosts:
        results = run_ranks(reduce_cases, 4, env={"DICOMM_ALLREDUCE": "hierarchical"}, hosts=hosts)
    for r, out in results.items():
        assert out["algorithm"] == "hierarchical", (r, out)
        assert out["members"] == ([0, 1] if r < 2 else [2, 3]), (r, out["members"])
        assert out["checked"] == 40 and out["wrong"] == [], (r, out["wrong"])
        assert out["left"] == [], f"segment files left in /dev/shm: {out['left']}"


def _algorithm(rank: int, world: int, _port: int) -> str:
    import torch.distributed as dist

    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    assert t.item() == world * (world + 1) / 2
    return dist.group.WORLD._get_backend(torch.device("cpu")).allreduce_algorithm


def test_a_group_over_tcp_keeps_the_ring_even_when_shared_is_forced():
    out = run_ranks(_algorithm, 2, env={"DICOMM_TRANSPORT": "tcp", "DICOMM_ALLREDUCE": "shared"})
    assert set(out.values()) == {"ring"}, out


def late_rank(rank: int, world: int, _port: int) -> dict:
    import torch.distributed as dist

    dist.all_reduce(torch.ones(8))  # the segment is connected
    if rank == 1:
        time.sleep(6)  # past rank 0's op timeout
        return {}
    t0 = time.monotonic()
    error = error_of(dist.all_reduce, torch.ones(CHUNK))
    return {"error": error, "elapsed": time.monotonic() - t0}


@pytest.mark.timeout(90)
def test_a_rank_that_does_not_come_times_out_naming_it():
    out = run_ranks(late_rank, 2, op_timeout_s=2)[0]
    assert out["error"] and "rank 1" in out["error"] and "timed out" in out["error"], out
    assert 1.5 < out["elapsed"] < 5, out


def dies_in_segment(rank: int, world: int, _port: int) -> dict:
    import torch.distributed as dist

    dist.all_reduce(torch.ones(8))
    if rank == 2:
        time.sleep(0.5)
        os._exit(3)
    t0 = time.monotonic()
    error = error_of(dist.all_reduce, torch.ones(3 * CHUNK))
    return {"error": error, "elapsed": time.monotonic() - t0}


@pytest.mark.timeout(90)
def test_a_rank_that_dies_fails_the_others_naming_it():
    results = run_ranks(dies_in_segment, 3, op_timeout_s=60, expect_exit={2})
    for r in (0, 1):
        out = results[r]
        assert out["error"] and "rank 2" in out["error"], out
        assert out["elapsed"] < 15, out  # detected through the broken pair, not the 60 s timeout
