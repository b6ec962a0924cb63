"""Two ranks on two emulated hosts joined by a shaped link exchange data both ways: the
pattern of a 2-rank ring and of each rail of the two-level allreduce. Times an isend + irecv
of 32 MiB each way with the send posted first and with the receive posted first (as the ring
posts them), two such exchanges back to back, and an allreduce of 64 MiB, for dicomm and gloo,
on a 1 Gbit/s link (tc tbf both ways) with the token bucket's queue at 100 ms and at 5 ms.
Prints seconds per operation (median of 4, after one warm-up) beside the link's own time.
Needs root (network namespaces); says so and does nothing without.

    .venv/bin/python benchmarks/pair_exchange.py        # about a minute on 2 cores
"""
from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT, ROOT / "tests", ROOT / "tests" / "comm"):
    sys.path.insert(0, str(p))

import emulated_hosts  # noqa: E402
from launcher import run_ranks  # noqa: E402

LINK_MBIT = 1000
MiB = 1 << 20
PATTERNS = ("send first", "receive first", "two back to back", "allreduce 64 MiB")


def exchange(rank: int, world: int, port: int) -> dict[str, float]:
    import torch
    import torch.distributed as dist

    x, y, z = torch.ones(8 * MiB), torch.empty(8 * MiB), torch.ones(16 * MiB)  # 32, 32, 64 MiB
    peer = 1 - rank

    def swap(send_first: bool) -> None:
        reqs = [dist.isend(x, peer), dist.irecv(y, peer)] if send_first else [dist.irecv(y, peer), dist.isend(x, peer)]
        for r in reqs:
            r.wait()

    ops = {"send first": lambda: swap(True), "receive first": lambda: swap(False),
           "two back to back": lambda: (swap(False), swap(False)), "allreduce 64 MiB": lambda: dist.all_reduce(z)}
    out = {}
    for name, op in ops.items():
        times = []
        for _ in range(5):
            dist.barrier()
            t0 = time.perf_counter()
            op()
            times.append(time.perf_counter() - t0)
        out[name] = statistics.median(times[1:])
    return out


def shaped(queue: str):
    """emulated_hosts with the token bucket's queue (tbf latency) set to ``queue``."""
    def shape(ns: str, dev: str, rate_mbit: float) -> None:
        burst = max(16_000, int(rate_mbit * 1e6 / 8 * 0.004))
        subprocess.run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{rate_mbit}mbit",
                        "burst", str(burst), "latency", queue], check=True, capture_output=True)
    emulated_hosts._shape = shape
    return emulated_hosts.emulated_hosts(2, LINK_MBIT)


def main() -> int:
    why = emulated_hosts.can_make_hosts()
    if why:  # skipped, as the tests that need emulated hosts are
        print(f"pair_exchange: skipped: {why}")
        return 0
    link = {"send first": 32, "receive first": 32, "two back to back": 64, "allreduce 64 MiB": 64}
    print(f"2 hosts x 1 rank, {LINK_MBIT} Mbit/s both ways; seconds per op (median of 4)")
    print(f"{'queue':>6} {'pattern':>18} {'link':>6} {'dicomm':>7} {'gloo':>6} {'dicomm/gloo':>12}")
    for queue in ("100ms", "5ms"):
        with shaped(queue) as hosts:
            got = {b: run_ranks(exchange, 2, env={"TEST_BACKEND": b}, hosts=hosts, wall_timeout_s=300)
                   for b in ("dicomm", "gloo")}
        for name in PATTERNS:
            d, g = (max(got[b][r][name] for r in (0, 1)) for b in ("dicomm", "gloo"))
            print(f"{queue:>6} {name:>18} {link[name] * MiB * 8 / (LINK_MBIT * 1e6):>6.2f} {d:>7.2f} {g:>6.2f} "
                  f"{d / g:>11.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
