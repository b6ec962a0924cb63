"""Every ReduceOp on every collective that takes one, and the process-group calls torchtitan makes.

`check_reduce_ops` runs SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR, BXOR and PREMUL_SUM (a number and
a one-element tensor as the factor, different on each rank, as NCCL allows) through all_reduce,
reduce, reduce_scatter, reduce_scatter_tensor (alone and coalesced) and all_reduce_coalesced for
bf16/fp16/fp32/fp64 and four integer dtypes, against a float64 (int64) reduction of every rank's
input computed locally; each op a dtype does not define is refused naming both, and the group
goes on. test_collectives.py runs it on every transport and allreduce algorithm (shm with the
shared segment, tcp rings, two emulated hosts); the test here runs it on `dipu` tensors.
"""
from __future__ import annotations

import datetime
import warnings

import pytest
import torch

from launcher import run_ranks

FLOATS = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
INTS = (torch.int8, torch.uint8, torch.int32, torch.int64)
# How c10 names each dtype in an error ("BAND is not defined for Float tensors").
C10_NAMES = {torch.bfloat16: "BFloat16", torch.float16: "Half", torch.float32: "Float", torch.float64: "Double",
             torch.int8: "Char", torch.uint8: "Byte", torch.int32: "Int", torch.int64: "Long"}
OPS = ("sum", "avg", "product", "min", "max", "band", "bor", "bxor", "premul_number", "premul_tensor")


def defined(op: str, dtype: torch.dtype) -> bool:
    """What torch's own ops define: bitwise ops on integers, a premultiplied sum on floats."""
    if op in ("band", "bor", "bxor"):
        return dtype in INTS
    if op.startswith("premul"):
        return dtype in FLOATS
    return True


def rank_input(seed: int, rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Halves in [-2, 2] (unsigned: 0..3): sums, products of 4 and the dyadic factors stay exact."""
    g = torch.Generator().manual_seed(seed * 100 + rank)
    if dtype in FLOATS:
        return torch.randint(-4, 5, (numel,), generator=g).to(dtype) / 2
    return torch.randint(0 if dtype == torch.uint8 else -3, 4, (numel,), generator=g).to(dtype)


def factor(op: str, rank: int) -> float:
    """This rank's PREMUL_SUM factor: dyadic, and another on every rank."""
    return (rank + 1) / 4 if op == "premul_number" else 0.5 ** rank


def reduce_op(op: str, rank: int, like: torch.Tensor):
    from torch.distributed import ReduceOp

    if op == "premul_number":
        return ReduceOp.PREMUL_SUM(factor(op, rank))
    if op == "premul_tensor":
        return torch.distributed._make_nccl_premul_sum(torch.tensor([factor(op, rank)], dtype=like.dtype,
                                                                    device=like.device))
    return getattr(ReduceOp, op.upper())


def reference(inputs: list[torch.Tensor], op: str) -> torch.Tensor:
    """The reduction of every rank's input, computed here in float64 (int64) from scratch."""
    dtype = inputs[0].dtype
    wide = [t.double() if dtype in FLOATS else t.long() for t in inputs]
    if op.startswith("premul"):
        # each rank's factor applied in its own dtype first, as the op does
        wide = [(t.to(dtype) * factor(op, r)).double() for r, t in enumerate(inputs)]
    stack = torch.stack(wide)
    if op in ("sum", "premul_number", "premul_tensor"):
        out = stack.sum(0)
    elif op == "avg":
        s = stack.sum(0)
        out = s / len(inputs) if dtype in FLOATS else torch.div(s, len(inputs), rounding_mode="trunc")
    elif op == "product":
        out = stack.prod(0)
    elif op in ("min", "max"):
        out = getattr(stack, op)(0).values
    else:
        out = stack[0]
        for t in stack[1:]:
            out = {"band": out & t, "bor": out | t, "bxor": out ^ t}[op]
    return out.to(dtype)


def agree(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    got = got.cpu()
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    if want.dtype in (torch.float16, torch.bfloat16):
        # an average is the one inexact result: the sum's quotient, rounded once
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-3, msg=what)
    elif want.dtype in FLOATS:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7, msg=what)
    else:
        assert torch.equal(got, want), f"{what}: {got} != {want}"


def check_reduce_ops(rank: int, world: int, device: str = "cpu", sizes: tuple[int, ...] = (5, 6000)) -> int:
    """Every op x collective x dtype on this group (see the module's docstring); the checks made."""
    import torch.distributed as dist

    checks = 0
    last = world - 1
    for numel in sizes:
        # past the first size (a ring's pipeline chunks and the segment's parts), three dtypes do
        for dtype in FLOATS + INTS if numel == sizes[0] else (torch.bfloat16, torch.float32, torch.int32):
            inputs = [rank_input(numel, r, numel, dtype) for r in range(world)]
            blocks = [[rank_input(numel + 1 + b, r, numel, dtype) for b in range(world)] for r in range(world)]
            mine = inputs[rank].to(device)
            for op in OPS:
                if op == "product" and numel > 5:
                    continue  # 6000 products of halves leave the dtypes; 5 elements cover the kernel
                what = f"{op} {dtype} n={numel}"
                if not defined(op, dtype):
                    for call in (lambda: dist.all_reduce(mine.clone(), op=reduce_op(op, rank, mine)),
                                 lambda: dist.reduce_scatter_tensor(torch.empty(numel, dtype=dtype, device=device),
                                                                    torch.cat(blocks[rank]).to(device),
                                                                    op=reduce_op(op, rank, mine))):
                        with pytest.raises(ValueError) as refused:
                            call()
                        said = str(refused.value)
                        name = "PREMUL_SUM" if op.startswith("premul") else op.upper()
                        assert f"{name} is not defined for {C10_NAMES[dtype]} tensors" in said, said
                        checks += 1
                    continue
                t = mine.clone()
                dist.all_reduce(t, op=reduce_op(op, rank, t))
                agree(t, reference(inputs, op), f"all_reduce {what}")
                t = mine.clone()
                dist.reduce(t, dst=last, op=reduce_op(op, rank, t))
                agree(t, reference(inputs, op) if rank == last else inputs[rank], f"reduce to {last} {what}")
                mine_blocks = [b.to(device) for b in blocks[rank]]
                out = torch.empty(numel, dtype=dtype, device=device)
                dist.reduce_scatter(out, [b.clone() for b in mine_blocks], op=reduce_op(op, rank, out))
                want = reference([blocks[r][rank] for r in range(world)], op)
                agree(out, want, f"reduce_scatter {what}")
                src = torch.cat(mine_blocks)
                out = torch.empty(numel, dtype=dtype, device=device)
                dist.reduce_scatter_tensor(out, src, op=reduce_op(op, rank, out))
                agree(out, want, f"reduce_scatter_tensor {what}")
                agree(src, torch.cat(blocks[rank]), f"reduce_scatter_tensor leaves its input {what}")
                checks += 4
            # a batch: all_reduce_coalesced of two tensors, and reduce_scatter_tensor coalesced (FSDP's path)
            for op in ("avg", "premul_number", "max"):
                if not defined(op, dtype):
                    continue
                pair = [mine.clone(), (mine * 2).clone()]
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", FutureWarning)  # all_reduce_coalesced is deprecated
                    dist.all_reduce_coalesced(pair, op=reduce_op(op, rank, mine))
                agree(pair[0], reference(inputs, op), f"all_reduce_coalesced {op} {dtype}")
                agree(pair[1], reference([x * 2 for x in inputs], op), f"all_reduce_coalesced {op} {dtype} 2nd")
                outs = [torch.empty(numel, dtype=dtype, device=device) for _ in range(2)]
                with dist._coalescing_manager(async_ops=True) as cm:
                    for k, o in enumerate(outs):
                        dist.reduce_scatter_tensor(o, torch.cat(blocks[rank]).to(device) * (k + 1),
                                                   op=reduce_op(op, rank, o))
                cm.wait()
                for k, o in enumerate(outs):
                    agree(o, reference([blocks[r][rank] * (k + 1) for r in range(world)], op),
                          f"coalesced reduce_scatter_tensor {op} {dtype} #{k}")
                checks += 4
    # a factor that is no power of two, on random values: the product rounds once, in fp32
    x = torch.randn(1000, generator=torch.Generator().manual_seed(rank))
    t = x.to(device)
    dist.all_reduce(t, op=dist.ReduceOp.PREMUL_SUM(1 / 3))
    want = sum((torch.randn(1000, generator=torch.Generator().manual_seed(r)) * (1 / 3)).double() for r in range(world))
    torch.testing.assert_close(t.cpu().double(), want, rtol=1e-6, atol=1e-6)
    return checks + 1


def torchtitan_group_calls(rank: int, world: int, _port: int) -> dict:
    """What torchtitan asks of its process groups, on dipu tensors over `cpu:gloo,dipu:dicomm`."""
    import torch.distributed as dist
    from torch.distributed import _functional_collectives as funcol
    from torch.distributed.device_mesh import init_device_mesh

    res = {"checks": check_reduce_ops(rank, world, "dipu", sizes=(5,))}
    world_group = dist.group.WORLD
    dicomm_backend = world_group._get_backend(torch.device("dipu"))
    # torchtitan's set_pg_timeouts: a barrier on the device, then _set_pg_timeout on every group
    dist.barrier(device_ids=[torch.dipu.current_device()])
    mesh = init_device_mesh("dipu", (2, 2), mesh_dim_names=("dp", "tp"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's own warns "only supported for either nccl or gloo"
        for group in [mesh.get_group(d) for d in range(mesh.ndim)] + [None]:
            dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=77), group)
    res["timeouts"] = [dicomm_backend.timeout_seconds] + [
        mesh.get_group(d)._get_backend(torch.device("dipu")).timeout_seconds for d in range(mesh.ndim)]
    # the mesh's groups: dp is a column of [[0, 1], [2, 3]], tp a row; FSDP2's ops on each
    for name in ("dp", "tp"):
        group = mesh.get_group(name)
        peers = dist.get_process_group_ranks(group)
        value = torch.full((4,), float(rank + 1), device="dipu")
        averaged = funcol.all_reduce(value, "avg", group)
        res[f"{name}_avg"] = (peers, averaged.cpu())
        grads = torch.arange(8, dtype=torch.float32, device="dipu") * (rank + 1)
        shard = torch.empty(4, device="dipu")
        dist.reduce_scatter_tensor(shard, grads, op=dist.ReduceOp.PREMUL_SUM(1 / 8), group=group)
        res[f"{name}_premul"] = shard.cpu()
    # split_group of the world (a group bound to dipu splits)
    pairs = dist.split_group(split_ranks=[[0, 3], [1, 2]])
    t = torch.tensor([float(rank)], device="dipu")
    dist.all_reduce(t, group=pairs)
    res["split"] = (dist.get_process_group_ranks(pairs), t.item())
    # the timeout _set_pg_timeout gave a group is the one its ops keep: rank 0 waits alone on a pair
    lonely = dist.new_group([0, 1])
    if rank in (0, 1):
        dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=1), lonely)
        if rank == 0:
            try:
                dist.all_reduce(torch.ones(1, device="dipu"), group=lonely)
                res["lonely"] = "completed"
            except Exception as e:  # noqa: BLE001 - the message is the result
                res["lonely"] = str(e)
    dist.barrier()  # rank 1 keeps its end of the pair open until rank 0's op has timed out
    return res


@pytest.mark.timeout(180)
def test_reduce_ops_and_torchtitan_group_calls_on_dipu():
    world = 4
    res = run_ranks(torchtitan_group_calls, world,
                    env={"TEST_BACKEND": "cpu:gloo,dipu:dicomm", "TEST_IMPORT_DITORCH": "1",
                         "TEST_DEVICE_ID": "dipu:0"})
    for r in range(world):
        out = res[r]
        assert out["checks"] > 150, out["checks"]
        assert out["timeouts"] == [77.0, 77.0, 77.0], out["timeouts"]
        for name, same in (("dp", lambda q: q % 2 == r % 2), ("tp", lambda q: q // 2 == r // 2)):
            peers, averaged = out[f"{name}_avg"]
            assert peers == [q for q in range(world) if same(q)], (name, peers)
            torch.testing.assert_close(averaged, torch.full((4,), sum(q + 1.0 for q in peers) / 2))
            full = sum(torch.arange(8, dtype=torch.float32) * (q + 1) / 8 for q in peers)
            index = peers.index(r)
            torch.testing.assert_close(out[f"{name}_premul"], full[4 * index:4 * index + 4])
        pair = [0, 3] if r in (0, 3) else [1, 2]
        assert out["split"] == (pair, float(sum(pair))), out["split"]
    assert "timed out after 1000 ms" in res[0]["lonely"], res[0]["lonely"]
