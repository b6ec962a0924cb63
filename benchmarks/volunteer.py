"""Training on unreliable devices: the task pool against a SWARM-like system and a synchronous
pipeline, as the paper's Table 2, Figure 2 and Figure 4 do.

The fleet is the paper's section 4.2: 6 reliable V100-class devices in two sites and 10
unreliable RTX 2080-class ones (55% slower) joined to them by 50-300 Mb/s, 100-150 ms links.
``ditorch volunteer plan``'s allocator places them; each system then runs the same batches in
the event-driven simulator (volunteer/simulator.py), where an unreliable device leaves during a
batch with the given probability and returns for the next. Prints time per batch per system,
the ratios, and the scaling from 16 to 48 devices; writes PNG plots of time per batch against
the disconnection rate. A second part runs the real runtime (servers and clients as threads,
compute and links paced by sleeping) on a small scenario and prints measured against simulated
time per batch for the task pool, the check that the simulator models the system.

    .venv/bin/python benchmarks/volunteer.py            # about a minute on 2 cores
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from volunteer.allocate import allocate  # noqa: E402
from volunteer.cost import Workload, group_link_time  # noqa: E402
from volunteer.devices import Device, Fleet  # noqa: E402
from volunteer.simulator import SYSTEMS, Participant, Scenario, mean_batch_time  # noqa: E402
from program_results import Measurement, save_run  # noqa: E402

OUT = Path(__file__).resolve().parent / "out"
NAMES = {"pool": "task pool (this system)", "swarm": "SWARM-like (no pool)", "sync": "sync 1F1B (restarts)"}
V100 = 30e12  # sustained FLOP/s of a reliable device; an RTX 2080 takes 55% longer
# A 1.3B-parameter-class decoder: 24 layers, hidden 2048, 1024-token samples, bf16 boundaries;
# 50 M parameters a layer at 16 bytes each (fp32 weights, gradients, AdamW moments).
WORKLOAD = dict(layers=24, flops_per_sample_layer=3.4e11, boundary_bytes_per_sample=4.2e6, layer_state_bytes=16 * 50e6)
V100_MEMORY, RTX2080_MEMORY = 32 * 2**30, 11 * 2**30  # an unreliable device holds at most 14 layers: two stages or more
# Seconds until the servers act on a departure: a device that vanishes is noticed when its
# heartbeats stop for the runtime's default liveness; one that leaves says so (LEAVE) and is
# noticed at the servers' next timer tick.
DETECT = {"vanish": 3.0, "leave": 0.02}


def paper_fleet(rng: np.random.Generator, n_reliable: int, n_unreliable: int) -> Fleet:
    """Reliable devices in sites of three (HPC nodes: 2 GB/s, sub-ms inside a site; 1-3 GB/s,
    10-100 ms between sites); unreliable ones over the internet to every site."""
    site = np.arange(n_reliable) // 3
    sites = int(site.max()) + 1
    between_delay = rng.uniform(10, 100, size=(sites, sites))
    between_bw = rng.uniform(8000, 24000, size=(sites, sites))
    delay = np.where(site[:, None] == site[None, :], 0.5, (between_delay + between_delay.T)[site][:, site] / 2)
    bw = np.where(site[:, None] == site[None, :], 16000.0, (between_bw + between_bw.T)[site][:, site] / 2)
    np.fill_diagonal(delay, 0.0)
    u_delay = rng.uniform(100, 150, size=(n_unreliable, sites))[:, site]
    u_bw = rng.uniform(50, 300, size=(n_unreliable, sites))[:, site]
    return Fleet(tuple(Device(f"s{i}", V100, memory=V100_MEMORY) for i in range(n_reliable)),
                 tuple(Device(f"u{i}", V100 / 1.55, memory=RTX2080_MEMORY) for i in range(n_unreliable)),
                 delay * 1e-3, bw * 1e6 / 8, u_delay * 1e-3, u_bw * 1e6 / 8)


def scenario(fleet: Fleet, work: Workload, unreliable_ratio: float, rng: np.random.Generator,
             detect: float) -> Scenario:
    """The allocation of ``fleet`` as the simulator sees it; ``unreliable_ratio`` of the client
    devices may leave (the rest stay)."""
    alloc = allocate(fleet, work)
    leaving = set(rng.choice(fleet.n_unreliable, size=round(unreliable_ratio * fleet.n_unreliable), replace=False).tolist())
    row = work.boundary_bytes_per_sample
    people = []
    for k, st in enumerate(alloc.stages):
        per_row = st.layers * work.flops_per_sample_layer
        for j in st.reliable:
            hops = [min((fleet.reliable_delay[a, j], row / fleet.reliable_bandwidth[a, j]) for a in side)
                    for side in (st.frontal, st.backward) if j not in side]
            people.append(Participant(fleet.reliable[j].name, k, per_row / fleet.reliable[j].flops,
                                      sum(h[0] for h in hops), sum(h[1] for h in hops)))
        for i in st.clients:
            hops = [min(((fleet.unreliable_delay[i, a], row / fleet.unreliable_bandwidth[i, a]) for a in side),
                        key=lambda h: h[0] + work.microbatch_samples * h[1]) for side in (st.frontal, st.backward)]
            people.append(Participant(fleet.unreliable[i].name, k, per_row / fleet.unreliable[i].flops,
                                      sum(h[0] for h in hops), sum(h[1] for h in hops), unreliable=i in leaving))
    boundary = tuple(group_link_time(fleet, a.backward, b.frontal, work.microbatch_bytes)
                     for a, b in zip(alloc.stages, alloc.stages[1:]))
    return Scenario(tuple(people), boundary, work.microbatches, work.microbatch_samples, detect)


def disconnection_sweep(rates: list[float], ratios: list[float], batches: int, seed: int, detect: float) -> dict:
    rng = np.random.default_rng(seed)
    fleet = paper_fleet(rng, 6, 10)
    work = Workload(batch=64, microbatches=8, **WORKLOAD)
    out = {}
    for ratio in ratios:
        sc = scenario(fleet, work, ratio, np.random.default_rng(seed + 1), detect)
        out[ratio] = {s: [mean_batch_time(sc, s, p, batches, seed=seed + 2) for p in rates] for s in SYSTEMS}
    return {"rates": rates, "stages": 1 + max(p.stage for p in sc.participants), "times": out}


def scaling(sizes: list[int], rate: float, ratio: float, batches: int, seed: int) -> dict:
    """Weak scaling: 3/8 of the devices reliable, 4 samples of batch per device."""
    out = {}
    for n in sizes:
        rng = np.random.default_rng(seed)
        reliable = 3 * n // 8
        fleet = paper_fleet(rng, reliable, n - reliable)
        work = Workload(batch=4 * n, microbatches=8, **WORKLOAD)
        sc = scenario(fleet, work, ratio, np.random.default_rng(seed + 1), DETECT["vanish"])
        t = mean_batch_time(sc, "pool", rate, batches, seed=seed + 2)
        out[n] = {"seconds_per_batch": t, "samples_per_second": work.batch / t,
                  "stages": 1 + max(p.stage for p in sc.participants)}
    base = out[sizes[0]]
    for n in sizes:
        out[n]["efficiency"] = out[n]["samples_per_second"] / (base["samples_per_second"] * n / sizes[0])
    return out


def plot(sweeps: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = list(sweeps)
    ratios = sorted(sweeps[kinds[0]]["times"])
    fig, axes = plt.subplots(len(kinds), len(ratios), figsize=(5 * len(ratios), 3.4 * len(kinds)), sharey=True,
                             squeeze=False)
    for row, kind in zip(axes, kinds):
        for ax, ratio in zip(row, ratios):
            for s in SYSTEMS:
                ax.plot([100 * r for r in sweeps[kind]["rates"]], sweeps[kind]["times"][ratio][s], marker="o",
                        label=NAMES[s])
            ax.set_title(f"devices {kind} ({DETECT[kind]:g} s to notice); {round(100 * ratio)}% of clients unreliable",
                         fontsize=9)
            ax.set_xlabel("disconnection rate per batch (%)")
            ax.grid(alpha=0.3)
        row[0].set_ylabel("seconds per batch")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=40, help="batches averaged per point")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-measured", action="store_true", help="only the simulated comparison")
    args = ap.parse_args()
    OUT.mkdir(exist_ok=True)
    wall, cpu = time.perf_counter(), time.process_time()
    rates = [0.0, 0.2, 0.3, 0.4, 0.5, 0.6]
    sweeps = {kind: disconnection_sweep(rates, [0.3, 0.6], args.batches, args.seed, detect)
              for kind, detect in DETECT.items()}
    for kind, sweep in sweeps.items():
        print(f"\n6 reliable + 10 unreliable devices in {sweep['stages']} stage(s); devices {kind} "
              f"(noticed after {DETECT[kind]:g} s); seconds per batch (mean of {args.batches} batches)")
        print(f"{'unreliable':>10} {'disconnect':>10} " + " ".join(f"{NAMES[s]:>24}" for s in SYSTEMS)
              + f" {'vs SWARM':>9} {'vs sync':>8}")
        for ratio, times in sweep["times"].items():
            for i, r in enumerate(rates):
                row = [times[s][i] for s in SYSTEMS]
                print(f"{100 * ratio:>9.0f}% {100 * r:>9.0f}% " + " ".join(f"{t:>24.1f}" for t in row)
                      + f" {row[1] / row[0]:>8.2f}x {row[2] / row[0]:>7.2f}x")
    plot(sweeps, OUT / "volunteer_disconnection.png")
    scale = scaling([16, 32, 48], 0.5, 0.6, args.batches, args.seed)
    print("\nweak scaling of the task pool at 50% disconnection, 60% unreliable, devices vanish (4 samples per device)")
    print(f"{'devices':>8} {'stages':>7} {'s/batch':>8} {'samples/s':>10} {'efficiency':>11}")
    for n, r in scale.items():
        print(f"{n:>8} {r['stages']:>7} {r['seconds_per_batch']:>8.1f} {r['samples_per_second']:>10.2f} "
              f"{100 * r['efficiency']:>10.0f}%")
    result = {"sweeps": {kind: {str(k): v for k, v in sw["times"].items()} for kind, sw in sweeps.items()},
              "rates": rates, "detect_s": DETECT,
              "scaling": {str(k): v for k, v in scale.items()}}
    if not args.skip_measured:
        from measured_volunteer import measured_against_simulated

        result["measured"] = measured_against_simulated()
    (OUT / "volunteer.json").write_text(json.dumps(result, indent=1) + "\n")
    save_run("volunteer", [
        Measurement(f"volunteer, devices {kind}: {100 * ratio:.0f}% unreliable, {100 * r:.0f}% disconnect, "
                    "simulated seconds per batch", NAMES[system], [times[system][i]],
                    {"peer": True} if system == "swarm" else {"target": "<= 0.83x (1.2x SWARM's rate)"} if system == "pool" else {})
        for kind, sweep in sweeps.items() for ratio, times in sweep["times"].items()
        for i, r in enumerate(rates) for system in SYSTEMS])
    print(f"\nwall {time.perf_counter() - wall:.0f} s, CPU {time.process_time() - cpu:.0f} s; "
          f"wrote {OUT / 'volunteer_disconnection.png'} and {OUT / 'volunteer.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
