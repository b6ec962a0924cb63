"""Every collective and point-to-point op of dicomm against results computed locally with torch.

Each rank builds every rank's input (a function of the rank), so the expected result of an op is
an ordinary torch reduction over those inputs: an independent reference.
"""
from __future__ import annotations

import pytest
import torch

from emulated_hosts import can_make_hosts, emulated_hosts
from launcher import run_ranks
from test_reduce_ops import check_reduce_ops
from test_shared_segment import reduce_cases

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64,
          torch.int8, torch.uint8]
FLOATS = {torch.float32, torch.float64, torch.float16, torch.bfloat16}


def rank_input(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Small values so products and sums stay exact in every dtype."""
    g = torch.Generator().manual_seed(1000 + rank)
    if dtype in FLOATS:
        return (torch.randint(-4, 5, (numel,), generator=g).to(dtype)) / 2
    lo = 0 if dtype == torch.uint8 else -3
    return torch.randint(lo, 4, (numel,), generator=g).to(dtype)


def reference(inputs: list[torch.Tensor], op: str) -> torch.Tensor:
    stack = torch.stack([t.double() for t in inputs])
    dtype = inputs[0].dtype
    if op == "sum":
        out = stack.sum(0)
    elif op == "avg":
        s = stack.sum(0)
        out = s / len(inputs) if dtype in FLOATS else torch.div(s, len(inputs), rounding_mode="trunc")
    elif op == "product":
        out = stack.prod(0)
    elif op == "min":
        out = stack.min(0).values
    else:
        out = stack.max(0).values
    return out.to(dtype)


def close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.dtype == b.dtype, f"{what}: dtype {a.dtype} != {b.dtype}"
    if a.dtype in (torch.float16, torch.bfloat16):
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-2, atol=1e-2, msg=what)
    else:
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=what)


def check_all(rank: int, world: int, _port: int) -> dict:
    import torch.distributed as dist
    from torch.distributed import ReduceOp

    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    transports = sorted({backend.transport_of(p) for p in range(world) if p != rank})
    algorithm = backend.allreduce_algorithm
    ops = {"sum": ReduceOp.SUM, "avg": ReduceOp.AVG, "product": ReduceOp.PRODUCT,
           "min": ReduceOp.MIN, "max": ReduceOp.MAX}
    checks = 0
    # Sizes: fewer elements than ranks, odd, and several pipeline chunks (chunk = 64 KiB here).
    for numel in (3, 1001, 70_000):
        for dtype in DTYPES:
            inputs = [rank_input(r, numel, dtype) for r in range(world)]
            for name, op in ops.items():
                if name == "product" and numel > 1001:
                    continue  # products of 70k values overflow; small sizes cover the kernel
                t = inputs[rank].clone()
                dist.all_reduce(t, op=op)
                close(t, reference(inputs, name), f"all_reduce {name} {dtype} n={numel}")
                checks += 1
            # reduce to every root
            for root in range(world):
                t = inputs[rank].clone()
                dist.reduce(t, dst=root, op=ReduceOp.SUM)
                if rank == root:
                    close(t, reference(inputs, "sum"), f"reduce {dtype} root={root}")
                else:
                    close(t, inputs[rank], f"reduce leaves non-root input intact {dtype}")
                checks += 1
            for root in range(world):
                t = inputs[rank].clone() if rank == root else torch.zeros(numel, dtype=dtype)
                dist.broadcast(t, src=root)
                close(t, inputs[root], f"broadcast {dtype} root={root}")
                checks += 1
            # all_gather: list and into-tensor
            outs = [torch.empty(numel, dtype=dtype) for _ in range(world)]
            dist.all_gather(outs, inputs[rank])
            for r in range(world):
                close(outs[r], inputs[r], f"all_gather {dtype} slot {r}")
            flat = torch.empty(world * numel, dtype=dtype)
            dist.all_gather_into_tensor(flat, inputs[rank])
            close(flat, torch.cat(inputs), f"all_gather_into_tensor {dtype}")
            # reduce_scatter: each rank contributes world blocks; rank r gets the sum of block r
            blocks = [[rank_input(100 * r + b, numel, dtype) for b in range(world)] for r in range(world)]
            out = torch.empty(numel, dtype=dtype)
            dist.reduce_scatter(out, [b.clone() for b in blocks[rank]], op=ReduceOp.SUM)
            close(out, reference([blocks[r][rank] for r in range(world)], "sum"), f"reduce_scatter {dtype}")
            src = torch.cat(blocks[rank])
            out2 = torch.empty(numel, dtype=dtype)
            dist.reduce_scatter_tensor(out2, src, op=ReduceOp.AVG)
            close(out2, reference([blocks[r][rank] for r in range(world)], "avg"), f"reduce_scatter_tensor avg {dtype}")
            close(src, torch.cat(blocks[rank]), "reduce_scatter_tensor leaves its input intact")
            checks += 5
    # gather / scatter from every root
    for root in range(world):
        x = rank_input(rank, 17, torch.float32)
        gl = [torch.empty(17) for _ in range(world)] if rank == root else None
        dist.gather(x, gather_list=gl, dst=root)
        if rank == root:
            for r in range(world):
                close(gl[r], rank_input(r, 17, torch.float32), f"gather slot {r}")
        pieces = [rank_input(10 * root + r, 5, torch.int64) for r in range(world)]
        y = torch.empty(5, dtype=torch.int64)
        dist.scatter(y, scatter_list=pieces if rank == root else None, src=root)
        close(y, pieces[rank], f"scatter root={root}")
        checks += 2
    # all_to_all: list form and single form with uneven splits
    send = [torch.full((r + 1,), 100 * rank + r, dtype=torch.int32) for r in range(world)]
    recv = [torch.empty(rank + 1, dtype=torch.int32) for _ in range(world)]
    dist.all_to_all(recv, send)
    for r in range(world):
        close(recv[r], torch.full((rank + 1,), 100 * r + rank, dtype=torch.int32), f"all_to_all from {r}")
    in_splits = [r + 1 for r in range(world)]          # rank sends r+1 rows to rank r
    out_splits = [rank + 1] * world                    # and receives rank+1 rows from everyone
    inp = torch.cat([torch.full((r + 1, 2), float(10 * rank + r)) for r in range(world)])
    out = torch.empty(sum(out_splits), 2)
    dist.all_to_all_single(out, inp, out_splits, in_splits)
    expect = torch.cat([torch.full((rank + 1, 2), float(10 * r + rank)) for r in range(world)])
    close(out, expect, "all_to_all_single uneven")
    checks += 2
    dist.barrier()
    # object collectives
    objs = [None] * world
    dist.all_gather_object(objs, {"rank": rank, "s": "x" * rank})
    assert objs == [{"rank": r, "s": "x" * r} for r in range(world)], objs
    lst = [{"from": 0, "payload": list(range(5))}] if rank == 0 else [None]
    dist.broadcast_object_list(lst, src=0)
    assert lst == [{"from": 0, "payload": list(range(5))}], lst
    checks += 2
    # coalesced collectives (FSDP's path): one Work for a batch of gathers or reduce-scatters
    sizes = (5, 300)
    xs = [rank_input(rank, n, torch.float32) for n in sizes]
    gathered = [torch.empty(world * n) for n in sizes]
    with dist._coalescing_manager(async_ops=True) as cm:
        for o, x in zip(gathered, xs):
            dist.all_gather_into_tensor(o, x)
    cm.wait()
    for o, n in zip(gathered, sizes):
        close(o, torch.cat([rank_input(r, n, torch.float32) for r in range(world)]),
              f"coalesced all_gather_into_tensor n={n}")
    srcs = [torch.cat([rank_input(100 * rank + b, n, torch.float32) for b in range(world)]) for n in sizes]
    scattered = [torch.empty(n) for n in sizes]
    with dist._coalescing_manager(async_ops=True) as cm:
        for o, x in zip(scattered, srcs):
            dist.reduce_scatter_tensor(o, x)
    cm.wait()
    for o, n in zip(scattered, sizes):
        close(o, reference([rank_input(100 * r + rank, n, torch.float32) for r in range(world)], "sum"),
              f"coalesced reduce_scatter_tensor n={n}")
    # torch's contract: one output list per rank, each with one tensor per input
    lists = [[torch.empty(n) for n in sizes] for _ in range(world)]
    dist.all_gather_coalesced(lists, xs)
    for r, lst in enumerate(lists):
        for o, n in zip(lst, sizes):
            close(o, rank_input(r, n, torch.float32), f"all_gather_coalesced n={n} from rank {r}")
    checks += 3
    # point to point: ring with send/recv, isend/irecv, batch_isend_irecv, tags, any source
    right, left = (rank + 1) % world, (rank - 1) % world
    for numel in (1, 4096, 300_000):  # inline, medium, and cross-memory-attach sizes
        x = rank_input(rank, numel, torch.float32)
        y = torch.empty(numel)
        if rank % 2 == 0:
            dist.send(x, right)
            dist.recv(y, left)
        else:
            dist.recv(y, left)
            dist.send(x, right)
        close(y, rank_input(left, numel, torch.float32), f"send/recv ring n={numel}")
        a, b = torch.empty(numel), torch.empty(numel)
        reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, x, right), dist.P2POp(dist.irecv, a, left),
                                       dist.P2POp(dist.isend, x * 2, left), dist.P2POp(dist.irecv, b, right)])
        for q in reqs:
            q.wait()
        close(a, rank_input(left, numel, torch.float32), "batch_isend_irecv from left")
        close(b, rank_input(right, numel, torch.float32) * 2, "batch_isend_irecv from right")
        checks += 3
    # tags: two messages to the same peer, received in the opposite order
    if rank == 0:
        dist.send(torch.tensor([1.0]), 1, tag=7)
        dist.send(torch.tensor([2.0]), 1, tag=9)
    elif rank == 1:
        t9, t7 = torch.empty(1), torch.empty(1)
        dist.recv(t9, 0, tag=9)
        dist.recv(t7, 0, tag=7)
        assert (t9.item(), t7.item()) == (2.0, 1.0), (t9, t7)
    # receive from any source: rank 0 collects one message from every other rank
    if rank == 0:
        seen = set()
        for _ in range(world - 1):
            t = torch.empty(1, dtype=torch.int64)
            src = dist.recv(t)
            assert t.item() == 1000 + src, (src, t)
            seen.add(src)
        assert seen == set(range(1, world)), seen
    else:
        dist.send(torch.tensor([1000 + rank]), 0)
    checks += 2
    # subgroups: new_group of the even ranks (split_group needs an accelerator: see test_dipu.py)
    evens = list(range(0, world, 2))
    g = dist.new_group(evens, backend="dicomm")
    if rank in evens:
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=g)
        assert t.item() == float(sum(evens)), t
        if len(evens) > 1:
            t = torch.tensor([1.0]) if rank == evens[0] else torch.zeros(1)
            dist.broadcast(t, src=evens[0], group=g)
            assert t.item() == 1.0, t
    dist.barrier()
    checks += 2
    # every ReduceOp (PREMUL_SUM, the bitwise ones, ...) on every reducing collective
    checks += check_reduce_ops(rank, world)
    return {"checks": checks, "transports": transports, "allreduce": algorithm}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world,transport", [(4, "auto"), (2, "tcp")])
def test_every_op_every_dtype(world, transport):
    results = run_ranks(check_all, world, env={"DICOMM_TRANSPORT": transport, "DICOMM_CHUNK_BYTES": "65536"})
    assert set(results) == set(range(world))
    expected = {"auto": ["shm"], "tcp": ["tcp"]}[transport]
    for r, out in results.items():
        assert out["transports"] == expected, (r, out)
        # one host over shm: the shared segment (its own tests: test_shared_segment.py)
        assert out["allreduce"] == {"auto": "shared", "tcp": "ring"}[transport], (r, out)
        assert out["checks"] > 300


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [3, 6])
def test_rings_of_any_size_over_tcp_match_a_cpu_reduction(world):
    """Over tcp (no shared segment): short payloads by recursive doubling, with the ranks beyond
    the largest power of two paired in (3 ranks: one; 6: two), longer ones by the ring; random
    cases against the CPU reduction, the same bits on every rank."""
    results = run_ranks(reduce_cases, world, env={"DICOMM_TRANSPORT": "tcp"})
    for r, out in results.items():
        assert out["algorithm"] == "ring", (r, out)
        assert out["checked"] == 40 and out["wrong"] == [], (r, out["wrong"])


def _choice_in_the_debug_log(rank, world, port):
    """Creates the group with this process's stderr (fd 2, where the C++ log writes) in a file."""
    import os
    import tempfile

    import torch.distributed as dist

    with tempfile.TemporaryFile() as log:
        saved = os.dup(2)
        os.dup2(log.fileno(), 2)
        try:
            dist.init_process_group("dicomm", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
            dist.barrier()  # rank 0 hosts the store: it leaves only once every rank is in the group
            dist.destroy_process_group()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        log.seek(0)
        return log.read().decode(errors="replace")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport,said", [("tcp", "allreduce ring, payloads of up to 16384 bytes by recursive doubling"),
                                            ("auto", "allreduce shared (")])
def test_the_allreduce_choice_is_in_the_debug_log(transport, said):
    """DICOMM_DEBUG=INFO: rank 0 says which allreduce the group uses, and over a ring that short
    payloads go by recursive doubling (the 16 KiB of the docs); the shared segment has no ring."""
    logs = run_ranks(_choice_in_the_debug_log, 2, init=False,
                     env={"DICOMM_TRANSPORT": transport, "DICOMM_DEBUG": "INFO"})
    lines = [line for line in logs[0].splitlines() if "group of 2" in line]
    assert len(lines) == 1 and said in lines[0], logs[0]
    assert "doubling" not in lines[0] or transport == "tcp", lines[0]
    assert not any("group of 2" in line for line in logs[1].splitlines()), logs[1]


@pytest.mark.timeout(240)
@pytest.mark.skipif(can_make_hosts() is not None, reason=str(can_make_hosts()))
@pytest.mark.parametrize("algorithm", ["auto", "hierarchical", "ring"])
def test_every_op_across_two_hosts(algorithm):
    """Two emulated hosts x two ranks, nothing configured: shm inside a host, tcp between them,
    each rank listening on the address that routes to the store; allreduce in two levels
    (forced, and auto) or one flat ring."""
    env = {"DICOMM_CHUNK_BYTES": "65536", "DICOMM_ALLREDUCE": algorithm}
    with emulated_hosts(2) as hosts:
        results = run_ranks(check_all, 4, env=env, hosts=hosts)
    for r, out in results.items():
        assert out["transports"] == ["shm", "tcp"], (r, out)
        # auto: two levels at every size, each host's level in its shared segment
        assert out["allreduce"] == {"auto": "hierarchical", "hierarchical": "hierarchical",
                                    "ring": "ring"}[algorithm], (r, out)
        assert out["checks"] > 300


def _algorithm(rank, world, port):
    import torch.distributed as dist

    return dist.group.WORLD._get_backend(torch.device("cpu")).allreduce_algorithm


def test_forced_hierarchy_on_one_host_falls_back_to_the_ring():
    out = run_ranks(_algorithm, 2, env={"DICOMM_ALLREDUCE": "hierarchical"})
    assert set(out.values()) == {"ring"}, out
