"""What an 8 B message after a pause costs on this machine below any communication library.

``pause_floor.c`` (compiled here with ``cc``): two C processes exchanging 8 B over a TCP
loopback connection whose receiver polls (``MSG_DONTWAIT``, as dicomm's waiters while the host
is quiet) or blocks in ``recv()`` (as gloo; the peer), and over a flag in shared memory, in a
hot loop and after 1 ms and 10 ms of compute or of sleep on both processes.

Then torch's own path: one ``dist.send`` and one ``dist.recv`` of 8 B in this Python process on
torch's no-op backend (``fake``, from ``torch.testing._internal.distributed.fake_pg``: every op
completes at once, nothing moves), after the same pauses on the calling thread. Every
``torch.distributed`` backend pays that call before its first byte leaves.

``benchmarks/comm.py`` measures dicomm's round trips after the same pauses; this program says
how much of them no library can remove here. docs/dicomm.md (After a pause) shows the run.

    .venv/bin/python benchmarks/pause_floor.py
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from program_results import Measurement, save_run  # noqa: E402

TARGET_US = 12.0  # issue 46's goal for dicomm's 8 B one-way after a pause


def pause_name(kind: str, ms: float) -> str:
    return "a hot loop" if ms == 0 else f"{ms:g} ms {kind}"


def c_floor(out: Path) -> list[dict]:
    """Build and run pause_floor.c; one dict per (transport, pause)."""
    binary = out / "pause_floor"
    subprocess.run(["cc", "-O2", "-o", str(binary), str(Path(__file__).with_suffix(".c"))], check=True)
    proc = subprocess.run([str(binary)], check=True, capture_output=True, text=True, timeout=300)
    rows = []
    for line in proc.stdout.splitlines():
        transport, kind, ms, median, p10, n = line.split()
        rows.append({"transport": transport, "pause": pause_name(kind, float(ms)), "median_us": float(median),
                     "p10_us": float(p10), "n": int(n)})
    return rows


def torch_floor(samples: int = 200) -> list[dict]:
    """Microseconds of one blocking ``dist.send`` and one ``dist.recv`` (8 B) on torch's no-op
    backend, in a hot loop and after 1 ms and 10 ms of compute (small matmuls) on this thread."""
    import time

    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    message, a = torch.zeros(2), torch.randn(64, 64)

    def compute(ms: float) -> None:
        end = time.perf_counter() + ms / 1e3
        while time.perf_counter() < end:
            a @ a

    rows = []
    try:
        for ms in (0.0, 1.0, 10.0):
            sends, recvs = [], []
            for _ in range(samples if ms < 10 else samples // 4):
                compute(ms)
                t0 = time.perf_counter()
                dist.send(message, 1)
                t1 = time.perf_counter()
                dist.recv(message, 1)
                t2 = time.perf_counter()
                sends.append((t1 - t0) * 1e6)
                recvs.append((t2 - t1) * 1e6)
            for name, values in (("send", sends), ("recv", recvs)):
                values.sort()
                rows.append({"transport": name, "pause": pause_name("compute", ms), "median_us": values[len(values) // 2],
                             "p10_us": values[len(values) // 10], "n": len(values)})
    finally:
        dist.destroy_process_group()
    return rows


def print_table(title: str, rows: list[dict], peer: str) -> None:
    print(f"\n{title}\n{'pause':<18} {'contender':<10} {'median us':>10} {'p10 us':>8} {'vs ' + peer:>10} "
          f"{'vs 12 us':>9}")
    peers = {r["pause"]: r["median_us"] for r in rows if r["transport"] == peer}
    for r in rows:
        print(f"{r['pause']:<18} {r['transport']:<10} {r['median_us']:>10.1f} {r['p10_us']:>8.1f} "
              f"{r['median_us'] / peers[r['pause']]:>9.2f}x {r['median_us'] / TARGET_US:>8.2f}x")


def measurements(title: str, rows: list[dict], peer: str) -> list[Measurement]:
    return [Measurement(f"{title} after {r['pause']}" if r["pause"] != "a hot loop" else f"{title} in a hot loop",
                        r["transport"], [r["median_us"] * 1e-6],
                        {"p10_us": round(r["p10_us"], 2), "samples": r["n"], "peer": r["transport"] == peer})
            for r in rows]


def main() -> int:
    out = ROOT / "out" / "pause_floor"
    out.mkdir(parents=True, exist_ok=True)
    print(f"8 B after a pause, below any library ({os.cpu_count()} cores); target for dicomm: {TARGET_US:g} us one-way")
    c_rows = c_floor(out)
    print_table("C processes, 8 B one-way (half the round trip):", c_rows, "tcp-block")
    torch_rows = torch_floor()
    print_table("torch's own path: one call on a backend that does nothing (8 B):", torch_rows, "send")
    save_run("pause_floor", measurements("pause floor: C, 8 B one-way", c_rows, "tcp-block")
             + measurements("pause floor: torch's path, one call on its no-op backend,", torch_rows, "send"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
