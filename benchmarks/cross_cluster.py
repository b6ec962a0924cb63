"""Di-PS against synchronous and asynchronous DiLoCo on 4 emulated heterogeneous clusters.

Each mode trains the tiny LLaMA (examples/configs/llama-tiny.yaml) on the same text corpus for
the same token budget: clusters are processes whose inner steps are paced to
step_s * (1 + delay), delays spread evenly over 0..eta% (eta = 100 by default); the PS is one
leader and two follower processes. Prints aggregated tokens/s and final held-out loss of the
global model per mode, the throughput ratio of Di-PS to sync DiLoCo and the loss gap, and writes
loss-vs-tokens and loss-vs-time plots.

    .venv/bin/python benchmarks/cross_cluster.py   # ~4 min on 2 idle cores; up to ~10 under heavy load
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from dips.auth import JobToken  # noqa: E402
from dips.client import OuterClient  # noqa: E402
from ditorch.datasets import sample_batch, text_corpus  # noqa: E402
from dips.harness import ClusterSpec, evaluate, free_port, read_log, start_cluster, start_follower  # noqa: E402
from dips.leader import Leader, LeaderConfig  # noqa: E402
from dips.model import build_model, load_config  # noqa: E402

MODES = {"dips": "Di-PS", "sync": "sync DiLoCo", "async": "async DiLoCo (no penalty)"}


def measure_step(model_cfg: dict, batch: int, seq: int) -> float:
    torch.set_num_threads(1)
    model = build_model(model_cfg, 0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train, _ = text_corpus()
    gen = torch.Generator().manual_seed(0)
    times = []
    for _ in range(6):
        t0 = time.perf_counter()
        model.loss(sample_batch(train, batch, seq, gen)).backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def run_mode(mode: str, args, model_cfg: dict, step_s: float, work: Path) -> dict:
    work.mkdir(parents=True)
    token_file = str(work / "job.key")
    token = JobToken.create(token_file)
    server_token_file = str(work / "servers.key")
    server_token = JobToken.create(server_token_file)
    leader = Leader(LeaderConfig(model=model_cfg, n_followers=args.followers, bind="127.0.0.1:0", mode=mode,
                                 token_budget=args.budget, metadata=str(work / "leader.json"),
                                 clip_norm=args.clip_norm if args.clip_norm > 0 else None,
                                 heartbeat_s=args.heartbeat, restart_followers=False), token, server_token)
    followers = [start_follower(leader.address, f"127.0.0.1:{free_port()}", server_token_file, str(work / f"f{i}"),
                                str(work / f"f{i}.log")) for i in range(args.followers)]
    n = args.clusters
    delays = [args.eta / 100 * i / (n - 1) for i in range(n)] if n > 1 else [0.0]
    specs = [ClusterSpec(name=f"c{i}", leader=leader.address, token_file=token_file, model=model_cfg,
                         log=str(work / f"c{i}.jsonl"), inner_steps=args.inner_steps, batch=args.batch, seq=args.seq,
                         inner_lr=args.inner_lr, step_s=step_s, delay=d, seed=i, go_file=str(work / "go"))
             for i, d in enumerate(delays)]
    procs = [start_cluster(s) for s in specs]
    while not all(Path(s.log).exists() and Path(s.log).read_text().strip() for s in specs):
        if not all(p.is_alive() for p in procs):
            raise RuntimeError(f"a cluster process died during start-up; see {work}")
        time.sleep(0.2)
    (work / "go").touch()  # all clusters joined: start the clock together
    t_start = time.time()
    deadline = t_start + args.timeout
    last = 0.0
    while any(p.is_alive() for p in procs) and time.time() < deadline:
        time.sleep(0.5)
        st = leader.status()
        if time.time() - last > 10:
            print(f"  [{MODES[mode]}] {time.time() - t_start:5.0f}s  version {st['version']:3d}  "
                  f"tokens {st['tokens']:7d}/{args.budget}", flush=True)
            last = time.time()
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.terminate()
    logs = {s.name: read_log(s.log) for s in specs}
    t0 = t_start
    t_end = leader.budget_reached_at or time.time()
    tokens = leader.tokens_total
    observer = build_model(model_cfg, 0)
    reader = OuterClient(observer, leader.address, args.inner_steps, token=token, join=False)
    version = reader.fetch_global()
    reader.close()
    _, held_out = text_corpus()
    final = evaluate(observer, held_out)
    rounds = leader.rounds_log
    leader.stop()
    for f in followers:
        f.terminate()
        f.wait(timeout=10)
    stats = {name: l[-1].get("stats", {}) for name, l in logs.items()}
    steps = [r for l in logs.values() for r in l if "loss" in r]
    late = sum(1 for r in steps if r.get("late")) / max(len(steps), 1)  # compute overran the emulated pace
    return {"mode": mode, "tokens": tokens, "wall": t_end - t0, "throughput": tokens / (t_end - t0),
            "final_loss": final, "version": version, "rounds": len(rounds),
            "rejected": sum(r["rejected"] for r in rounds), "mean_scale": sum(r["scale"] for r in rounds) / max(len(rounds), 1),
            "curve": curve(logs, t0), "stats": stats, "late": late}


def curve(logs: dict, t0: float, window: int = 32) -> list[tuple[float, int, float]]:
    """(seconds, aggregated tokens, mean of the last ``window`` training losses over all clusters)."""
    merged = sorted((r["t"], name, r["tokens"], r["loss"]) for name, l in logs.items() for r in l if "loss" in r)
    last = {name: 0 for name in logs}
    out, recent, total = [], [], 0
    for t, name, tokens, loss in merged:
        total += tokens - last[name]
        last[name] = tokens
        recent = (recent + [loss])[-window:]
        out.append((t - t0, total, sum(recent) / len(recent)))
    return out


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for r in results:
        xs_t = [p[0] for p in r["curve"]]
        xs_k = [p[1] for p in r["curve"]]
        ys = [p[2] for p in r["curve"]]
        axes[0].plot(xs_k, ys, label=MODES[r["mode"]])
        axes[1].plot(xs_t, ys, label=MODES[r["mode"]])
    start = max(r["curve"][0][2] for r in results if r["curve"])
    floor = min(p[2] for r in results for p in r["curve"])
    for ax in axes:  # a diverging baseline would otherwise flatten the curves that converge
        ax.set_ylim(floor - 0.2, start + 0.5)
    axes[0].set_xlabel("aggregated tokens")
    axes[1].set_xlabel("wall time (s)")
    for ax in axes:
        ax.set_ylabel("training loss (running mean, all clusters)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("Di-PS vs DiLoCo: 4 emulated clusters, eta = 100")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(Path(__file__).resolve().parent.parent / "examples/configs/llama-tiny.yaml"))
    ap.add_argument("--modes", default="dips,sync,async")
    ap.add_argument("--clusters", type=int, default=4)
    ap.add_argument("--followers", type=int, default=2)
    ap.add_argument("--eta", type=float, default=100.0, help="delays spread evenly over 0..eta%% of a step")
    ap.add_argument("--inner-steps", type=int, default=16)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--inner-lr", type=float, default=3e-3)
    ap.add_argument("--clip-norm", type=float, default=1.0)
    ap.add_argument("--budget", type=int, default=100_000, help="tokens per mode")
    ap.add_argument("--step-s", type=float, default=0.0, help="paced inner step at delay 0 (0: --pace x measured)")
    ap.add_argument("--pace", type=float, default=2.5, help="paced step / measured single-process step")
    ap.add_argument("--heartbeat", type=float, default=2.0,
                    help="cluster heartbeat interval (s); generous because 7 processes share 2 busy cores")
    ap.add_argument("--timeout", type=float, default=400.0, help="per-mode limit, seconds")
    ap.add_argument("--out", default="out/dips")
    args = ap.parse_args()
    model_cfg = load_config(args.model)
    measured = measure_step(model_cfg, args.batch, args.seq)
    step_s = args.step_s or round(args.pace * measured, 3)
    print(f"inner step {measured * 1e3:.0f} ms alone on one core; paced to {step_s * 1e3:.0f} ms x (1 + delay), "
          f"{args.clusters} clusters, eta={args.eta:g}, H={args.inner_steps}, budget {args.budget} tokens")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="dips-bench-") as tmp:
        for mode in args.modes.split(","):
            print(f"running {MODES[mode]} ...", flush=True)
            results.append(run_mode(mode, args, model_cfg, step_s, Path(tmp) / mode))
    print()
    print(f"{'mode':28s} {'tokens':>8s} {'wall s':>7s} {'tokens/s':>9s} {'rounds':>6s} {'rejected':>8s} "
          f"{'clip':>5s} {'late':>5s} {'final loss':>10s}")
    for r in results:
        print(f"{MODES[r['mode']]:28s} {r['tokens']:8d} {r['wall']:7.1f} {r['throughput']:9.0f} {r['rounds']:6d} "
              f"{r['rejected']:8d} {r['mean_scale']:5.2f} {r['late']:5.0%} {r['final_loss']:10.4f}")
    print("(clip: mean clip scale of the rounds; late: inner steps whose computation overran the emulated pace)")
    by = {r["mode"]: r for r in results}
    if "dips" in by and "sync" in by:
        ratio = by["dips"]["throughput"] / by["sync"]["throughput"]
        gap = (by["dips"]["final_loss"] - by["sync"]["final_loss"]) / by["sync"]["final_loss"]
        print(f"\nDi-PS / sync DiLoCo aggregated throughput: {ratio:.2f}x (target >= 1.27x)")
        print(f"Di-PS final loss vs sync DiLoCo: {gap * 100:+.2f}% (target within 2%)")
    if "async" in by and "sync" in by:
        print(f"async DiLoCo / sync DiLoCo throughput: {by['async']['throughput'] / by['sync']['throughput']:.2f}x, "
              f"final loss {100 * (by['async']['final_loss'] / by['sync']['final_loss'] - 1):+.2f}%")
    plot(results, out / "cross_cluster_loss.png")
    (out / "cross_cluster.json").write_text(json.dumps([{k: v for k, v in r.items() if k != "curve"} for r in results],
                                                       indent=1))
    print(f"plots: {out / 'cross_cluster_loss.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
