"""The main job: train one model over pipeline stages of different emulated chips.

Runs, as a user would, each command of the HeteroPP workflow and shows what it prints:

0. choose the time scale: how many times longer this host takes for a layer than each chip of
   the cluster does by its datasheet (the largest), times ranks per core and headroom;
1. ``ditorch profile``: measure the model's layer times on each chip type at TP 1 and 2;
2. ``ditorch plan``: HeteroAuto picks stages, TP sizes and layers for the cluster;
3. ``torchrun -m ditorch.train``: the heterogeneous run (one process per chip, dicomm);
4. ``python -m ditorch.train --reference``: the same model and batches in one CPU process, fp32;
5. ``ditorch mre``: the loss curves' Mean Relative Error against the H2 paper's 1.5%;
6. ``ditorch simulate --measured``: the measured pipeline timeline beside the simulated one;
7. ``ditorch hsr``: each chip group trains alone on its own best plan, and the HeteroSpeedupRatio
   of the whole cluster (at the same global batch) is measured against them;
8. ``ditorch ps leader`` + two clusters: the heterogeneous pipeline of step 3 and a one-chip
   cluster of another plan train one model together through Di-PS (each pipeline stage pushes
   its own units; pushes and pulls compressed with the codecs of ``PS_WIRE``, the fewest bytes
   of benchmarks/cross_cluster.py's modes that kept Di-PS's loss, whose bytes per outer round
   it prints), and their loss curves are plotted;
9. ``ditorch volunteer``: devices that come and go (examples/volunteer_demo.py): clients on
   chips A, B and C join parameter-server stages, one is killed, one leaves, one joins late,
   and the loss curve still equals single-process training's.

    python examples/hetero_demo.py [--steps 16] [--chips A:1,B:1,C:2] [--reprofile] [--no-ps] [--no-volunteer]

Outputs land in ``--out`` (default ``out/hetero``: plan, logs, trace, loss plot, timeline PNG, Di-PS
loss plot) and the volunteer phase's in its ``volunteer/``.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import yaml  # noqa: E402

from heteropp.model_spec import ModelSpec  # noqa: E402
from heteropp.runtime.profiler import cluster_time_scale, write_cluster  # noqa: E402

NOISE = ("rdma transport not usable", "FutureWarning", "return func(", "OMP_NUM_THREADS", "*****")


# Seconds each phase took ("1/9" -> seconds), printed at the end.
PHASE_SECONDS: dict[str, float] = {}


def run(cmd: list[str], env: dict, step: str, check: bool = True) -> int:
    """Run one command with its output shown (minus torchrun's and dicomm's boilerplate)."""
    print(f"\n[{step}] $ {' '.join(shlex.quote(c) for c in cmd)}", flush=True)
    start = time.perf_counter()
    try:
        return _run(cmd, env, step, check)
    finally:
        PHASE_SECONDS[step] = PHASE_SECONDS.get(step, 0.0) + time.perf_counter() - start


def _run(cmd: list[str], env: dict, step: str, check: bool) -> int:
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
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
    # Work per phase sized so the demo fits 12 minutes on 2 cores: the time scale makes every
    # step as long as the host needs to keep up with the chips (docs/device.md, "Speed").
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--chips", default="A:1,B:1,C:2", help="chip type:count pairs of the emulated cluster")
    p.add_argument("--model", default="examples/configs/llama-small.yaml")
    p.add_argument("--gbs", default="1K", help="global batch in tokens (1K = 8 sequences of 128)")
    p.add_argument("--memory-scale", default="0.01", help="chip memory scale (0.01: a 32 GB chip holds 328 MiB)")
    p.add_argument("--reprofile", action="store_true", help="measure the chips again even if profiles exist")
    p.add_argument("--time-scale", type=float, default=None,
                   help="run the chips this many times slower than their datasheets (default: chosen for this host)")
    p.add_argument("--ps-steps", type=int, default=8, help="steps of each cluster in the Di-PS phase")
    p.add_argument("--no-hsr", action="store_true", help="skip measuring each chip group alone (step 7)")
    p.add_argument("--no-ps", action="store_true", help="skip the Di-PS phase (step 8)")
    p.add_argument("--no-volunteer", action="store_true", help="skip the devices-that-come-and-go phase (step 9)")
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
    # Every chip runs at its datasheet's speed times one time scale, chosen so that this host
    # keeps up with every chip while ranks outnumber cores (docs/device.md, "Speed"): the chip
    # whose layer costs the host the most against its own time (a fast chip, or one whose
    # numerics the host reproduces at length) must keep up on its own rank, and all ranks' costs
    # together must fit the cores.
    time_scale = args.time_scale
    chosen = out / "time-scale.json"  # the scale chosen before, kept with the profiles taken at it
    if time_scale is None and chosen.exists() and not args.reprofile:
        time_scale = float(json.loads(chosen.read_text())["time_scale"])
        print(f"\n[0/9] time scale {time_scale:g}, chosen before ({chosen}; --reprofile to choose again)")
    if time_scale is None:
        time_scale, ratios = cluster_time_scale([counts], ModelSpec.load(args.model))
        PHASE_SECONDS["0/9"] = time.perf_counter() - started
        print(f"\n[0/9] this host's time for a layer of {Path(args.model).name} against each chip's: "
              + ", ".join(f"{c} {r:.1f}x" for c, r in ratios.items())
              + f"; {world} ranks on {os.cpu_count()} cores run at time scale {time_scale:g} "
              f"({PHASE_SECONDS['0/9']:.0f} s)", flush=True)
        chosen.write_text(json.dumps({"time_scale": time_scale, "host_ratios": ratios}) + "\n")

    for chip in counts:
        profile = out / f"chip-{chip}.yaml"
        if args.reprofile or not usable_profile(profile, chip, time_scale):
            run([*ditorch, "profile", "--chip", chip, "--model", args.model, "--tp", "1,2", "--repeats", "3",
                 "--time-scale", f"{time_scale:g}", "--out", str(profile)], env, "1/9")
        else:
            print(f"\n[1/9] chip {chip}: using the profile measured before ({profile}; --reprofile to measure again)")
    cluster = write_cluster(out / "cluster-emu.yaml", counts)
    plan = out / "plan.json"
    run([*ditorch, "plan", "--cluster", str(cluster), "--model", args.model, "--gbs", args.gbs, "--out", str(plan)],
        env, "2/9")
    run([py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world), "-m", "ditorch.train",
         "--plan", str(plan), "--steps", str(args.steps), "--loss-log", str(out / "run.jsonl"),
         "--trace", str(out / "trace.json")], env, "3/9")
    run([py, "-m", "ditorch.train", "--plan", str(plan), "--reference", "--steps", str(args.steps), "--quiet",
         "--loss-log", str(out / "reference.jsonl")], env, "4/9")
    verdict = run([*ditorch, "mre", str(out / "reference.jsonl"), str(out / "run.jsonl"), "--threshold", "1.5",
                   "--plot", str(out / "loss_curves.png")], env, "5/9", check=False)
    run([*ditorch, "simulate", str(plan), "--measured", str(out / "trace.json"), "--timeline",
         str(out / "timeline.png")], env, "6/9")
    hsr = None
    if len(counts) > 1 and not args.no_hsr:
        run([*ditorch, "hsr", "--cluster", str(cluster), "--model", args.model, "--gbs", args.gbs, "--batch",
             "constant", "--steps", "2", "--out", str(out / "hsr")], env, "7/9")
        hsr = json.loads((out / "hsr" / "hsr.json").read_text())
    if not args.no_ps:
        ps_started = time.perf_counter()
        verdict = two_clusters_through_dips(args, counts, plan, out, env) or verdict
        PHASE_SECONDS["8/9"] = time.perf_counter() - ps_started
    if not args.no_volunteer:
        import volunteer_demo

        volunteer_started = time.perf_counter()
        verdict = volunteer_demo.main(["--model", args.model, "--out", str(out / "volunteer")], step="9/9") or verdict
        PHASE_SECONDS["9/9"] = time.perf_counter() - volunteer_started
    summarize(out, plan, hsr)
    print("\nphase times: " + ", ".join(f"{step} {seconds:.0f} s" for step, seconds in sorted(PHASE_SECONDS.items())))
    print(f"\nhetero demo: {'PASS' if verdict == 0 else 'FAIL'} in {time.perf_counter() - started:.0f} s; "
          f"loss curves {out / 'loss_curves.png'}, timeline {out / 'timeline.png'}, "
          f"trace {out / 'trace.json'} (open in https://ui.perfetto.dev)"
          + ("" if args.no_ps else f", Di-PS clusters {out / 'dips_clusters.png'}")
          + ("" if args.no_volunteer else f", volunteer loss curves {out / 'volunteer' / 'loss_curves.png'}"))
    return verdict


def summarize(out: Path, plan_path: Path, hsr: dict | None) -> None:
    """The heterogeneous run in three verdicts: its loss against the fp32 reference, its speed
    against the simulation, and its throughput against each chip group alone."""
    from diutil.loss_log import load_losses
    from ditorch.hsr import simulated_iteration
    from ditorch.tools.mre import mean_relative_error
    from heteropp.measured import read_trace
    from heteropp.plan import Plan

    plan = Plan.from_json(plan_path)
    mre = mean_relative_error(load_losses(out / "reference.jsonl"), load_losses(out / "run.jsonl")).mre_percent
    measured, simulated = read_trace(out / "trace.json", plan.num_stages).iteration_time, simulated_iteration(plan)
    print("\nthe heterogeneous run:")
    print(f"  loss curve against the fp32 CPU reference: MRE {mre:.3f}% ({'within' if mre < 1.5 else 'above'} "
          f"the H2 paper's 1.5%)")
    print(f"  iteration: measured {measured:.3f} s, simulated {simulated:.3f} s, measured/simulated {measured / simulated:.3f}")
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
          f"{100 * ratio['simulated']:.1f}%; all chips together train {gain:.2f}x as fast as the fastest group "
          f"alone ({best['name']})")


# How the Di-PS phase's pushes and pulls travel: 4-bit both ways, 3.6x fewer bytes than BF16 at
# Di-PS's loss (docs/dips.md, "Compressed and streamed outer steps", measured).
PS_WIRE = {"push": "int4", "pull": "int4"}


def two_clusters_through_dips(args, counts: dict[str, int], plan: Path, out: Path, env: dict) -> int:
    """Step 7: a Di-PS leader (with two followers it runs) and two clusters training one model:
    the heterogeneous pipeline of ``plan`` and a one-chip cluster planned for the first chip type."""
    from dips.auth import JobToken
    from diutil.address import free_port
    from dips.rpc import RpcClient, RpcError

    py, ditorch = sys.executable, [sys.executable, "-m", "ditorch.cli"]
    job, servers = JobToken.create(out / "job.key"), JobToken.create(out / "servers.key")
    single = out / "plan-single.json"
    first = next(iter(counts))
    run([*ditorch, "plan", "--cluster", str(write_cluster(out / "cluster-single.yaml", {first: 1})), "--model",
         args.model, "--gbs", args.gbs, "--out", str(single)], env, "8/9")
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
                   "--steps", str(args.ps_steps), "--seed", str(seed), "--ps", leader_addr, "--inner-steps", "4", "--ps-token-file",
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
        ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], label=f"cluster {name}")
    ax.set_xlabel("step (an outer step every 4)")
    ax.set_ylabel("training loss")
    ax.set_title("Two clusters, one model, through Di-PS")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "dips_clusters.png", dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
