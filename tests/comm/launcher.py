"""Run a function on N local ranks of a dicomm process group and collect what each returns.

Each rank is a process of its own, forked with torch already imported (tests/forked_ranks.py);
a test still runs many checks inside one job rather than one job per check.
"""
from __future__ import annotations

import datetime
import io
import os
import queue
import time
import traceback
from typing import Any, Callable

import forked_ranks
from diutil.address import free_port


def _entry(fn, rank, world, port, env, results, init, timeout_s, host, store_host):
    # The fork server's environment is the test process's when the server started; a rank
    # takes the caller's as of now (as spawn would), then its own on top.
    os.environ.clear()
    os.environ.update(env)
    if host is not None:
        host.enter()  # before anything opens a socket
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        import torch

        torch.set_num_threads(1)
        if env.get("TEST_IMPORT_DITORCH") == "1":
            import ditorch  # noqa: F401  (the dipu device; imports dicomm too)
        import dicomm  # noqa: F401  (registers the backend)
        import torch.distributed as dist

        if init:
            dist.init_process_group(
                backend=env.get("TEST_BACKEND", "dicomm"),
                init_method=f"tcp://{store_host}:{port}",
                rank=rank,
                world_size=world,
                timeout=datetime.timedelta(seconds=timeout_s),
                device_id=torch.device(env["TEST_DEVICE_ID"]) if env.get("TEST_DEVICE_ID") else None,
            )
        out = fn(rank, world, port)
        if init and dist.is_initialized():
            dist.destroy_process_group()
        # Tensors through an mp.Queue travel as shared-memory handles that die with this
        # process: serialize them instead.
        buf = io.BytesIO()
        torch.save(out, buf)
        results.put((rank, True, buf.getvalue()))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        results.put((rank, False, traceback.format_exc()))


def error_of(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> str | None:
    """Call fn; the message of what it raised, or None when it returned."""
    try:
        fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - the caller asserts on the message
        return str(e)
    return None


def leave_together(alive: int) -> None:
    """Wait, through the default store, until all `alive` ranks got here; rank 0, which hosts the
    store, leaves last. Fault tests use it so that one survivor's shutdown cannot become a second
    failure another survivor hears of before the one under test."""
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    store.add("leave_together/arrived", 1)
    while store.add("leave_together/arrived", 0) < alive:
        time.sleep(0.01)
    if dist.get_rank() != 0:
        store.add("leave_together/left", 1)
        return
    while store.add("leave_together/left", 0) < alive - 1:
        time.sleep(0.01)


def run_ranks(
    fn: Callable[[int, int, int], Any],
    world: int,
    env: dict[str, str] | None = None,
    init: bool = True,
    op_timeout_s: float = 60.0,
    wall_timeout_s: float = 150.0,
    expect_exit: set[int] | None = None,
    hosts: list | None = None,
    store_address: str | None = None,
    rank_env: dict[int, dict[str, str]] | None = None,
) -> dict[int, Any]:
    """Run ``fn(rank, world, port)`` on ``world`` processes; return {rank: result}.

    ``env`` is set in every rank before dicomm and ditorch are imported, ``rank_env[r]`` on top of it in rank r
    (e.g. a vendor of its own: DITORCH_VENDOR is read at import).

    Raises AssertionError with every failing rank's traceback. Ranks in ``expect_exit`` may die
    without reporting (fault tests kill them on purpose). With ``hosts`` (emulated_hosts.Host),
    the ranks are split over them in contiguous blocks, as torchrun places nodes, and the store
    runs on the first host (at ``store_address``, default its IPv4 address).
    """
    ctx = forked_ranks.context()
    results = ctx.Queue()
    port = free_port()
    placed = [hosts[r * len(hosts) // world] if hosts else None for r in range(world)]
    store_host = store_address or (hosts[0].address if hosts else "127.0.0.1")
    procs = [
        ctx.Process(target=_entry, args=(fn, r, world, port,
                                         {**os.environ, **(env or {}), **(rank_env or {}).get(r, {})}, results,
                                         init, op_timeout_s,
                                         placed[r], store_host))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    expect_exit = expect_exit or set()
    want = world - len(expect_exit)
    got: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + wall_timeout_s
    try:
        while len([r for r in got if r not in expect_exit]) < want:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"ranks {sorted(set(range(world)) - set(got))} did not finish within {wall_timeout_s}s")
            try:
                rank, ok, out = results.get(timeout=min(left, 1.0))
                got[rank] = (ok, out)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in got and r not in expect_exit]
                if dead:
                    time.sleep(0.5)  # a result may still be in the pipe
                    while not results.empty():
                        rank, ok, out = results.get()
                        got[rank] = (ok, out)
                    dead = [r for r in dead if r not in got]
                    if dead:
                        raise AssertionError(f"ranks {dead} died (exit codes {[procs[r].exitcode for r in dead]})")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    failures = {r: out for r, (ok, out) in got.items() if not ok}
    if failures:
        raise AssertionError("\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items())))
    import torch

    return {r: torch.load(io.BytesIO(out), weights_only=False) for r, (ok, out) in got.items()}
