"""What dipu costs over the native device it runs on: dipu over the cpu vendor against plain CPU
tensors, in one process, the contenders taking turns (interleaved within each round, the order
rotated from turn to turn) so that load from the rest of the machine and the host's own drifting
speed hit them alike.

  add 1000   a 1,000-element fp32 ``a + b``: per-op host time (target: dipu <= 1 us over cpu)
  add 1      a one-element add (the shim's fixed cost alone, for scale)
  step       a training step of the LLaMA `make gpu-check` trains (dim 256, 4 layers, 8x128
             tokens, AdamW), bf16 autocast and fp32 (target: dipu <= 1.05x cpu)

A control row runs native cpu against itself (a second set of tensors, a second model): its
ratio is the benchmark's own noise floor on this machine, measured in the same rounds. Models and
tensors are built afresh every round (same seed, one warm-up step), so where their memory happens
to lie (which moves a step by several percent from one instance to the next) is drawn anew each
round instead of favouring one device for the whole run.

Wall time (perf_counter) and this process's CPU time (process_time) are printed side by side:
CPU time is what the process spent, wall time what it waited too (other agents' load). The
figures are medians over rounds; ratios and differences are taken within each round first.
One intra-op thread (torch.set_num_threads(1)) for both; the garbage collector is held off while a
contender is timed (a collection before each, as timeit does).

    .venv/bin/python benchmarks/native_vendor_overhead.py [--rounds 15 --steps 4]
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("DITORCH_VENDOR", "cpu")  # chosen once, at import
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from program_results import Measurement, save_run  # noqa: E402

LLAMA = dict(vocab_size=512, dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=688, max_seq_len=128)
DEVICES = ("cpu", "dipu")
CONTROL = "cpu again"  # native cpu measured against itself: the noise floor
CONTENDERS = (*DEVICES, CONTROL)


def _device(contender: str) -> str:
    return "cpu" if contender == CONTROL else contender


def _clocks(fn, repeats: int) -> tuple[float, float]:
    """(wall, cpu) seconds per call of `fn` over `repeats` calls, Python's garbage collector held
    off while they run (as timeit does): a collection lands in whichever contender happens to cross
    its allocation threshold, and over a whole heap it took 6-8% of a step here."""
    gc.collect()
    gc.disable()
    try:
        w, c = time.perf_counter(), time.process_time()
        for _ in range(repeats):
            fn()
        return (time.perf_counter() - w) / repeats, (time.process_time() - c) / repeats
    finally:
        gc.enable()


def _rounds(make, rounds: int, turns: int, repeats: int) -> dict:
    """Every round, `make(contender)` builds each contender's work afresh (a callable doing one
    unit of it); the contenders then take `turns` turns of `repeats` units each, interleaved, the
    order rotated from turn to turn, so a change in the host's own speed (it drifts by 2x here over
    minutes) hits them alike. Per-contender lists of per-unit (wall, cpu) seconds, one per round,
    and each round's dipu and control against cpu (differences and ratios taken within the round)."""
    wall = {c: [] for c in CONTENDERS}
    cpu = {c: [] for c in CONTENDERS}
    for r in range(rounds):
        work = {c: make(c) for c in CONTENDERS}
        spent = {c: [0.0, 0.0] for c in CONTENDERS}
        for turn in range(turns):
            shift = (r + turn) % len(CONTENDERS)
            for c in CONTENDERS[shift:] + CONTENDERS[:shift]:
                w, t = _clocks(work[c], repeats)
                spent[c][0] += w / turns
                spent[c][1] += t / turns
        for c in CONTENDERS:
            wall[c].append(spent[c][0])
            cpu[c].append(spent[c][1])
    out = {"wall": wall, "cpu": cpu}
    for c in ("dipu", CONTROL):
        out[c] = {"over_wall": [b - a for a, b in zip(wall["cpu"], wall[c])],
                  "over_cpu": [b - a for a, b in zip(cpu["cpu"], cpu[c])],
                  "ratio_wall": [b / a for a, b in zip(wall["cpu"], wall[c])],
                  "ratio_cpu": [b / a for a, b in zip(cpu["cpu"], cpu[c])]}
    return out


def per_op(numel: int, repeats: int, rounds: int) -> dict:
    import torch

    def make(contender: str):
        device = _device(contender)
        a, b = torch.randn(numel).to(device), torch.randn(numel).to(device)
        add = lambda: a + b  # noqa: E731
        _clocks(add, repeats // 4)  # warm
        return add

    return _rounds(make, rounds, turns=4, repeats=repeats // 4)


def training_steps(precision: str, steps: int, rounds: int) -> dict:
    import torch

    from dimodel.llama import Llama, LlamaConfig

    cfg = LlamaConfig(**LLAMA)

    def make(contender: str):
        device = _device(contender)
        torch.manual_seed(0)
        model = Llama(cfg).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        tokens = torch.randint(0, cfg.vocab_size, (8, cfg.max_seq_len + 1),
                               generator=torch.Generator().manual_seed(1)).to(device)

        def step() -> None:
            with torch.autocast(device, dtype=torch.bfloat16, enabled=precision == "bf16"):
                logits = model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            loss.item()  # the host waits for the step, as a training loop that logs does

        step()  # warm: optimizer state, allocator caches
        return step

    return _rounds(make, rounds, turns=steps, repeats=1)


def _print_rows(label: str, r: dict, unit: float, digits: int) -> None:
    """dipu's row and the control's, in `unit`s of a second (1e6: us), ratios to `digits`; the last
    column is the middle half of the rounds' CPU-time ratios (their spread)."""
    med = statistics.median
    for c in ("dipu", CONTROL):
        name = label if c == "dipu" else f"  {CONTROL}"
        q1, _, q3 = statistics.quantiles(r[c]["ratio_cpu"], n=4)
        print(f"{name:<22} {unit * med(r['wall']['cpu']):>10.2f} {unit * med(r['wall'][c]):>10.2f} "
              f"{unit * med(r['cpu']['cpu']):>10.2f} {unit * med(r['cpu'][c]):>10.2f} "
              f"{unit * med(r[c]['over_wall']):>14.2f} {unit * med(r[c]['over_cpu']):>13.2f} "
              f"{med(r[c]['ratio_wall']):>10.{digits}f} {med(r[c]['ratio_cpu']):>10.{digits}f} "
              f"{q1:>7.{digits}f}-{q3:.{digits}f}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=15, help="rounds per measurement (each builds every contender afresh)")
    p.add_argument("--steps", type=int, default=4, help="training steps per contender per round, interleaved")
    p.add_argument("--repeats", type=int, default=2000, help="adds per contender per round (in 4 interleaved turns)")
    p.add_argument("--no-save", action="store_true", help="print only; save no run under .benchmarks")
    args = p.parse_args()

    import torch

    import ditorch  # noqa: F401

    torch.set_num_threads(1)
    assert ditorch.vendor_name() == "cpu", f"DITORCH_VENDOR must be cpu here, got {ditorch.vendor_name()}"
    med = statistics.median
    load = os.getloadavg()
    print(f"dipu over the cpu vendor against cpu, one process, 1 thread, {args.rounds} rounds; "
          f"torch {torch.__version__}, {os.cpu_count()} cores, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print(f"{'measurement':<22} {'cpu wall':>10} {'dipu wall':>10} {'cpu CPU':>10} {'dipu CPU':>10} "
          f"{'dipu-cpu wall':>14} {'dipu-cpu CPU':>13} {'ratio wall':>10} {'ratio CPU':>10} {'CPU ratio q1-q3':>15}")
    print(f"(each '{CONTROL}' row: native cpu in dipu's columns, against cpu: the noise floor)")
    measurements = []
    verdicts = []
    for numel, label in ((1000, "add 1000 (us)"), (1, "add 1 (us)")):
        r = per_op(numel, args.repeats, args.rounds)
        _print_rows(label, r, 1e6, 2)
        group = f"dipu over the cpu vendor: {numel}-element add"
        measurements += [Measurement(group, "cpu", r["wall"]["cpu"], {"peer": True}),
                         Measurement(group, "dipu", r["wall"]["dipu"], {"target": "<= 1 us over cpu"} if numel == 1000 else {}),
                         Measurement(group, CONTROL, r["wall"][CONTROL], {"control": True})]
        if numel == 1000:
            verdicts.append(("add 1000: dipu - cpu <= 1 us (CPU time)", med(r["dipu"]["over_cpu"]) <= 1e-6))
    for precision in ("bf16", "fp32"):
        r = training_steps(precision, args.steps, args.rounds)
        _print_rows(f"step {precision} (ms)", r, 1e3, 3)
        group = f"dipu over the cpu vendor: llama training step {precision}"
        measurements += [Measurement(group, "cpu", r["wall"]["cpu"], {"peer": True}),
                         Measurement(group, "dipu", r["wall"]["dipu"], {"target": "<= 1.05x"}),
                         Measurement(group, CONTROL, r["wall"][CONTROL], {"control": True})]
        verdicts.append((f"step {precision}: dipu/cpu <= 1.05 (CPU time)", med(r["dipu"]["ratio_cpu"]) <= 1.05))
    load = os.getloadavg()
    print(f"load average after: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    for what, ok in verdicts:
        print(f"{'PASS' if ok else 'FAIL'}: {what}")
    if not args.no_save:
        save_run("native_vendor_overhead", measurements)
    return 0 if all(ok for _, ok in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
