"""Eager against torch.compile (Inductor) training steps on dipu, per vendor, in the same run.

Each vendor runs in its own process (``DITORCH_VENDOR`` is read at import): the project's LLaMA
(small) trains on dipu for a few steps eager, then with each decoder block compiled (regional
compilation, as ``ditorch.train --compile``), and the steady-state step times are compared. On
the cpu vendor the gain is the host's own (Inductor's fused C++ kernels against ATen's); on emu
the chip's time is what counts, so the emu run takes chip A at a time scale where the device, not
the host, sets the pace, and the gain is the chip's fused-kernel time (one roofline charge per
fused kernel instead of one per eager op).

    .venv/bin/python benchmarks/compile.py [--steps 4] [--time-scale 100]

Prints a table (wall and CPU time per step, compiled/eager ratio) and writes
docs/compile-bench.png.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _worker(steps: int, chip: str, time_scale: float) -> dict:
    import torch

    import ditorch
    from dimodel.llama import Llama, LlamaConfig

    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=768, max_seq_len=128)
    tokens = torch.randint(0, config.vocab_size, (4, 129), device="dipu")
    result = {"vendor": ditorch.vendor_name(), "chip": chip}
    for mode in ("eager", "compiled"):
        torch.manual_seed(0)
        model = Llama(config).to("dipu")
        if mode == "compiled":
            for block in model.layers:
                block.compile()
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)

        def step() -> float:
            logits = model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.item()

        ditorch.set_chip("host")
        step()  # compiles (forward and backward) on the host chip
        ditorch.set_chip(chip, time_scale=time_scale)
        step()
        torch.dipu.synchronize()
        wall, cpu, losses = [], [], []
        emulated = ditorch.vendor_name() == "emu"
        if emulated:
            torch.ops.ditorch_emu.emulation_stats(True)
        for _ in range(steps):
            w0, c0 = time.perf_counter(), time.process_time()
            losses.append(step())
            torch.dipu.synchronize()
            wall.append(time.perf_counter() - w0)
            cpu.append(time.process_time() - c0)
        kernels, busy_ns = torch.ops.ditorch_emu.emulation_stats(False)[:2] if emulated else (0, 0)
        result[mode] = {"wall_s": min(wall), "cpu_s": min(cpu), "loss": losses[-1],
                        "device_s": busy_ns / 1e9 / steps, "kernels": kernels / steps}
    return result


def _run(vendor: str, chip: str, steps: int, time_scale: float) -> dict:
    env = dict(os.environ, DITORCH_VENDOR=vendor, PYTHONPATH=str(ROOT), TORCHINDUCTOR_COMPILE_THREADS="1")
    cmd = [sys.executable, __file__, "--worker", "--steps", str(steps), "--chip", chip, "--time-scale", str(time_scale)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"{vendor} worker failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['vendor']} ({r['chip']})" for r in rows]
    xs = range(len(rows))
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar([x - 0.2 for x in xs], [r["eager"]["wall_s"] * 1e3 for r in rows], 0.4, label="eager")
    ax.bar([x + 0.2 for x in xs], [r["compiled"]["wall_s"] * 1e3 for r in rows], 0.4, label="compiled (Inductor)")
    ax.set_xticks(list(xs), labels)
    ax.set_ylabel("training step (ms, best of the run)")
    ax.set_title("LLaMA-small on dipu: eager vs torch.compile")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--time-scale", type=float, default=100.0, help="the emu chip's time scale (device-bound)")
    p.add_argument("--chip", default="A")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--plot", type=Path, default=ROOT / "docs" / "compile-bench.png")
    args = p.parse_args()
    if args.worker:
        print(json.dumps(_worker(args.steps, args.chip, args.time_scale)))
        return 0
    rows = [_run("cpu", "host", args.steps, 1.0), _run("emu", args.chip, args.steps, args.time_scale)]
    print(f"{'vendor':<6} {'chip':<14} {'eager wall':>11} {'eager cpu':>10} {'compiled wall':>14} {'compiled cpu':>13} "
          f"{'compiled/eager':>15} {'loss diff':>10}  chip busy per step (kernels), eager -> compiled")
    for r in rows:
        e, c = r["eager"], r["compiled"]
        chip = r["chip"] if r["vendor"] == "cpu" else f"{r['chip']} x{args.time_scale:g}"
        print(f"{r['vendor']:<6} {chip:<14} {e['wall_s'] * 1e3:>9.1f}ms {e['cpu_s'] * 1e3:>8.1f}ms "
              f"{c['wall_s'] * 1e3:>12.1f}ms {c['cpu_s'] * 1e3:>11.1f}ms {c['wall_s'] / e['wall_s']:>15.2f} "
              f"{abs(c['loss'] - e['loss']):>10.1e}  "
              + (f"{e['device_s'] * 1e3:.1f}ms ({e['kernels']:.0f}) -> {c['device_s'] * 1e3:.1f}ms ({c['kernels']:.0f})"
                 if r["vendor"] == "emu" else "-"))
    _plot(rows, args.plot)
    print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
