"""Work futures (`Work.get_future()`, what DDP's comm hooks chain on).

dicomm makes a work's future on first request, so it must behave the same whether it is asked
for before the op completes, after it completed, or after it failed. Values are checked against
hand-computed tensors.
"""
from __future__ import annotations

import torch

from launcher import error_of, run_ranks


def futures(rank: int, world: int, _port: int) -> dict:
    import torch.distributed as dist

    out = {}
    # Asked for before completion, with a chained callback.
    x = torch.full((5,), float(rank + 1))
    work = dist.all_reduce(x, async_op=True)
    doubled = work.get_future().then(lambda f: f.value()[0] * 2)
    out["chained"] = doubled.wait()
    work.wait()
    out["again"] = work.get_future().value()[0]  # a second request: the same, completed future
    # Asked for after completion: complete at once, holding the received tensor.
    if rank == 0:
        dist.send(torch.arange(4, dtype=torch.float32), dst=1)
    else:
        buf = torch.zeros(4)
        w = dist.irecv(buf, src=0)
        w.wait()
        fut = w.get_future()
        out["late_done"] = fut.done()
        out["late_value"] = fut.value()[0]
    # Asked for after the op failed (a size mismatch): the future carries the same error.
    if rank == 0:
        dist.send(torch.ones(4), dst=1)
    else:
        w = dist.irecv(torch.zeros(3), src=0)
        out["wait_error"] = error_of(w.wait)
        out["future_error"] = error_of(lambda: w.get_future().wait())
    return out


def test_futures_made_before_and_after_completion_and_failure() -> None:
    results = run_ranks(futures, 2, op_timeout_s=60)
    for r in (0, 1):
        # all_reduce of (1, 2) everywhere, doubled by the chained callback: 6
        torch.testing.assert_close(results[r]["chained"], torch.full((5,), 6.0))
        torch.testing.assert_close(results[r]["again"], torch.full((5,), 3.0))
    r1 = results[1]
    assert r1["late_done"]
    torch.testing.assert_close(r1["late_value"], torch.arange(4, dtype=torch.float32))
    assert r1["wait_error"] and "size mismatch" in r1["wait_error"], r1
    assert r1["future_error"] and "size mismatch" in r1["future_error"], r1
