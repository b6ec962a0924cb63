"""Devices that come and go: one model trained over parameter-server pipeline stages whose
clients are emulated chips of different types joining and leaving (docs/volunteer.md).

Runs, as a user would, each ``ditorch volunteer`` command:

1. ``plan``: four reliable devices in two far-apart sites and four unreliable ones; no device
   holds the whole model, so the allocator makes two stages (the sites);
2. ``server`` on each reliable device (processes on loopback ports);
3. ``client`` on emulated chips A, B and C (``--device dipu``, ``DITORCH_CHIP``): one is killed
   (SIGKILL) once the first step is done, one leaves saying so, one joins late and picks its
   stage by probing the servers;
4. ``reference``: the same job trained in one process on the CPU; ``ditorch mre`` holds the
   job's loss curve against it to the H2 paper's 1.5% criterion, as the pipeline's is held in
   ``make demo``'s step 5. The curves differ only by the chips' arithmetic (A, B and C keep
   fewer mantissa bits in fp32 matmuls): with ``--chip host`` for every client they agree to
   fp32 rounding, departures and all (tests/volunteer checks that to 1e-5).

    python examples/volunteer_demo.py [--steps 10] [--out out/volunteer]

``examples/hetero_demo.py`` (``make demo``) runs this as its last step.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import yaml  # noqa: E402

from diutil.address import free_port  # noqa: E402
from hetero_demo import run  # noqa: E402  (one command, its output shown)

SITES = (0, 0, 1, 1)  # the site of each reliable device
FAR_MS, NEAR_MS = 80.0, 0.5
# name, chip, stage (None: probe for the best), joins once this many steps are logged,
# leaves (saying so) after this many seconds
CLIENTS = (
    ("a0", "A", 0, 0, None),
    ("b1", "B", 1, 0, None),
    ("victim", "A", 0, 0, None),
    ("leaver", "B", 1, 0, 8.0),
    ("late", "C", None, 2, None),
)
VICTIM, KILL_AT_STEPS = "victim", 1  # SIGKILLed once this many steps are logged
CHIP_TFLOPS = {"A": 3.0, "B": 2.0, "C": 1.0}  # sizes each client's share of a micro-batch


def layer_bytes(model: dict) -> float:
    """Training state of one decoder layer (fp32 weights, gradients, AdamW moments)."""
    dim, ffn = model["dim"], model["ffn_dim"]
    kv = dim * model["n_kv_heads"] // model["n_heads"]
    return 16.0 * (2 * dim * dim + 2 * dim * kv + 3 * dim * ffn + 2 * dim)


def write_devices(path: Path, model: dict, addresses: list[str]) -> None:
    """A fleet where every device holds a little over half the model's layers."""
    memory_gb = layer_bytes(model) * (model["n_layers"] // 2 + 0.5) / 2**30
    delay = [[0.0 if i == j else (NEAR_MS if SITES[i] == SITES[j] else FAR_MS) for j in range(4)] for i in range(4)]
    bw = [[10000.0 if SITES[i] == SITES[j] else 100.0 for j in range(4)] for i in range(4)]
    near_site = [0, 1, 0, 1]  # the site each unreliable device is close to
    path.write_text(yaml.safe_dump({
        "reliable": [{"name": f"s{i}", "tflops": 4.0, "memory_gb": memory_gb, "address": a}
                     for i, a in enumerate(addresses)],
        "unreliable": [{"name": f"u{i}", "tflops": 2.0, "memory_gb": memory_gb} for i in range(4)],
        "reliable_delay_ms": delay, "reliable_bandwidth_mbps": bw,
        "unreliable_delay_ms": [[5.0 if SITES[j] == near_site[i] else FAR_MS for j in range(4)] for i in range(4)],
        "unreliable_bandwidth_mbps": [[1000.0 if SITES[j] == near_site[i] else 10.0 for j in range(4)]
                                      for i in range(4)],
    }, sort_keys=False))


def show(cmd: list[str], step: str) -> None:
    print(f"\n[{step}] $ {' '.join(cmd)}", flush=True)


def logged_steps(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def train(args: argparse.Namespace, alloc: Path, token: Path, out: Path, env: dict, label: str) -> bool:
    """Servers and clients as processes, with the departures and the late join of CLIENTS;
    True when every process ended cleanly within the time allowed."""
    ditorch = [sys.executable, "-m", "ditorch.cli", "volunteer"]
    allocation = json.loads(alloc.read_text())
    metrics = out / "run.jsonl"
    metrics.unlink(missing_ok=True)
    procs: dict[str, subprocess.Popen] = {}

    def start(name: str, *cmd: str, chip: str | None = None) -> None:
        full = [*ditorch, *cmd, "--token-file", str(token), "--log-level", "INFO"]
        show(full if chip is None else [f"DITORCH_CHIP={chip}", *full], label)
        procs[name] = subprocess.Popen(full, env=dict(env, **({"DITORCH_CHIP": chip} if chip else {})), cwd=REPO,
                                       stdout=open(out / f"{name}.log", "w"), stderr=subprocess.STDOUT)

    def client(name: str, chip: str, stage: int | None, leave_after: float | None, join_when: Path | None) -> None:
        chip = args.chip or chip
        extra = (["--stage", str(stage)] if stage is not None else []) + \
                (["--leave-after", str(leave_after)] if leave_after is not None else []) + \
                (["--join-when", str(join_when)] if join_when is not None else [])
        start(name, "client", "--join", entry, "--name", name, "--device", "dipu",
              "--tflops", str(CHIP_TFLOPS.get(chip, 2.0)), *extra,
              *(["--emulate-tflops", str(args.emulate_tflops)] if args.emulate_tflops else []), chip=chip)

    started = time.perf_counter()
    deadline = time.monotonic() + args.timeout
    try:
        servers = [s["name"] for s in allocation["fleet"]["reliable"]]
        for name in servers:
            start(name, "server", "--alloc", str(alloc), "--id", name, "--metrics", str(metrics),
                  "--server-token-file", str(token.with_name("servers.key")))
        entry = allocation["fleet"]["reliable"][0]["address"]
        # Late clients start now and join when their step comes (their start-up, importing
        # torch, takes seconds a loaded host does not bound): a file they wait for releases them.
        release = {name: out / f"{name}.join" for name, _, _, after, _ in CLIENTS if after}
        for path in release.values():
            path.unlink(missing_ok=True)
        for name, chip, stage, _, leave in CLIENTS:
            client(name, chip, stage, leave, release.get(name))
        waiting = [c for c in CLIENTS if c[0] in release]
        killed, shown = False, 0
        while time.monotonic() < deadline and any(procs[n].poll() is None for n in servers):
            steps = logged_steps(metrics)
            for line in metrics.read_text().splitlines()[shown:] if steps > shown else []:
                r = json.loads(line)
                print(f"   step {r['step']:>3}  loss {r['loss']:.4f}  ({time.perf_counter() - started:.0f} s)", flush=True)
            shown = steps
            if steps >= KILL_AT_STEPS and not killed and VICTIM in procs:
                print(f"   -> SIGKILL {VICTIM}: it vanishes mid-step; its tasks go back to the pool", flush=True)
                os.kill(procs[VICTIM].pid, signal.SIGKILL)
                killed = True
            for name, chip, stage, after, leave in [c for c in waiting if steps >= c[3]]:
                waiting.remove((name, chip, stage, after, leave))
                print(f"   -> {name} joins (chip {args.chip or chip})", flush=True)
                release[name].touch()
            time.sleep(0.2)
        ok = all(p.wait(max(1.0, deadline - time.monotonic())) == 0 for n, p in procs.items() if n != VICTIM)
    except subprocess.TimeoutExpired:
        ok = False
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    print(f"   ({time.perf_counter() - started:.0f} s)", flush=True)
    for name, *_ in CLIENTS:
        lines = (out / f"{name}.log").read_text().splitlines() if (out / f"{name}.log").exists() else []
        said = [ln.split(" volunteer.client ", 1)[-1] for ln in lines if "joins stage" in ln or "computed" in ln]
        print(f"   {name:>7}: {'; '.join(said) or 'no report (killed)'}")
    if not ok:
        print(f"   the job did not end cleanly; logs in {out}")
    return ok


def main(argv: list[str] | None = None, step: str = "") -> int:
    """Run the whole phase; 0 when every process ended cleanly and the job's loss curve is within
    ``--threshold`` MRE of the single-process one."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="examples/configs/llama-small.yaml")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--threshold", type=float, default=1.5, help="MRE %% allowed against the single-process run")
    p.add_argument("--chip", default=None, help="run every client on this chip instead of A, B and C (e.g. host)")
    p.add_argument("--emulate-tflops", type=float, default=None,
                   help="pace every client's compute to this speed (a tiny model's steps then last long enough "
                        "for the late client to take part)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds the training may take")
    p.add_argument("--out", default="out/volunteer")
    args = p.parse_args(argv)
    if args.steps < 4:
        p.error(f"--steps {args.steps}: the departures and the late join need at least 4 steps")
    label = step or "volunteer"
    out = REPO / args.out
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    ditorch = [sys.executable, "-m", "ditorch.cli"]
    model = yaml.safe_load((REPO / args.model).read_text())
    devices, alloc, token = out / "devices.yaml", out / "alloc.json", out / "job.key"
    write_devices(devices, model, [f"127.0.0.1:{free_port()}" for _ in SITES])
    if run([*ditorch, "volunteer", "token", str(token)], env, label, check=False) or run(
            [*ditorch, "volunteer", "token", str(token.with_name("servers.key"))], env, label, check=False) or run(
            [*ditorch, "volunteer", "plan", "--devices", str(devices), "--model", args.model, "--batch",
             str(args.batch), "--microbatches", "2", "--seq", str(args.seq), "--steps", str(args.steps),
             "--lr", "0.003", "--out", str(alloc)], env, label, check=False):
        return 1
    trained = train(args, alloc, token, out, env, label)
    if run([*ditorch, "volunteer", "reference", "--alloc", str(alloc), "--loss-log", str(out / "reference.jsonl")],
           env, label, check=False):
        return 1
    verdict = run([*ditorch, "mre", str(out / "reference.jsonl"), str(out / "run.jsonl"), "--threshold",
                   str(args.threshold), "--plot", str(out / "loss_curves.png")], env, label, check=False)
    return 0 if trained and verdict == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
