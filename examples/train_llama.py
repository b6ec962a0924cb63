"""One emulated chip against the CPU: train a small LLaMA-style model on it and check its loss curve (make demo-single).

Trains the same model, from the same seed, on the same batches twice: on ``cpu`` in fp32 (the
reference) and on ``dipu`` as the chip you name (bf16 autocast by default), then reports the
loss curves' Mean Relative Error against the H2 paper's 1.5% alignment criterion and writes the
curves as a PNG.

    python examples/train_llama.py --chip B --steps 100
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

import ditorch
from dimodel.datasets import sample_batch, text_corpus
from dimodel import Llama, LlamaConfig
from ditorch.tools import LossLogger, load_losses, mean_relative_error, plot_mre

REPO = Path(__file__).resolve().parent.parent


def train(device: str, args: argparse.Namespace, config: LlamaConfig, log_path: Path) -> float:
    """Train on ``device``, logging each step's loss; returns tokens per second."""
    torch.manual_seed(args.seed)
    model = Llama(config).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    data, _ = text_corpus()
    gen = torch.Generator().manual_seed(args.seed)
    autocast = device != "cpu" and args.dtype == "bf16"
    tokens = 0
    start = time.perf_counter()
    with LossLogger(log_path) as log:
        for step in range(1, args.steps + 1):
            batch = sample_batch(data, args.batch, args.seq, gen).to(device)
            with torch.autocast(device.split(":")[0], dtype=torch.bfloat16, enabled=autocast):
                loss = model.loss(batch)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            tokens += batch[:, 1:].numel()
            log.log(step, loss.item(), tokens)
            if step % args.log_every == 0 or step == args.steps:
                rate = tokens / (time.perf_counter() - start)
                bar = "#" * (30 * step // args.steps)
                print(f"  [{bar:<30}] {device:>6} step {step:>4}/{args.steps}  loss {loss.item():.4f}  "
                      f"{rate:,.0f} tok/s", flush=True)
    return tokens / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chip", default="B", help="emulated chip (A, B, C, D, host, or one from $DITORCH_PROFILE_FILE)")
    parser.add_argument("--memory-scale", type=float, default=0.001,
                        help="scale of the chip's memory (0.001: a 64 GB chip holds 64 MB)")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16", help="dipu precision (bf16 = autocast)")
    parser.add_argument("--model", default=str(REPO / "examples/configs/llama-tiny.yaml"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threshold", type=float, default=1.5, help="MRE threshold in percent")
    parser.add_argument("--out", default=str(REPO / "out/demo"))
    parser.add_argument("--log-every", type=int, default=10)
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")

    profile = ditorch.set_chip(args.chip, memory_scale=args.memory_scale)
    config = LlamaConfig.from_yaml(args.model)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    props = torch.dipu.get_device_properties()
    print(f"ditorch demo: {config.n_layers}-layer LLaMA ({sum(p.numel() for p in Llama(config).parameters()):,} "
          f"parameters) on chip {profile.name} ({props.total_memory / 2**20:.0f} MiB, {profile.relative_speed}x A100), "
          f"{args.dtype}, {args.steps} steps of {args.batch}x{args.seq} tokens")

    print("reference run (cpu, fp32):")
    cpu_rate = train("cpu", args, config, out / "reference_losses.jsonl")
    print(f"chip run (dipu, chip {profile.name}):")
    torch.dipu.reset_peak_memory_stats()
    dipu_rate = train("dipu", args, config, out / "run_losses.jsonl")

    report = mean_relative_error(load_losses(out / "reference_losses.jsonl"), load_losses(out / "run_losses.jsonl"))
    plot = plot_mre({f"dipu chip {profile.name} ({args.dtype})": report}, out / "loss_curves.png",
                    threshold_percent=args.threshold, title=f"Loss: cpu fp32 vs dipu chip {profile.name}")
    print()
    print(f"{'run':<22}{'tokens/s':>12}{'final loss':>12}")
    print(f"{'cpu fp32':<22}{cpu_rate:>12,.0f}{report.reference[-1]:>12.4f}")
    print(f"{'dipu ' + profile.name + ' ' + args.dtype:<22}{dipu_rate:>12,.0f}{report.run[-1]:>12.4f}")
    print(f"(dipu speed is emulated: every kernel of chip {profile.name} is stretched {profile.slowdown:.2f}x, and "
          f"{args.dtype} kernels run on this host's CPU, which may lack fast {args.dtype} arithmetic)")
    print(f"peak dipu memory: {torch.dipu.max_memory_allocated() / 2**20:.1f} MiB of "
          f"{props.total_memory / 2**20:.0f} MiB; ops run on CPU by fallback: {sum(ditorch.cpu_fallback_counts().values())}")
    print(report.format(args.threshold))
    print(f"loss curves: {plot}")
    return 0 if report.passed(args.threshold) else 1


if __name__ == "__main__":
    sys.exit(main())
