"""DiTorch device-layer benchmark: the dipu shim against plain CPU, measured in the same run.

Three measurements, each printed as a row with its ratio to CPU and the target:
- per-op dispatch overhead of a one-element add (and PyTorch's copying CPU fallback for scale);
- a training step of the small LLaMA (fp32, AdamW);
- host-to-device copy bandwidth of a 64 MiB tensor against a CPU ``copy_``.
Timings interleave the runs under comparison and keep the best of several repeats, so that
other load on the machine affects both sides alike.
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch

import ditorch
import ditorch_ext
from ditorch.datasets import sample_batch, text_corpus
from ditorch.models import Llama, LlamaConfig


def best_of(fns: dict[str, Callable[[], None]], inner: int, repeats: int) -> dict[str, float]:
    """Seconds per call of each fn: the best of ``repeats`` rounds, the fns interleaved."""
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(inner):
                fn()
            samples[name].append((time.perf_counter() - start) / inner)
    return {name: min(s) for name, s in samples.items()}


def dispatch_overhead(repeats: int) -> list[tuple[str, float, str]]:
    a, b = torch.ones(1), torch.ones(1)
    da, db = a.to("dipu"), b.to("dipu")
    t = best_of({"cpu": lambda: a + b, "dipu": lambda: da + db}, inner=20000, repeats=repeats)
    ditorch_ext.set_unsupported_ops(["aten::add"])  # what PyTorch's own cpu_fallback costs
    ditorch_ext.reset_cpu_fallback_counts()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fb = best_of({"fallback": lambda: da + db}, inner=5000, repeats=repeats)["fallback"]
    ditorch_ext.set_unsupported_ops([])
    return [
        ("add, 1 element: cpu", t["cpu"], "1.00x"),
        ("add, 1 element: dipu (zero-copy shim)", t["dipu"], f"{t['dipu'] / t['cpu']:.2f}x  (target <= 2x)"),
        ("add, 1 element: dipu via copying cpu_fallback", fb, f"{fb / t['cpu']:.2f}x  (PyTorch's fallback, for scale)"),
    ]


def training_step(repeats: int) -> list[tuple[str, float, str]]:
    config = LlamaConfig.from_yaml("examples/configs/llama-tiny.yaml")
    data, _ = text_corpus()
    batch = sample_batch(data, 8, 64, torch.Generator().manual_seed(0))
    steps = {}
    for device in ("cpu", "dipu"):
        torch.manual_seed(0)
        model = Llama(config).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        tokens = batch.to(device)

        def step(model=model, opt=opt, tokens=tokens) -> None:
            model.loss(tokens).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        step()  # warm-up
        steps[device] = step
    t = best_of(steps, inner=3, repeats=repeats)
    return [
        ("llama-tiny train step (8x64 tokens): cpu", t["cpu"], "1.00x"),
        ("llama-tiny train step (8x64 tokens): dipu", t["dipu"], f"{t['dipu'] / t['cpu']:.2f}x  (target <= 1.15x)"),
    ]


def copy_bandwidth(repeats: int) -> list[tuple[str, float, str]]:
    n = 64 << 20
    src = torch.empty(n, dtype=torch.uint8).random_()
    cpu_dst = torch.empty_like(src)
    dipu_dst = torch.empty(n, dtype=torch.uint8, device="dipu")
    cpu_dst.copy_(src), dipu_dst.copy_(src)
    t = best_of({"cpu": lambda: cpu_dst.copy_(src), "dipu": lambda: dipu_dst.copy_(src)}, inner=4, repeats=repeats)
    assert torch.equal(dipu_dst.cpu(), src)
    gbps = {k: n / v / 1e9 for k, v in t.items()}
    return [
        (f"64 MiB copy_ cpu->cpu ({gbps['cpu']:.2f} GB/s)", t["cpu"], "1.00x"),
        (f"64 MiB copy_ cpu->dipu ({gbps['dipu']:.2f} GB/s)", t["dipu"],
         f"{gbps['dipu'] / gbps['cpu']:.2f}x bandwidth  (target >= 0.8x)"),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    ditorch.set_chip("host")
    rows: list[tuple[str, float, str]] = []
    for name, bench in [("dispatch", dispatch_overhead), ("train step", training_step), ("copy", copy_bandwidth)]:
        print(f"measuring {name} ...", flush=True)
        rows += bench(args.repeats)
    width = max(len(r[0]) for r in rows)
    print(f"\n{'measurement':<{width}}  {'time':>12}  ratio to cpu")
    for name, seconds, ratio in rows:
        unit = f"{seconds * 1e6:10.2f} us" if seconds < 1e-3 else f"{seconds * 1e3:10.2f} ms"
        print(f"{name:<{width}}  {unit}  {ratio}")


if __name__ == "__main__":
    main()
