"""The main job: train one model over pipeline stages of different emulated chips.

Runs, as a user would, each command of the HeteroPP workflow and shows what it prints:

1. ``ditorch profile``: measure the model's layer times on each chip type at TP 1 and 2;
2. ``ditorch plan``: HeteroAuto picks stages, TP sizes and layers for the cluster;
3. ``torchrun -m ditorch.train``: the heterogeneous run (one process per chip, dicomm);
4. ``python -m ditorch.train --reference``: the same model and batches in one CPU process, fp32;
5. ``ditorch mre``: the loss curves' Mean Relative Error against the H2 paper's 1.5%;
6. ``ditorch simulate --measured``: the measured pipeline timeline beside the simulated one.

    python examples/hetero_demo.py [--steps 50] [--chips A:1,B:1,C:2] [--reprofile]

Outputs land in ``out/hetero`` (plan, logs, trace, loss plot, timeline PNG).
"""
from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from heteropp.runtime.profiler import write_cluster  # noqa: E402
NOISE = ("rdma transport not usable", "FutureWarning", "return func(", "OMP_NUM_THREADS", "*****")


def run(cmd: list[str], env: dict, step: str, check: bool = True) -> int:
    """Run one command with its output shown (minus torchrun's and dicomm's boilerplate)."""
    print(f"\n[{step}] $ {' '.join(shlex.quote(c) for c in cmd)}", flush=True)
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        if not any(n in line for n in NOISE):
            print("   " + line, end="", flush=True)
    if proc.wait() != 0 and check:
        sys.exit(f"hetero demo: step {step} failed (exit {proc.returncode})")
    print(f"   ({time.perf_counter() - start:.0f} s)", flush=True)
    return proc.returncode


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--chips", default="A:1,B:1,C:2", help="chip type:count pairs of the emulated cluster")
    p.add_argument("--model", default="examples/configs/llama-small.yaml")
    p.add_argument("--gbs", default="1K", help="global batch in tokens (1K = 8 sequences of 128)")
    p.add_argument("--memory-scale", default="0.01", help="chip memory scale (0.01: a 32 GB chip holds 328 MiB)")
    p.add_argument("--reprofile", action="store_true", help="measure the chips again even if profiles exist")
    p.add_argument("--out", default="out/hetero")
    args = p.parse_args(argv)
    try:
        counts = {name: int(n) for name, n in (pair.split(":") for pair in args.chips.split(","))}
    except ValueError:
        p.error(f"--chips {args.chips!r}: expected NAME:COUNT pairs like A:1,B:1,C:2")
    out = REPO / args.out
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, DITORCH_MEMORY_SCALE=args.memory_scale, PYTHONPATH=str(REPO))
    py = sys.executable
    ditorch = [py, "-m", "ditorch.cli"]
    world = sum(counts.values())
    started = time.perf_counter()

    for chip in counts:
        profile = out / f"chip-{chip}.yaml"
        if args.reprofile or not profile.exists():
            run([*ditorch, "profile", "--chip", chip, "--model", args.model, "--tp", "1,2", "--out", str(profile)],
                env, "1/6")
        else:
            print(f"\n[1/6] chip {chip}: using the profile measured before ({profile}; --reprofile to measure again)")
    cluster = write_cluster(out / "cluster-emu.yaml", counts)
    plan = out / "plan.json"
    run([*ditorch, "plan", "--cluster", str(cluster), "--model", args.model, "--gbs", args.gbs, "--out", str(plan)],
        env, "2/6")
    run([py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world), "-m", "ditorch.train",
         "--plan", str(plan), "--steps", str(args.steps), "--loss-log", str(out / "run.jsonl"),
         "--trace", str(out / "trace.json")], env, "3/6")
    run([py, "-m", "ditorch.train", "--plan", str(plan), "--reference", "--steps", str(args.steps), "--quiet",
         "--loss-log", str(out / "reference.jsonl")], env, "4/6")
    verdict = run([*ditorch, "mre", str(out / "reference.jsonl"), str(out / "run.jsonl"), "--threshold", "1.5",
                   "--plot", str(out / "loss_curves.png")], env, "5/6", check=False)
    run([*ditorch, "simulate", str(plan), "--measured", str(out / "trace.json"), "--timeline",
         str(out / "timeline.png")], env, "6/6")
    print(f"\nhetero demo: {'PASS' if verdict == 0 else 'FAIL'} in {time.perf_counter() - started:.0f} s; "
          f"loss curves {out / 'loss_curves.png'}, timeline {out / 'timeline.png'}, "
          f"trace {out / 'trace.json'} (open in https://ui.perfetto.dev)")
    return verdict


if __name__ == "__main__":
    sys.exit(main())
