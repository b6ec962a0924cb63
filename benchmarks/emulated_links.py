"""Emulated links on the runtime: a plan trained with the fleet's links emulated by dicomm
(docs/dicomm.md, "Emulated links") and with the host's (DITORCH_EMULATED_LINKS=0), taking turns,
each against the simulator's time for the same links (the fleet's at the profiles' time scale,
or the host's: unscaled, as the simulation had them when the runs did not emulate links).

Uses the profiles and the main plan ``benchmarks/heteropp_runtime.py`` leaves in its --out
folder; ``--link-gbps``/``--latency-us`` restate the plan's links (same stages) to show a link
that dominates the step.

    python benchmarks/emulated_links.py [--out out/bench-heteropp] [--steps 4] [--rounds 2]
        [--link-gbps 0.1 --latency-us 500]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from heteropp.measured import read_trace  # noqa: E402
from heteropp.plan import Plan  # noqa: E402
from heteropp.schedule import one_f_one_b  # noqa: E402
from heteropp.simulator import pipeline_from_plan, simulate  # noqa: E402


def simulated(plan: Plan) -> dict[str, float]:
    """1F1B iteration with the fleet's links at the profiles' time scale, and with them unscaled."""
    pipe = pipeline_from_plan(plan)
    scale = plan.cluster.emulated_time_scale or 1.0
    host = dataclasses.replace(pipe, links=[dataclasses.replace(lk, bandwidth=lk.bandwidth * scale,
                                                                latency=lk.latency / scale) for lk in pipe.links])
    sched = one_f_one_b(plan.num_stages, plan.num_microbatches, [s.recompute for s in plan.stages])
    return {"emulated": simulate(pipe, sched).iteration_time, "host": simulate(host, sched).iteration_time}


def train(plan_path: Path, plan: Plan, links: str, steps: int, out: Path, env: dict) -> float:
    trace = out / f"links-{links}-{time.time_ns()}.trace.json"
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(plan.num_chips),
         "-m", "ditorch.train", "--plan", str(plan_path), "--steps", str(steps), "--quiet", "--zero1",
         "--schedule", "1f1b", "--trace", str(trace)],
        env=dict(env, DITORCH_EMULATED_LINKS="1" if links == "emulated" else "0"), capture_output=True, text=True)
    if run.returncode != 0:
        sys.exit(f"the {links}-links run failed:\n{run.stderr[-3000:]}")
    return read_trace(trace, plan.num_stages).iteration_time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(REPO / "out/bench-heteropp"))
    ap.add_argument("--plan", default="heteroauto_A1_B1_C2.json", help="a plan in --out")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--link-gbps", type=float, default=None, help="restate both of the plan's links' bandwidth")
    ap.add_argument("--latency-us", type=float, default=None, help="and their latency")
    args = ap.parse_args()
    out = Path(args.out)
    plan_path = out / args.plan
    if args.link_gbps is not None:
        data = json.loads(plan_path.read_text())
        for name in data["cluster"]["links"]:
            data["cluster"]["links"][name] = {"bandwidth_gbps": args.link_gbps, "latency_us": args.latency_us or 0.0}
        plan_path = out / f"links-{args.link_gbps:g}gbps-{args.latency_us or 0:g}us-{args.plan}"
        plan_path.write_text(json.dumps(data))
    plan = Plan.from_json(plan_path)
    env = dict(os.environ, PYTHONPATH=str(REPO), DITORCH_MEMORY_SCALE="0.01",
               DITORCH_PROFILE_FILE=str(out / "chips.yaml"))
    sims = simulated(plan)
    links = plan.cluster.inter_node
    print(f"{args.plan}: links {links.bandwidth / 1e9:g} GB/s, {links.latency * 1e6:g} us at time scale "
          f"{plan.cluster.emulated_time_scale:g}; {args.steps} steps per run, load {os.getloadavg()[0]:.1f}")
    print(f"{'links':<9} {'measured s':>10} {'simulated s':>11} {'meas/sim':>8}")
    for _ in range(args.rounds):
        for kind in ("emulated", "host"):
            measured = train(plan_path, plan, kind, args.steps, out, env)
            print(f"{kind:<9} {measured:>10.3f} {sims[kind]:>11.3f} {measured / sims[kind]:>8.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
