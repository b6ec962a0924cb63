"""HeteroPP runtime benchmark: real pipeline runs over emulated chips A, B and C against the
simulator's prediction for the same plans, the HeteroAuto plan against a uniform layer split,
SR&AG against naive resharding, the fine-grained schedule against 1F1B, and each chip's speed
inside a 4-rank pipeline on 2 cores against the same chip profiled alone; the main plan again
on a loaded machine (a busy process per core).

Every run is ``torchrun -m ditorch.train`` with ``--trace``; measured numbers come from the
trace (``heteropp.measured``), predictions from ``heteropp.simulator`` with the layer times
``ditorch profile`` measured on this machine at the start of the run.

    python benchmarks/heteropp_runtime.py [--steps 8] [--out out/bench-heteropp]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from ditorch.hsr import simulated_iteration  # noqa: E402
from heteropp.cluster import ClusterSpec, parse_tokens  # noqa: E402
from heteropp.measured import read_trace  # noqa: E402
from heteropp.model_spec import ModelSpec  # noqa: E402
from heteropp.plan import Plan  # noqa: E402
from heteropp.runtime.profiler import cluster_time_scale, write_cluster  # noqa: E402
from heteropp.search import HeteroAuto  # noqa: E402
from heteropp.simulator import pipeline_from_plan  # noqa: E402
from emulated_chips import speed_only_profiles  # noqa: E402
from program_results import Measurement, save_run  # noqa: E402

MODEL = REPO / "examples/configs/llama-small.yaml"
SCALE = "0.01"


ENV = dict(os.environ, DITORCH_MEMORY_SCALE=SCALE, PYTHONPATH=str(REPO))


def _env() -> dict:
    return ENV


def profile_chips(out: Path, chips: list[str], time_scale: float, reuse: bool = False) -> None:
    """Profiles each chip on this machine now (the build and the machine's speed both move the
    profiles) under `time_scale`, or, with `reuse`, keeps a profile an earlier run left in `out`."""
    for chip in chips:
        path = out / f"chip-{chip}.yaml"
        if not (reuse and path.exists()):
            print(f"profiling chip {chip} at time scale {time_scale:g} ...", flush=True)
            subprocess.run([sys.executable, "-m", "ditorch.cli", "profile", "--chip", chip, "--model", str(MODEL),
                            "--tp", "1,2", "--time-scale", str(time_scale), "--out", str(path)],
                           env=_env(), check=True, capture_output=True)


def cluster(out: Path, counts: dict[str, int]) -> ClusterSpec:
    return ClusterSpec.from_yaml(write_cluster(out / f"cluster-{'-'.join(f'{c}{n}' for c, n in counts.items())}.yaml",
                                               counts))


def heteroauto(out: Path, counts: dict[str, int]) -> Plan:
    auto = HeteroAuto(ModelSpec.from_yaml(MODEL), cluster(out, counts), parse_tokens("1K"))
    return auto.to_plan(auto.search())


def uniform(plan: Plan) -> Plan:
    """The same stages (chips, TP, DP, recompute) with the layers split as evenly as possible."""
    S, L = plan.num_stages, plan.model.n_layers
    layers = [L // S + (1 if i < L % S else 0) for i in range(S)]
    stages, first = [], 0
    for s, n in zip(plan.stages, layers):
        stages.append(dataclasses.replace(s, layers=n, first_layer=first))
        first += n
    return dataclasses.replace(plan, stages=tuple(stages), estimate={})


def _busy() -> None:
    while True:
        pass


@dataclasses.dataclass
class Run:
    name: str
    plan: Plan
    schedule: str = "1f1b"
    reshard: str = "srag"
    loaded: bool = False


def execute(run: Run, out: Path, steps: int) -> dict:
    tag = run.name.replace(" ", "_")
    plan_path = out / f"{tag}.json"
    run.plan.to_json(plan_path)
    trace = out / f"{tag}.trace.json"
    hogs = [mp.Process(target=_busy, daemon=True) for _ in range(os.cpu_count() or 1)] if run.loaded else []
    for h in hogs:
        h.start()
    start = time.perf_counter()
    try:
        # ZeRO-1, as the plan's memory and update estimates assume for its DP sizes
        proc = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(run.plan.num_chips),
             "-m", "ditorch.train", "--plan", str(plan_path), "--steps", str(steps), "--quiet", "--zero1", "--schedule",
             run.schedule, "--reshard", run.reshard, "--trace", str(trace)],
            env=_env(), capture_output=True, text=True)
    finally:
        for h in hogs:
            h.terminate()
    if proc.returncode != 0:
        sys.exit(f"{run.name}: the run failed:\n{proc.stderr[-3000:]}")
    m = read_trace(trace, run.plan.num_stages)
    sim = simulated_iteration(run.plan, run.schedule)
    return {"name": run.name, "stages": " ".join(f"{s.chip}/tp{s.tp}/{s.layers}L" for s in run.plan.stages),
            "schedule": run.schedule, "reshard": run.reshard, "loaded": run.loaded,
            "measured_s": m.iteration_time, "simulated_s": sim, "cpu_s": m.cpu_per_step,
            "p2p_mib": m.p2p_bytes_per_step / 2**20, "stage_busy_s": m.stage_busy,
            "stage_peak_gb": [b / 1e9 for b in m.stage_peak_bytes],
            "stage_estimate_gb": [run.plan.stage_memory(i) / 1e9 for i in range(run.plan.num_stages)],
            "wall_s": time.perf_counter() - start, "trace": str(trace)}


def chip_speed(result: dict, plan: Plan) -> list[tuple[str, float, float]]:
    """Per stage: measured compute per step in the pipeline against the profiled (solo) times."""
    b = plan.num_microbatches
    pipe = pipeline_from_plan(plan)
    rows = []
    for i, st in enumerate(pipe.stages):
        solo = b * (st.fwd + st.bwd_input + st.bwd_weight + (st.recompute_time if st.recompute else 0.0))
        rows.append((f"{i} {plan.stages[i].chip} tp{plan.stages[i].tp}", result["stage_busy_s"][i], solo))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", default=str(REPO / "out/bench-heteropp"))
    ap.add_argument("--reuse-profiles", action="store_true", help="keep chip profiles an earlier run left in --out")
    ap.add_argument("--time-scale", type=float, default=None,
                    help="emulation time scale of profiles and runs (default: chosen so this host keeps up with "
                         "4 ranks of chips A, B and C by their datasheets)")
    ap.add_argument("--numerics", choices=("host", "chip"), default="host",
                    help="host: chips A, B, C's speed and memory with IEEE numerics (default; "
                         "benchmarks/emulated_chips.py says why); chip: their own numerics")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    names = {c: c for c in "ABC"}
    if args.numerics == "host":
        names = speed_only_profiles(out / "chips.yaml", list(names))
        ENV["DITORCH_PROFILE_FILE"] = os.environ["DITORCH_PROFILE_FILE"] = str(out / "chips.yaml")
    mixes = ({"A": 1, "B": 1, "C": 2}, {"A": 2, "B": 1, "C": 1}, {"A": 2, "C": 2})
    if args.time_scale is None:
        # the chips' datasheet speeds times a scale at which this host keeps up with the 4 ranks of
        # every mix (each run reports how far its host fell behind, if it did: docs/device.md, "Speed")
        args.time_scale, ratios = cluster_time_scale([{names[c]: n for c, n in mix.items()} for mix in mixes],
                                                     ModelSpec.load(MODEL))
        print("this host's time for a layer against each chip's: "
              + ", ".join(f"{c} {r:.1f}x" for c, r in ratios.items()), flush=True)
    print(f"emulation time scale {args.time_scale:g} (4 ranks on {os.cpu_count()} cores), {args.numerics} numerics")
    profile_chips(out, list(names.values()), args.time_scale, args.reuse_profiles)
    plans = {f"heteroauto {' '.join(f'{c}{n}' for c, n in counts.items())}":
             heteroauto(out, {names[c]: n for c, n in counts.items()})
             for counts in mixes}
    main_name, main_plan = next(iter(plans.items()))
    runs = [Run(name, plan) for name, plan in plans.items()]
    uni = uniform(main_plan)
    if [s.layers for s in uni.stages] != [s.layers for s in main_plan.stages]:
        runs.append(Run("uniform split", uni))
    # resharding matters where TP changes at a boundary: the first plan with such a boundary
    reshard_name, reshard_plan = next(((n, p) for n, p in plans.items()
                                       if any(a.tp != b.tp for a, b in zip(p.stages, p.stages[1:]))), (None, None))
    if reshard_plan is not None:
        runs.append(Run("naive resharding", reshard_plan, reshard="naive"))
    runs += [Run("fine-grained", main_plan, schedule="fine-grained"), Run("loaded machine", main_plan, loaded=True)]
    results = []
    print(f"{'run':<24} {'stages (chip/TP/layers)':<40} {'measured s':>10} {'simulated s':>11} {'meas/sim':>8} "
          f"{'CPU s/step':>10} {'p2p MiB':>8}")
    for r in runs:
        res = execute(r, out, args.steps)
        results.append(res)
        print(f"{res['name']:<24} {res['stages']:<40} {res['measured_s']:>10.3f} {res['simulated_s']:>11.3f} "
              f"{res['measured_s'] / res['simulated_s']:>8.3f} {res['cpu_s']:>10.2f} {res['p2p_mib']:>8.2f}", flush=True)
    by = {r["name"]: r for r in results}
    main_r, fine, loaded = by[main_name], by["fine-grained"], by["loaded machine"]
    print(f"\nratios (same run of this program; the main plan is {main_name}):")
    within = [abs(by[n]["measured_s"] / by[n]["simulated_s"] - 1) for n in plans]
    print(f"  measured vs simulated, three HeteroAuto plans: {', '.join(f'{100 * w:.1f}%' for w in within)} off "
          f"(target within 10%)")
    if "uniform split" in by:
        uni_r = by["uniform split"]
        print(f"  uniform split / HeteroAuto plan: measured {uni_r['measured_s'] / main_r['measured_s']:.3f}x, "
              f"simulated {uni_r['simulated_s'] / main_r['simulated_s']:.3f}x")
    else:
        print("  uniform split: HeteroAuto's plan splits the layers uniformly in this run (nothing to compare)")
    if reshard_plan is not None:
        srag, naive = by[reshard_name], by["naive resharding"]
        print(f"  naive / SR&AG resharding ({reshard_name}): bytes {naive['p2p_mib'] / srag['p2p_mib']:.2f}x, "
              f"time {naive['measured_s'] / srag['measured_s']:.3f}x")
    else:
        print("  resharding: no plan changes TP at a stage boundary in this run (nothing to compare)")
    print(f"  1F1B / fine-grained: measured {main_r['measured_s'] / fine['measured_s']:.3f}x, "
          f"simulated {main_r['simulated_s'] / fine['simulated_s']:.3f}x")
    print(f"  loaded / quiet machine: {loaded['measured_s'] / main_r['measured_s']:.3f}x wall, "
          f"{loaded['cpu_s'] / main_r['cpu_s']:.3f}x CPU per step")
    print(f"\nchip speed inside the {main_plan.num_chips}-rank pipeline (compute per step) against the chip "
          f"profiled alone:")
    for label, measured, solo in chip_speed(main_r, main_plan):
        print(f"  stage {label:<10} pipeline {measured:.3f} s, alone {solo:.3f} s, {100 * (measured / solo - 1):+.1f}% "
              f"(target within 10%)")
    print("\ndevice memory high-water mark against the plan's estimate (main plan):")
    for i, (peak, est) in enumerate(zip(main_r["stage_peak_gb"], main_r["stage_estimate_gb"])):
        print(f"  stage {i}: measured {peak * 1e3:.1f} MB, estimate {est * 1e3:.1f} MB, {100 * (peak / est - 1):+.1f}% "
              f"(target within 20%)")
    (out / "results.json").write_text(json.dumps(results, indent=1))
    # What docs/heteropp-runtime.md shows per run (report.py reads these columns): a note per row
    # with what that row is compared with.
    notes = {main_name: "chips in the pipeline vs alone " + ", ".join(
                 f"{100 * (m / solo - 1):+.0f}%" for _, m, solo in chip_speed(main_r, main_plan))
             + "; memory vs the plan " + ", ".join(
                 f"{100 * (peak / est - 1):+.0f}%" for peak, est in zip(main_r["stage_peak_gb"], main_r["stage_estimate_gb"])),
             "fine-grained": f"1F1B / fine-grained: measured {main_r['measured_s'] / fine['measured_s']:.2f}x, "
                             f"simulated {main_r['simulated_s'] / fine['simulated_s']:.2f}x",
             "loaded machine": f"loaded / quiet: CPU per step {loaded['cpu_s'] / main_r['cpu_s']:.2f}x"}
    if "uniform split" in by:
        notes["uniform split"] = (f"uniform / HeteroAuto simulated "
                                  f"{by['uniform split']['simulated_s'] / main_r['simulated_s']:.2f}x")
    if reshard_plan is not None:
        notes["naive resharding"] = (f"naive / SR&AG on {reshard_name}: bytes "
                                     f"{by['naive resharding']['p2p_mib'] / by[reshard_name]['p2p_mib']:.2f}x, time "
                                     f"{by['naive resharding']['measured_s'] / by[reshard_name]['measured_s']:.2f}x")
    save_run("heteropp_runtime", [
        Measurement("heteropp runtime: seconds per pipeline iteration", r["name"], [r["measured_s"]],
                    {"stages": r["stages"], "simulated_s": round(r["simulated_s"], 3),
                     "measured/simulated": round(r["measured_s"] / r["simulated_s"], 2),
                     "cpu_s_per_step": round(r["cpu_s"], 2), "p2p_mib": round(r["p2p_mib"], 2),
                     "note": notes.get(r["name"], ""), "peer": r["name"] == main_name})
        for r in results])
    _plot(results, out / "heteropp_runtime.png")
    print(f"\nresults: {out / 'results.json'}, plot: {out / 'heteropp_runtime.png'}")
    return 0


def _plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["name"] for r in results]
    x = range(len(results))
    fig, ax = plt.subplots(figsize=(11, 4.5))
    ax.bar([i - 0.2 for i in x], [r["measured_s"] for r in results], 0.4, label="measured")
    ax.bar([i + 0.2 for i in x], [r["simulated_s"] for r in results], 0.4, label="simulated")
    ax.set_xticks(list(x))
    ax.set_xticklabels(names, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("seconds per iteration")
    ax.set_title("HeteroPP runtime on emulated chips: measured vs simulated (benchmarks/heteropp_runtime.py)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
