"""The main job: train one model over pipeline stages of different emulated chips.

Runs, as a user would, each command of the HeteroPP workflow and shows what it prints:

0. measure the host: the time scale (how many times longer this host takes for a layer than
   each chip of the cluster does by its datasheet, then every rank run at once at that scale,
   raised until each keeps up with its chip), a process's start-up and a fixed piece of CPU work;
   from these the budget's cost model (examples/demo_budget.py) sizes each phase's work (steps,
   repeats) so that the demo, with the set-up before it, fits ``--budget`` minutes;
1. ``ditorch profile``: measure the model's layer times on each chip type at TP 1 and 2;
2. ``ditorch plan``: HeteroAuto picks stages, TP sizes and layers for the cluster;
3. ``torchrun -m ditorch.train``: the heterogeneous run (one process per chip, dicomm);
4. ``python -m ditorch.train --reference``: the same model and batches in one CPU process, fp32;
5. ``ditorch mre``: the loss curves' Mean Relative Error against the H2 paper's 1.5%;
6. ``ditorch simulate --measured``: the measured pipeline timeline beside the simulated one;
7. ``ditorch hsr``: each chip group trains alone on its own best plan (side by side, each on its
   own chips), and the HeteroSpeedupRatio of the whole cluster (at the same global batch) is
   measured against them;
8. ``ditorch ps leader`` + two clusters: the heterogeneous pipeline of step 3 and a one-chip
   cluster of another plan train one model together through Di-PS (each pipeline stage pushes
   its own units; pushes and pulls compressed with the codecs of ``PS_WIRE``, the fewest bytes
   of benchmarks/cross_cluster.py's modes that kept Di-PS's loss, whose bytes per outer round
   it prints), and their loss curves are plotted;
9. ``ditorch volunteer``: devices that come and go (examples/volunteer_demo.py): clients on
   chips A, B and C join parameter-server stages, one is killed, one leaves, one joins late,
   and the loss curve still equals single-process training's.

    python examples/hetero_demo.py [--budget 10] [--steps N] [--chips A:1,B:1,C:2] [--reprofile] [--no-ps] [--no-volunteer]

Every verdict is printed with the work it rests on; at the end, each phase's predicted and
actual seconds and each training rank's lateness behind its chip (over 5% flagged).

Outputs land in ``--out`` (default ``out/hetero``: plan, logs, trace, loss plot, timeline PNG, Di-PS
loss plot) and the volunteer phase's in its ``volunteer/``.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "examples"))

import yaml  # noqa: E402

from demo_budget import (BATCHES, DIPS_INNER_STEPS, Host, demo_phases, describe,  # noqa: E402
                         predicted_against_actual, size_phases)
from heteropp.cluster import parse_tokens  # noqa: E402
from heteropp.model_spec import ModelSpec  # noqa: E402
from heteropp.runtime.profiler import LATE_WARNING_LINE, cluster_time_scale, write_cluster  # noqa: E402

NOISE = ("rdma transport not usable", "FutureWarning", "return func(", "OMP_NUM_THREADS", "*****")


# Seconds each phase took ("1/9" -> seconds), printed at the end.
PHASE_SECONDS: dict[str, float] = {}


def run(cmd: list[str], env: dict, step: str, check: bool = True, lines: list[str] | None = None) -> int:
    """Run one command with its output shown (minus torchrun's and dicomm's boilerplate); its
    lines also go into ``lines`` when given."""
    print(f"\n[{step}] $ {' '.join(shlex.quote(c) for c in cmd)}", flush=True)
    start = time.perf_counter()
    try:
        return _run(cmd, env, step, check, lines)
    finally:
        PHASE_SECONDS[step] = PHASE_SECONDS.get(step, 0.0) + time.perf_counter() - start


def _run(cmd: list[str], env: dict, step: str, check: bool, lines: list[str] | None) -> int:
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        if lines is not None:
            lines.append(line)
        if not any(n in line for n in NOISE):
            print("   " + line, end="", flush=True)
    if proc.wait() != 0 and check:
        sys.exit(f"hetero demo: step {step} failed (exit {proc.returncode})")
    print(f"   ({time.perf_counter() - start:.0f} s)", flush=True)
    return proc.returncode


def usable_profile(path: Path, chip: str, time_scale: float) -> bool:
    """Whether a profile measured before exists, is one the planner accepts and was taken at this
    run's time scale by this profiler (else measure again)."""
    from heteropp.cluster import ChipSpec
    from heteropp.runtime.profiler import PROFILER_VERSION

    if not path.exists():
        return False
    try:
        spec = ChipSpec.from_dict(chip, yaml.safe_load(path.read_text())["chips"][chip])
        if spec.emulated_time_scale != time_scale:
            raise ValueError(f"taken at time scale {spec.emulated_time_scale}, this run's is {time_scale:g}")
        if spec.profiler_version != PROFILER_VERSION:
            raise ValueError(f"measured by profiler version {spec.profiler_version}, this one is {PROFILER_VERSION}")
    except (ValueError, KeyError, TypeError, yaml.YAMLError) as exc:
        print(f"\n[1/9] chip {chip}: the profile measured before ({path}) is not usable ({exc}); measuring again")
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # Each phase's work (steps, repeats) is sized to --budget from what phase 0 measures of this
    # host (examples/demo_budget.py); a value given here fixes that phase's work instead.
    p.add_argument("--budget", type=float, default=10.0,
                   help="minutes the demo may take, with the set-up just before it (build/setup-seconds.json)")
    p.add_argument("--steps", type=int, default=None, help="training steps (default: sized to the budget)")
    p.add_argument("--chips", default="A:1,B:1,C:2", help="chip type:count pairs of the emulated cluster")
    p.add_argument("--model", default="examples/configs/llama-small.yaml")
    p.add_argument("--gbs", default=None,
                   help=f"global batch in tokens (default: {DEFAULT_GBS}, 8 sequences of 128, or half that when the "
                        f"budget cannot hold every phase's least work at it)")
    p.add_argument("--memory-scale", default="0.01", help="chip memory scale (0.01: a 32 GB chip holds 328 MiB)")
    p.add_argument("--reprofile", action="store_true", help="measure the chips again even if profiles exist")
    p.add_argument("--time-scale", type=float, default=None,
                   help="run the chips this many times slower than their datasheets (default: chosen for this host)")
    p.add_argument("--repeats", type=int, default=None, help="profile repeats per TP size (default: sized)")
    p.add_argument("--hsr-steps", type=int, default=None, help="steps of each HSR run (default: sized)")
    p.add_argument("--ps-steps", type=int, default=None, help="steps of each cluster in the Di-PS phase (default: sized)")
    p.add_argument("--volunteer-steps", type=int, default=None, help="steps of the volunteer phase (default: sized)")
    p.add_argument("--no-hsr", action="store_true", help="skip measuring each chip group alone (step 7)")
    p.add_argument("--no-ps", action="store_true", help="skip the Di-PS phase (step 8)")
    p.add_argument("--no-volunteer", action="store_true", help="skip the devices-that-come-and-go phase (step 9)")
    p.add_argument("--out", default="out/hetero")
    args = p.parse_args(argv)
    try:
        counts = {name: int(n) for name, n in (pair.split(":") for pair in args.chips.split(","))}
    except ValueError:
        p.error(f"--chips {args.chips!r}: expected NAME:COUNT pairs like A:1,B:1,C:2")
    if not args.budget > 0:
        p.error(f"--budget {args.budget}: expected a positive number of minutes")
    out = REPO / args.out
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, DITORCH_MEMORY_SCALE=args.memory_scale, PYTHONPATH=str(REPO))
    py = sys.executable
    ditorch = [py, "-m", "ditorch.cli"]
    world = sum(counts.values())
    started = time.perf_counter()
    setup_s = setup_seconds()
    time_scale = choose_time_scale(args, counts, out)
    host = measure_host(time_scale)
    PHASE_SECONDS["0/9"] = time.perf_counter() - started
    print(f"\n[0/9] a process starts in {host.start_s:.1f} s here; a fixed piece of CPU work takes {host.cpu_factor:.2f}x "
          f"the calibration host's time ({PHASE_SECONDS['0/9']:.0f} s)", flush=True)

    profile_scale = profile_time_scale(time_scale, world, max(PROFILED_TP))
    to_profile = [chip for chip in counts if args.reprofile or not usable_profile(out / f"chip-{chip}.yaml", chip,
                                                                                    time_scale)]
    phases = fixed_by_options(demo_phases(len(to_profile), len(counts) > 1 and not args.no_hsr, not args.no_ps,
                                          not args.no_volunteer, profile_scale / time_scale), args)
    budget_s = 60 * args.budget - setup_s - PHASE_SECONDS["0/9"]
    sizing = size_phases(phases, host, BUDGET_SHARE * budget_s, BATCHES if args.gbs is None else (1.0,))
    units = sizing.units
    args.gbs = args.gbs or str(round(sizing.batch * parse_tokens(DEFAULT_GBS)))
    print(f"\n[0/9] budget {args.budget:g} min: set-up {setup_s:.0f} s, phase 0 {PHASE_SECONDS['0/9']:.0f} s, "
          f"{budget_s:.0f} s left for the phases, sized to {100 * BUDGET_SHARE:.0f}% of it; a global batch of "
          f"{args.gbs} tokens; each phase's work and predicted seconds:\n   "
          + "\n   ".join(describe(sizing, phases)), flush=True)
    if sizing.over_s:
        print(f"   the budget cannot hold every phase's floor (the least work its verdict means something on): "
              f"the floors need {sizing.total_s:.0f} s, {sizing.total_s - budget_s:.0f} s more than is left; the demo "
              f"runs at the floors and will take about that much over {args.budget:g} min", flush=True)

    for chip in counts:
        profile = out / f"chip-{chip}.yaml"
        if chip in to_profile:
            profile_chip([*ditorch, "profile", "--chip", chip, "--model", args.model, "--tp",
                          ",".join(map(str, PROFILED_TP)), "--repeats", str(units["1/9"]), "--run-time-scale",
                          f"{time_scale:g}", "--out", str(profile)], chip, (profile_scale, time_scale), env)
        else:
            print(f"\n[1/9] chip {chip}: using the profile measured before ({profile}; --reprofile to measure again)")
    cluster = write_cluster(out / "cluster-emu.yaml", counts)
    plan = out / "plan.json"
    run([*ditorch, "plan", "--cluster", str(cluster), "--model", args.model, "--gbs", args.gbs, "--out", str(plan)],
        env, "2/9")
    steps = units["3/9"]
    train_lines: list[str] = []
    # Every rank states its lateness at exit, however small (ditorch_ext.chip, DITORCH_LATE_REPORT).
    run([py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world), "-m", "ditorch.train",
         "--plan", str(plan), "--steps", str(steps), "--loss-log", str(out / "run.jsonl"),
         "--trace", str(out / "trace.json")], dict(env, DITORCH_LATE_REPORT="all"), "3/9", lines=train_lines)
    late = rank_lateness(train_lines)
    run([py, "-m", "ditorch.train", "--plan", str(plan), "--reference", "--steps", str(steps), "--quiet",
         "--loss-log", str(out / "reference.jsonl")], env, "4/9")
    verdict = run([*ditorch, "mre", str(out / "reference.jsonl"), str(out / "run.jsonl"), "--threshold", "1.5",
                   "--plot", str(out / "loss_curves.png")], env, "5/9", check=False)
    run([*ditorch, "simulate", str(plan), "--measured", str(out / "trace.json"), "--timeline",
         str(out / "timeline.png")], env, "6/9")
    hsr = None
    if "7/9" in units:
        run([*ditorch, "hsr", "--cluster", str(cluster), "--model", args.model, "--gbs", args.gbs, "--batch",
             "constant", "--steps", str(units["7/9"]), "--out", str(out / "hsr")], env, "7/9")
        hsr = json.loads((out / "hsr" / "hsr.json").read_text())
    if "8/9" in units:
        args.ps_steps = units["8/9"]
        ps_started = time.perf_counter()
        verdict = two_clusters_through_dips(args, counts, plan, out, env) or verdict
        PHASE_SECONDS["8/9"] = time.perf_counter() - ps_started
    if "9/9" in units:
        import volunteer_demo

        volunteer_started = time.perf_counter()
        # its batch follows the pipeline's share of the default (8 sequences of 64 tokens at 1K)
        verdict = volunteer_demo.main(["--model", args.model, "--out", str(out / "volunteer"), "--steps",
                                       str(units["9/9"]), "--batch", str(round(VOLUNTEER_BATCH * sizing.batch))],
                                      step="9/9") or verdict
        PHASE_SECONDS["9/9"] = time.perf_counter() - volunteer_started
    summarize(out, plan, hsr, Work(steps, args.gbs, units.get("7/9"), units.get("9/9")), late)
    total = time.perf_counter() - started
    print(f"\nphase seconds, predicted (examples/demo_budget.py, at time scale {time_scale:g}) and actual:\n  "
          + "\n  ".join(predicted_against_actual(sizing.predicted_s, {k: v for k, v in PHASE_SECONDS.items()
                                                                      if k != "0/9"})))
    print(f"  set-up {setup_s:.0f} s + phase 0 {PHASE_SECONDS['0/9']:.0f} s + phases "
          f"{total - PHASE_SECONDS['0/9']:.0f} s = {setup_s + total:.0f} s against a budget of "
          f"{60 * args.budget:.0f} s ({'within' if setup_s + total <= 60 * args.budget else 'over'})")
    print(f"\nhetero demo: {'PASS' if verdict == 0 else 'FAIL'} in {total:.0f} s; "
          f"loss curves {out / 'loss_curves.png'}, timeline {out / 'timeline.png'}, "
          f"trace {out / 'trace.json'} (open in https://ui.perfetto.dev)"
          + ("" if args.no_ps else f", Di-PS clusters {out / 'dips_clusters.png'}")
          + ("" if args.no_volunteer else f", volunteer loss curves {out / 'volunteer' / 'loss_curves.png'}"))
    return verdict


# The demo's global batch in tokens when the budget holds every phase's floor at it (else half:
# examples/demo_budget.py, BATCHES).
DEFAULT_GBS = "1K"
# The volunteer phase's batch in sequences (of 64 tokens) at the default batch.
VOLUNTEER_BATCH = 8

# The TP sizes each chip is profiled at (the plan may give a chip group either).
PROFILED_TP = (1, 2)


def profile_time_scale(time_scale: float, world: int, profiled_ranks: int) -> float:
    """The time scale the chips are measured at, for training's ``time_scale`` chosen for ``world``
    ranks on this host's cores: a rank keeps up at a scale in inverse proportion to its share of a
    core, and a profile runs ``profiled_ranks`` ranks (its largest TP), not the cluster's. A chip's
    profiled times are its own at any scale its host keeps up at
    (tests/heteropp/test_profile_invariance.py); at a lower one the profile waits less for its
    emulated device. Two significant digits, never above training's."""
    cores = os.cpu_count() or 1
    scale = time_scale * min(1.0, cores / world) / min(1.0, cores / profiled_ranks)
    return min(time_scale, float(f"{scale:.2g}"))


def profile_chip(cmd: list[str], chip: str, time_scales: tuple[float, float], env: dict) -> None:
    """Phase 1 for one chip: ``cmd`` (``ditorch profile`` with the runs' time scale) measuring at
    the profiles' own scale, then, if its host fell behind there (beside other work that scale
    can be too low: a host that falls behind leaves the times less exact), again at training's,
    the scale the calibration found every rank keeping up at."""
    low, high = time_scales
    for scale in dict.fromkeys((low, high)):
        lines: list[str] = []
        run([*cmd, "--time-scale", f"{scale:g}"], env, "1/9", lines=lines)
        late = [float(m.group(1)) for m in map(LATE_WARNING_LINE.search, lines) if m]
        if not late or scale == high:
            return
        print(f"\n[1/9] chip {chip}'s host fell {max(late):.1f}% behind it at time scale {scale:g}: measuring again "
              f"at {high:g}, training's", flush=True)


# The phases are sized to this share of the budget: their predictions err by 10-30% on a loaded
# host (each phase's predicted and actual seconds are printed at the end).
BUDGET_SHARE = 0.85

# The set-up's record (scripts/setup_env.sh) counts against the budget when it was written this
# recently: `make demo` runs the set-up just before the demo; an older record is another run's.
SETUP_RECORD = REPO / "build" / "setup-seconds.json"
SETUP_RECORD_FRESH_S = 300.0


def setup_seconds() -> float:
    """Seconds of the set-up that ran just before this demo (0 when none did)."""
    try:
        if time.time() - SETUP_RECORD.stat().st_mtime > SETUP_RECORD_FRESH_S:
            return 0.0
        seconds = float(json.loads(SETUP_RECORD.read_text())["seconds"])
    except FileNotFoundError:
        return 0.0
    except (ValueError, KeyError, TypeError) as exc:
        print(f"hetero demo: {SETUP_RECORD} is unreadable ({exc}); the set-up's time is left out of the budget")
        return 0.0
    return seconds if seconds >= 0 else 0.0


def choose_time_scale(args, counts: dict[str, int], out: Path) -> float:
    """Phase 0: the time scale at which this host keeps up with every chip of the cluster
    (docs/device.md, "Speed"): each chip's host ratio measured alone gives a first scale
    (the largest ratio and the ratios' sum per core, with headroom), then the cluster's ranks run
    together at it, on the cores training will have beside whatever else runs there, and the
    scale rises until every rank keeps within heteropp.runtime.keep_up's target of its chip."""
    from heteropp.runtime.keep_up import TARGET_LATE_FRACTION, TRAINING_MARGIN, calibrate

    if args.time_scale is not None:
        return args.time_scale
    chosen = out / "time-scale.json"  # the scale chosen before, kept with the profiles taken at it
    if chosen.exists() and not args.reprofile:
        time_scale = float(json.loads(chosen.read_text())["time_scale"])
        print(f"\n[0/9] time scale {time_scale:g}, chosen before ({chosen}; --reprofile to choose again)")
        return time_scale
    started = time.perf_counter()
    spec = ModelSpec.load(args.model)
    first, ratios = cluster_time_scale([counts], spec)
    print(f"\n[0/9] this host's time for a layer of {Path(args.model).name} against each chip's: "
          + ", ".join(f"{c} {r:.1f}x" for c, r in ratios.items())
          + f"; {sum(counts.values())} ranks on {os.cpu_count()} cores: time scale {first:g} by the ratios "
          f"({time.perf_counter() - started:.0f} s)", flush=True)
    ranks = [chip for chip, n in counts.items() for _ in range(n)]
    keep_up = calibrate(ranks, spec, first)
    for scale, late in keep_up.tried:
        print(f"[0/9] all {len(ranks)} ranks at once at time scale {scale:g}: each rank's host behind its chip by "
              + ", ".join(f"{chip} {100 * x:.1f}%" for chip, x in zip(ranks, late)), flush=True)
    if keep_up.kept_up:
        print(f"[0/9] training runs at {TRAINING_MARGIN:g}x that: time scale {keep_up.time_scale:g} (a pipeline rank "
              f"does more per step than its layer's loop)")
    else:
        print(f"[0/9] no scale tried kept every rank within {100 * TARGET_LATE_FRACTION:g}%; running at "
              f"{keep_up.time_scale:g}, the ranks will say how late they were")
    chosen.write_text(json.dumps({"time_scale": keep_up.time_scale, "host_ratios": ratios,
                                  "tried": keep_up.tried}) + "\n")
    return keep_up.time_scale


def measure_host(time_scale: float) -> Host:
    """What the budget's cost model needs of this host: one process's start-up (Python, torch
    and the device layer imported) and its wall time for a fixed piece of CPU work against the
    calibration host's (wall time: neighbours and a CPU quota slow the demo as they slow this)."""
    from demo_budget import HOST_PROBE, HOST_PROBE_REFERENCE_S

    def probe() -> tuple[float, float]:
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-c", HOST_PROBE], env=dict(os.environ, PYTHONPATH=str(REPO)),
                              capture_output=True, text=True, check=True)
        work_s = float(json.loads(done.stdout.splitlines()[-1])["work_s"])
        return max(time.perf_counter() - start - work_s, 0.1), work_s

    # the faster of two: one sample may land on another job's burst
    (start_a, work_a), (start_b, work_b) = probe(), probe()
    return Host(time_scale, min(start_a, start_b), min(work_a, work_b) / HOST_PROBE_REFERENCE_S)


def fixed_by_options(phases: list, args) -> list:
    """Phases whose work an option fixes (--steps, --repeats, ...) at exactly that."""
    import dataclasses

    given = {"1/9": args.repeats, "3/9": args.steps, "7/9": args.hsr_steps, "8/9": args.ps_steps,
             "9/9": args.volunteer_steps}
    for step, value in given.items():
        if value is not None and value < 1:
            sys.exit(f"hetero demo: {value} units of work for phase {step}; expected at least 1")
    return [dataclasses.replace(ph, floor=given[ph.step], default=given[ph.step], most=given[ph.step], multiple_of=1)
            if given.get(ph.step) is not None else ph for ph in phases]


LATE_LINE = re.compile(r"ditorch: rank (\d+) chip (\S+) at time scale \S+: .*?\((\d+(?:\.\d+)?)%")
# A rank later than this share of its chip's device time did not keep up (the emulation's goal).
LATE_FLAG_PERCENT = 5.0


def rank_lateness(lines: list[str]) -> dict[int, tuple[str, float]]:
    """Each training rank's chip and how far (percent of its device time) its host fell behind,
    from the lines the ranks print at exit."""
    late = {}
    for line in lines:
        m = LATE_LINE.search(line)
        if m:
            late[int(m.group(1))] = (m.group(2), float(m.group(3)))
    return dict(sorted(late.items()))


class Work(NamedTuple):
    """How much work each verdict rests on."""

    steps: int
    gbs: str
    hsr_steps: int | None
    volunteer_steps: int | None


def summarize(out: Path, plan_path: Path, hsr: dict | None, work: Work, late: dict[int, tuple[str, float]]) -> None:
    """The heterogeneous run in three verdicts, each with the work it rests on: its loss against
    the fp32 reference, its speed against the simulation, and its throughput against each chip
    group alone; and how far each rank's host fell behind its chip."""
    from diutil.loss_log import load_losses
    from ditorch.hsr import simulated_iteration
    from ditorch.tools.mre import mean_relative_error
    from heteropp.measured import read_trace
    from heteropp.plan import Plan

    plan = Plan.from_json(plan_path)
    mre = mean_relative_error(load_losses(out / "reference.jsonl"), load_losses(out / "run.jsonl")).mre_percent
    measured, simulated = read_trace(out / "trace.json", plan.num_stages).iteration_time, simulated_iteration(plan)
    print("\nthe heterogeneous run:")
    print(f"  loss curve against the fp32 CPU reference: MRE {mre:.3f}% over {work.steps} steps x {work.gbs} tokens "
          f"({'within' if mre < 1.5 else 'above'} the H2 paper's 1.5%)")
    print(f"  iteration: measured {measured:.3f} s, simulated {simulated:.3f} s, measured/simulated "
          f"{measured / simulated:.3f} (over {work.steps} steps)")
    if late:
        print("  each rank's host behind its chip (% of its device time): "
              + ", ".join(f"rank {r} ({chip}) {pct:.1f}%" + (" LATE" if pct > LATE_FLAG_PERCENT else "")
                          for r, (chip, pct) in late.items())
              + (f"; over {LATE_FLAG_PERCENT:g}% the rank did not keep up and its times are the host's, not its "
                 f"chip's" if any(pct > LATE_FLAG_PERCENT for _, pct in late.values()) else
                 f"; every rank within {LATE_FLAG_PERCENT:g}%"))
    if hsr is None:
        return
    def tokens_per_s(r: dict) -> float:
        return 0.0 if r["failure"] else r["tokens"] / r["measured_s"]

    print(f"  {'run':<20} {'chips':>5} {'tokens/s':>9} {'simulated':>9}")
    for r in [*hsr["alone"], *hsr["together"].values()]:
        print(f"  {r['name']:<20} {r['chips']:>5} {tokens_per_s(r):>9.0f} {r['tokens'] / r['simulated_s']:>9.0f}"
              + (f"  (did not train: {r['failure']})" if r["failure"] else ""))
    ratio = hsr["hsr"]["constant"]
    together = hsr["together"]["constant"]
    best = max(hsr["alone"], key=tokens_per_s)
    gain = tokens_per_s(together) / tokens_per_s(best)
    print(f"  HeteroSpeedupRatio at constant batch: measured {100 * ratio['measured']:.1f}%, simulated "
          f"{100 * ratio['simulated']:.1f}% (each run {work.hsr_steps} steps, the first not timed); all chips "
          f"together train {gain:.2f}x as fast as the fastest group alone ({best['name']})")


# How the Di-PS phase's pushes and pulls travel: 4-bit both ways, 3.6x fewer bytes than BF16 at
# Di-PS's loss (docs/dips.md, "Compressed and streamed outer steps", measured).
PS_WIRE = {"push": "int4", "pull": "int4"}


def two_clusters_through_dips(args, counts: dict[str, int], plan: Path, out: Path, env: dict) -> int:
    """Step 7: a Di-PS leader (with two followers it runs) and two clusters training one model:
    the heterogeneous pipeline of ``plan`` and a one-chip cluster, at half its batch, planned for
    the first chip type."""
    from dips.auth import JobToken
    from diutil.address import free_port
    from dips.rpc import RpcClient, RpcError

    py, ditorch = sys.executable, [sys.executable, "-m", "ditorch.cli"]
    job, servers = JobToken.create(out / "job.key"), JobToken.create(out / "servers.key")
    single = out / "plan-single.json"
    first = next(iter(counts))
    # the one-chip cluster takes half the pipeline's batch: clusters of different sizes train at
    # batches of their own, and its steps then keep pace with the pipeline's four chips
    run([*ditorch, "plan", "--cluster", str(write_cluster(out / "cluster-single.yaml", {first: 1})), "--model",
         args.model, "--gbs", str(parse_tokens(args.gbs) // 2), "--out", str(single)], env, "8/9")
    run([*ditorch, "ps", "bytes", "--model", args.model, "--push", f"bf16,{PS_WIRE['push']}",
         "--pull", f"bf16,{PS_WIRE['pull']}"], env, "8/9")
    leader_addr = f"127.0.0.1:{free_port()}"
    followers = ",".join(f"127.0.0.1:{free_port()}" for _ in range(2))
    leader_cmd = [*ditorch, "ps", "leader", "--bind", leader_addr, "--followers", "2", "--launch-followers",
                  followers, "--checkpoint-root", str(out / "ps-followers"), "--model", args.model,
                  "--token-file", str(out / "job.key"), "--server-token-file", str(out / "servers.key"),
                  "--metadata", str(out / "ps-leader.json"), "--log-level", "WARNING"]
    (out / "ps-leader.json").unlink(missing_ok=True)  # a rerun starts a fresh job
    shutil.rmtree(out / "ps-followers", ignore_errors=True)
    print(f"\n[8/9] $ {' '.join(leader_cmd)}", flush=True)
    leader = subprocess.Popen(leader_cmd, env=env, cwd=REPO, stdout=open(out / "ps-leader.log", "w"),
                              stderr=subprocess.STDOUT)
    try:
        # each cluster draws its own batches (--seed), as clusters on their own data shards would
        clusters = {"pipeline": (plan, sum(counts.values()), 0), "single": (single, 1, 1)}
        procs = {}
        for name, (cluster_plan, world, seed) in clusters.items():
            cmd = [py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
                   "-m", "ditorch.train", "--plan", str(cluster_plan),
                   "--steps", str(args.ps_steps), "--seed", str(seed), "--ps", leader_addr,
                   "--inner-steps", str(DIPS_INNER_STEPS), "--ps-token-file",
                   str(out / "job.key"), "--ps-name", name, "--quiet", "--loss-log", str(out / f"ps-{name}.jsonl"),
                   "--ps-push", PS_WIRE["push"], "--ps-pull", PS_WIRE["pull"]]
            print(f"[8/9] $ {' '.join(shlex.quote(c) for c in cmd)}", flush=True)
            procs[name] = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=open(out / f"ps-{name}.log", "w"),
                                           stderr=subprocess.STDOUT)
        failed = [n for n, p in procs.items() if p.wait() != 0]
        try:
            status = RpcClient("dips.Leader", leader_addr, job).call("Status")
        except RpcError as exc:
            status = {"error": str(exc)}
    finally:
        leader.terminate()
        leader.wait(30)
    if failed:
        print(f"   clusters {failed} failed; see {out}/ps-*.log")
        return 1
    print(f"   Di-PS: {status.get('version')} outer steps applied from clusters pipeline ({', '.join(counts)}) "
          f"and single ({first}); {status.get('tokens')} tokens pushed; each push {PS_WIRE['push']}, each pull "
          f"{PS_WIRE['pull']}: {_bytes_per_round(args.model):,} bytes per outer round and cluster")
    _plot_clusters(out, clusters)
    return 0


def _bytes_per_round(model: str) -> int:
    """What one cluster's push and pull of the whole model move under ``PS_WIRE`` (a payload's
    size follows from the codec and the unit's size alone)."""
    from dips.codec import Codec
    from dips.layout import ModelLayout
    from dips.model import build_model, load_config

    sizes = [sum(t.numel for t in u.tensors) for u in ModelLayout.of(build_model(load_config(model), 0)).units]
    return sum(Codec.parse(PS_WIRE[d]).payload_bytes(n) for d in ("push", "pull") for n in sizes)


def _plot_clusters(out: Path, clusters: dict) -> None:
    import json

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name in clusters:
        rows = [json.loads(line) for line in (out / f"ps-{name}.jsonl").read_text().splitlines()]
        ax.plot([r["tokens"] for r in rows], [r["loss"] for r in rows], label=f"cluster {name}")
    ax.set_xlabel(f"tokens the cluster trained on (an outer step every {DIPS_INNER_STEPS} steps)")
    ax.set_ylabel("training loss")
    ax.set_title("Two clusters, one model, through Di-PS")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "dips_clusters.png", dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
