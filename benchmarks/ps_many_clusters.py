"""Many clusters on one Di-PS: do heartbeats and rounds hold, with nobody removed wrongly?

Emulated clusters are light: threads in a few processes, each an ``OuterClient`` on a small
LLaMA (a ~30 K-parameter config, so pushes are tens of KB) whose inner training is a sleep of
2-6 s (drawn per cluster) followed by a small random change of its parameters; so the PS, not
the clusters' compute, is what is measured. The leader (16 RPC worker threads, heartbeat 1 s:
a cluster silent for 3 s is removed) and two followers run in this process. Every second the
benchmark samples the leader; at the end it prints, per cluster count, the removals (target 0),
outer rounds, pushes applied, and the CPU time of the PS process, writes JSON and a PNG, and
saves the run as ``ps_many_clusters`` (the PS's CPU and wall seconds per outer round, the counts
beside them) for docs/dips.md.

    .venv/bin/python benchmarks/ps_many_clusters.py --clusters 64 --minutes 10   # the issue's soak
    .venv/bin/python benchmarks/ps_many_clusters.py --clusters 64 --minutes 2    # a short run
"""
from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # program_results

import torch  # noqa: E402
from program_results import Measurement, save_run  # noqa: E402

from dips.auth import JobToken  # noqa: E402
from dips.follower import Follower  # noqa: E402
from diutil.address import free_port  # noqa: E402
from dips.leader import Leader, LeaderConfig  # noqa: E402

SMALL = {"vocab_size": 64, "dim": 32, "n_layers": 2, "n_heads": 2, "n_kv_heads": 1, "ffn_dim": 64,
         "max_seq_len": 32}


def run_clusters(leader: str, token_file: str, names: list[str], until: float, seed: int, out) -> None:
    """One process: a thread per cluster, pushing until ``until`` (wall time)."""
    import threading

    from dips.client import OuterClient
    from dips.model import build_model

    torch.set_num_threads(1)
    stats = {}

    def cluster(name: str, rng: random.Random) -> None:
        model = build_model(SMALL, rng.randint(0, 1000))
        client = OuterClient(model, leader, inner_steps=1, token_file=token_file, name=name, join=False,
                             round_timeout_s=30.0)
        client.join(timeout_s=60)
        step_s = rng.uniform(2.0, 6.0)
        while time.time() < until:
            time.sleep(step_s)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p) * 1e-3)
            client.step(tokens=256)
        stats[name] = client.stats
        client.close()

    threads = [threading.Thread(target=cluster, args=(n, random.Random(seed + i))) for i, n in enumerate(names)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.put(stats)


class RemovalCounter(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.removed: list[tuple[float, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "removed: no heartbeat" in record.getMessage():
            self.removed.append((record.created, record.getMessage()))


def measurements(result: dict) -> list[Measurement]:
    """The run in program_results' form: the PS's CPU and wall seconds per outer round, with the
    counts the target is about (removed clusters, the fewest alive) beside them."""
    rounds = max(result["rounds"], 1)
    counts = {k: result[k] for k in ("removed", "min_clusters_after_join", "rounds", "pushes_applied",
                                     "pushes_failed", "outer_steps_skipped", "ps_cpu_s", "wall_s")}
    group = f"many clusters: {result['clusters']} clusters, {result['minutes']:g} min"
    return [Measurement(group, "PS CPU seconds per outer round", [result["ps_cpu_s"] / rounds],
                        {**counts, "target": "0 removed, all alive after joining"}),
            Measurement(group, "wall seconds per outer round", [result["wall_s"] / rounds], counts)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clusters", type=int, default=64)
    ap.add_argument("--procs", type=int, default=4, help="processes the cluster threads are spread over")
    ap.add_argument("--minutes", type=float, default=2.0)
    ap.add_argument("--out", default="benchmarks/out/ps_many_clusters")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="dips-many-"))
    token, servers = JobToken.create(work / "job.key"), JobToken.create(work / "servers.key")
    counter = RemovalCounter()
    logging.getLogger("dips.leader").addHandler(counter)
    leader = Leader(LeaderConfig(model=SMALL, n_followers=2, bind="127.0.0.1:0", heartbeat_s=1.0,
                                 restart_followers=False), token, servers)
    followers = [Follower(leader.address, f"127.0.0.1:{free_port()}", servers, work / f"f{i}") for i in range(2)]
    start = time.time()
    until = start + 60 * args.minutes
    names = [f"c{i:03d}" for i in range(args.clusters)]
    queue = mp.get_context("spawn").Queue()
    procs = [mp.get_context("spawn").Process(target=run_clusters, args=(leader.address, str(work / "job.key"),
                                                                       names[p::args.procs], until, 1000 * p, queue))
             for p in range(args.procs)]
    for p in procs:
        p.start()
    cpu0 = time.process_time()
    samples = []
    print(f"{args.clusters} clusters in {args.procs} processes for {args.minutes:g} min ...", flush=True)
    while time.time() < until + 5:
        time.sleep(1.0)
        st = leader.status()
        samples.append({"t": round(time.time() - start, 1), "clusters": len(st["clusters"]), "version": st["version"]})
        if len(samples) % 30 == 0:
            print(f"  {samples[-1]['t']:6.0f} s  clusters {samples[-1]['clusters']:3d}  version {st['version']}",
                  flush=True)
    stats = {}
    for _ in procs:
        stats.update(queue.get(timeout=120))
    for p in procs:
        p.join(30)
    cpu = time.process_time() - cpu0
    wall = time.time() - start
    for f in followers:
        f.stop()
    leader.stop()
    steady = [s["clusters"] for s in samples if 20 < s["t"] < 60 * args.minutes]  # after everyone joined
    result = {
        # clusters stop at `until` and are then removed rightly; before it, every removal is wrong
        "clusters": args.clusters, "minutes": args.minutes, "removed": sum(t < until for t, _ in counter.removed),
        "min_clusters_after_join": min(steady) if steady else None, "rounds": samples[-1]["version"],
        "pushes_applied": sum(s["applied"] for s in stats.values()),
        "pushes_failed": sum(s["failed"] for s in stats.values()),
        "outer_steps_skipped": sum(s["skipped"] for s in stats.values()),
        "ps_cpu_s": round(cpu, 1), "wall_s": round(wall, 1), "samples": samples,
    }
    (out / "result.json").write_text(json.dumps(result, indent=1))
    print(f"\n{'clusters':>8} {'minutes':>7} {'removed':>7} {'min alive':>9} {'rounds':>6} {'applied':>7} "
          f"{'failed':>6} {'skipped':>7} {'PS cpu s':>8} {'wall s':>6}")
    print(f"{args.clusters:>8} {args.minutes:>7g} {result['removed']:>7} {str(result['min_clusters_after_join']):>9} "
          f"{result['rounds']:>6} {result['pushes_applied']:>7} {result['pushes_failed']:>6} "
          f"{result['outer_steps_skipped']:>7} {result['ps_cpu_s']:>8} {result['wall_s']:>6}")
    print("target: 0 removed, every cluster alive after joining")
    _plot(samples, out / "ps_many_clusters.png", args.clusters)
    save_run("ps_many_clusters", measurements(result))
    print(f"wrote {out / 'result.json'} and {out / 'ps_many_clusters.png'}")
    return 0 if result["removed"] == 0 else 1


def _plot(samples: list[dict], path: Path, n: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    t = [s["t"] for s in samples]
    ax.plot(t, [s["clusters"] for s in samples], label="clusters the leader knows")
    ax.axhline(n, color="grey", lw=0.5, ls="--")
    ax.set_xlabel("seconds")
    ax.set_ylabel("clusters")
    ax2 = ax.twinx()
    ax2.plot(t, [s["version"] for s in samples], color="tab:orange", label="outer rounds")
    ax2.set_ylabel("outer rounds")
    fig.legend(loc="lower right")
    ax.set_title(f"{n} clusters on one Di-PS")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
