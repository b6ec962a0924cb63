"""Run PyTorch's OpInfo database on ``dipu`` against CPU and classify every op.

For each OpInfo in ``op_db`` the first few CPU sample inputs (float32, or the op's first
supported dtype when it has no float32) are run on CPU, then the same samples moved with
``.to("dipu")`` are run on dipu. Forward results are compared with ``torch.testing.assert_close``;
for ops that support autograd the gradients of ``sum(out * g)`` with respect to every input that
requires grad are compared too (``g`` drawn on CPU and moved).

Random ops (an ATen op tagged ``nondeterministic_seeded`` runs in the CPU call) draw dipu's own
counter-based stream, not the CPU's: they are compared with the CPU by structure, dtype and
device, and by value with a second dipu run under the same seed (reproducibility). Ops whose output is uninitialized memory
(``has_nondeterministic_output``, e.g. ``empty``) are compared by shape, dtype and device only.

Run as a script to print the table and write ``build/opinfo.json``::

    PYTHONPATH=/work/main .venv/bin/python tests/device/opinfo_sweep.py [--samples 3] [--ops name,...]
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils._python_dispatch import TorchDispatchMode

import ditorch_ext  # registers the dipu device (the device layer alone, without the other layers)
from opinfo_expectations import CPU_ARGUMENTS

DIPU = "dipu"
# Samples larger than this (elements over all tensor arguments) are skipped: they cost time and
# exercise no path that a small sample does not.
MAX_SAMPLE_NUMEL = 50_000
SEED = 1234

# Default tolerances per dtype (as torch.testing.assert_close): the emu vendor runs the very same
# CPU kernels, so only alignment-dependent vectorisation may change the last bits.
PREFERRED_DTYPES = (torch.float32, torch.int64, torch.int32, torch.bool, torch.uint8, torch.complex64)


def reseed() -> None:
    """The CPU and dipu generators seeded alike before a sample: what ``torch.manual_seed`` does
    for them (tests/device/test_device.py checks that it does), without the lazy seeding calls it
    queues for CUDA, XPU and MTIA, each of which formats the caller's whole stack."""
    torch.default_generator.manual_seed(SEED)
    torch.dipu.manual_seed_all(SEED)


@dataclasses.dataclass
class OpResult:
    """The outcome of one OpInfo (all its checked samples)."""

    name: str
    dtype: str
    samples_run: int = 0  # samples whose CPU run succeeded (and so were run on dipu)
    cpu_failed: int = 0  # samples whose CPU run itself raised
    forward: str = "skip"  # pass | fail | skip (no sample ran on CPU)
    forward_error: str = ""
    grad: str = "n/a"  # pass | fail | n/a (op not differentiable or no differentiable output)
    grad_error: str = ""
    random: bool = False  # outputs depend on the RNG
    fallbacks: dict = dataclasses.field(default_factory=dict)  # ops run on CPU with copies
    seconds: float = 0.0


def op_key(op) -> str:
    return op.name + ("." + op.variant_test_name if op.variant_test_name else "")


def pick_dtype(op) -> Optional[torch.dtype]:
    supported = op.supported_dtypes("cpu")
    for dt in PREFERRED_DTYPES:
        if dt in supported:
            return dt
    return next(iter(sorted(supported, key=str)), None)


def _numel(sample) -> int:
    leaves, _ = tree_flatten((sample.input, sample.args, sample.kwargs))
    return sum(t.numel() for t in leaves if isinstance(t, torch.Tensor))


def _move_tensor(x: torch.Tensor) -> torch.Tensor:
    """``x`` on dipu with the same strides and storage offset over a copy of its whole storage.

    Samples include views into larger storages (``as_strided`` partial views, non-contiguous
    inputs); a plain ``.to()`` would compact them and change what the op reads.
    """
    x = x.detach()
    if x.layout != torch.strided or x.is_conj() or x.is_neg() or x._is_zerotensor():
        return x.to(DIPU)
    n = x.untyped_storage().nbytes() // x.element_size()
    return x.as_strided((n,), (1,), 0).to(DIPU).as_strided(x.shape, x.stride(), x.storage_offset())


def _to_dipu(tree: Any) -> Any:
    """Move every tensor (and every CPU device argument) of a sample to dipu, keeping leaves leaves."""

    def move(x):
        if isinstance(x, torch.Tensor):
            return _move_tensor(x).requires_grad_(x.requires_grad)
        if isinstance(x, torch.device) and x.type == "cpu":
            return torch.device(DIPU)
        if isinstance(x, str) and x == "cpu":  # a device named by string (to('cpu'), device='cpu')
            return DIPU
        return x

    return tree_map(move, tree)


def _call(op, sample, inputs) -> Any:
    inp, args, kwargs = inputs
    return op(inp, *args, **kwargs)


class _SeededProbe(TorchDispatchMode):
    """Notes whether any ATen op tagged ``nondeterministic_seeded`` (draws from a generator) runs."""

    seen = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if torch.Tag.nondeterministic_seeded in func.tags:
            self.seen = True
        return func(*args, **(kwargs or {}))


def compare(cpu: Any, dev: Any, what: str, values: bool = True) -> None:
    """Assert that the dipu result ``dev`` matches the CPU result ``cpu`` (structure, dtype, device, values)."""
    lc, sc = tree_flatten(cpu)
    ld, sd = tree_flatten(dev)
    if sc != sd:
        raise AssertionError(f"{what}: structure differs: cpu {sc} vs dipu {sd}")
    for i, (c, d) in enumerate(zip(lc, ld)):
        where = f"{what}[{i}]"
        if isinstance(c, torch.Tensor):
            if not isinstance(d, torch.Tensor):
                raise AssertionError(f"{where}: cpu gave a tensor, dipu gave {type(d).__name__}")
            expected_device = DIPU if c.device.type == "cpu" else c.device.type
            if d.device.type != expected_device:
                raise AssertionError(f"{where}: result on {d.device}, expected {expected_device}")
            if c.dtype != d.dtype or c.shape != d.shape:
                raise AssertionError(f"{where}: cpu {c.dtype}{list(c.shape)} vs dipu {d.dtype}{list(d.shape)}")
            if values and c.layout == torch.strided and c.numel() > 1 and c.stride() != d.stride():
                raise AssertionError(f"{where}: strides cpu {c.stride()} vs dipu {d.stride()}")
            if values:
                torch.testing.assert_close(d.detach().cpu(), c.detach(), equal_nan=True, msg=lambda m: f"{where}: {m}")
        elif c is None or isinstance(c, (bool, int, float, complex, str, torch.dtype, torch.Size)):
            if c != d and not (c != c and d != d):
                raise AssertionError(f"{where}: cpu {c!r} vs dipu {d!r}")
        elif isinstance(c, torch.device):
            if d.type != (DIPU if c.type == "cpu" else c.type):
                raise AssertionError(f"{where}: device {d} vs cpu {c}")
        else:
            if type(c) is not type(d):
                raise AssertionError(f"{where}: cpu {type(c).__name__} vs dipu {type(d).__name__}")


def _to_cpu(x: Any) -> Any:
    return x.detach().cpu() if isinstance(x, torch.Tensor) else x


def _grad_targets(out: Any) -> list:
    leaves, _ = tree_flatten(out)
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad and (t.is_floating_point() or t.is_complex())]


def _grad_inputs(inputs: Any) -> list:
    leaves, _ = tree_flatten(inputs)
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]


def _grads(outs: list, inputs: list, cotangents: list) -> tuple:
    loss = sum((o * g).sum().real if o.is_complex() else (o * g).sum() for o, g in zip(outs, cotangents))
    return torch.autograd.grad(loss, inputs, allow_unused=True)


def _short(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    first = next((line for line in msg if line.strip()), "")
    return f"{type(e).__name__}: {first[:300]}"


def run_op(op, max_samples: int) -> OpResult:
    """Run the first ``max_samples`` CPU samples of ``op`` on CPU and dipu and compare."""
    t0 = time.perf_counter()
    dtype = pick_dtype(op)
    res = OpResult(op_key(op), str(dtype).replace("torch.", ""))
    if dtype is None:
        res.forward_error = "no CPU dtype"
        return res
    differentiable = op.supports_autograd and (dtype.is_floating_point or dtype.is_complex)
    ditorch_ext.reset_cpu_fallback_counts()
    try:
        reseed()
        samples = op.sample_inputs("cpu", dtype, requires_grad=differentiable)
        samples = itertools.islice((s for s in samples if _numel(s) <= MAX_SAMPLE_NUMEL), max_samples)
        samples = list(samples)
    except Exception as e:  # the sample generator itself fails on CPU
        res.forward_error = f"CPU samples: {_short(e)}"
        return res
    fwd_ok = True
    grad_state = "n/a"
    for si, sample in enumerate(samples):
        cpu_inputs = (sample.input, sample.args, sample.kwargs)
        process = sample.output_process_fn_grad
        # CPU reference, and a second run under another seed to tell random ops apart.
        try:
            reseed()
            with _SeededProbe() as probe:
                cpu_out = _call(op, sample, cpu_inputs)
            res.random |= probe.seen
        except Exception:
            res.cpu_failed += 1
            continue
        res.samples_run += 1
        values = not op.has_nondeterministic_output
        keep = CPU_ARGUMENTS.get(res.name, (None, ()))[1]
        dev_inputs = (_to_dipu(sample.input),
                      tuple(a if i in keep else _to_dipu(a) for i, a in enumerate(sample.args)),
                      _to_dipu(sample.kwargs))
        # A random op draws dipu's own stream (docs/device.md, "Random numbers"), not the CPU's: its
        # result is compared with the CPU's by structure, dtype and device, and by value with a
        # second dipu run under the same seed.
        drawn = probe.seen
        try:
            reseed()
            dev_out = _call(op, sample, dev_inputs)
            compare(cpu_out, dev_out, f"sample {si} output", values=values and not drawn)
            if drawn and values:
                reseed()
                again = _call(op, sample, dev_inputs)
                compare(tree_map(_to_cpu, dev_out), again, f"sample {si} output drawn again")
        except Exception as e:
            if fwd_ok:
                res.forward_error = f"sample {si}: {_short(e)}"
            fwd_ok = False
            continue
        if not differentiable or not values or drawn:
            continue
        try:
            outs_c = _grad_targets(process(cpu_out))
            ins_c = _grad_inputs(cpu_inputs)
            if not outs_c or not ins_c:
                continue
            gen = torch.Generator().manual_seed(SEED + si)
            cot_c = [torch.randn(o.shape, dtype=o.dtype, generator=gen) for o in outs_c]
            grads_c = _grads(outs_c, ins_c, cot_c)
        except Exception:
            continue  # no CPU gradient to compare against for this sample
        if grad_state == "n/a":
            grad_state = "pass"
        try:
            outs_d = _grad_targets(process(dev_out))
            ins_d = _grad_inputs(dev_inputs)
            grads_d = _grads(outs_d, ins_d, [g.to(DIPU) for g in cot_c])
            compare(list(grads_c), list(grads_d), f"sample {si} grad")
        except Exception as e:
            if grad_state != "fail":
                res.grad_error = f"sample {si}: {_short(e)}"
            grad_state = "fail"
    if res.samples_run:
        res.forward = "pass" if fwd_ok else "fail"
        res.grad = grad_state
    elif not res.forward_error:
        res.forward_error = f"all {res.cpu_failed} CPU samples fail" if res.cpu_failed else "no samples"
    res.fallbacks = ditorch_ext.cpu_fallback_counts()
    res.seconds = time.perf_counter() - t0
    return res


# Variants swept beside each op's function form, and the dtypes beside its preferred one.
VARIANTS = ("function", "inplace", "out")
LOW_PRECISION = (torch.bfloat16, torch.float16)


@dataclasses.dataclass
class VariantResult:
    """One (op, variant, dtype) combination: forward results of its samples on dipu vs CPU."""

    name: str
    variant: str  # function | inplace | out
    dtype: str
    samples_run: int = 0  # samples whose CPU run succeeded
    verdict: str = "skip"  # pass | fail | skip (no sample ran on CPU)
    error: str = ""

    @property
    def key(self) -> str:
        return f"{self.name}[{self.variant},{self.dtype}]"


def _variant_call(op, variant: str):
    """A callable (input, args, kwargs, out) -> (result, written) for the variant, or None if the op lacks it."""
    if variant == "function":
        return lambda inp, args, kwargs, out: (op(inp, *args, **kwargs), None)
    if variant == "inplace":
        if op.inplace_variant is None:
            return None
        return lambda inp, args, kwargs, out: (op.inplace_variant(inp, *args, **kwargs), inp)
    if not op.supports_out:
        return None
    return lambda inp, args, kwargs, out: (op(inp, *args, **kwargs, out=out), out)


def _out_like(expected: Any, device: str) -> Any:
    """Empty out= tensors shaped like the function's result (a tensor or a tuple of them)."""
    if isinstance(expected, torch.Tensor):
        return torch.empty_like(expected, device=device)
    if isinstance(expected, (tuple, list)) and expected and all(isinstance(t, torch.Tensor) for t in expected):
        return tuple(torch.empty_like(t, device=device) for t in expected)
    return None


def _touches_dipu(tree: Any) -> bool:
    """Whether a moved sample reaches dipu at all (a factory sample without a device argument does not)."""
    leaves, _ = tree_flatten(tree)
    return any((isinstance(x, torch.Tensor) and x.device.type == DIPU) or
               (isinstance(x, torch.device) and x.type == DIPU) or (isinstance(x, str) and x == DIPU) for x in leaves)


def run_variants(op, max_samples: Optional[int], random: bool) -> list:
    """Forward results of the op's function, in-place and out= forms in its preferred dtype, bf16
    and fp16 (those it supports on CPU), on every sample under the size cap (``max_samples`` per
    combination when given), on dipu against CPU. Random ops (``run_op`` tells them) are left to
    ``run_op``'s generator-contract check. No dispatch mode runs here: under one, some CPU out=
    kernels (linalg.matrix_rank's) leave their out tensor unwritten."""
    dtype = pick_dtype(op)
    if dtype is None or random:
        return []
    supported = op.supported_dtypes("cpu")
    dtypes = [dtype] + [d for d in LOW_PRECISION if d in supported and d != dtype]
    keep = CPU_ARGUMENTS.get(op_key(op), (None, ()))[1]
    values = not op.has_nondeterministic_output
    results = []
    for dt in dtypes:
        try:
            reseed()
            samples = [s for s in op.sample_inputs("cpu", dt, requires_grad=False) if _numel(s) <= MAX_SAMPLE_NUMEL]
        except Exception:
            continue  # no samples in this dtype: not a combination that runs on CPU
        samples = samples[:max_samples] if max_samples else samples
        for variant in VARIANTS:
            call = _variant_call(op, variant)
            if call is None:
                continue
            res = VariantResult(op_key(op), variant, str(dt).replace("torch.", ""))
            ok = True
            for si, sample in enumerate(samples):
                try:
                    expected = op(sample.input, *sample.args, **sample.kwargs) if variant == "out" else None
                    inp = sample.input.clone() if isinstance(sample.input, torch.Tensor) else sample.input
                    out_c = _out_like(expected, "cpu") if variant == "out" else None
                    if variant == "out" and out_c is None:
                        continue
                    dev_inp = _to_dipu(inp)  # taken before an in-place variant writes it
                    cpu = call(inp, sample.args, sample.kwargs, out_c)
                except Exception:
                    continue
                dev_args = tuple(a if i in keep else _to_dipu(a) for i, a in enumerate(sample.args))
                dev_kwargs = _to_dipu(sample.kwargs)
                if not _touches_dipu((dev_inp, dev_args, dev_kwargs)):
                    continue  # runs on the default device (CPU) on both sides: not a dipu sample
                res.samples_run += 1
                try:
                    out_d = _out_like(expected, DIPU) if variant == "out" else None
                    dev = call(dev_inp, dev_args, dev_kwargs, out_d)
                    compare(cpu, dev, f"sample {si} {variant}", values=values)
                except Exception as e:
                    if ok:
                        res.error = f"sample {si}: {_short(e)}"
                    ok = False
            if res.samples_run:
                res.verdict = "pass" if ok else "fail"
                results.append(res)
    return results


def load_op_db() -> list:
    from torch.testing._internal.common_methods_invocations import op_db

    return op_db


def sweep(max_samples: int = 3, only: Optional[set] = None, progress: Optional[Callable[[OpResult], None]] = None,
          variant_samples: Optional[int] = None) -> tuple:
    """Run every OpInfo (or those named in ``only``): returns (one OpResult per op, one
    VariantResult per (op, variant, dtype) that runs on CPU, ``variant_samples`` samples each
    or all under the size cap)."""
    results, combos = [], []
    threads = torch.get_num_threads()
    # One intra-op thread for both sides: the samples are tiny, and on a shared, loaded machine
    # spinning OpenMP workers cost several times the work itself.
    torch.set_num_threads(1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for op in load_op_db():
                if only and op_key(op) not in only and op.name not in only:
                    continue
                r = run_op(op, max_samples)
                results.append(r)
                combos += run_variants(op, variant_samples, r.random)
                if progress:
                    progress(r)
    finally:
        torch.set_num_threads(threads)
    return results, combos


def summarize(results: list, combos: list) -> dict:
    ran = [r for r in results if r.samples_run]
    combos_pass = [c for c in combos if c.verdict == "pass"]
    fwd_pass = [r for r in ran if r.forward == "pass"]
    graded = [r for r in ran if r.grad in ("pass", "fail")]
    grad_pass = [r for r in graded if r.grad == "pass"]
    return {
        "ops": len(results),
        "ops_cpu_ran": len(ran),
        "forward_pass": len(fwd_pass),
        "forward_rate": len(fwd_pass) / max(1, len(ran)),
        "grad_checked": len(graded),
        "grad_pass": len(grad_pass),
        "grad_rate": len(grad_pass) / max(1, len(graded)),
        "random_ops": sorted(r.name for r in ran if r.random),
        "cpu_skipped": {r.name: r.forward_error for r in results if not r.samples_run},
        "forward_failures": {r.name: r.forward_error for r in ran if r.forward == "fail"},
        "grad_failures": {r.name: r.grad_error for r in ran if r.grad == "fail"},
        "cpu_fallbacks": {r.name: r.fallbacks for r in results if r.fallbacks},
        "combos_ran": len(combos),
        "combos_pass": len(combos_pass),
        "combos_rate": len(combos_pass) / max(1, len(combos)),
        "combos_by_variant": {v: sum(c.variant == v for c in combos) for v in VARIANTS},
        "combos_by_dtype": {d: sum(c.dtype == d for c in combos) for d in sorted({c.dtype for c in combos})},
        "combo_failures": {c.key: c.error for c in combos if c.verdict == "fail"},
    }


def write_report(results: list, combos: list, path: Path) -> dict:
    summary = summarize(results, combos)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"summary": summary, "ops": [dataclasses.asdict(r) for r in results],
                                "combinations": [dataclasses.asdict(c) for c in combos]}, indent=1))
    return summary


def format_summary(summary: dict) -> str:
    lines = [
        f"OpInfo on dipu vs CPU: {summary['ops']} ops, {summary['ops_cpu_ran']} with CPU samples that run",
        f"  forward agree: {summary['forward_pass']}/{summary['ops_cpu_ran']} = {summary['forward_rate']:.1%}",
        f"  gradients agree: {summary['grad_pass']}/{summary['grad_checked']} = {summary['grad_rate']:.1%}",
        f"  random ops (compared by structure with CPU, by value with a second dipu run): {len(summary['random_ops'])}",
        f"  (op, variant, dtype) combinations agree: {summary['combos_pass']}/{summary['combos_ran']} = "
        f"{summary['combos_rate']:.1%} (variants {summary['combos_by_variant']}, dtypes {summary['combos_by_dtype']})",
    ]
    for title, key in (("forward failures", "forward_failures"), ("gradient failures", "grad_failures"),
                       ("combination failures", "combo_failures")):
        lines.append(f"{title} ({len(summary[key])}):")
        lines += [f"  {name:40s} {err}" for name, err in sorted(summary[key].items())]
    if summary["cpu_fallbacks"]:
        lines.append("ops that fell back to CPU with copies:")
        lines += [f"  {name:40s} {fb}" for name, fb in sorted(summary["cpu_fallbacks"].items())]
    return "\n".join(lines)


def main(argv: Optional[list] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=3, help="samples per op (default 3)")
    p.add_argument("--variant-samples", type=int, default=0,
                   help="samples per (op, variant, dtype) combination (default 0: all under the size cap)")
    p.add_argument("--ops", default="", help="comma-separated op names (default: all)")
    p.add_argument("--out", default=str(Path(__file__).resolve().parents[2] / "build" / "opinfo.json"))
    p.add_argument("-v", "--verbose", action="store_true")
    a = p.parse_args(argv)
    only = set(a.ops.split(",")) if a.ops else None

    def progress(r: OpResult) -> None:
        if a.verbose or r.forward == "fail" or r.grad == "fail":
            print(f"{r.name:40s} fwd={r.forward:4s} grad={r.grad:4s} {r.seconds:6.2f}s {r.forward_error or r.grad_error}",
                  flush=True)

    t0 = time.perf_counter()
    results, combos = sweep(a.samples, only, progress, a.variant_samples or None)
    summary = write_report(results, combos, Path(a.out))
    print(format_summary(summary))
    print(f"({time.perf_counter() - t0:.1f}s; JSON in {a.out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
