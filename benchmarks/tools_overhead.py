"""What the precision tools cost when they are off, on a training step of the small LLaMA.

Each peer runs in its own process (a module cannot be un-imported), single-threaded, side by
side with a baseline process started at the same instant (a barrier after setup), so load
from the rest of the machine hits both alike; the ratio is taken within each pair.
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
from program_results import Measurement, save_run  # noqa: E402
SMALL = dict(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=172, max_seq_len=64)
PEERS = ["baseline", "tools off", "time_ops on", "overflow on"]


def worker(peer: str, steps: int) -> None:
    import torch

    torch.set_num_threads(1)
    from dimodel import Llama, LlamaConfig

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
    print("ready", flush=True)
    sys.stdin.readline()  # barrier: the pair starts timing together
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


def run_pair(peer: str, steps: int) -> tuple[dict, dict]:
    """Run ``peer`` and a baseline side by side; returns their timings."""
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", name, "--steps", str(steps)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for name in ("baseline", peer)]
    try:
        for proc in procs:
            if proc.stdout.readline().strip() != "ready":
                raise RuntimeError(f"worker failed before timing (exit {proc.wait()})")
        for proc in procs:
            proc.stdin.write("go\n")
            proc.stdin.flush()
        outs = [proc.communicate(timeout=600)[0] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    base, other = (json.loads(out.strip().splitlines()[-1]) for out in outs)
    return base, other


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--worker", choices=PEERS, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.worker, args.steps)
        return 0
    peers = PEERS[1:]
    ratios: dict[str, list[float]] = {peer: [] for peer in peers}
    times: dict[str, list[float]] = {peer: [] for peer in PEERS}
    for r in range(args.rounds):
        for peer in peers:
            base, other = run_pair(peer, args.steps)
            ratios[peer].append(other["median_ms"] / base["median_ms"])
            times["baseline"].append(base["median_ms"])
            times[peer].append(other["median_ms"])
        print(f"round {r + 1}/{args.rounds}: tools off / baseline = {ratios['tools off'][-1]:.3f}",
              file=sys.stderr, flush=True)
    print(f"training step of the small LLaMA (2 layers, dim 64, batch 8x64), 1 thread per process; "
          f"{args.rounds} rounds x {args.steps} steps; each peer timed beside a baseline process")
    print(f"{'peer':<13} {'median ms':>10} {'ratio to its baseline (median of rounds)':>42} {'min':>7} {'max':>7}")
    print(f"{'baseline':<13} {statistics.median(times['baseline']):>10.2f} {1.0:>42.3f}")
    for peer in peers:
        rs = ratios[peer]
        print(f"{peer:<13} {statistics.median(times[peer]):>10.2f} {statistics.median(rs):>42.3f} "
              f"{min(rs):>7.3f} {max(rs):>7.3f}")
    save_run("tools_overhead", [
        Measurement("precision tools: llama train step, each peer beside a baseline process", peer,
                    [ms / 1e3 for ms in times[peer]],
                    {"peer": True} if peer == "baseline" else {"target": "<= 1.05x"} if peer == "tools off" else {})
        for peer in PEERS])
    off = statistics.median(ratios["tools off"])
    verdict = "PASS" if off < 1.05 else "FAIL"
    print(f"{verdict}: tools off / baseline = {off:.3f} (target < 1.05)")
    return 0 if off < 1.05 else 1


if __name__ == "__main__":
    sys.exit(main())
