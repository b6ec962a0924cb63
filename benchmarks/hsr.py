"""The HeteroSpeedupRatio (the H2 paper, section 6.2) measured on the runtime.

Each chip group trains alone on its own best homogeneous plan (HeteroAuto over that group), then
all groups train together on HeteroAuto's plan for the whole cluster: once at the same global
batch as each group alone (constant batch), once at the sum of the groups' batches (sum batch).
Every run is ``torchrun -m ditorch.train --trace`` on dicomm; throughputs come from the traces,
predictions from the simulator with the layer times ``ditorch profile`` measured at the start.

    HSR = tokens/s of the heterogeneous run / sum over groups of each group's tokens/s alone

    python benchmarks/hsr.py [--chips A:2,B:2,C:2] [--gbs 2K] [--steps 4] [--out out/bench-hsr]

The chips' *speed* is the built-in profiles'; their numerics are the host's by default
(``benchmarks/emulated_chips.py`` says why; ``--numerics chip`` keeps the chips' own). Each chip
holds ``--chip-memory`` GiB (at ``--memory-scale``): by default 15, the band where every group
alone holds the model only in two stages with recompute, as a model large for its chips makes
it (the paper's 100B model on 32-96 GB chips); ``--chip-memory builtin`` keeps each built-in
chip's own memory (96, 64, 32 GiB), where no group needs recompute alone.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from ditorch.hsr import measure, ratio_table  # noqa: E402
from heteropp.cluster import ClusterSpec, parse_tokens  # noqa: E402
from heteropp.model_spec import ModelSpec  # noqa: E402
from heteropp.runtime.profiler import cluster_time_scale, write_cluster  # noqa: E402
from emulated_chips import speed_only_profiles  # noqa: E402
from program_results import Measurement, save_run  # noqa: E402

MODEL = REPO / "examples/configs/llama-deep.yaml"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chips", default="A:2,B:2,C:2", help="chip type:count pairs, one group per type")
    ap.add_argument("--model", default=str(MODEL))
    ap.add_argument("--gbs", default="4K", help="each group's global batch alone, in tokens")
    ap.add_argument("--memory-scale", default="0.01", help="chip memory scale (0.01: a 32 GB chip holds 328 MiB)")
    ap.add_argument("--chip-memory", default="15",
                    help="GiB per chip before --memory-scale, the same for every chip type, or 'builtin' for each "
                         "built-in chip's own (host numerics only)")
    ap.add_argument("--steps", type=int, default=4, help="steps per run (the first is not timed)")
    ap.add_argument("--numerics", choices=("host", "chip"), default="host",
                    help="host: the chips' speed and memory with IEEE numerics (default); chip: their own numerics")
    ap.add_argument("--time-scale", type=float, default=None,
                    help="emulation time scale (default: chosen so this host keeps up with the largest run's "
                         "ranks of these chips by their datasheets)")
    ap.add_argument("--out", default=str(REPO / "out/bench-hsr"))
    ap.add_argument("--reuse-profiles", action="store_true",
                    help="keep chip profiles an earlier run left in --out at the same memory and time scales")
    args = ap.parse_args()
    counts = {name: int(n) for name, n in (pair.split(":") for pair in args.chips.split(","))}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, DITORCH_MEMORY_SCALE=args.memory_scale, PYTHONPATH=str(REPO))
    chip_memory = _chip_memory(args.chip_memory, args.numerics)
    names = {c: c for c in counts}
    if args.numerics == "host":
        profile_file = out / "chips.yaml"
        names = speed_only_profiles(profile_file, list(counts), chip_memory)
        env["DITORCH_PROFILE_FILE"] = os.environ["DITORCH_PROFILE_FILE"] = str(profile_file)
    time_scale = args.time_scale
    if time_scale is None:
        # the chips' datasheet speeds times a scale at which this host keeps up with the largest
        # run's ranks (each run reports how far its host fell behind, if it did: docs/device.md)
        time_scale, ratios = cluster_time_scale([{names[c]: n for c, n in counts.items()}],
                                                ModelSpec.load(args.model))
        print("this host's time for a layer against each chip's: "
              + ", ".join(f"{c} {r:.1f}x" for c, r in ratios.items()), flush=True)
    memory_text = "built-in memory" if chip_memory is None else f"{chip_memory:g} GiB per chip"
    print(f"{len(counts)} chip groups {args.chips} ({args.numerics} numerics, {memory_text} at scale "
          f"{args.memory_scale}), model {Path(args.model).name}, time scale {time_scale:g} "
          f"({sum(counts.values())} ranks on {os.cpu_count()} cores)", flush=True)
    # A profile holds the chip's memory at one memory scale and its times at one time scale:
    # profiles are kept (and reused) per chip memory and pair of scales.
    memory_tag = "builtin" if chip_memory is None else f"{chip_memory:g}GiB"
    profiles = out / f"profiles-{memory_tag}-memory{float(args.memory_scale):g}-time{time_scale:g}"
    profiles.mkdir(exist_ok=True)
    for chip in names.values():
        path = profiles / f"chip-{chip}.yaml"
        if not (args.reuse_profiles and path.exists()):
            print(f"profiling chip {chip} ...", flush=True)
            subprocess.run([sys.executable, "-m", "ditorch.cli", "profile", "--chip", chip, "--model", args.model,
                            "--tp", "1,2", "--time-scale", str(time_scale), "--out", str(path)],
                           env=env, check=True, capture_output=True)
    cluster = ClusterSpec.from_yaml(write_cluster(profiles / "cluster.yaml", {names[c]: n for c, n in counts.items()}))
    model, gbs = ModelSpec.from_yaml(args.model), parse_tokens(args.gbs)
    # one run at a time: each row's measured/simulated is that run's with the host to itself
    m = measure(model, cluster, gbs, out, args.steps, env=env, progress=lambda line: print(line, flush=True),
                groups_at_once=False)
    goals = {"sum": 1.05, "constant": 0.90}
    paper = {"sum": "104-109%", "constant": "77-90%"}
    print(f"\n{ratio_table(m)}\n  goals: sum >= 105% (paper {paper['sum']}), constant >= 90% (paper {paper['constant']})")
    for kind, goal in goals.items():
        if m.ratio(kind) < goal:
            print(f"  {kind} batch: measured {100 * m.ratio(kind):.1f}% is short of the goal")
    summary = {"chips": args.chips, "numerics": args.numerics, "time_scale": time_scale, "memory_scale": args.memory_scale,
               "chip_memory_gib": chip_memory or "builtin",
               "model": Path(args.model).name,
               "gbs_tokens": gbs, **m.to_dict()}
    (out / "results.json").write_text(json.dumps(summary, indent=1))
    _plot(m, out / "hsr.png", memory_text)
    runs = [*m.alone, *m.together.values()]  # a group that ran out of memory alone is in the table, not saved
    kind_of = {id(r): k for k, r in m.together.items()}
    save_run("hsr" if chip_memory is not None else "hsr_builtin_memory", [
        Measurement(f"hsr ({memory_text}): seconds per iteration, each chip group alone and all together", r.name,
                    [r.measured_s],
                    {"stages": r.stages(), "tokens": r.tokens, "tokens_per_s": round(r.throughput()),
                     "simulated_s": round(r.simulated_s, 3), "measured/simulated": round(r.measured_s / r.simulated_s, 2),
                     "cpu_s_per_step": round(r.cpu_s, 2),
                     "note": (f"HSR measured {100 * m.ratio(kind_of[id(r)]):.1f}%, simulated "
                              f"{100 * m.ratio(kind_of[id(r)], True):.1f}%") if id(r) in kind_of else "",
                     "peer": r is runs[0]})
        for r in runs if not r.failure])
    print(f"\nresults: {out / 'results.json'}, plot: {out / 'hsr.png'}")
    return 0


def _chip_memory(value: str, numerics: str) -> float | None:
    """``--chip-memory``: GiB per chip, or None for each built-in chip's own."""
    if value == "builtin":
        return None
    try:
        gib = float(value)
    except ValueError:
        raise SystemExit(f"--chip-memory {value!r}: expected GiB per chip (e.g. 15) or 'builtin'") from None
    if not gib > 0:
        raise SystemExit(f"--chip-memory {value!r}: expected a positive number of GiB")
    if numerics != "host":
        raise SystemExit(f"--chip-memory {value}: the chips' own numerics come with their built-in memory; "
                         "use --chip-memory builtin with --numerics chip")
    return gib


def _plot(m, path: Path, memory_text: str) -> None:
    """Tokens/s: the groups alone stacked into one bar (their sum) beside each heterogeneous run,
    measured and simulated."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    ticks, labels = [], []
    for col, simulated in enumerate((False, True)):
        x0 = col * (len(m.together) + 2)
        bottom = 0.0
        for i, a in enumerate(m.alone):
            ax.bar(x0, a.throughput(simulated), 0.7, bottom=bottom, color=f"C{i}", label=a.name if col == 0 else None)
            bottom += a.throughput(simulated)
        ticks.append(x0)
        labels.append(f"groups alone\n({'simulated' if simulated else 'measured'})")
        for i, (kind, r) in enumerate(m.together.items(), 1):
            ax.bar(x0 + i, r.throughput(simulated), 0.7, color="0.35")
            ax.text(x0 + i, r.throughput(simulated), f"HSR {100 * m.ratio(kind, simulated):.0f}%", ha="center",
                    va="bottom", fontsize=8)
            ticks.append(x0 + i)
            labels.append(f"together, {kind}\n({'simulated' if simulated else 'measured'})")
    ax.set_xticks(ticks)
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_ylabel("tokens per second")
    ax.set_title(f"HeteroSpeedupRatio on emulated chips, {memory_text} (benchmarks/hsr.py)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
