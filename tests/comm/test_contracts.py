"""Argument shapes of every list-shaped collective, checked against gloo as the reference: the same
call on a gloo group and on a dicomm group must give the same outputs, and a call gloo refuses
must be refused by dicomm too. Three ranks and unequal sizes, so that a list per rank and a list
per input cannot be confused."""
from __future__ import annotations

import pytest
import torch

from launcher import run_ranks


def _cases(rank: int, world: int):
    """(name, make) pairs; make() returns (call(group) -> outputs, outputs-to-compare)."""
    import torch.distributed as dist

    sizes = (2, 5)
    xs = [torch.arange(n, dtype=torch.float32) + 10 * rank + n for n in sizes]

    def all_gather(group):
        outs = [torch.empty(3) for _ in range(world)]
        dist.all_gather(outs, torch.full((3,), float(rank)), group=group)
        return outs

    def all_gather_coalesced(group):
        lists = [[torch.empty(n) for n in sizes] for _ in range(world)]
        dist.all_gather_coalesced(lists, [x.clone() for x in xs], group=group)
        return [t for lst in lists for t in lst]

    def all_gather_coalesced_per_input(group):  # the shape torch does not define: must be refused
        lists = [[torch.empty(n) for _ in range(world)] for n in sizes]
        dist.all_gather_coalesced(lists, [x.clone() for x in xs], group=group)
        return [t for lst in lists for t in lst]

    def all_gather_wrong_length(group):
        outs = [torch.empty(3) for _ in range(world + 1)]
        dist.all_gather(outs, torch.ones(3), group=group)
        return outs

    def all_gather_into_tensor_stacked(group):
        out = torch.empty(world, 4)
        dist.all_gather_into_tensor(out, torch.full((4,), float(rank)), group=group)
        return [out]

    def gather(group):
        outs = []
        for dst in range(world):
            lst = [torch.empty(3) for _ in range(world)] if rank == dst else None
            dist.gather(torch.full((3,), rank + 0.5), lst, dst=dst, group=group)
            outs += lst or []
        return outs

    def scatter(group):
        outs = []
        for src in range(world):
            out = torch.empty(2)
            lst = [torch.full((2,), 100.0 * src + r) for r in range(world)] if rank == src else None
            dist.scatter(out, lst, src=src, group=group)
            outs.append(out)
        return outs

    def reduce_scatter(group):
        out = torch.empty(3)
        dist.reduce_scatter(out, [torch.full((3,), float(rank + r)) for r in range(world)], group=group)
        return [out]

    def reduce_scatter_tensor(group):
        out = torch.empty(2)
        dist.reduce_scatter_tensor(out, torch.arange(2 * world, dtype=torch.float32) * (rank + 1), group=group)
        return [out]

    def all_to_all_single_splits(group):
        # rank r sends r + 1 + p elements to rank p
        send = [r + 1 + rank for r in range(world)]
        recv = [rank + 1 + p for p in range(world)]
        x = torch.arange(sum(send), dtype=torch.float32) + 1000 * rank
        out = torch.empty(sum(recv))
        dist.all_to_all_single(out, x, output_split_sizes=recv, input_split_sizes=send, group=group)
        return [out]

    def all_to_all_lists(group):
        ins = [torch.full((p + 1,), 10.0 * rank + p) for p in range(world)]
        outs = [torch.empty(rank + 1) for _ in range(world)]
        dist.all_to_all(outs, ins, group=group)
        return outs

    def broadcast_non_contiguous(group):
        t = (torch.arange(12, dtype=torch.float32).reshape(3, 4) * (rank + 1)).t()
        dist.broadcast(t, src=world - 1, group=group)
        return [t.contiguous()]

    return [(f.__name__, f) for f in (all_gather, all_gather_coalesced, all_gather_coalesced_per_input,
                                       all_gather_wrong_length, all_gather_into_tensor_stacked, gather,
                                       scatter, reduce_scatter, reduce_scatter_tensor,
                                       all_to_all_single_splits, all_to_all_lists, broadcast_non_contiguous)]


def _documented_beyond_gloo(rank: int, world: int) -> dict:
    """Forms torch's documentation allows (and NCCL takes) that gloo refuses, with hand-computed
    results: a stacked all_gather_into_tensor output, and all_to_all lists of unequal sizes."""
    stacked = torch.arange(world, dtype=torch.float32)[:, None].expand(world, 4)
    uneven = [torch.full((rank + 1,), 10.0 * p + rank) for p in range(world)]
    return {"all_gather_into_tensor_stacked": [stacked], "all_to_all_lists": uneven}


def _unsupported(message: str) -> bool:
    return "does not support" in message or "not supported" in message or "not implemented" in message.lower()


def compare_with_gloo(rank: int, world: int, _port: int) -> dict:
    import torch.distributed as dist

    gloo = dist.new_group(backend="gloo")
    dicomm = dist.group.WORLD
    compared, refused, gloo_lacks = [], [], []
    for name, call in _cases(rank, world):
        results = {}
        for backend, group in (("gloo", gloo), ("dicomm", dicomm)):
            try:
                results[backend] = ("ok", call(group))
            except Exception as e:  # noqa: BLE001 - the refusal is what we compare
                results[backend] = ("error", str(e))
            dist.barrier(group=gloo)  # a refused call must not leave one rank behind the others
        (g_kind, g_out), (d_kind, d_out) = results["gloo"], results["dicomm"]
        if g_kind == "error" and name in _documented_beyond_gloo(rank, world):
            assert d_kind == "ok", f"{name}: torch documents this form, dicomm refused it: {d_out}"
            for a, b in zip(_documented_beyond_gloo(rank, world)[name], d_out, strict=True):
                torch.testing.assert_close(b, a, msg=name)
            compared.append(name)
            continue
        if g_kind == "error" and _unsupported(g_out):
            gloo_lacks.append(name)
            assert d_kind == "ok", f"{name}: gloo lacks it, dicomm failed: {d_out}"
            continue
        assert g_kind == d_kind, f"{name}: gloo {g_kind} ({g_out if g_kind == 'error' else ''}), dicomm {d_kind} ({d_out if d_kind == 'error' else ''})"
        if g_kind == "ok":
            assert len(g_out) == len(d_out), name
            for a, b in zip(g_out, d_out):
                torch.testing.assert_close(b, a, msg=name)
            compared.append(name)
        else:
            refused.append(name)
    return {"compared": compared, "refused": refused, "gloo_lacks": gloo_lacks}


@pytest.mark.timeout(180)
def test_list_collectives_take_the_shapes_gloo_takes():
    out = run_ranks(compare_with_gloo, 3)
    first = out[0]
    assert all(o == first for o in out.values()), out
    assert "all_gather_coalesced" in first["compared"], first
    assert {"all_gather_coalesced_per_input", "all_gather_wrong_length"} <= set(first["refused"]), first
    assert len(first["compared"]) >= 8, first
