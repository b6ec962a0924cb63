"""What the precision tools cost when they are off, on a training step of the small LLaMA.

Peers, each in its own process (a module cannot be un-imported), run alternately so machine
load hits them alike:
  baseline      ``ditorch.tools`` never imported
  tools off     ``ditorch.tools`` imported, every tool entered and exited once, then timed
and, for scale, the cost with a tool on:
  time_ops on   the timed steps run inside ``time_ops()``
  overflow on   the timed steps run inside ``overflow_check()``
Target: 'tools off' within 5% of 'baseline'.

    .venv/bin/python benchmarks/tools_overhead.py [--rounds 5 --steps 30]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
SMALL = dict(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=172, max_seq_len=64)
PEERS = ["baseline", "tools off", "time_ops on", "overflow on"]


def worker(peer: str, steps: int) -> None:
    import torch

    torch.set_num_threads(1)
    from ditorch.models import Llama, LlamaConfig

    torch.manual_seed(0)
    model = Llama(LlamaConfig(**SMALL))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 256, (8, 65))

    def step():
        loss = model.loss(tokens)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    context = None
    if peer != "baseline":
        import tempfile

        from ditorch import tools

        with tempfile.TemporaryDirectory() as tmp:  # use every tool once, then turn all off
            for tool in (tools.autocompare(out_dir=tmp), tools.overflow_check(), tools.time_ops(),
                         tools.capture(path=tmp, ops="addmm", max_calls=1),
                         tools.dtype_cast({torch.float32: torch.float64}, ops="softmax"),
                         tools.fallback(ops="layer_norm")):
                with tool:
                    step()
        assert torch._C._len_torch_dispatch_stack() == 0
        context = {"time_ops on": tools.time_ops, "overflow on": tools.overflow_check}.get(peer)
    for _ in range(3):
        step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        if context is None:
            step()
        else:
            with context():
                step()
        times.append(time.perf_counter() - start)
    print(json.dumps({"median_ms": 1e3 * statistics.median(times), "min_ms": 1e3 * min(times)}))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--worker", choices=PEERS, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.worker, args.steps)
        return 0
    results: dict[str, list[dict]] = {peer: [] for peer in PEERS}
    for r in range(args.rounds):
        for peer in PEERS:
            out = subprocess.run([sys.executable, __file__, "--worker", peer, "--steps", str(args.steps)],
                                 capture_output=True, text=True, timeout=600, check=True)
            results[peer].append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    base = statistics.median(x["median_ms"] for x in results["baseline"])
    base_min = min(x["min_ms"] for x in results["baseline"])
    print(f"training step of the small LLaMA (2 layers, dim 64, batch 8x64), 1 thread; "
          f"{args.rounds} processes x {args.steps} steps per peer")
    print(f"{'peer':<13} {'median ms':>10} {'best ms':>9} {'ratio (median)':>15} {'ratio (best)':>13}")
    for peer in PEERS:
        med = statistics.median(x["median_ms"] for x in results[peer])
        best = min(x["min_ms"] for x in results[peer])
        print(f"{peer:<13} {med:>10.2f} {best:>9.2f} {med / base:>15.3f} {best / base_min:>13.3f}")
    off = statistics.median(x["median_ms"] for x in results["tools off"]) / base
    verdict = "PASS" if off < 1.05 else "FAIL"
    print(f"{verdict}: tools off / baseline = {off:.3f} (target < 1.05)")
    return 0 if off < 1.05 else 1


if __name__ == "__main__":
    sys.exit(main())
