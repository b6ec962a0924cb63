"""DiComm's tcp and rdma transports side by side: p2p one-way latency and bandwidth, and
allreduce bus bandwidth, 2 ranks, measured in the same run.

    .venv/bin/python benchmarks/rdma.py              # on a host with a verbs device
    .venv/bin/python benchmarks/rdma.py --vm         # inside the qemu soft-RoCE guest (root)

Without a usable verbs device and without --vm it says so and exits 0 (so `make bench` works
everywhere). Under the guest, rxe is a software NIC and the CPU is emulated by TCG (7-20x slower):
those numbers only show that both paths work end to end, not how fast RDMA is, and sizes stop
at 1 MiB there unless --max-bytes says otherwise (the in-guest tests move up to 64 MiB).
Conventions as benchmarks/comm.py (nccl-tests): one-way = median round trip / 2; busbw of
allreduce = bytes / time * 2 (n - 1) / n. A PNG plot goes to --out.
"""
from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from diutil.address import free_port  # noqa: E402

SIZES = [8, 4096, 64 << 10, 1 << 20, 16 << 20, 64 << 20]


def _iters(nbytes: int, slow: bool) -> int:
    budget = 0.6 if slow else 0.3
    est = (300e-6 if slow else 30e-6) + nbytes / (0.05e9 if slow else 1e9)
    return max(3, min(200, int(budget / est)))


def _rank(rank: int, port: int, transport: str, slow: bool, sizes: list[int], out: "mp.Queue") -> None:
    os.environ["DICOMM_TRANSPORT"] = transport
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch

    torch.set_num_threads(1)
    import dicomm  # noqa: F401
    import torch.distributed as dist

    dist.init_process_group("dicomm", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=600))
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    used = backend.transport_of(1 - rank)
    rows = []
    for n in sizes:
        buf = torch.ones(n, dtype=torch.uint8)
        iters = _iters(n, slow)
        rtts = []
        for i in range(iters + 1):
            if i == 0:
                dist.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            else:
                dist.recv(buf, 0)
                dist.send(buf, 0)
            if i:
                rtts.append(time.perf_counter() - t0)
        one_way = statistics.median(rtts) / 2
        x = torch.ones(n // 4 or 1, dtype=torch.float32)
        ar_iters = max(2, iters // 4)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(ar_iters):
            dist.all_reduce(x)
        ar = (time.perf_counter() - t0) / ar_iters
        rows.append({"bytes": n, "one_way_us": one_way * 1e6, "p2p_GBps": n / one_way / 1e9,
                     "allreduce_busbw_GBps": x.numel() * 4 / ar * 2 * (2 - 1) / 2 / 1e9})
        if rank == 0:
            print(f"  {transport:4s} {n:>10d} B  one-way {one_way * 1e6:10.1f} us", flush=True)
    if rank == 0:
        out.put({"transport": used, "rows": rows})
    dist.destroy_process_group()


def measure(transport: str, slow: bool, sizes: list[int]) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, transport, slow, sizes, q)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        res = q.get(timeout=1500)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    return res


def rdma_usable() -> bool:
    if os.environ.get("DICOMM_IN_RDMA_VM") == "1":
        return True  # the harness guest has rxe0; measure() checks every pair really is rdma
    code = "import dicomm, sys; sys.exit(0 if 'rdma' in dicomm.transports_usable() else 1)"
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, timeout=300).returncode == 0


def save_results(program: str, results: dict) -> None:
    """The run in pytest-benchmark's form (benchmarks/program_results.py): per size, each
    transport's one-way time with tcp as the peer, and the bandwidths beside it."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from program_results import Measurement, save_run

    rows = []
    for t, r in zip(results["tcp"]["rows"], results["rdma"]["rows"]):
        for name, row in (("tcp", t), ("rdma", r)):
            rows.append(Measurement(f"{program}, p2p one-way, {row['bytes']} B", name, [row["one_way_us"] * 1e-6],
                                    {"peer": name == "tcp", "p2p_GBps": round(row["p2p_GBps"], 4),
                                     "allreduce_busbw_GBps": round(row["allreduce_busbw_GBps"], 4)}))
    save_run(program, rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vm", action="store_true", help="run inside the qemu soft-RoCE guest (scripts/rdma_vm)")
    ap.add_argument("--out", default=str(ROOT / "out" / "rdma"), help="directory for the JSON and PNG")
    ap.add_argument("--max-bytes", type=int, default=None,
                    help="largest message (default 64 MiB; 1 MiB in the guest, where rxe under TCG moves "
                         "about 1 MB/s and each 64 MiB round trip takes minutes)")
    args = ap.parse_args()
    emulated = os.environ.get("DICOMM_IN_RDMA_VM") == "1"
    if args.vm and not emulated:
        cmd = [str(ROOT / "scripts/rdma_vm/run.sh"), "--timeout", "2400", "--collect", args.out, "--", sys.executable,
               str(Path(__file__).resolve()), "--out", "/run/rdma_vm/out"]
        if args.max_bytes:
            cmd += ["--max-bytes", str(args.max_bytes)]
        print("booting the soft-RoCE guest (scripts/rdma_vm/run.sh) ...", flush=True)
        rc = subprocess.call(cmd)
        if rc == 0:
            save_results("rdma_vm", json.loads((Path(args.out) / "rdma_vs_tcp.json").read_text()))
        return rc
    if not rdma_usable():
        print("benchmarks/rdma.py: no usable verbs device here (dicomm.transports_usable() has no 'rdma');\n"
              "  run it inside the soft-RoCE guest: .venv/bin/python benchmarks/rdma.py --vm")
        return 0
    if emulated:
        print("NOTE: emulated RDMA (rxe soft-RoCE in a TCG guest, CPU ~7x slower): these numbers only show\n"
              "      that both paths work end to end; they say nothing about RDMA speed on real NICs.")
    top = args.max_bytes or ((1 << 20) if emulated else SIZES[-1])
    sizes = [n for n in SIZES if n <= top]
    results = {}
    for transport in ("tcp", "rdma"):
        print(f"measuring {transport} ...", flush=True)
        results[transport] = measure(transport, slow=emulated, sizes=sizes)
        assert results[transport]["transport"] == transport, results[transport]
    print()
    print(f"{'bytes':>10} | {'tcp one-way us':>14} {'rdma one-way us':>15} {'rdma/tcp lat':>12} | "
          f"{'tcp GB/s':>9} {'rdma GB/s':>9} {'rdma/tcp bw':>11} | {'tcp AR busbw':>12} {'rdma AR busbw':>13}")
    for t, r in zip(results["tcp"]["rows"], results["rdma"]["rows"]):
        print(f"{t['bytes']:>10} | {t['one_way_us']:>14.1f} {r['one_way_us']:>15.1f} {r['one_way_us'] / t['one_way_us']:>12.2f} | "
              f"{t['p2p_GBps']:>9.3f} {r['p2p_GBps']:>9.3f} {r['p2p_GBps'] / t['p2p_GBps']:>11.2f} | "
              f"{t['allreduce_busbw_GBps']:>12.3f} {r['allreduce_busbw_GBps']:>13.3f}")
    if emulated:
        print("\n(emulated: both transports work; the ratios are not a performance claim)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "rdma_vs_tcp.json").write_text(json.dumps({"emulated": emulated, **results}, indent=1))
    if not emulated:  # (a guest's run is saved by the host that launched it, where the storage lives)
        save_results("rdma", results)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
        for name, res in results.items():
            xs = [r["bytes"] for r in res["rows"]]
            a.loglog(xs, [r["one_way_us"] for r in res["rows"]], "o-", label=name)
            b.semilogx(xs, [r["p2p_GBps"] for r in res["rows"]], "o-", label=name)
        a.set(xlabel="bytes", ylabel="one-way latency (us)", title="p2p latency")
        b.set(xlabel="bytes", ylabel="GB/s", title="p2p bandwidth")
        for ax in (a, b):
            ax.legend()
            ax.grid(True, which="both", alpha=0.3)
        if emulated:
            fig.suptitle("EMULATED (rxe + TCG): shows both paths work, not RDMA speed")
        fig.tight_layout()
        fig.savefig(out / "rdma_vs_tcp.png", dpi=100)
        print(f"wrote {out / 'rdma_vs_tcp.json'} and {out / 'rdma_vs_tcp.png'}")
    except ImportError:
        print(f"wrote {out / 'rdma_vs_tcp.json'} (matplotlib missing: no plot)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
