"""DiComm vs gloo on local ranks, nccl-tests style: p2p latency/bandwidth and allreduce busbw.

    .venv/bin/python benchmarks/comm.py                 # 2 and 4 ranks, 8 B .. 256 MiB
    .venv/bin/python benchmarks/comm.py --quick         # fewer sizes, up to 64 MiB

Conventions (as nccl-tests): one-way latency = median round trip / 2 of a ping-pong between
ranks 0 and 1; p2p bandwidth = bytes / one-way time; allreduce algbw = bytes / time and
busbw = algbw * 2 (n - 1) / n. The table prints dicomm/gloo ratios and the issue's targets; a
PNG plot goes to --out. The same ping-pong over one plain blocking socket (raw-tcp, no torch
framing) shows what a single loopback TCP stream moves on this machine.

Every contender runs in the same processes, on groups side by side (gloo, dicomm over tcp, over
shm, and the raw socket), and they take turns: each size is timed in ROUNDS rounds, each round
running every contender once in an order rotated from round to round. A shared VM drifts by 2x
within a minute (where the scheduler puts the ranks, steal time); taking turns makes that drift
hit every contender alike instead of whichever ran during a bad minute.
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
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MiB = 1 << 20
ROUNDS = 5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _iters(nbytes: int, budget_s: float, lo: int, hi: int, est_bw: float = 1e9) -> int:
    est = 60e-6 + nbytes / est_bw
    return max(lo, min(hi, int(budget_s / est)))


def _take_turns(contenders: dict[str, Callable[[], list[float]]], rounds: int) -> dict[str, list[float]]:
    """Call each contender's sampler once per round, the order rotated every round; return each
    contender's samples from all rounds. Every rank must call this with the same contenders."""
    names = list(contenders)
    samples: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            samples[name].extend(contenders[name]())
    return samples


def _ping_pong_sampler(round_trip: Callable, nbytes: int, budget: float) -> Callable[[], list[float]]:
    """A sampler timing round trips of `nbytes`: at least 4 per call (4 x ROUNDS in all), after a
    few untimed ones, since the contender's threads slept while the others ran."""
    timed = _iters(2 * nbytes, budget / ROUNDS, lo=4, hi=400)
    warm = _iters(2 * nbytes, budget / ROUNDS / 10, lo=1, hi=20)

    def sample() -> list[float]:
        rtts = []
        for i in range(warm + timed):
            t0 = time.perf_counter()
            round_trip()
            if i >= warm:
                rtts.append(time.perf_counter() - t0)
        return rtts

    return sample


def _raw_socket(rank: int) -> socket.socket:
    """A plain blocking loopback TCP connection between ranks 0 and 1 (TCP_NODELAY, as gloo).

    Rank 0 listens on a port the kernel picks and tells rank 1 over the default group: a port
    picked earlier and bound later can be taken meanwhile (by a dicomm or gloo listener)."""
    import torch.distributed as dist

    port = [0]
    if rank == 0:
        with socket.socket() as ls:
            ls.bind(("127.0.0.1", 0))
            ls.listen(1)
            port[0] = ls.getsockname()[1]
            dist.broadcast_object_list(port, src=0)
            ls.settimeout(60)
            s, _ = ls.accept()
            s.settimeout(None)
    else:
        dist.broadcast_object_list(port, src=0)
        s = socket.create_connection(("127.0.0.1", port[0]), timeout=60)
        s.settimeout(None)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def _worker(rank, world, port, sizes, ar_sizes, budget, q):
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    import torch
    import torch.distributed as dist

    import dicomm  # noqa: F401

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=300))

    def dicomm_group(transport: str | None):
        # The transport is read when a group connects: set it for this group only.
        saved = os.environ.pop("DICOMM_TRANSPORT", None)
        if transport:
            os.environ["DICOMM_TRANSPORT"] = transport
        group = dist.new_group(backend="dicomm")
        os.environ.pop("DICOMM_TRANSPORT", None)
        if saved is not None:
            os.environ["DICOMM_TRANSPORT"] = saved
        return group

    def log(text: str) -> None:
        if rank == 0:
            print(f"[{time.strftime('%H:%M:%S')}] {world} ranks: {text}", flush=True)

    res: dict = {"p2p": {}, "allreduce": {}}
    if sizes and world == 2:
        # gloo gets a group of its own too: ops on a new group cost the same Python path for all.
        groups = {"gloo": dist.new_group(backend="gloo"), "dicomm-tcp": dicomm_group("tcp"),
                  "dicomm-shm": dicomm_group("shm")}
        raw = _raw_socket(rank)
        peer = 1 - rank

        def torch_round_trip(buf, group):
            def round_trip():
                if rank == 0:
                    dist.send(buf, peer, group=group)
                    dist.recv(buf, peer, group=group)
                else:
                    dist.recv(buf, peer, group=group)
                    dist.send(buf, peer, group=group)
            return round_trip

        def raw_round_trip(buf):
            view = memoryview(buf.numpy()).cast("B")

            def recv():
                got = 0
                while got < len(view):
                    k = raw.recv_into(view[got:], len(view) - got, socket.MSG_WAITALL)
                    if k == 0:
                        raise ConnectionError("raw-tcp peer closed")
                    got += k

            def round_trip():
                if rank == 0:
                    raw.sendall(view)
                    recv()
                else:
                    recv()
                    raw.sendall(view)
            return round_trip

        def contenders(buf, nbytes: int) -> dict:
            out = {label: _ping_pong_sampler(torch_round_trip(buf, g), nbytes, budget)
                   for label, g in groups.items()}
            out["raw-tcp"] = _ping_pong_sampler(raw_round_trip(buf), nbytes, budget)
            return out

        # Fresh processes and connections run slower for their first messages (lazy set-up,
        # page faults, the scheduler spreading the ranks over the cores): as nccl-tests' -w.
        tiny = torch.zeros(2)
        for round_trip in [torch_round_trip(tiny, g) for g in groups.values()] + [raw_round_trip(tiny)]:
            for _ in range(1000):
                round_trip()
        for nbytes in sizes:
            log(f"p2p {fmt_size(nbytes)}")
            buf = torch.zeros(nbytes, dtype=torch.uint8)
            for label, rtts in _take_turns(contenders(buf, nbytes), ROUNDS).items():
                one_way = statistics.median(rtts) / 2
                res["p2p"].setdefault(label, {})[nbytes] = {"lat_us": one_way * 1e6,
                                                             "bw_GBs": nbytes / one_way / 1e9}
        raw.close()

    ar_groups = {"gloo": dist.new_group(backend="gloo"), "dicomm": dicomm_group(None)}
    for nbytes in ar_sizes:
        log(f"allreduce {fmt_size(nbytes)}")
        t = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
        n = _iters(4 * nbytes, budget / ROUNDS, lo=2, hi=200)

        def sampler(group):
            def sample() -> list[float]:
                dist.all_reduce(t, group=group)  # warm-up: this group's threads slept meanwhile
                dist.barrier(group=group)
                t0 = time.perf_counter()
                for _ in range(n):
                    dist.all_reduce(t, group=group)
                return [(time.perf_counter() - t0) / n]
            return sample

        times = _take_turns({label: sampler(g) for label, g in ar_groups.items()}, ROUNDS)
        for label, ts in times.items():
            tt = statistics.median(ts)
            algbw = t.numel() * 4 / tt / 1e9
            res["allreduce"].setdefault(f"{label}/{world}", {})[nbytes] = {
                "time_us": tt * 1e6, "algbw_GBs": algbw, "busbw_GBs": algbw * 2 * (world - 1) / world}
        del t
    dist.barrier()
    dist.destroy_process_group()
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


def run(world: int, sizes, ar_sizes, budget: float) -> dict:
    """gloo and dicomm on `world` spawned local ranks, taking turns: p2p ping-pong of `sizes`
    between ranks 0 and 1 (world 2 only: gloo, dicomm over tcp and shm, one raw socket) and
    allreduce of `ar_sizes`; returns rank 0's results."""
    port = _free_port()
    return _spawn(_worker, [(r, world, port, sizes, ar_sizes, budget) for r in range(world)])


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
    sizes += [64 * MiB, top]  # the 64 MiB targets, and the largest size asked for
    sizes = sorted(set(sizes))
    budget = 0.5 if args.quick else 1.5
    worlds = [int(w) for w in args.ranks.split(",")]

    results: dict = {"p2p": {}, "allreduce": {}}
    for world in worlds:
        r = run(world, sizes if world == 2 else [], sizes, budget)
        results["p2p"].update(r["p2p"])
        results["allreduce"].update(r["allreduce"])
    if not results["p2p"]:
        r = run(2, sizes, [], budget)
        results["p2p"].update(r["p2p"])

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
