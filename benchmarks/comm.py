"""DiComm vs gloo on local ranks, nccl-tests style: p2p latency/bandwidth and allreduce busbw.

    .venv/bin/python benchmarks/comm.py                 # 2 and 4 ranks, 8 B .. 256 MiB
    .venv/bin/python benchmarks/comm.py --quick         # fewer sizes, up to 64 MiB

Conventions (as nccl-tests): one-way latency = median round trip / 2 of a ping-pong between
ranks 0 and 1; p2p bandwidth = bytes / one-way time; allreduce algbw = bytes / time and
busbw = algbw * 2 (n - 1) / n. gloo and dicomm are measured in the same run on the same machine;
the table prints dicomm/gloo ratios and the issue's targets; a PNG plot goes to --out. The same
ping-pong over one plain blocking socket (raw-tcp, no torch) shows what a single loopback TCP
stream moves on this machine without any framework around it.
"""
from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MiB = 1 << 20
# Round trips per size before timing (nccl-tests' -w default): first touches of the pages, and
# the kernel growing a connection's buffers to the message size (TCP auto-tuning).
WARMUP = 5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _iters(nbytes: int, budget_s: float, est_bw: float = 1e9, lo: int = 3, hi: int = 300) -> int:
    est = 60e-6 + nbytes / est_bw
    return max(lo, min(hi, int(budget_s / est)))


def _warm_up(round_trip, tiny) -> None:
    """1000 untimed round trips (as nccl-tests' -w): fresh processes and connections run slower
    for their first messages (lazy set-up, page faults, and the scheduler spreading the two
    ranks over the cores, which takes tens of milliseconds)."""
    for _ in range(1000):
        round_trip(tiny)


def _time_ping_pong(round_trip, buf, nbytes: int, budget: float) -> dict:
    """One-way latency (median round trip / 2) and bandwidth of `round_trip(buf)`, timed over at
    least 10 round trips (a median of 3 is noise) after WARMUP untimed ones."""
    rtts = []
    for i in range(_iters(2 * nbytes, budget, lo=10, hi=1000) + WARMUP):
        t0 = time.perf_counter()
        round_trip(buf)
        if i >= WARMUP:
            rtts.append(time.perf_counter() - t0)
    one_way = statistics.median(rtts) / 2
    return {"lat_us": one_way * 1e6, "bw_GBs": nbytes / one_way / 1e9}


def _worker(rank, world, port, backend, transport, sizes, ar_sizes, budget, q):
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    if transport:
        os.environ["DICOMM_TRANSPORT"] = transport
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if backend == "dicomm":
        import dicomm  # noqa: F401
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=300))
    res = {"p2p": {}, "allreduce": {}}
    # ---- ping-pong between ranks 0 and 1 ----
    peer = 1 - rank

    def round_trip(t):
        if rank == 0:
            dist.send(t, peer)
            dist.recv(t, peer)
        else:
            dist.recv(t, peer)
            dist.send(t, peer)

    if rank < 2 and sizes:
        _warm_up(round_trip, torch.zeros(2))
    for nbytes in sizes:
        buf = torch.zeros(max(1, nbytes // 4), dtype=torch.float32) if nbytes >= 4 else torch.zeros(nbytes, dtype=torch.uint8)
        dist.barrier()
        if rank < 2:
            timed = _time_ping_pong(round_trip, buf, nbytes, budget)
            if rank == 0:
                res["p2p"][nbytes] = timed
        del buf
    # ---- allreduce ----
    for nbytes in ar_sizes:
        t = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
        n = _iters(4 * nbytes, budget, est_bw=1e9, lo=2, hi=200)
        dist.all_reduce(t)  # warm-up
        times = []
        for _ in range(3):
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(n):
                dist.all_reduce(t)
            times.append((time.perf_counter() - t0) / n)
        tt = statistics.median(times)
        algbw = t.numel() * 4 / tt / 1e9
        if rank == 0:
            res["allreduce"][nbytes] = {"time_us": tt * 1e6, "algbw_GBs": algbw,
                                        "busbw_GBs": algbw * 2 * (world - 1) / world}
        del t
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        q.put(res)


def _raw_tcp_worker(rank, port, sizes, budget, q):
    """One blocking loopback TCP socket, ping-pong as in _worker: what one plain stream moves on
    this machine (no framing, no threads, no torch), measured beside gloo and dicomm."""
    if rank == 0:
        with socket.socket() as ls:
            ls.bind(("127.0.0.1", port))
            ls.listen(1)
            s, _ = ls.accept()
    else:
        deadline = time.monotonic() + 60
        while True:
            try:
                s = socket.create_connection(("127.0.0.1", port))
                break
            except ConnectionRefusedError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def send(view):
        s.sendall(view)

    def recv(view):
        got = 0
        while got < len(view):
            k = s.recv_into(view[got:], len(view) - got, socket.MSG_WAITALL)
            if k == 0:
                raise ConnectionError("raw-tcp peer closed")
            got += k

    def round_trip(view):
        if rank == 0:
            send(view)
            recv(view)
        else:
            recv(view)
            send(view)

    _warm_up(round_trip, memoryview(bytearray(8)))
    res = {n: _time_ping_pong(round_trip, memoryview(bytearray(n)), n, budget) for n in sizes}
    s.close()
    if rank == 0:
        q.put(res)


def _spawn(target, per_rank_args) -> dict:
    """Start one spawned process per argument tuple (each gets the result queue last) and
    return what rank 0 puts on the queue."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args, q)) for args in per_rank_args]
    for p in procs:
        p.start()
    try:
        return q.get(timeout=1800)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()


def run_raw_tcp(sizes, budget: float) -> dict:
    """Ping-pong of `sizes` over one blocking loopback TCP socket between two processes."""
    port = _free_port()
    return _spawn(_raw_tcp_worker, [(r, port, sizes, budget) for r in range(2)])


def run(backend: str, transport: str | None, world: int, sizes, ar_sizes, budget: float) -> dict:
    """gloo or dicomm on `world` spawned local ranks: p2p ping-pong of `sizes` between ranks 0
    and 1, allreduce of `ar_sizes`; returns rank 0's results."""
    port = _free_port()
    return _spawn(_worker, [(r, world, port, backend, transport, sizes, ar_sizes, budget)
                            for r in range(world)])


def fmt_size(n: int) -> str:
    for unit, div in (("MiB", MiB), ("KiB", 1024)):
        if n >= div:
            return f"{n // div} {unit}"
    return f"{n} B"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="sizes up to 64 MiB, shorter loops")
    ap.add_argument("--ranks", default="2,4", help="comma-separated world sizes for allreduce (default 2,4)")
    ap.add_argument("--out", default=str(ROOT / "out" / "bench"), help="folder for comm.json and comm.png")
    args = ap.parse_args(argv)

    top = 64 * MiB if args.quick else 256 * MiB
    sizes = [8] + [1 << k for k in range(6, 29, 3) if (1 << k) <= top]
    if 64 * MiB not in sizes and top >= 64 * MiB:
        sizes.append(64 * MiB)
    sizes = sorted(set(sizes))
    budget = 0.5 if args.quick else 1.5
    worlds = [int(w) for w in args.ranks.split(",")]

    # (label, backend, transport)
    p2p_cfgs = [("gloo", "gloo", None), ("dicomm-tcp", "dicomm", "tcp"), ("dicomm-shm", "dicomm", "shm")]
    results: dict = {"p2p": {}, "allreduce": {}}
    t_start = time.time()
    for label, backend, transport in p2p_cfgs:
        print(f"[{time.time() - t_start:6.0f}s] p2p  {label:11s} 2 ranks ...", flush=True)
        results["p2p"][label] = run(backend, transport, 2, sizes, [], budget)["p2p"]
    print(f"[{time.time() - t_start:6.0f}s] p2p  raw-tcp     one blocking socket ...", flush=True)
    results["p2p"]["raw-tcp"] = run_raw_tcp(sizes, budget)
    for world in worlds:
        for label, backend, transport in [("gloo", "gloo", None), ("dicomm", "dicomm", None)]:
            print(f"[{time.time() - t_start:6.0f}s] allreduce {label:7s} {world} ranks ...", flush=True)
            results["allreduce"][f"{label}/{world}"] = run(backend, transport, world, [], sizes, budget)["allreduce"]

    # ---- tables ----
    print("\nPoint-to-point, 2 ranks (one-way latency us / bandwidth GB/s); raw-tcp: one blocking")
    print("loopback socket without torch (what one plain stream moves here)")
    hdr = (f"{'size':>9} | {'gloo':>17} | {'dicomm-tcp':>17} | {'dicomm-shm':>17} | {'raw-tcp':>17} | "
           f"{'tcp/gloo':>8} | {'shm/gloo':>8} | {'gloo/raw':>8}")
    print(hdr)
    print("-" * len(hdr))
    P = results["p2p"]
    for s in sizes:
        g, t, m, r = P["gloo"][s], P["dicomm-tcp"][s], P["dicomm-shm"][s], P["raw-tcp"][s]
        cell = lambda r: f"{r['lat_us']:8.1f} {r['bw_GBs']:8.3f}"
        ratio = lambda a, b: f"{a['bw_GBs'] / b['bw_GBs']:8.2f}"
        print(f"{fmt_size(s):>9} | {cell(g)} | {cell(t)} | {cell(m)} | {cell(r)} | "
              f"{ratio(t, g)} | {ratio(m, g)} | {ratio(g, r)}")
    print("\nAllreduce float32 (busbw GB/s)")
    hdr = f"{'size':>9} | " + " | ".join(f"{'gloo/' + str(w):>9} {'dicomm/' + str(w):>9} {'ratio':>6}" for w in worlds)
    print(hdr)
    print("-" * len(hdr))
    A = results["allreduce"]
    for s in sizes:
        cells = []
        for w in worlds:
            g, d = A[f"gloo/{w}"][s]["busbw_GBs"], A[f"dicomm/{w}"][s]["busbw_GBs"]
            cells.append(f"{g:9.3f} {d:9.3f} {d / g:6.2f}")
        print(f"{fmt_size(s):>9} | " + " | ".join(cells))

    # ---- targets ----
    print("\nTargets (issue 3):")
    checks = []
    lat_ratio = P["dicomm-shm"][8]["lat_us"] / P["gloo"][8]["lat_us"]
    lat_tcp = P["dicomm-tcp"][8]["lat_us"] / P["gloo"][8]["lat_us"]
    checks.append((f"8 B one-way latency shm {P['dicomm-shm'][8]['lat_us']:.1f} us, tcp {P['dicomm-tcp'][8]['lat_us']:.1f} us "
                   f"vs gloo {P['gloo'][8]['lat_us']:.1f} us: {lat_ratio:.3f}x / {lat_tcp:.3f}x (<= 0.2)", max(lat_ratio, lat_tcp) <= 0.2))
    big = 64 * MiB
    if big in sizes:
        r_tcp = P["dicomm-tcp"][big]["bw_GBs"] / P["gloo"][big]["bw_GBs"]
        r_shm = P["dicomm-shm"][big]["bw_GBs"] / P["gloo"][big]["bw_GBs"]
        checks.append((f"64 MiB p2p over tcp {r_tcp:.2f}x gloo (>= 1.2)", r_tcp >= 1.2))
        checks.append((f"64 MiB p2p over shm {r_shm:.2f}x gloo (>= 3)", r_shm >= 3))
        for w in worlds:
            r = A[f"dicomm/{w}"][big]["busbw_GBs"] / A[f"gloo/{w}"][big]["busbw_GBs"]
            checks.append((f"64 MiB allreduce busbw on {w} ranks {r:.2f}x gloo (>= 2)", r >= 2))
    for text, ok in checks:
        print(f"  [{'PASS' if ok else 'MISS'}] {text}")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "comm.json").write_text(json.dumps(results, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(1, 3, figsize=(16, 4.5))
        for label in P:
            ax[0].loglog(sizes, [P[label][s]["lat_us"] for s in sizes], "o-", label=label)
            ax[1].semilogx(sizes, [P[label][s]["bw_GBs"] for s in sizes], "o-", label=label)
        for key in A:
            ax[2].semilogx(sizes, [A[key][s]["busbw_GBs"] for s in sizes], "o-", label=key)
        ax[0].set(title="p2p one-way latency (2 ranks)", xlabel="bytes", ylabel="us")
        ax[1].set(title="p2p bandwidth (2 ranks)", xlabel="bytes", ylabel="GB/s")
        ax[2].set(title="allreduce busbw", xlabel="bytes", ylabel="GB/s")
        for a in ax:
            a.grid(True, which="both", alpha=0.3)
            a.legend()
        fig.tight_layout()
        fig.savefig(out / "comm.png", dpi=110)
        print(f"\nwrote {out / 'comm.png'} and {out / 'comm.json'}")
    except ImportError:
        print("matplotlib missing: no plot")
    return 0


if __name__ == "__main__":
    sys.exit(main())
