"""Refusals that must leave the group as it was: a reduce op undefined for the tensor's dtype is
refused before anything is posted; work.wait(timeout) that expires raises (torch's and gloo's
contract) while the op stays in flight; a group too large for the message tags is refused when
it is made."""
from __future__ import annotations

import datetime

import pytest
import torch

from launcher import error_of, run_ranks


def refusals(rank: int, world: int, _port: int) -> dict:
    import torch.distributed as dist
    from torch.distributed import ReduceOp

    out = {}
    out["band_float"] = error_of(dist.all_reduce, torch.ones(4), op=ReduceOp.BAND)
    out["bxor_float_reduce_scatter"] = error_of(dist.reduce_scatter_tensor, torch.empty(2),
                                                torch.ones(2 * world), op=ReduceOp.BXOR)
    t = torch.ones(4)
    dist.all_reduce(t)  # the group still works
    out["after"] = t[0].item()
    ints = torch.tensor([rank + 1, 3], dtype=torch.int32)
    dist.all_reduce(ints, op=ReduceOp.BAND)  # defined for integers
    out["band_int"] = ints.tolist()

    # wait(timeout) raises; the receive stays posted and completes once the message comes
    if rank == 0:
        buf = torch.zeros(3)
        work = dist.irecv(buf, 1, tag=7)
        out["wait_timeout"] = error_of(work.wait, datetime.timedelta(milliseconds=300))
        dist.send(torch.ones(1), 1, tag=8)  # now rank 1 may send
        work.wait()
        out["received"] = buf.tolist()
    else:
        dist.recv(torch.empty(1), 0, tag=8)
        dist.send(torch.full((3,), 7.0), 0, tag=7)
    dist.barrier()
    out["aborted"] = dist.group.WORLD._get_backend(torch.device("cpu")).aborted
    return out


@pytest.mark.timeout(120)
def test_refusals_leave_the_group_usable():
    out = run_ranks(refusals, 2, op_timeout_s=30)
    for rank, r in out.items():
        assert "reduce op BAND is not defined for Float" in r["band_float"], r
        assert "reduce op BXOR is not defined for Float" in r["bxor_float_reduce_scatter"], r
        assert r["after"] == 2.0, r
        assert r["band_int"] == [1 & 2, 3], r
        assert r["aborted"] is False, r
    assert "wait(timeout=300 ms) expired" in out[0]["wait_timeout"], out[0]
    assert "still in flight" in out[0]["wait_timeout"], out[0]
    assert out[0]["received"] == [7.0, 7.0, 7.0], out[0]


def test_a_group_larger_than_the_tags_is_refused_at_once():
    import dicomm

    store = torch.distributed.HashStore()
    with pytest.raises(RuntimeError, match="a group of 1026 ranks is larger than the 1025"):
        dicomm.ProcessGroupDicomm(store, 0, 1026, 5.0)


def too_many_chunks(rank: int, world: int, _port: int) -> dict:
    import torch.distributed as dist

    # 131073 floats over 2 ranks: segments of 65537 and 65536 elements, in 4-byte chunks. Rank 1
    # could post the receives of the smaller segment before meeting the larger one; both ranks
    # must refuse before posting anything, and the group stays usable.
    out = {"error": error_of(dist.all_reduce, torch.ones(131073))}
    # the trees cut the whole tensor: 65537 chunks of 4 bytes
    out["broadcast"] = error_of(dist.broadcast, torch.ones(65537), src=0)
    out["reduce"] = error_of(dist.reduce, torch.ones(65537), dst=1)
    t = torch.full((4,), float(rank + 1))
    dist.all_reduce(t)
    out["after"] = t.tolist()
    out["aborted"] = dist.group.WORLD._get_backend(torch.device("cpu")).aborted
    return out


@pytest.mark.timeout(120)
def test_a_collective_with_more_chunks_than_tags_is_refused_before_posting():
    # the ring's chunks (on one host allreduce would take the shared segment, which has no tags)
    out = run_ranks(too_many_chunks, 2, env={"DICOMM_CHUNK_BYTES": "4", "DICOMM_ALLREDUCE": "ring"}, op_timeout_s=30)
    for r in out.values():
        assert "262148-byte segment in chunks of 4 bytes makes 65537 chunks" in r["error"], r
        assert "raise DICOMM_CHUNK_BYTES (now 4)" in r["error"], r
        for op in ("broadcast", "reduce"):
            assert "262148-byte segment in chunks of 4 bytes makes 65537 chunks" in r[op], (op, r)
        assert r["after"] == [3.0] * 4 and r["aborted"] is False, r


def waits_out_of_issue_order(rank: int, world: int, _port: int) -> dict:
    """Collectives issued async and waited in another order on each rank: every one still runs
    in issue order everywhere."""
    import torch.distributed as dist

    sizes = [3, 1, 4, 1, 5, 9, 2, 6]
    tensors = [torch.full((n,), float(rank + 1) * (i + 1)) for i, n in enumerate(sizes)]
    works = [dist.all_reduce(t, async_op=True) for t in tensors]
    order = range(len(works)) if rank % 2 else reversed(range(len(works)))
    for i in order:
        works[i].wait()
    dist.barrier()  # a synchronous one after them
    synced = torch.full((2,), float(rank))
    dist.all_reduce(synced)
    return {"values": [t.tolist() for t in tensors], "synced": synced.tolist()}


@pytest.mark.timeout(120)
def test_collectives_run_in_issue_order_whatever_order_they_are_waited_in():
    world = 3
    out = run_ranks(waits_out_of_issue_order, world, op_timeout_s=30)
    ranks_sum = sum(r + 1 for r in range(world))
    for rank, r in out.items():
        for i, (n, got) in enumerate(zip([3, 1, 4, 1, 5, 9, 2, 6], r["values"])):
            assert got == [float(ranks_sum * (i + 1))] * n, (rank, i, got)
        assert r["synced"] == [float(sum(range(world)))] * 2, r
