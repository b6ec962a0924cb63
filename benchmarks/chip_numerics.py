"""The host's cost of a chip's matmul numerics: the fused K-reduction kernel against its peers,
per matmul of a `llama-small` layer, in the same run.

An emulated chip with a narrow accumulator (B: 12 bits every 32 K-terms) computes each matmul's
result as the chip would (docs/device.md, "Numerics"): `torch.ops.ditorch_emu.chip_matmul`, one
register-tiled pass. Its peers, measured beside it on the same operands:

- per-block GEMM: the same numerics with torch ops (the operands widened to fp32, one GEMM per
  block of K-terms into the running sum, the sum truncated after each): output-bandwidth bound;
- fp32 mm: plain `torch.mm` of operands already in fp32, no chip numerics: the floor.

The shapes are the layer's own, recorded from one forward and backward of it in bf16 autocast
(`heteropp.runtime.profiler.one_layer_on_chip`, as the demo's phase 0 runs it), with the operands'
layouts (the weights arrive as transposed views). Wall and CPU time per call, 1 and 2 threads.

    .venv/bin/python benchmarks/chip_numerics.py [--model examples/configs/llama-small.yaml] [--chip B] [--repeats 20]

Prints a table per thread count and the layer's total (each shape times how often the layer runs
it), and saves the run for benchmarks/report.py.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from program_results import Measurement, save_run  # noqa: E402

MATMULS = ("aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten.baddbmm.default")
PEERS = ("fused kernel", "per-block GEMM", "fp32 mm")


def layer_matmuls(model: str) -> Counter:
    """(a's shape and strides, b's shape and strides, dtype) -> how often one forward and backward
    of the model's layer runs that matmul."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from heteropp.model_spec import ModelSpec
    from heteropp.runtime.profiler import one_layer_on_chip

    seen: Counter = Counter()

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if str(func) in MATMULS:
                a, b = args[1:3] if "add" in str(func) else args[:2]
                seen[(tuple(a.shape), a.stride(), tuple(b.shape), b.stride(), a.dtype)] += 1
            return func(*args, **(kwargs or {}))

    spec = ModelSpec.load(model)
    stage, x, autocast = one_layer_on_chip("host", spec.to_dict(), "bf16", 1.0)
    with Record():
        with autocast:
            out = stage(x.detach().requires_grad_())
        out.backward(torch.ones_like(out))
    return seen


def operand(shape: tuple, stride: tuple, dtype, g):
    """A random host tensor with `shape`, laid out as `stride` says (a transposed view stays one)."""
    import torch

    order = sorted(range(len(shape)), key=lambda d: -stride[d])  # outermost dimension first
    dense = torch.randn([shape[d] for d in order], generator=g).to(dtype)
    return dense.permute([order.index(d) for d in range(len(shape))])


def per_block_gemm(a, b, bits: int, block: int):
    """The chip's numerics with torch ops: fp32 operands, a GEMM per block into the running sum,
    the sum truncated after each block."""
    import torch

    af, bf = a.float(), b.float()
    a3, b3 = (af.unsqueeze(0), bf.unsqueeze(0)) if af.dim() == 2 else (af, bf)
    k = af.shape[-1]
    mask = -(1 << (23 - bits))  # the int32 whose set bits are the sign, exponent and kept mantissa
    total = None
    for k0 in range(0, k, block):
        width = min(block, k - k0)
        if total is None:
            total = torch.bmm(a3.narrow(2, 0, width), b3.narrow(1, 0, width))
        else:
            total.baddbmm_(a3.narrow(2, k0, width), b3.narrow(1, k0, width))
        total.view(torch.int32).bitwise_and_(mask)
    return total


def timed(fn, repeats: int) -> tuple[list[float], list[float]]:
    fn()  # the allocator warmed up
    wall, cpu = [], []
    for _ in range(repeats):
        w, c = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - w)
        cpu.append(time.process_time() - c)
    return wall, cpu


def describe(key: tuple) -> str:
    a_shape, a_stride, b_shape, b_stride, _ = key
    t = lambda shape, stride: "T" if stride[-2] == 1 and shape[-1] > 1 else ""  # noqa: E731
    return "x".join(map(str, a_shape)) + t(a_shape, a_stride) + " @ " + "x".join(map(str, b_shape)) + t(b_shape, b_stride)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(ROOT / "examples" / "configs" / "llama-small.yaml"))
    p.add_argument("--chip", default="B", help="whose accumulator (bits, block) the numerics are")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--threads", default="1,2")
    p.add_argument("--no-save", action="store_true")
    args = p.parse_args()
    import torch

    import ditorch_ext  # noqa: F401  (torch.ops.ditorch_emu)
    from diutil.datasheets.chips import resolve

    chip = resolve(args.chip)
    bits, block = chip.accumulator_bits, chip.accumulation_block or 1 << 30
    shapes = layer_matmuls(args.model)
    g = torch.Generator().manual_seed(0)
    fused = torch.ops.ditorch_emu.chip_matmul
    print(f"chip {args.chip}: accumulator {bits} bits every {chip.accumulation_block or 'all'} K-terms; "
          f"kernel {torch.ops.ditorch_emu.chip_matmul_kernel()}, torch {torch.backends.cpu.get_cpu_capability()}; "
          f"{Path(args.model).name}'s layer, {sum(shapes.values())} matmuls of {len(shapes)} shapes "
          f"(median of {args.repeats}, ms per call)")
    measurements = []
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        totals = {p: [0.0, 0.0] for p in PEERS}  # wall, cpu
        print(f"\n{threads} thread{'s' if threads > 1 else ''}\n{'matmul':<26} {'x':>2} "
              + " ".join(f"{p + ' wall/cpu':>24}" for p in PEERS) + f" {'fused/per-block':>16} {'fused/fp32 mm':>14}")
        for key, count in shapes.items():
            a = operand(key[0], key[1], key[4], g)
            b = operand(key[2], key[3], key[4], g)
            a32, b32 = operand(key[0], key[1], torch.float32, g), operand(key[2], key[3], torch.float32, g)
            mm = torch.bmm if a.dim() == 3 else torch.mm
            runs = {"fused kernel": timed(lambda: fused(a, b, bits, block), args.repeats),
                    "per-block GEMM": timed(lambda: per_block_gemm(a, b, bits, block), args.repeats),
                    "fp32 mm": timed(lambda: mm(a32, b32), args.repeats)}
            wall = {p: statistics.median(runs[p][0]) for p in PEERS}
            cpu = {p: statistics.median(runs[p][1]) for p in PEERS}
            for peer in PEERS:
                totals[peer][0] += count * wall[peer]
                totals[peer][1] += count * cpu[peer]
            print(f"{describe(key):<26} {count:>2} "
                  + " ".join(f"{1e3 * wall[p]:>11.3f}/{1e3 * cpu[p]:<12.3f}" for p in PEERS)
                  + f" {wall['fused kernel'] / wall['per-block GEMM']:>15.2f}x {wall['fused kernel'] / wall['fp32 mm']:>13.2f}x")
            group = f"chip {args.chip} numerics, {describe(key)}, {threads} thread{'s' if threads > 1 else ''}"
            measurements += [Measurement(group, peer, runs[peer][0], {"peer": True} if peer == "per-block GEMM" else {})
                             for peer in PEERS]
        print(f"{'the layer (x count)':<29} "
              + " ".join(f"{1e3 * totals[p][0]:>11.3f}/{1e3 * totals[p][1]:<12.3f}" for p in PEERS)
              + f" {totals['fused kernel'][0] / totals['per-block GEMM'][0]:>15.2f}x "
              f"{totals['fused kernel'][0] / totals['fp32 mm'][0]:>13.2f}x  (wall; in CPU time "
              f"{totals['fused kernel'][1] / totals['per-block GEMM'][1]:.2f}x and "
              f"{totals['fused kernel'][1] / totals['fp32 mm'][1]:.2f}x)")
    if not args.no_save:
        save_run("chip_numerics", measurements)
    return 0


if __name__ == "__main__":
    sys.exit(main())
