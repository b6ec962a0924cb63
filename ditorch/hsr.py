"""``ditorch hsr``: the HeteroSpeedupRatio of a cluster, measured by training on it.

Each chip group (chip type) trains alone on its own best plan (HeteroAuto over that group), then
the whole cluster trains on HeteroAuto's plan for all of it, at the same global batch
(*constant*) and, if asked, at the groups' batches summed (*sum*). Every run is
``torchrun -m ditorch.train --trace`` on this host; throughputs come from the traces, and the
simulator's prediction for each plan is printed beside them. ``heteropp.hsr`` holds the formula
and the planner's expectation; this module runs the jobs.

    ditorch hsr --cluster cluster.yaml --model model.yaml --gbs 1K [--batch constant,sum] [--steps 4]
"""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from heteropp.cluster import ClusterSpec, parse_tokens
from heteropp.hsr import best_plan, hetero_speedup_ratio, sub_cluster
from heteropp.model_spec import ModelSpec
from heteropp.plan import Plan

BATCHES = ("constant", "sum")


@dataclasses.dataclass
class RunResult:
    """One training run of the measurement."""

    name: str
    plan: Plan
    measured_s: float  # median seconds per iteration after the first (inf: the run failed)
    simulated_s: float
    cpu_s: float  # CPU seconds of all ranks per iteration
    failure: str = ""  # why the run did not train (a group alone then counts 0, as the HSR defines)

    @property
    def tokens(self) -> int:
        return self.plan.global_batch_tokens

    def throughput(self, simulated: bool = False) -> float:
        return self.tokens / (self.simulated_s if simulated else self.measured_s)

    def stages(self) -> str:
        return " ".join(f"{s.chip}/tp{s.tp}/dp{s.dp}/{s.layers}L{'/rc' if s.recompute else ''}" for s in self.plan.stages)


@dataclasses.dataclass
class Measurement:
    """Every group alone and the whole cluster at each batch asked for."""

    alone: list[RunResult]
    together: dict[str, RunResult]  # batch kind -> run

    def ratio(self, batch: str, simulated: bool = False) -> float:
        return hetero_speedup_ratio(self.together[batch].throughput(simulated),
                                    [r.throughput(simulated) for r in self.alone])

    def to_dict(self) -> dict:
        def run(r: RunResult) -> dict:
            return {"name": r.name, "stages": r.stages(), "chips": r.plan.num_chips, "tokens": r.tokens,
                    "microbatches": r.plan.num_microbatches, "measured_s": r.measured_s if not r.failure else None,
                    "simulated_s": r.simulated_s, "cpu_s": r.cpu_s, "failure": r.failure}

        return {"alone": [run(r) for r in self.alone], "together": {k: run(r) for k, r in self.together.items()},
                "hsr": {k: {"measured": self.ratio(k), "simulated": self.ratio(k, True)} for k in self.together}}


def simulated_iteration(plan: Plan, schedule: str | None = None) -> float:
    """The simulator's iteration time for ``plan`` under ``schedule`` (default: the plan's)."""
    from heteropp.plan_schedules import plan_schedules, schedule_pipeline
    from heteropp.simulator import simulate

    pipeline = schedule_pipeline(plan, schedule)
    return simulate(pipeline, plan_schedules(plan, schedule)[:len(pipeline.microbatches)]).iteration_time


def train_command(plan_path: Path, trace: Path, chips: int, steps: int) -> list[str]:
    """torchrun of ``ditorch.train`` on ``plan_path``, its trace written to ``trace``. ZeRO-1, as the
    plan's memory estimate assumes for its DP sizes (the optimizer's state sharded over DP)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(chips),
            "-m", "ditorch.train", "--plan", str(plan_path), "--steps", str(steps), "--quiet", "--zero1",
            "--trace", str(trace)]


class TrainingRun:
    """One run of the measurement, started on construction; :meth:`result` waits for it. Its
    output goes to a log file beside the plan, so runs side by side never block on a pipe."""

    def __init__(self, name: str, plan: Plan, out: Path, steps: int, env: dict | None = None):
        tag = name.replace(" ", "_").replace(",", "")
        self.name, self.plan = name, plan
        plan_path, self.trace, self.log = out / f"{tag}.json", out / f"{tag}.trace.json", out / f"{tag}.log"
        plan.to_json(plan_path)
        with open(self.log, "w") as log:
            # a session of its own, so that stop() reaches torchrun's ranks too
            self.proc = subprocess.Popen(train_command(plan_path, self.trace, plan.num_chips, steps), env=env,
                                         stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True)

    def stop(self) -> None:
        """Kill the run, its ranks included, if it is still going."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:  # it ended meanwhile
                pass

    def result(self) -> RunResult:
        from heteropp.measured import read_trace

        if self.proc.wait() != 0:
            output = self.log.read_text(errors="replace")
            out_of_memory = next((line.strip() for line in output.splitlines() if "OutOfMemoryError" in line), None)
            if out_of_memory:  # the plan fits by its estimate, the run does not: reported, not fatal
                return RunResult(self.name, self.plan, float("inf"), simulated_iteration(self.plan), 0.0,
                                 failure=out_of_memory)
            raise RuntimeError(f"{self.name}: the run failed (exit {self.proc.returncode}; {self.log}):\n"
                               f"{output[-3000:]}")
        measured = read_trace(self.trace, self.plan.num_stages)
        return RunResult(self.name, self.plan, measured.iteration_time, simulated_iteration(self.plan),
                         measured.cpu_per_step)


def train_and_time(name: str, plan: Plan, out: Path, steps: int, env: dict | None = None) -> RunResult:
    """Train ``plan`` for ``steps`` steps under torchrun on this host and read its trace."""
    return TrainingRun(name, plan, out, steps, env).result()


def plans(model: ModelSpec, cluster: ClusterSpec, gbs: int, batches: tuple[str, ...], alpha: float = 1.0
          ) -> tuple[dict[str, Plan], dict[str, Plan]]:
    """Each chip type's best plan alone at ``gbs``, and the whole cluster's at each batch kind."""
    alone = {}
    for chip in cluster.chips:
        plan = best_plan(model, sub_cluster(cluster, [chip.name]), gbs, alpha)
        if plan is None:
            raise ValueError(f"chip group {chip.name} cannot train the model alone at {gbs} tokens; the "
                             f"HeteroSpeedupRatio needs every group to")
        alone[chip.name] = plan
    together = {}
    for kind in batches:
        tokens = gbs if kind == "constant" else gbs * len(cluster.chips)
        plan = best_plan(model, cluster, tokens, alpha)
        if plan is None:
            raise ValueError(f"the whole cluster cannot train the model at {tokens} tokens")
        together[kind] = plan
    return alone, together


def measure(model: ModelSpec, cluster: ClusterSpec, gbs: int, out: Path, steps: int = 4,
            batches: tuple[str, ...] = BATCHES, env: dict | None = None, progress=print,
            groups_at_once: bool = True) -> Measurement:
    """Train every group alone and the whole cluster; ``progress`` gets one table row per run.

    With ``groups_at_once`` the groups train alone side by side: each on its own chips of the
    cluster, as they would on a real fleet, so together they occupy the chips (and, emulated,
    the host ranks) that the whole cluster's run does next, in the time of the slowest group."""
    out.mkdir(parents=True, exist_ok=True)
    alone_plans, together_plans = plans(model, cluster, gbs, batches)
    progress(header())
    alone = []
    if groups_at_once:
        runs = [TrainingRun(f"{chip} alone", plan, out, steps, env) for chip, plan in alone_plans.items()]
        with ThreadPoolExecutor(len(runs)) as pool:
            futures = [pool.submit(run.result) for run in runs]
            try:
                for done in as_completed(futures):  # the first failure raises here, whichever group it is
                    progress(row(done.result()))
            except BaseException:
                for run in runs:  # a failed group stops the measurement: its peers are not left running
                    run.stop()
                raise
        alone = [f.result() for f in futures]
    else:
        for chip, plan in alone_plans.items():
            alone.append(train_and_time(f"{chip} alone", plan, out, steps, env))
            progress(row(alone[-1]))
    together = {}
    for kind, plan in together_plans.items():
        together[kind] = train_and_time(f"all, {kind} batch", plan, out, steps, env)
        progress(row(together[kind]))
        if together[kind].failure:
            raise RuntimeError(f"all chips at {kind} batch did not train: {together[kind].failure}")
    return Measurement(alone, together)


def header() -> str:
    return (f"{'run':<20} {'stages (chip/TP/DP/layers)':<52} {'tokens':>6} {'mb':>3} {'measured s':>10} "
            f"{'simulated s':>11} {'meas/sim':>8} {'tok/s':>7} {'CPU s/it':>8}")


def row(r: RunResult) -> str:
    if r.failure:
        return f"{r.name:<20} {r.stages():<52} {r.tokens:>6} {r.plan.num_microbatches:>3} did not train: {r.failure}"
    return (f"{r.name:<20} {r.stages():<52} {r.tokens:>6} {r.plan.num_microbatches:>3} {r.measured_s:>10.3f} "
            f"{r.simulated_s:>11.3f} {r.measured_s / r.simulated_s:>8.3f} {r.throughput():>7.0f} {r.cpu_s:>8.2f}")


def ratio_table(m: Measurement) -> str:
    lines = ["HeteroSpeedupRatio (all chip groups together against the sum of each group alone):",
             f"  {'batch':<9} {'measured':>9} {'simulated':>9}"]
    for kind in m.together:
        lines.append(f"  {kind:<9} {100 * m.ratio(kind):>8.1f}% {100 * m.ratio(kind, True):>8.1f}%")
    for r in m.alone:
        if r.failure:
            lines.append(f"  {r.name} did not train on this runtime and counts 0 (the plan's memory estimate "
                         f"fits the chips, the run did not)")
    best_alone = max(m.alone, key=lambda r: r.throughput())
    if "constant" in m.together:
        gain = m.together["constant"].throughput() / best_alone.throughput()
        lines.append(f"  together at constant batch: {gain:.2f}x the fastest group alone ({best_alone.name})")
    return "\n".join(lines)


def register(subparsers) -> None:
    p = subparsers.add_parser("hsr", help="measure the HeteroSpeedupRatio: train each chip group alone and all together")
    p.add_argument("--cluster", required=True, help="cluster.yaml (ditorch plan's)")
    p.add_argument("--model", required=True, help="model.yaml")
    p.add_argument("--gbs", required=True, help="each group's global batch alone, in tokens (e.g. 1K)")
    p.add_argument("--batch", default="constant,sum", help="constant, sum or both (comma-separated)")
    p.add_argument("--steps", type=int, default=4, help="steps per run (the first is not timed)")
    p.add_argument("--out", default="out/hsr", help="plans, traces, logs and hsr.json land here")
    p.add_argument("--groups-in-turn", action="store_true",
                   help="train the groups alone one after another (default: side by side, each on its own chips)")
    p.set_defaults(func=hsr_command)


def hsr_command(args) -> int:
    try:
        batches = tuple(b.strip() for b in args.batch.split(","))
        if not batches or any(b not in BATCHES for b in batches):
            raise ValueError(f"--batch {args.batch!r}: expected constant, sum or both")
        if args.steps < 2:
            raise ValueError(f"--steps {args.steps}: expected at least 2 (the first step is not timed)")
        model, cluster, gbs = ModelSpec.load(args.model), ClusterSpec.from_yaml(args.cluster), parse_tokens(args.gbs)
        if len(cluster.chips) < 2:
            raise ValueError(f"{args.cluster}: one chip type; the HeteroSpeedupRatio compares two or more")
        out = Path(args.out)
        start = time.perf_counter()
        m = measure(model, cluster, gbs, out, args.steps, batches, env=dict(os.environ),
                    groups_at_once=not args.groups_in_turn)
    except (ValueError, OSError, RuntimeError) as exc:
        print(f"ditorch hsr: {exc}", file=sys.stderr)
        return 1
    print(ratio_table(m))
    (out / "hsr.json").write_text(json.dumps(m.to_dict(), indent=1))
    print(f"wrote {out / 'hsr.json'} ({time.perf_counter() - start:.0f} s)")
    return 0
