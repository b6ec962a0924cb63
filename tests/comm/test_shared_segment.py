"""The allreduce of a group on one host through one shared-memory segment (SharedSegment.h):
results against a CPU reduction of every rank's input, on sizes spanning several rounds; the
same bits on every rank; refusals and failures named; nothing left in /dev/shm."""
from __future__ import annotations

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


def segments_of_this_process() -> dict:
    """The shared segments this process maps (/proc/self/maps), and those whose file is still in
    /dev/shm: an unlinked one shows as "(deleted)". Only this process's own: other tests' groups
    (another xdist worker) may hold a file of theirs in /dev/shm at any moment."""
    mapped, left = set(), set()
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(None, 5)
            if len(fields) == 6 and fields[5].startswith("/dev/shm/dicomm-"):
                path = fields[5].strip()
                mapped.add(path)
                if not path.endswith("(deleted)"):
                    left.add(path)
    return {"mapped": len(mapped), "left": sorted(left)}


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
            "checked": checked, **segments_of_this_process()}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [2, 3])
def test_shared_allreduce_matches_a_cpu_reduction(world):
    results = run_ranks(reduce_cases, world)
    for r, out in results.items():
        assert out["algorithm"] == "shared", (r, out)
        assert out["members"] == list(range(world)), (r, out["members"])
        assert out["checked"] == 40 and out["wrong"] == [], (r, out["wrong"])
        assert out["mapped"] == 1 and out["left"] == [], f"segment files left in /dev/shm: {out['left']}"


def scatter_gather_cases(rank: int, world: int, _port: int) -> dict:
    """reduce_scatter_tensor / reduce_scatter and all_gather_into_tensor / all_gather on random
    cases, against the CPU reduction of every rank's input and the concatenation of every
    rank's piece."""
    import torch.distributed as dist
    from torch.distributed import ReduceOp

    ops = {"sum": ReduceOp.SUM, "avg": ReduceOp.AVG, "max": ReduceOp.MAX, "min": ReduceOp.MIN,
           "band": ReduceOp.BAND, "bxor": ReduceOp.BXOR}
    tols = {torch.bfloat16: 3e-2, torch.float16: 3e-3, torch.float32: 1e-5, torch.float64: 1e-12}
    wrong = []
    for i, (numel, dtype, op) in enumerate(cases(world + 100, 30)):
        m = numel // world  # each rank's piece
        inputs = [rank_input(i, r, m * world, dtype) for r in range(world)]
        want = reference(inputs, op)[rank * m:(rank + 1) * m]
        tol = tols.get(dtype, 0)
        got = torch.empty(m, dtype=dtype)
        dist.reduce_scatter_tensor(got, inputs[rank].clone(), op=ops[op])
        if not torch.allclose(got.double(), want.double(), rtol=tol, atol=tol * world):
            wrong.append(f"reduce_scatter_tensor {op} {m} x {dtype}")
        # In place (the output is the rank's own part of the input, as NCCL defines it), and on
        # rank 1 an output one element past its part, overlapping input not yet read: torch
        # allows both.
        shift = 1 if rank == 1 and m else 0
        for name, start in (("in place", rank * m), ("one element past its part", rank * m + shift)):
            buf = inputs[rank].clone()
            aliased = buf[start:start + m]
            dist.reduce_scatter_tensor(aliased, buf, op=ops[op])
            if not torch.allclose(aliased.double(), want.double(), rtol=tol, atol=tol * world):
                wrong.append(f"reduce_scatter_tensor {name} {op} {m} x {dtype}")
        listed = torch.empty(m, dtype=dtype)
        dist.reduce_scatter(listed, list(inputs[rank].clone().split(m) if m else [inputs[rank]] * world), op=ops[op])
        if not torch.allclose(listed.double(), want.double(), rtol=tol, atol=tol * world):
            wrong.append(f"reduce_scatter {op} {m} x {dtype}")
        pieces = [rank_input(i + 1000, r, m, dtype) for r in range(world)]
        gathered = torch.empty(m * world, dtype=dtype)
        dist.all_gather_into_tensor(gathered, pieces[rank])
        if not torch.equal(gathered, torch.cat(pieces)):
            wrong.append(f"all_gather_into_tensor {m} x {dtype}")
        outs = [torch.empty(m, dtype=dtype) for _ in range(world)]
        dist.all_gather(outs, pieces[rank])
        if not all(torch.equal(o, p) for o, p in zip(outs, pieces)):
            wrong.append(f"all_gather {m} x {dtype}")
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    return {"members": backend.host_segment_members, "wrong": wrong, **segments_of_this_process()}


@pytest.mark.timeout(240)
def test_reduce_scatter_and_allgather_on_one_host_go_through_the_segment():
    results = run_ranks(scatter_gather_cases, 3)
    for r, out in results.items():
        assert out["members"] == [0, 1, 2], (r, out["members"])
        assert out["wrong"] == [], (r, out["wrong"])
        assert out["mapped"] == 1 and out["left"] == [], f"segment files left in /dev/shm: {out['left']}"


def cut_differently(rank: int, world: int, _port: int) -> dict:
    """An all_gather whose ranks give the same total cut differently (rank 0 expects 2 + 3
    elements, rank 1 3 + 2): refused on both, naming the other rank's request."""
    import torch.distributed as dist

    dist.all_reduce(torch.ones(8))  # the segment is connected
    sizes = [[2, 3], [3, 2]][rank]
    outs = [torch.empty(k) for k in sizes]
    return {"error": error_of(dist.all_gather, outs, torch.ones(sizes[rank]))}


@pytest.mark.timeout(90)
def test_an_allgather_cut_differently_on_two_ranks_is_refused():
    results = run_ranks(cut_differently, 2, op_timeout_s=10)
    for r, out in results.items():
        assert out["error"] and "mismatch" in out["error"] and f"rank {1 - r}" in out["error"], (r, out)


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
        assert out["mapped"] == 1 and out["left"] == [], f"segment files left in /dev/shm: {out['left']}"


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


def leaves_in_segment(rank: int, world: int, _port: int) -> dict:
    import torch.distributed as dist

    dist.all_reduce(torch.ones(8))
    if rank == 2:
        time.sleep(0.5)
        dist.destroy_process_group()  # a clean leave: its pairs close with a goodbye, none breaks
        return {}
    t0 = time.monotonic()
    out = torch.empty(world * 3 * CHUNK)
    error = error_of(dist.all_gather_into_tensor, out, torch.ones(3 * CHUNK))
    return {"error": error, "elapsed": time.monotonic() - t0}


@pytest.mark.timeout(90)
def test_a_rank_that_leaves_cleanly_fails_the_others_waits_naming_it():
    """A member that shuts its group down breaks no pair, so nothing closes the others'
    communicators: their wait in the segment must see its goodbye, not sit out the op timeout."""
    results = run_ranks(leaves_in_segment, 3, op_timeout_s=60)
    for r in (0, 1):
        out = results[r]
        assert out["error"] and "rank 2" in out["error"] and "shut down its process group" in out["error"], out
        assert out["elapsed"] < 15, out
