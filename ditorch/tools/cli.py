"""``ditorch mre`` and ``ditorch replay``."""
from __future__ import annotations

import argparse
import sys


def register(subparsers) -> None:
    p = subparsers.add_parser("mre", help="Mean Relative Error of a loss curve against a reference run",
                              description="MRE = (1/n) sum |(y_i - yhat_i)/y_i| over the logged steps "
                                          "(y: reference loss). Exit 0 on pass, 1 on fail, 2 on bad input.")
    p.add_argument("reference", help="reference loss log (JSON lines with step, loss, tokens)")
    p.add_argument("run", help="loss log of the run to check")
    p.add_argument("--threshold", type=float, default=1.5, help="pass when MRE %% is below this (default 1.5)")
    p.add_argument("--plot", metavar="PNG", help="write both curves and the per-step relative error here")
    p.add_argument("--worst", type=int, default=5, help="how many worst steps to list (default 5)")
    p.add_argument("--common-steps", action="store_true",
                   help="compare the steps both runs logged instead of failing on differing step ranges")
    p.set_defaults(func=_mre)

    r = subparsers.add_parser("replay", help="re-run captured ops and compare outputs bit for bit",
                              description="DIR is one capture (holding meta.json) or a folder of captures. "
                                          "Exit 0 when every output is bit-identical, 1 otherwise.")
    r.add_argument("dir", help="capture directory (e.g. dump/addmm_17) or a folder of them")
    r.add_argument("--device", default="cpu", help="device to run on: cpu, dipu, dipu:1, cuda ... (default cpu)")
    r.set_defaults(func=_replay)


def _mre(args: argparse.Namespace) -> int:
    from diutil.loss_log import load_losses
    from ditorch.tools.mre import mean_relative_error, plot_mre

    try:
        report = mean_relative_error(load_losses(args.reference), load_losses(args.run),
                                     common_steps_only=args.common_steps, worst=args.worst)
    except (ValueError, FileNotFoundError) as exc:
        print(f"ditorch mre: {exc}", file=sys.stderr)
        return 2
    print(report.format(args.threshold))
    if args.plot:
        print(f"plot: {plot_mre(report, args.plot, threshold_percent=args.threshold)}")
    return 0 if report.passed(args.threshold) else 1


def _replay(args: argparse.Namespace) -> int:
    import torch  # the dipu device is registered: this module's package, ditorch, loaded it

    from ditorch.tools.capture import find_captures, replay

    try:
        torch.device(args.device)
        captures = find_captures(args.dir)
    except (RuntimeError, FileNotFoundError) as exc:
        print(f"ditorch replay: {exc}", file=sys.stderr)
        return 2
    failures = 0
    for directory in captures:
        try:
            result = replay(directory, args.device)
        except Exception as exc:  # one bad capture must not hide the others
            print(f"ERROR     {directory}: {type(exc).__name__}: {exc}")
            failures += 1
            continue
        worst = max((d.max_abs_err for d in result.differences), default=0.0)
        verdict = "IDENTICAL" if result.identical else "DIFFERENT"
        print(f"{verdict:<9} {directory}  {result.op} on {result.device}"
              f"{'' if result.identical else f'  max abs err {worst:.3g}'}"
              f"{'  (' + result.note + ')' if result.note else ''}")
        failures += not result.identical
    print(f"{len(captures) - failures}/{len(captures)} captures reproduced bit for bit on {args.device}")
    return 0 if failures == 0 else 1
