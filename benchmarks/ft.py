"""Fault-tolerant DP (``ditorch.train --ft``, docs/ft.md) against plain DP on dicomm.

A two-stage plan (X and Y chips, TP 1, the tests' small LLaMA; ``--stages 1``: all four layers on
one X chip) with DP 2, fp32, 16 micro-batches of 32 tokens per replica per step by default
(``--microbatches``), three runs of the same steps:

* plain DP: one ``torchrun`` of all the ranks (2 per stage; the DP all-reduce on a dicomm group);
* --ft, no failure: two replicas under a lighthouse, each its own ``torchrun`` of one rank per
  stage, on the vendors ``--vendors`` names (default: both on emulated chips, as plain DP's ranks
  are, so that the overhead compares like with like; ``--vendors cpu,emu`` trains one replica on
  the cpu vendor and one on emulated chips);
* --ft with a failure: replica 1 SIGKILLed (its whole torchrun) at step ``--kill-at``, started
  again at once; it heals from replica 0 and rejoins.

The emulated chips run at the time scale the other benchmarks choose for this host
(``heteropp.runtime.profiler.cluster_time_scale``: the host keeps up with them), so a step takes
the chips' time and the Manager's cost is what it adds to that, as on accelerators. At
``--time-scale 1`` the chips are far faster than the host: every step is then the host's CPU
time, and whatever CPU the Manager's Python spends shows as step time.

With two stages the four ranks share this machine's two cores, so the Manager's per-step meeting
of a replica's ranks (``should_commit``) waits on the slowest of them; one stage gives each rank a
core and measures the Manager alone.

Reported: the steady step time of each (median of the steps' inter-arrival times in the loss
log, read as the runs write it), the Manager's step overhead against plain DP (goal <= 5%), the
survivor's longest stall at the failure and at the rejoin, the steps replica 1 missed, the time
from its restart to its first step (heal), the MRE of the survivor's loss curve against the run
without failure (criterion 1.5%), and whether the fp32 run without failure equals plain DP bit
for bit. CPU time (all the runs' processes) stands beside wall time. A PNG of both curves and
the survivor's step times goes beside the JSON.

    python benchmarks/ft.py [--steps 60] [--kill-at 20] [--microbatches 16] [--stages 2] [--vendors emu,emu]
                            [--time-scale S] [--out out/bench-ft]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "tests" / "runtime"))

from ditorch.tools.mre import mean_relative_error  # noqa: E402
from plans import chip_file, kill_tree, make_plan  # noqa: E402


def _env(out: Path, **extra) -> dict:
    return dict(os.environ, PYTHONPATH=str(REPO), DITORCH_PROFILE_FILE=str(chip_file(out)),
                DITORCH_MEMORY_SCALE="0.001", **extra)


class LogWatcher:
    """The arrival time of each step's line in a loss log (polled every 5 ms)."""

    def __init__(self, path: Path):
        self.path, self.arrived, self.losses = path, {}, {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        seen = 0
        while not self._stop.is_set():
            if self.path.exists():
                lines = self.path.read_text().splitlines()
                now = time.monotonic()
                for line in lines[seen:]:
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError:
                        break  # a line being written: read it next time
                    self.arrived.setdefault(record["step"], now)
                    self.losses[record["step"]] = record["loss"]
                    seen += 1
            time.sleep(0.005)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def torchrun(out: Path, nproc: int, args: list[str], log: str, vendor: str | None = None) -> subprocess.Popen:
    env = _env(out, **({"DITORCH_VENDOR": vendor} if vendor else {}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "-m", "ditorch.train", "--plan", "plan.json", "--precision", "fp32", "--timeout", "30", "--quiet", *args]
    return subprocess.Popen(cmd, cwd=out, env=env, stdout=open(out / log, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def wait_ok(p: subprocess.Popen, what: str, out: Path, log: str, timeout: float = 600) -> None:
    try:
        rc = p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(p.pid)
        raise SystemExit(f"{what} did not finish within {timeout} s; see {out / log}")
    if rc != 0:
        raise SystemExit(f"{what} failed (exit {rc}); see {out / log}")


def lighthouse(out: Path) -> tuple[subprocess.Popen, str]:
    address_file = out / "lighthouse.txt"
    address_file.unlink(missing_ok=True)
    p = subprocess.Popen([sys.executable, "-m", "ditorch.cli", "ft", "lighthouse", "--bind", "127.0.0.1:0",
                          "--min-replicas", "1", "--join-timeout-ms", "500", "--heartbeat-timeout-ms", "1000",
                          "--address-file", str(address_file)], env=_env(out), stdout=open(out / "lighthouse.log", "w"),
                         stderr=subprocess.STDOUT)
    while not (address_file.exists() and address_file.read_text().strip()):
        if p.poll() is not None:
            raise SystemExit(f"the lighthouse failed; see {out / 'lighthouse.log'}")
        time.sleep(0.05)
    return p, address_file.read_text().strip()


def cpu_of_children() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def steady_step_time(arrived: dict[int, float], skip: int = 3) -> float:
    steps = sorted(arrived)
    gaps = [arrived[b] - arrived[a] for a, b in zip(steps, steps[1:]) if a > skip and b == a + 1]
    return statistics.median(gaps)


def chosen_time_scale(out: Path, plan, stages: int) -> float:
    """The time scale at which this host keeps up with the runs' ranks (2 per stage here)."""
    from heteropp.runtime.profiler import cluster_time_scale

    os.environ["DITORCH_PROFILE_FILE"] = str(chip_file(out))  # the measuring worker reads X and Y from it
    chips = {s.chip: 2 for s in plan.stages}
    scale, ratios = cluster_time_scale([chips], plan.model, precision="fp32", memory_scale=0.001)
    print(f"this host's time for a layer against each chip's: "
          f"{', '.join(f'{c} {r:.1f}x' for c, r in ratios.items())}; time scale {scale:g} "
          f"({2 * stages} ranks on {os.cpu_count()} cores)", flush=True)
    return scale


def run_plain_dp(out: Path, steps: int, stages: int) -> dict:
    (out / "dp.jsonl").unlink(missing_ok=True)
    watch = LogWatcher(out / "dp.jsonl")
    cpu, wall = cpu_of_children(), time.monotonic()
    p = torchrun(out, 2 * stages, ["--steps", str(steps), "--loss-log", "dp.jsonl", "--check-replicas", str(steps)], "dp.log")
    wait_ok(p, "plain DP", out, "dp.log")
    wall, cpu = time.monotonic() - wall, cpu_of_children() - cpu
    watch.stop()
    return {"losses": watch.losses, "step_s": steady_step_time(watch.arrived), "wall_s": wall, "cpu_s": cpu}


def run_ft(out: Path, steps: int, stages: int, vendors: list[str], tag: str, kill_at: int | None = None) -> dict:
    for k in range(2):
        (out / f"{tag}{k}.jsonl").unlink(missing_ok=True)
    lh, address = lighthouse(out)
    watches = [LogWatcher(out / f"{tag}{k}.jsonl") for k in range(2)]
    cpu, wall = cpu_of_children(), time.monotonic()
    ft = lambda k: ["--steps", str(steps), "--ft", "--lighthouse", address, "--replica", str(k),
                    "--loss-log", f"{tag}{k}.jsonl", "--check-replicas", str(steps)]
    procs = [torchrun(out, stages, ft(k), f"{tag}{k}.log", vendor) for k, vendor in enumerate(vendors)]
    result: dict = {}
    try:
        if kill_at is not None:
            while kill_at not in watches[1].arrived:
                if procs[1].poll() is not None or procs[0].poll() is not None:
                    raise SystemExit(f"a replica ended before step {kill_at}; see {out}/{tag}*.log")
                time.sleep(0.005)
            kill_tree(procs[1].pid)
            killed = time.monotonic()
            procs[1].wait()
            procs[1] = torchrun(out, stages, ft(1), f"{tag}1-restarted.log", vendors[1])
            result.update(killed=killed, killed_at=max(watches[0].arrived), restarted=time.monotonic())
        for k, p in enumerate(procs):
            wait_ok(p, f"replica {k} ({tag})", out, f"{tag}{k}.log")
    finally:
        for p in procs:
            if p.poll() is None:
                kill_tree(p.pid)
        lh.kill()
        lh.wait()
    wall, cpu = time.monotonic() - wall, cpu_of_children() - cpu
    for w in watches:
        w.stop()
    result.update(losses=watches[0].losses, replica1=watches[1].losses, arrived=watches[0].arrived,
                  arrived1=watches[1].arrived, step_s=steady_step_time(watches[0].arrived), wall_s=wall, cpu_s=cpu)
    return result


def failure_numbers(run: dict, steady: float) -> dict:
    """Stalls of the survivor at the failure and at the rejoin, steps replica 1 missed, heal time."""
    arrived, back = run["arrived"], run["arrived1"]
    rejoined = min((s for s, t in back.items() if t > run["restarted"]), default=None)
    if rejoined is None:
        raise SystemExit("the restarted replica never logged a step")

    def longest_gap(lo: float, hi: float) -> float:
        times = sorted(t for t in arrived.values()) + [hi]
        gaps = [b - a for a, b in zip(times, times[1:]) if a >= lo - steady * 3 and b <= hi]
        return max(gaps, default=0.0)

    heal_t = back[rejoined]
    return {
        "stall_at_failure_s": longest_gap(run["killed"], run["restarted"] + 1.0),
        "stall_at_rejoin_s": max((arrived[s + 1] - arrived[s] for s in arrived
                                  if s + 1 in arrived and arrived[s] <= heal_t + steady and arrived[s + 1] >= heal_t - 3 * steady),
                                 default=0.0),
        "steps_missed_by_replica1": rejoined - run["killed_at"] - 1,
        "survivor_steps_lost": len([s for s in range(1, max(arrived) + 1) if s not in arrived]),
        "heal_s": heal_t - run["restarted"],
    }


def plot(out: Path, dp: dict, ft: dict, failed: dict) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for name, run in (("plain DP", dp), ("--ft", ft), ("--ft, replica 1 killed", failed)):
        steps = sorted(run["losses"])
        a.plot(steps, [run["losses"][s] for s in steps], label=name, linestyle="--" if "killed" in name else "-")
    a.axvline(failed["killed_at"], color="grey", linewidth=0.8)
    a.set_xlabel("step"), a.set_ylabel("loss"), a.legend(), a.set_title("loss (fp32)")
    for name, run in (("--ft", ft), ("--ft, replica 1 killed", failed)):
        steps = sorted(run["arrived"])
        b.plot(steps[1:], [run["arrived"][s] - run["arrived"][p] for p, s in zip(steps, steps[1:])], label=name)
    b.axvline(failed["killed_at"], color="grey", linewidth=0.8)
    b.set_xlabel("step"), b.set_ylabel("s since the previous step (replica 0)"), b.set_yscale("log"), b.legend()
    b.set_title("survivor's step times")
    fig.tight_layout()
    path = out / "ft.png"
    fig.savefig(path, dpi=110)
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--kill-at", type=int, default=20)
    ap.add_argument("--microbatches", type=int, default=16,
                    help="micro-batches of 32 tokens per replica per step (the test plan has 4)")
    ap.add_argument("--stages", type=int, choices=(1, 2), default=2,
                    help="pipeline stages per replica (1: the four layers on one chip, a rank per core)")
    ap.add_argument("--vendors", default="emu,emu",
                    help="the two replicas' vendors, comma-separated (plain DP runs on emu)")
    ap.add_argument("--time-scale", type=float, default=None,
                    help="run the emulated chips this many times slower than their datasheets (default: chosen "
                         "for this host, as the other benchmarks do)")
    ap.add_argument("--out", type=Path, default=REPO / "out" / "bench-ft")
    args = ap.parse_args()
    vendors = args.vendors.split(",")
    if len(vendors) != 2 or not set(vendors) <= {"emu", "cpu"}:
        ap.error(f"--vendors {args.vendors!r}: expected two of emu and cpu, comma-separated (e.g. emu,emu)")
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    stages = [("X", 1, 4, False)] if args.stages == 1 else [("X", 1, 2, False), ("Y", 1, 2, False)]
    plan = make_plan(stages, dp=2, microbatches=args.microbatches)
    plan.to_json(out / "plan.json")
    if args.time_scale is not None:
        from ditorch_ext.profiles import check_time_scale

        scale = check_time_scale(args.time_scale, "--time-scale")
    else:
        scale = chosen_time_scale(out, plan, args.stages)
    os.environ["DITORCH_TIME_SCALE"] = f"{scale:g}"  # every run's ranks inherit it

    dp = run_plain_dp(out, args.steps, args.stages)
    ft = run_ft(out, args.steps, args.stages, vendors, "ft", None)
    failed = run_ft(out, args.steps, args.stages, vendors, "killed", args.kill_at)
    f = failure_numbers(failed, ft["step_s"])
    exact = [dp["losses"][s] for s in sorted(dp["losses"])] == [ft["losses"][s] for s in sorted(ft["losses"])]
    mre = mean_relative_error(ft["losses"], failed["losses"]).mre_percent
    overhead = ft["step_s"] / dp["step_s"] - 1

    print(f"{'run':<28}{'step (median)':>15}{'wall':>9}{'CPU':>9}")
    for name, r in ((f"plain DP ({2 * args.stages} ranks)", dp), (f"--ft, 2 replicas x {args.stages} rank(s)", ft), ("--ft, replica 1 killed", failed)):
        print(f"{name:<28}{1000 * r['step_s']:>12.1f} ms{r['wall_s']:>8.1f}s{r['cpu_s']:>8.1f}s")
    print(f"Manager step overhead against plain DP: {100 * overhead:+.1f}% (goal <= 5%)")
    print(f"fp32 --ft without failure equals plain DP bit for bit: {exact}")
    print(f"killed at step {failed['killed_at']}: survivor's longest stall at the failure {f['stall_at_failure_s']:.2f} s, "
          f"at the rejoin {f['stall_at_rejoin_s']:.2f} s; steps the survivor lost {f['survivor_steps_lost']}; "
          f"steps replica 1 missed {f['steps_missed_by_replica1']}; restart to first step (heal) {f['heal_s']:.1f} s")
    print(f"loss curve with the failure against without: MRE {mre:.3f}% (criterion 1.5%)")
    png = plot(out, dp, ft, failed)
    summary = {"steps": args.steps, "stages": args.stages, "kill_at": args.kill_at, "microbatches": args.microbatches,
               "vendors": vendors, "time_scale": scale, "plain_dp_step_s": dp["step_s"], "ft_step_s": ft["step_s"],
               "overhead": overhead, "exact": exact, "mre_percent": mre, **f,
               "wall_s": {"dp": dp["wall_s"], "ft": ft["wall_s"], "killed": failed["wall_s"]},
               "cpu_s": {"dp": dp["cpu_s"], "ft": ft["cpu_s"], "killed": failed["cpu_s"]}}
    (out / "ft.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"wrote {out / 'ft.json'}" + (f" and {png}" if png else ""))
    return 0 if exact and mre <= 1.5 else 1


if __name__ == "__main__":
    sys.exit(main())
