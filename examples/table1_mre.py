"""Reproduce Table 1 of the H2 paper: MRE of the training loss per chip against a reference.

Trains the small LLaMA-style model for ``--iters`` steps (paper: n = 300) with the same data,
seed and initial weights on the CPU in fp32 (the reference, the paper's A100) and on the
``dipu`` device under each emulated chip profile (``DITORCH_CHIP=A|B|C|D``, one process per
chip since the profile is chosen per process), logs each run's losses with
``ditorch.tools.LossLogger``, and prints the MRE per chip beside the paper's numbers, with a
PNG of the curves and the per-step relative error.

    .venv/bin/python examples/table1_mre.py                 # 300 iterations, chips A-D
    .venv/bin/python examples/table1_mre.py --iters 50 --chips A,D --out /tmp/t1
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

PAPER_MRE = {"A": 0.391, "B": 0.477, "C": 0.584, "D": 1.215}
THRESHOLD = 1.5
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing
# Small enough that 5 runs x 300 steps take a few minutes on 2 cores.
SMALL = dict(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=172, max_seq_len=64)


def synthetic_batch(step: int, seed: int, batch: int, seq: int, vocab: int):
    """Batch ``step`` of a fixed synthetic language: a sparse random bigram chain (each token
    has 4 likely successors), so the loss falls from ln(vocab) towards ~ln(4) and every run
    sees exactly the same tokens."""
    import torch

    g = torch.Generator().manual_seed(seed)
    successors = torch.randint(0, vocab, (vocab, 4), generator=g)
    g.manual_seed(seed * 1_000_003 + step)
    tokens = torch.empty(batch, seq + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, vocab, (batch,), generator=g)
    choice = torch.randint(0, 4, (batch, seq), generator=g)
    for t in range(seq):
        tokens[:, t + 1] = successors[tokens[:, t], choice[:, t]]
    return tokens


def train(args: argparse.Namespace) -> None:
    """One run (a worker process): train and log the loss of every step."""
    import torch

    torch.set_num_threads(args.threads)
    if args.device != "cpu":
        import ditorch  # noqa: F401  loads the device layer and registers dipu

        torch.empty(1, device=args.device)  # fail early, with torch's message, if unavailable
    from ditorch.models import Llama, LlamaConfig
    from ditorch.tools import LossLogger

    config = LlamaConfig.from_yaml(args.config) if args.config else LlamaConfig(**SMALL)
    torch.manual_seed(args.seed)
    model = Llama(config).to(args.device)  # initialized on the CPU: same weights everywhere
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    tokens_seen = 0
    with LossLogger(args.log) as log:
        for step in range(args.iters):
            batch = synthetic_batch(step, args.seed, args.batch, args.seq, config.vocab_size).to(args.device)
            loss = model.loss(batch)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            tokens_seen += batch.shape[0] * (batch.shape[1] - 1)
            log.log(step, loss.item(), tokens_seen)


def worker_command(args: argparse.Namespace, device: str, log: Path) -> list[str]:
    cmd = [sys.executable, __file__, "--worker", "--device", device, "--log", str(log), "--iters", str(args.iters),
           "--seed", str(args.seed), "--batch", str(args.batch), "--seq", str(args.seq), "--lr", str(args.lr),
           "--threads", str(args.threads)]
    return cmd + (["--config", args.config] if args.config else [])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--chips", default="A,B,C,D", help="comma-separated chip profiles (default A,B,C,D)")
    p.add_argument("--config", help="model YAML (default: a 2-layer dim-64 model, fast on 2 cores)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--threads", type=int, default=1, help="torch threads per run (runs go 2 at a time)")
    p.add_argument("--parallel", type=int, default=2, help="runs at a time")
    p.add_argument("--out", default="table1_out", help="folder for loss logs and the plot")
    p.add_argument("--timeout", type=float, default=1800, help="seconds allowed per run")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--device", default="cpu", help=argparse.SUPPRESS)
    p.add_argument("--log", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        train(args)
        return 0

    from ditorch.tools import load_losses, mean_relative_error, plot_mre

    chips = [c.strip().upper() for c in args.chips.split(",") if c.strip()]
    bad = [c for c in chips if c not in PAPER_MRE]
    if bad:
        p.error(f"--chips: unknown chip(s) {bad}; expected some of {sorted(PAPER_MRE)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = {"reference": ("cpu", None)} | {f"chip {c}": ("dipu", c) for c in chips}
    env_base = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env_base.pop("DITORCH_CHIP", None)  # the reference must not inherit a chip profile
    pending = list(runs.items())
    active: dict[str, tuple[subprocess.Popen, float, Path]] = {}
    failed: dict[str, str] = {}
    print(f"training {len(runs)} runs x {args.iters} iterations, {args.parallel} at a time ...", flush=True)
    while pending or active:
        while pending and len(active) < args.parallel:
            name, (device, chip) = pending.pop(0)
            env = dict(env_base, **({"DITORCH_CHIP": chip} if chip else {}))
            log = out / f"{name.replace(' ', '_')}.jsonl"
            errf = open(out / f"{name.replace(' ', '_')}.stderr", "w")
            proc = subprocess.Popen(worker_command(args, device, log), env=env, stderr=errf, stdout=errf)
            active[name] = (proc, time.time(), log)
        time.sleep(0.5)
        for name, (proc, start, log) in list(active.items()):
            elapsed = time.time() - start
            if proc.poll() is None and elapsed < args.timeout:
                continue
            if proc.poll() is None:
                proc.kill()
                proc.wait()
                failed[name] = f"timed out after {args.timeout:.0f}s"
            elif proc.returncode != 0:
                lines = (out / f"{name.replace(' ', '_')}.stderr").read_text().strip().splitlines()
                failed[name] = lines[-1] if lines else f"exit code {proc.returncode}"
            status = "failed: " + failed[name] if name in failed else "done"
            print(f"  {name:<10} {status} ({elapsed:.0f}s)", flush=True)
            del active[name]

    if "reference" in failed:
        print(f"reference run failed ({failed['reference']}); no MRE to compute", file=sys.stderr)
        return 1
    reference = load_losses(out / "reference.jsonl")
    reports = {}
    print(f"\nTable 1: MRE of the training loss against the CPU fp32 reference (n = {args.iters})")
    print(f"{'chip':<8} {'MRE (here)':>11} {'MRE (paper)':>12}  {'< 1.5%':<7} {'final loss':>10}  note")
    for chip in chips:
        name = f"chip {chip}"
        if name in failed:
            print(f"{chip:<8} {'-':>11} {PAPER_MRE[chip]:>11.3f}%  {'-':<7} {'-':>10}  run failed: {failed[name]}")
            continue
        report = mean_relative_error(reference, load_losses(out / f"chip_{chip}.jsonl"))
        reports[name] = report
        note = "identical to the reference: chip numerics inactive?" if report.mre_percent == 0.0 else ""
        print(f"{chip:<8} {report.mre_percent:>10.3f}% {PAPER_MRE[chip]:>11.3f}%  "
              f"{'pass' if report.passed(THRESHOLD) else 'FAIL':<7} {report.run[-1]:>10.4f}  {note}")
    print(f"reference final loss {reference[max(reference)]:.4f}; loss logs in {out}/")
    if reports:
        png = plot_mre(reports, out / "table1_mre.png", threshold_percent=THRESHOLD,
                       title=f"Loss vs CPU fp32 reference, {args.iters} iterations")
        print(f"plot: {png}")
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
