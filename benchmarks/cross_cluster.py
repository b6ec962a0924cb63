"""Di-PS against synchronous and asynchronous DiLoCo on emulated heterogeneous clusters over WAN links.

Each mode trains the tiny LLaMA (examples/configs/llama-tiny.yaml) on the same text corpus for
the same token budget. Clusters differ in two ways, as in the paper's section 5.1:
- compute: inner steps are paced to step_s * (1 + delay), delays spread evenly over 0..eta%;
- network: as root, every cluster runs on its own emulated host (a network namespace) whose link
  to the PS host is shaped with tc tbf, both ways. The paper's links are 10 Gbps, with one cluster
  at 1 Gbps; they are scaled so that moving the model over a link takes the same share of an outer
  step as LLaMA3.2-1B does in the paper (see ``--comm-share``). Without root, everything runs on
  loopback with unshaped links, and the benchmark says so.
The PS (one leader in the driver process and two follower processes) runs on host 0.

Modes ``dips-int8``, ``dips-int4``, ``dips-topk``, ``dips-sparse``, ``dips-sign``,
``dips-sparselocoD`` (SparseLoCo's push at D%, ``nonzero`` pulls; run them at outer momentum 0,
the default), ``dips-sparselocoD-pullP`` (the same push, pulls of each chunk's top P% in BF16) and their variants (``WIRE`` names each one's push and pull codec, ``OUTER_LR`` an
outer learning rate of its own; ``-stream``: pushes streamed in 4 parts over the inner steps) are Di-PS with compressed pushes and pulls (docs/dips.md, "Compressed and
streamed outer steps"); the table adds each cluster's bytes per outer round (the join's whole
pull apart), the most bytes it handed its link in one second, the slow-linked cluster's own
tokens/s, and the loss and throughput against uncompressed Di-PS. ``--links slowest`` is the
issue's slow-link setting (the middle cluster's link 10x slower than the paper's slowest).

``--churn`` adds the production scenario's events (paper, section 5.4) in every mode: a cluster
joins late, one leaves on purpose (SIGTERM: it says goodbye), one crashes (SIGKILL) and comes back.
Modes ``dips-noclip``, ``dips-nofilter`` and ``dips-nostale`` are Di-PS without clipping, without
the outlier filter and without the staleness penalty (the ablation).

Prints aggregated tokens/s and the final held-out loss of the global model per mode, the
throughput ratio of Di-PS to sync DiLoCo and the loss gap, rejected pushes and clip scales;
writes loss-vs-tokens and loss-vs-time plots and a JSON of the results.

    .venv/bin/python benchmarks/cross_cluster.py                        # 4 clusters, ~6 min
    .venv/bin/python benchmarks/cross_cluster.py --clusters 9 --churn --faulty 1   # production-like
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # emulated_hosts

import torch  # noqa: E402

from dips.auth import JobToken  # noqa: E402
from dips.client import OuterClient  # noqa: E402
from diutil.address import free_port  # noqa: E402
from dips.harness import ClusterSpec, evaluate, read_log, start_cluster, start_follower  # noqa: E402
from dips.leader import Leader, LeaderConfig  # noqa: E402
from dips.model import build_model, load_config  # noqa: E402
from dimodel.datasets import sample_batch, text_corpus  # noqa: E402
from program_results import Measurement, save_run  # noqa: E402

# mode -> (leader mode, clip, outlier filter, staleness penalty, label)
MODES = {
    "dips": ("dips", True, True, True, "Di-PS"),
    "sync": ("sync", False, False, False, "sync DiLoCo"),
    "async": ("async", False, False, False, "async DiLoCo (no penalty)"),
    "dips-noclip": ("dips", False, True, True, "Di-PS without clipping"),
    "dips-nofilter": ("dips", True, False, True, "Di-PS without outlier filter"),
    "dips-nostale": ("dips", True, True, False, "Di-PS without staleness penalty"),
    "dips-int8": ("dips", True, True, True, "Di-PS int8 / int8"),
    "dips-int4": ("dips", True, True, True, "Di-PS int4 / int4"),
    "dips-topk": ("dips", True, True, True, "Di-PS top-k 2% / int4"),
    "dips-topk2": ("dips", True, True, True, "Di-PS top-k 2% / top-k 2%"),
    "dips-topk-bf16": ("dips", True, True, True, "Di-PS top-k 2% / bf16"),
    "dips-int8-stream": ("dips", True, True, True, "Di-PS int8 / int8, streamed"),
    "dips-topk-stream": ("dips", True, True, True, "Di-PS top-k 2% / int4, streamed"),
    "dips-topk2-stream": ("dips", True, True, True, "Di-PS top-k 2% / top-k 2%, streamed"),
    "dips-topk-nofilter": ("dips", True, False, True, "Di-PS top-k 2% / int4, no filter"),
    "dips-topk2-nofilter": ("dips", True, False, True, "Di-PS top-k 2% / top-k 2%, no filter"),
    "dips-topk2-stream-nofilter": ("dips", True, False, True, "Di-PS top-k 2% / top-k 2%, streamed, no filter"),
    "dips-sparse": ("dips", True, True, True, "Di-PS sparse 3% / sparse 3%"),
    "dips-sparse-push": ("dips", True, True, True, "Di-PS sparse 3% / int8"),
    "dips-sign": ("dips", True, True, True, "Di-PS sign / sign"),
    "dips-sign-sparse": ("dips", True, True, True, "Di-PS sign / sparse 3%"),
    "dips-sign-int8": ("dips", True, True, True, "Di-PS sign / int8"),
    "dips-sign-half": ("dips", True, True, True, "Di-PS sign, half the blocks / sign"),
    "dips-sign-half2": ("dips", True, True, True, "Di-PS sign, half the blocks, both ways"),
    "dips-sign-noclip": ("dips", False, True, True, "Di-PS sign / sign without clipping"),
    "dips-sign-pullhalf": ("dips", True, True, True, "Di-PS sign / sign, half the blocks"),
    "dips-sparseloco1": ("dips", True, True, True, "Di-PS SparseLoCo 1% / nonzero"),
    "dips-sparseloco2": ("dips", True, True, True, "Di-PS SparseLoCo 2% / nonzero"),
    "dips-sparseloco3": ("dips", True, True, True, "Di-PS SparseLoCo 3% / nonzero"),
    "dips-sparseloco2-noclip": ("dips", False, True, True, "Di-PS SparseLoCo 2% / nonzero without clipping"),
    "dips-sparseloco2-lr1": ("dips", True, True, True, "Di-PS SparseLoCo 2% / nonzero, outer lr 1"),
    "dips-sparseloco2-lr1-noclip": ("dips", False, True, True, "Di-PS SparseLoCo 2% / nonzero, outer lr 1, no clip"),
    "dips-sparseloco2-lr1.5": ("dips", True, True, True, "Di-PS SparseLoCo 2% / nonzero, outer lr 1.5"),
    "dips-sparseloco1-lr1.5": ("dips", True, True, True, "Di-PS SparseLoCo 1% / nonzero, outer lr 1.5"),
    "dips-sparseloco1-pull4": ("dips", True, True, True, "Di-PS SparseLoCo 1% / sparse BF16 4%"),
    "dips-sparseloco1-pull5": ("dips", True, True, True, "Di-PS SparseLoCo 1% / sparse BF16 5%"),
    "dips-sparseloco2-pull3": ("dips", True, True, True, "Di-PS SparseLoCo 2% / sparse BF16 3%"),
    "dips-sparseloco2-pull4": ("dips", True, True, True, "Di-PS SparseLoCo 2% / sparse BF16 4%"),
    "dips-sparseloco3-pull3": ("dips", True, True, True, "Di-PS SparseLoCo 3% / sparse BF16 3%"),
    "dips-sparseloco3-pull4": ("dips", True, True, True, "Di-PS SparseLoCo 3% / sparse BF16 4%"),
    "dips-sparseloco1-pull4-lr1.5": ("dips", True, True, True, "Di-PS SparseLoCo 1% / sparse BF16 4%, outer lr 1.5"),
    "dips-sparseloco3-pull4-lr1.5": ("dips", True, True, True, "Di-PS SparseLoCo 3% / sparse BF16 4%, outer lr 1.5"),
    "dips-sparseloco3-pull4-noclip": ("dips", False, True, True, "Di-PS SparseLoCo 3% / sparse BF16 4% without clipping"),
}
# mode -> the outer learning rate it runs at instead of --outer-lr
OUTER_LR = {"dips-sparseloco2-lr1": 1.0, "dips-sparseloco2-lr1-noclip": 1.0, "dips-sparseloco2-lr1.5": 1.5,
            "dips-sparseloco1-lr1.5": 1.5, "dips-sparseloco1-pull4-lr1.5": 1.5, "dips-sparseloco3-pull4-lr1.5": 1.5}
# mode -> (push codec, pull codec, fragments of a streamed push); the others move BF16 in one burst
WIRE = {"dips-int8": ("int8", "int8", 1), "dips-int4": ("int4", "int4", 1), "dips-topk": ("topk:0.02", "int4", 1),
        "dips-topk2": ("topk:0.02", "topk:0.02", 1), "dips-topk-bf16": ("topk:0.02", "bf16", 1), "dips-int8-stream": ("int8", "int8", 4),
        "dips-topk-stream": ("topk:0.02", "int4", 4), "dips-topk2-stream": ("topk:0.02", "topk:0.02", 4),
        "dips-topk-nofilter": ("topk:0.02", "int4", 1),
        "dips-topk2-nofilter": ("topk:0.02", "topk:0.02", 1), "dips-topk2-stream-nofilter": ("topk:0.02", "topk:0.02", 4),
        "dips-sparse": ("sparse:0.03", "sparse:0.03", 1), "dips-sparse-push": ("sparse:0.03", "int8", 1),
        "dips-sign": ("sign", "sign", 1), "dips-sign-sparse": ("sign", "sparse:0.03", 1),
        "dips-sign-int8": ("sign", "int8", 1), "dips-sign-half": ("sign:0.5", "sign", 1),
        "dips-sign-half2": ("sign:0.5", "sign:0.5", 1), "dips-sign-noclip": ("sign", "sign", 1),
        "dips-sign-pullhalf": ("sign", "sign:0.5", 1),
        "dips-sparseloco1": ("sparseloco:0.01", "nonzero", 1), "dips-sparseloco2": ("sparseloco:0.02", "nonzero", 1),
        "dips-sparseloco3": ("sparseloco:0.03", "nonzero", 1),
        "dips-sparseloco2-noclip": ("sparseloco:0.02", "nonzero", 1),
        "dips-sparseloco2-lr1": ("sparseloco:0.02", "nonzero", 1),
        "dips-sparseloco2-lr1-noclip": ("sparseloco:0.02", "nonzero", 1),
        "dips-sparseloco2-lr1.5": ("sparseloco:0.02", "nonzero", 1),
        "dips-sparseloco1-lr1.5": ("sparseloco:0.01", "nonzero", 1),
        "dips-sparseloco1-pull4": ("sparseloco:0.01", "sparsebf16:0.04", 1),
        "dips-sparseloco1-pull5": ("sparseloco:0.01", "sparsebf16:0.05", 1),
        "dips-sparseloco2-pull3": ("sparseloco:0.02", "sparsebf16:0.03", 1),
        "dips-sparseloco2-pull4": ("sparseloco:0.02", "sparsebf16:0.04", 1),
        "dips-sparseloco3-pull3": ("sparseloco:0.03", "sparsebf16:0.03", 1),
        "dips-sparseloco3-pull4": ("sparseloco:0.03", "sparsebf16:0.04", 1),
        "dips-sparseloco1-pull4-lr1.5": ("sparseloco:0.01", "sparsebf16:0.04", 1),
        "dips-sparseloco3-pull4-lr1.5": ("sparseloco:0.03", "sparsebf16:0.04", 1),
        "dips-sparseloco3-pull4-noclip": ("sparseloco:0.03", "sparsebf16:0.04", 1)}
DEFAULT_MODES = "dips,sync,async,dips-noclip,dips-nofilter,dips-nostale"
# The paper moves LLaMA3.2-1B (2.5 GB in BF16) over 10 Gbps links: 2 s per transfer, against an
# outer step of 64 inner steps of 32 K tokens on one H800 of about 40 s (6 N tokens FLOPs at ~40%
# of 989 TFLOPS). The emulated links keep that 5% share for the fast links.
PAPER_COMM_SHARE = 0.05
FAST_GBPS, SLOW_GBPS = 10.0, 1.0
# --links presets, (fast, slow) Gbps: the paper's links; the slow-link setting, its slowest
# link 10x slower than the paper's; and every link 10x slower than the paper's
LINK_PRESETS = {"paper": (FAST_GBPS, SLOW_GBPS), "slowest": (FAST_GBPS, SLOW_GBPS / 10),
                "slow": (FAST_GBPS / 10, SLOW_GBPS / 10)}
MIN_STEP_S = 0.3


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


def link_rates(args, model_cfg: dict, step_s: float) -> list[float]:
    """Emulated Mbit/s of each cluster's link: the paper's Gbps scaled by the model's size and step."""
    wire_bits = 16 * sum(p.numel() for p in build_model(model_cfg, 0).parameters())  # BF16 on the wire
    mbit_per_paper_gbps = wire_bits / (PAPER_COMM_SHARE * args.inner_steps * step_s) / 1e6 / FAST_GBPS
    # the paper does not say which cluster has the slow link; the middle one is neither the case
    # most favourable to Di-PS (the slowest cluster) nor the least (the fastest: the link evens it out)
    if args.links in LINK_PRESETS:
        fast, slow = LINK_PRESETS[args.links]
        gbps = [slow if i == args.clusters // 2 else fast for i in range(args.clusters)]
    else:
        gbps = [float(x) for x in args.links.split(",")]
    if len(gbps) != args.clusters:
        raise SystemExit(f"--links has {len(gbps)} values for {args.clusters} clusters; give one per cluster")
    return [round(g * mbit_per_paper_gbps, 3) for g in gbps]


@dataclasses.dataclass
class Event:
    at_s: float        # seconds after the common start
    what: str          # "join" (starts late), "leave" (SIGTERM), "crash" (SIGKILL), "restart"
    cluster: int


def churn_events(n: int, outer_s: float) -> list[Event]:
    """The production scenario's events, timed in outer steps of the fastest cluster."""
    if n < 4:
        raise SystemExit(f"--churn needs at least 4 clusters (it moves 3 of them), got {n}")
    return [Event(1.5 * outer_s, "join", n - 3), Event(2.0 * outer_s, "crash", n - 1),
            Event(3.0 * outer_s, "leave", n - 2), Event(4.0 * outer_s, "restart", n - 1)]


class Places:
    """Where the PS and each cluster run: emulated hosts (0 is the PS's) or this machine's loopback."""

    def __init__(self, hosts: list | None):
        self.hosts = hosts

    @property
    def ps_address(self) -> str:
        return self.hosts[0].address if self.hosts else "127.0.0.1"

    def wrap(self, cluster: int):
        return self.hosts[cluster + 1].run if self.hosts else None


def run_mode(mode: str, args, momentum: float, model_cfg: dict, step_s: float, work: Path, places: Places) -> dict:
    work.mkdir(parents=True)
    base_mode, clip, outlier_filter, stale_penalty, label = MODES[mode]
    push_codec, pull_codec, fragments = WIRE.get(mode, ("bf16", "bf16", 1))
    token_file, server_token_file = str(work / "job.key"), str(work / "servers.key")
    token, server_token = JobToken.create(token_file), JobToken.create(server_token_file)
    ps = places.ps_address
    leader = Leader(LeaderConfig(model=model_cfg, n_followers=args.followers, bind=f"{ps}:0", mode=base_mode,
                                 token_budget=args.budget, metadata=str(work / "leader.json"),
                                 clip_norm=args.clip_norm if clip else None, staleness_decay=args.staleness_decay if stale_penalty else 0.0,
                                 beta=3.0 if outlier_filter else float("inf"),
                                 outer_lr=OUTER_LR.get(mode, args.outer_lr), outer_momentum=momentum,
                                 heartbeat_s=args.heartbeat, restart_followers=False), token, server_token)
    followers = [start_follower(leader.address, f"{ps}:{free_port(ps)}", server_token_file, str(work / f"f{i}"),
                                str(work / f"f{i}.log")) for i in range(args.followers)]
    n = args.clusters
    delays = [args.eta / 100 * i / (n - 1) for i in range(n)] if n > 1 else [0.0]
    faulty = dict(poison_scale=100.0, poison_from_step=3 * args.inner_steps)
    specs = [ClusterSpec(name=f"c{i}", leader=leader.address, token_file=token_file, model=model_cfg,
                         log=str(work / f"c{i}.jsonl"), inner_steps=args.inner_steps, batch=args.batch, seq=args.seq,
                         inner_lr=args.inner_lr, step_s=step_s, delay=d, seed=i, go_file=str(work / "go"),
                         heartbeat_s=args.heartbeat, push_codec=push_codec, pull_codec=pull_codec,
                         fragments=min(fragments, args.inner_steps), transfer_timeout_s=args.transfer_timeout,
                         **(faulty if i == args.faulty else {}))
             for i, d in enumerate(delays)]
    events = churn_events(n, args.inner_steps * step_s) if args.churn else []
    late = {e.cluster for e in events if e.what == "join"}
    procs = {i: start_cluster(s, places.wrap(i)) for i, s in enumerate(specs) if i not in late}
    logs = [s.log for i, s in enumerate(specs) if i not in late]
    while not all(Path(p).exists() and Path(p).read_text().strip() for p in logs):
        if not all(p.alive() for p in procs.values()):
            raise RuntimeError(f"a cluster process died during start-up; see {work}")
        time.sleep(0.2)
    (work / "go").touch()  # all clusters joined: start the clock together
    t_start = time.time()
    deadline = t_start + args.timeout
    last, pending, done_events = 0.0, list(events), []
    while any(p.alive() for p in procs.values()) and time.time() < deadline:
        time.sleep(0.2)
        while pending and time.time() - t_start >= pending[0].at_s and not leader.status()["done"]:
            e = pending.pop(0)
            apply_event(e, specs, procs, logs, places)
            done_events.append({"t": round(time.time() - t_start, 1), "what": e.what, "cluster": f"c{e.cluster}"})
            print(f"  [{label}] {time.time() - t_start:5.0f}s  cluster c{e.cluster}: {e.what}", flush=True)
        st = leader.status()
        if time.time() - last > 10:
            print(f"  [{label}] {time.time() - t_start:5.0f}s  version {st['version']:3d}  "
                  f"tokens {st['tokens']:7d}/{args.budget}  clusters {len(st['clusters'])}", flush=True)
            last = time.time()
    for p in procs.values():
        if None in p.join(10):
            p.stop()
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
    read = {Path(p).stem: read_log(p) for p in logs if Path(p).exists()}
    steps = [r for rs in read.values() for r in rs if "loss" in r]
    overran = sum(1 for r in steps if r.get("late")) / max(len(steps), 1)  # compute overran the emulated pace
    scales = [r["scale"] for r in rounds]
    stale_scales = [r["stale_scale"] for r in rounds]
    stale = [s for r in rounds for s in r["staleness"]]
    per_round, join = round_bytes(read)
    return {"bytes_per_round": per_round, "peak_bytes_s": peak_bytes(read), "join_bytes": join,
            "mode": mode, "label": label, "momentum": momentum, "tokens": tokens, "wall": t_end - t_start,
            "throughput": tokens / (t_end - t_start), "final_loss": final, "version": version,
            "rounds": len(rounds), "rejected": sum(r["rejected"] for r in rounds),
            "mean_scale": sum(scales) / max(len(scales), 1), "min_scale": min(scales, default=1.0),
            "mean_stale_scale": sum(stale_scales) / max(len(stale_scales), 1),
            "staleness": sum(stale) / max(len(stale), 1), "max_staleness": max(stale, default=0),
            "curve": curve(read, t_start), "late": overran, "events": done_events,
            # the middle cluster's own tokens/s: the one behind the slow link
            "slow_cluster_throughput": max((r["tokens"] for r in read.get(f"c{n // 2}", []) if "tokens" in r),
                                           default=0) / (t_end - t_start),
            "stats": {name: rs[-1].get("stats", {}) for name, rs in read.items()}}


def apply_event(e: Event, specs: list[ClusterSpec], procs: dict, logs: list[str], places: Places) -> None:
    """Carry out one churn event, updating the cluster processes and log files in play."""
    spec = specs[e.cluster]
    if e.what == "join":
        procs[e.cluster] = start_cluster(spec, places.wrap(e.cluster))
        logs.append(spec.log)
    elif e.what in ("leave", "crash"):
        procs[e.cluster].signal(signal.SIGTERM if e.what == "leave" else signal.SIGKILL)
    elif e.what == "restart":  # a crashed cluster comes back under its name, from the global model
        again = dataclasses.replace(spec, log=spec.log.replace(".jsonl", "-again.jsonl"), seed=spec.seed + 100)
        procs[e.cluster] = start_cluster(again, places.wrap(e.cluster))
        logs.append(again.log)


def round_bytes(logs: dict) -> tuple[float, float]:
    """A cluster's payload bytes per outer round (its pushes' bytes per push plus its pulls'
    bytes per pull, the join's pull left out) and its join's pull, each the mean over the
    clusters that pushed."""
    joins = [(rs[0].get("join_bytes", 0), rs[0].get("join_pulls", 0), rs[-1]["stats"]) for rs in logs.values()
             if rs and "stats" in rs[-1] and rs[-1]["stats"].get("pushed")]
    per_round = [e["push_bytes"] / e["pushed"] + (e["pull_bytes"] - jb) / max(e["pulls"] - jp, 1)
                 for jb, jp, e in joins]
    return (sum(per_round) / max(len(per_round), 1), sum(jb for jb, _, _ in joins) / max(len(joins), 1))


def peak_bytes(logs: dict, window_s: float = 1.0) -> float:
    """The most payload bytes one cluster handed its link within ``window_s`` (its pushes and
    pulls, counted when sent; the join's whole pull before the first step left out): a burst's
    size, which streaming spreads out."""
    best = 0.0
    for rs in logs.values():
        marks = [(r["t"], r["bytes"]) for r in rs if "bytes" in r]
        lo = 0
        for hi in range(1, len(marks)):
            while marks[hi][0] - marks[lo][0] > window_s:
                lo += 1
            best = max(best, marks[hi][1] - marks[max(lo - 1, 0)][1])
    return best / window_s


def curve(logs: dict, t0: float, window: int = 32) -> list[tuple[float, int, float]]:
    """(seconds, aggregated tokens, mean of the last ``window`` training losses over all clusters)."""
    merged = sorted((r["t"], name, r["tokens"], r["loss"]) for name, rs in logs.items() for r in rs if "loss" in r)
    last = {name: 0 for name in logs}
    out, recent, total = [], [], 0
    for t, name, tokens, loss in merged:
        total += tokens - last[name]
        last[name] = tokens
        recent = (recent + [loss])[-window:]
        out.append((t - t0, total, sum(recent) / len(recent)))
    return out


def plot(results: list[dict], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for r in results:
        xs_t = [p[0] for p in r["curve"]]
        xs_k = [p[1] for p in r["curve"]]
        ys = [p[2] for p in r["curve"]]
        axes[0].plot(xs_k, ys, label=r["label"])
        axes[1].plot(xs_t, ys, label=r["label"])
    start = max(r["curve"][0][2] for r in results if r["curve"])
    floor = min(p[2] for r in results for p in r["curve"])
    for ax in axes:  # a diverging baseline would otherwise flatten the curves that converge
        ax.set_ylim(floor - 0.2, start + 0.5)
    axes[0].set_xlabel("aggregated tokens")
    axes[1].set_xlabel("wall time (s)")
    for ax in axes:
        ax.set_ylabel("training loss (running mean, all clusters)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def report(results: list[dict], args, links: list[float] | None, step_s: float, measured: float) -> None:
    print()
    shaped = ", ".join(f"{m:g}" for m in links) + " Mbit/s" if links else "not shaped (loopback)"
    print(f"{args.clusters} clusters, eta={args.eta:g}, H={args.inner_steps}, inner step {measured * 1e3:.0f} ms "
          f"alone, paced to {step_s * 1e3:.0f} ms x (1 + delay); links {shaped}"
          f"{'; churn: late join, leave, crash + restart' if args.churn else ''}"
          f"{f'; c{args.faulty} pushes x100 parameters from its 4th outer step' if args.faulty is not None else ''}")
    for momentum in args.outer_momentum:
        rows = [r for r in results if r["momentum"] == momentum]
        print(f"\nouter momentum {momentum:g}")
        print(f"{'mode':33s} {'tokens':>8s} {'wall s':>7s} {'tokens/s':>9s} {'rounds':>6s} {'rejected':>8s} "
              f"{'clip mean/min':>13s} {'stale':>9s} {'x stale':>7s} {'late':>5s} {'KB/round':>9s} {'join KB':>8s} "
              f"{'peak KB/s':>9s} {'final loss':>10s}")
        for r in rows:
            print(f"{r['label']:33s} {r['tokens']:8d} {r['wall']:7.1f} {r['throughput']:9.0f} {r['rounds']:6d} "
                  f"{r['rejected']:8d} {r['mean_scale']:6.2f}/{r['min_scale']:<6.2f} "
                  f"{r['staleness']:5.1f}/{r['max_staleness']:<3d} {r['mean_stale_scale']:7.2f} {r['late']:5.0%} "
                  f"{r['bytes_per_round'] / 1e3:9.0f} {r['join_bytes'] / 1e3:8.0f} {r['peak_bytes_s'] / 1e3:9.0f} "
                  f"{r['final_loss']:10.4f}")
        for r in rows:
            if "vs_dips" in r:
                print(f"{r['label']} / Di-PS: {r['vs_dips']['bytes']:.1f}x fewer bytes per round, throughput "
                      f"{r['vs_dips']['throughput']:.2f}x (the slow-linked c{args.clusters // 2}'s "
                      f"{r['vs_dips']['slow_cluster']:.2f}x), final loss {r['vs_dips']['loss'] * 100:+.2f}% "
                      f"(goal: >= 16x fewer bytes, loss within 2%)")
        for r in rows:
            if "vs_sync" in r:
                target = " (target >= 1.27x, loss within 2%)" if r["mode"] == "dips" else ""
                print(f"{r['label']} / sync DiLoCo: throughput {r['vs_sync']['throughput']:.2f}x, final loss "
                      f"{r['vs_sync']['loss'] * 100:+.2f}%{target}")
    print("(clip: clip scale over the rounds, 1 = not clipped; stale: mean/max versions decided between an "
          "applied push's base and the version it was applied to; x stale: mean staleness scale of a round "
          "(--staleness-decay), 1 = none; late: inner steps whose computation overran the emulated pace)")


def compare_with_sync(results: list[dict]) -> None:
    """Add each result's throughput ratio and final-loss gap to sync DiLoCo at the same momentum."""
    sync = {r["momentum"]: r for r in results if r["mode"] == "sync"}
    for r in results:
        base = sync.get(r["momentum"])
        if base is not None and r is not base:
            r["vs_sync"] = {"throughput": r["throughput"] / base["throughput"],
                            "loss": (r["final_loss"] - base["final_loss"]) / base["final_loss"]}
    plain = {r["momentum"]: r for r in results if r["mode"] == "dips"}
    for r in results:
        base = plain.get(r["momentum"])
        if base is not None and r["mode"] in WIRE:
            r["vs_dips"] = {"bytes": base["bytes_per_round"] / max(r["bytes_per_round"], 1.0),
                            "throughput": r["throughput"] / base["throughput"],
                            "slow_cluster": r["slow_cluster_throughput"] / max(base["slow_cluster_throughput"], 1e-9),
                            "loss": (r["final_loss"] - base["final_loss"]) / base["final_loss"]}


def run_tag(args) -> str:
    """The run's name: cluster count and scenario, the outer momentum when not the default,
    whether compressed modes ran, and the links when not the default."""
    momentum = "" if args.outer_momentum == [0.0] else "-momentum-" + "-".join(f"{m:g}" for m in args.outer_momentum)
    wire = "-compressed" if any(m in WIRE for m in args.modes.split(",")) else ""
    links = "" if args.links == "paper" else "-links-" + args.links.replace(",", "-")
    return (f"{args.clusters}c{'-churn' if args.churn else ''}{'-faulty' if args.faulty is not None else ''}"
            f"{momentum}{wire}{links}{'-' + args.tag if args.tag else ''}")


def measurements(results: list[dict], tag: str) -> list[Measurement]:
    """One group per outer momentum: each mode's wall seconds per 1000 tokens, sync DiLoCo the
    peer, with the table's other columns as extra_info."""
    return [Measurement(f"cross-cluster {tag}, outer momentum {r['momentum']:g}: wall seconds per 1000 tokens",
                        r["label"], [1e3 / r["throughput"]],
                        {"peer": r["mode"] == "sync", "tokens": r["tokens"], "rounds": r["rounds"],
                         "rejected": r["rejected"], "clip_mean/min": f"{r['mean_scale']:.2f} / {r['min_scale']:.2f}",
                         "stale_mean/max": f"{r['staleness']:.1f} / {r['max_staleness']}",
                         "staleness_scale": round(r["mean_stale_scale"], 2),
                         "final_loss": round(r["final_loss"], 4),
                         "loss_vs_sync": f"{r['vs_sync']['loss'] * 100:+.1f}%" if "vs_sync" in r else "",
                         "KB_per_round": round(r["bytes_per_round"] / 1e3),
                         "join_KB": round(r["join_bytes"] / 1e3),
                         "slow_cluster_tokens/s": round(r["slow_cluster_throughput"]),
                         "peak_KB/s": round(r["peak_bytes_s"] / 1e3),
                         **({"vs_Di-PS": f"{r['vs_dips']['bytes']:.1f}x fewer bytes, "
                                         f"{r['vs_dips']['throughput']:.2f}x tokens/s, "
                                         f"loss {r['vs_dips']['loss'] * 100:+.1f}%"} if "vs_dips" in r else {}),
                         **({"target": "<= 0.79x (1.27x tokens/s), loss within 2%"}
                            if r["mode"] == "dips" and "vs_sync" in r else {})})
            for r in results]


def drive(args, model_cfg: dict, step_s: float, measured: float, links: list[float] | None,
          hosts: list | None) -> int:
    """Run every mode (on host 0 when there are emulated hosts) and report."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if links:  # a whole BF16 pull (a join) must fit in the timeout on the slowest link
        wire_bits = 16 * sum(p.numel() for p in build_model(model_cfg, 0).parameters())
        args.transfer_timeout = max(args.transfer_timeout, 3 * wire_bits / (min(links) * 1e6))
    results = []
    with tempfile.TemporaryDirectory(prefix="dips-bench-") as tmp:
        work = Path(args.workdir or tmp)
        for momentum in args.outer_momentum:
            for mode in args.modes.split(","):
                print(f"running {MODES[mode][-1]}, outer momentum {momentum:g} ...", flush=True)
                results.append(run_mode(mode, args, momentum, model_cfg, step_s, work / f"{mode}-m{momentum:g}",
                                        Places(hosts)))
                if len(args.outer_momentum) > 1:
                    results[-1]["label"] += f", momentum {momentum:g}"
    compare_with_sync(results)
    report(results, args, links, step_s, measured)
    tag = run_tag(args)
    title = (f"Di-PS vs DiLoCo: {args.clusters} emulated clusters, eta = {args.eta:g}, "
             f"{'shaped WAN links' if links else 'loopback'}{', churn' if args.churn else ''}"
             f"{', a faulty cluster' if args.faulty is not None else ''}")
    plot(results, title, out / f"cross_cluster_{tag}.png")
    summary = {"clusters": args.clusters, "churn": args.churn, "faulty": args.faulty, "links_mbit": links,
               "step_s": step_s,
               "results": [{k: v for k, v in r.items() if k != "curve"} for r in results]}
    (out / f"cross_cluster_{tag}.json").write_text(json.dumps(summary, indent=1))
    save_run(f"cross_cluster_{tag}", measurements(results, tag))
    print(f"plot: {out / f'cross_cluster_{tag}.png'}")
    return 0


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(ROOT / "examples/configs/llama-tiny.yaml"))
    ap.add_argument("--modes", default=DEFAULT_MODES, help=f"comma-separated, of {', '.join(MODES)}")
    ap.add_argument("--clusters", type=int, default=4)
    ap.add_argument("--churn", action="store_true", help="a late join, a leave and a crash + restart in every mode")
    ap.add_argument("--faulty", type=int, default=None,
                    help="this cluster pushes parameters x100 from its 4th outer step on (the outlier filter's case)")
    ap.add_argument("--followers", type=int, default=2)
    ap.add_argument("--eta", type=float, default=100.0, help="delays spread evenly over 0..eta%% of a step")
    ap.add_argument("--inner-steps", type=int, default=16)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--inner-lr", type=float, default=3e-3)
    # the clip is in norm units: the paper's 1 binds on every round of this model (pseudo-gradient
    # norms ~7), which makes each push a fixed-length step; 4 binds on the larger ones, and the
    # staleness penalty then keeps stale pushes short (docs/dips.md has the sweep)
    ap.add_argument("--clip-norm", type=float, default=4.0, help="Di-PS clips the averaged pseudo-gradient to this norm")
    ap.add_argument("--staleness-decay", type=float, default=0.5,
                    help="Di-PS scales a push s versions stale by (1 + s) ** -decay")
    ap.add_argument("--outer-lr", type=float, default=0.7, help="every mode's outer Nesterov learning rate")
    # 0, not the paper's 0.8: on this tiny model both Di-PS and sync DiLoCo end lower without outer
    # momentum (docs/dips.md has the sweep), and momentum amplifies stale asynchronous pushes most
    ap.add_argument("--outer-momentum", default="0",
                    help="every mode's outer Nesterov momentum; comma-separated values run every mode at each")
    ap.add_argument("--budget", type=int, default=0, help="tokens per mode (0: 25,600 per cluster)")
    ap.add_argument("--step-s", type=float, default=0.0, help="paced inner step at delay 0 (0: pace x measured)")
    ap.add_argument("--pace", type=float, default=0.0,
                    help="paced step / measured single-process step (0: enough for the clusters to share 2 cores)")
    ap.add_argument("--links", default="paper",
                    help="each cluster's link in the paper's Gbps, comma-separated, or a preset: paper (1 for the "
                         "middle cluster, 10 for the rest), slowest (0.1 for the middle one), slow (0.1 and 1)")
    ap.add_argument("--transfer-timeout", type=float, default=30.0,
                    help="seconds a cluster waits for a push or pull, at least 3 BF16 models' time on its link")
    ap.add_argument("--tag", default="", help="a suffix for the run's saved name (runs of other modes side by side)")
    ap.add_argument("--loopback", action="store_true", help="no emulated hosts: every link is loopback, unshaped")
    ap.add_argument("--heartbeat", type=float, default=2.0,
                    help="cluster heartbeat interval (s); generous because many processes share 2 busy cores")
    ap.add_argument("--timeout", type=float, default=600.0, help="per-mode limit, seconds")
    ap.add_argument("--out", default="out/dips")
    ap.add_argument("--workdir", default=None,
                    help="keep each mode's logs, metadata and checkpoints here (default: a temporary directory)")
    ap.add_argument("--on-host", default=None, help=argparse.SUPPRESS)  # internal: the driver on host 0
    args = ap.parse_args(argv)
    if args.links not in LINK_PRESETS:
        try:
            [float(x) for x in args.links.split(",")]
        except ValueError:
            ap.error(f"--links {args.links!r}: expected {', '.join(LINK_PRESETS)} or comma-separated Gbps")
    unknown = [m for m in args.modes.split(",") if m not in MODES]
    if unknown:
        ap.error(f"--modes {unknown}: expected some of {', '.join(MODES)}")
    args.budget = args.budget or 25_600 * args.clusters
    try:
        args.outer_momentum = [float(m) for m in args.outer_momentum.split(",")]
    except ValueError:
        ap.error(f"--outer-momentum {args.outer_momentum!r}: expected comma-separated numbers, e.g. 0,0.5,0.8")
    if any(not 0 <= m < 1 for m in args.outer_momentum):
        ap.error(f"--outer-momentum {args.outer_momentum}: expected values in [0, 1)")
    if args.faulty is not None and not 0 <= args.faulty < args.clusters:
        ap.error(f"--faulty {args.faulty}: expected a cluster index in 0..{args.clusters - 1}")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    model_cfg = load_config(args.model)
    if args.on_host:  # the driver, started on host 0 by the run below
        setup = json.loads(args.on_host)
        from emulated_hosts import Host

        return drive(args, model_cfg, setup["step_s"], setup["measured"], setup["links"],
                     [Host(**h) for h in setup["hosts"]])
    measured = measure_step(model_cfg, args.batch, args.seq)
    pace = args.pace or max(2.5, 0.6 * (args.clusters + args.followers + 1))  # processes per 2 cores, with slack
    # at least MIN_STEP_S: H inner steps must be long against the PS's fixed cost of a round, as in the paper
    step_s = args.step_s or round(max(pace * measured, MIN_STEP_S), 3)
    from emulated_hosts import can_make_hosts, emulated_hosts

    why = None if not args.loopback else "--loopback"
    why = why or can_make_hosts()
    if why:
        print(f"links not shaped, every cluster on loopback ({why})")
        return drive(args, model_cfg, step_s, measured, None, None)
    links = link_rates(args, model_cfg, step_s)
    with emulated_hosts(args.clusters + 1, rate_mbit=[None] + links) as hosts:
        setup = json.dumps({"step_s": step_s, "measured": measured, "links": links,
                            "hosts": [dataclasses.asdict(h) for h in hosts]})
        cmd = hosts[0].run([sys.executable, str(Path(__file__).resolve()), *(argv or sys.argv[1:]),
                            "--on-host", setup])
        return subprocess.run(cmd).returncode


if __name__ == "__main__":
    sys.exit(main())
