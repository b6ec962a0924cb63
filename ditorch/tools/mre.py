"""Mean Relative Error of a training-loss curve against a reference run (H2 paper, Table 1):

    MRE = (1/n) * sum_i |(y_i - yhat_i) / y_i|     (as a percentage)

over the n steps both runs logged, y the reference loss and yhat the evaluated run's.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Mapping, Optional, Sequence


def _ranges(steps: Sequence[int], limit: int = 6) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``0-2, 5, 7-8``."""
    steps = sorted(steps)
    spans, start, prev = [], steps[0], steps[0]
    for s in steps[1:] + [None]:
        if s is not None and s == prev + 1:
            prev = s
            continue
        spans.append(f"{start}-{prev}" if prev != start else f"{start}")
        if s is not None:
            start = prev = s
    more = f", ... ({len(spans) - limit} more spans)" if len(spans) > limit else ""
    return ", ".join(spans[:limit]) + more


@dataclasses.dataclass
class MREReport:
    """``mre_percent`` over ``n`` common steps; ``worst``: (step, reference, run, relative
    error) for the largest relative errors, largest first; ``steps``/``reference``/``run``/
    ``rel_errors`` hold the full per-step series (for plots)."""

    mre_percent: float
    n: int
    worst: list[tuple[int, float, float, float]]
    steps: list[int]
    reference: list[float]
    run: list[float]
    rel_errors: list[float]
    ignored_steps: int = 0

    def passed(self, threshold_percent: float = 1.5) -> bool:
        return self.mre_percent < threshold_percent

    def format(self, threshold_percent: Optional[float] = 1.5) -> str:
        lines = [f"MRE {self.mre_percent:.4f}% over n={self.n} steps ({self.steps[0]}-{self.steps[-1]})"]
        if self.ignored_steps:
            lines.append(f"({self.ignored_steps} steps logged by only one run were ignored)")
        if threshold_percent is not None:
            verdict = "PASS" if self.passed(threshold_percent) else "FAIL"
            lines.append(f"{verdict}: MRE {'<' if self.passed(threshold_percent) else '>='} {threshold_percent}%")
        if self.worst:
            lines.append(f"worst steps:  {'step':>7} {'reference':>12} {'run':>12} {'rel err %':>10}")
            for step, ref, run, rel in self.worst:
                lines.append(f"              {step:>7} {ref:>12.6f} {run:>12.6f} {100 * rel:>10.4f}")
        return "\n".join(lines)


def mean_relative_error(reference: Mapping[int, float], run: Mapping[int, float], *,
                        common_steps_only: bool = False, worst: int = 5) -> MREReport:
    """MRE of ``run`` against ``reference`` (both ``{step: loss}``, e.g. from ``load_losses``).

    Step policy: both runs must log the same steps — a different set is a ``ValueError`` naming
    the steps each run lacks (a run cut short must not pass on its first steps alone). With
    ``common_steps_only=True`` the steps both logged are used and the others counted in
    ``ignored_steps``; no common step is always an error. A zero reference loss is an error
    (its relative error is undefined).
    """
    if not reference:
        raise ValueError("mean_relative_error: the reference has no steps")
    if not run:
        raise ValueError("mean_relative_error: the run has no steps")
    ref_steps, run_steps = set(reference), set(run)
    common = sorted(ref_steps & run_steps)
    only_ref, only_run = sorted(ref_steps - run_steps), sorted(run_steps - ref_steps)
    if not common:
        raise ValueError(f"mean_relative_error: no common steps (reference {_ranges(sorted(ref_steps))}; "
                         f"run {_ranges(sorted(run_steps))})")
    if (only_ref or only_run) and not common_steps_only:
        parts = []
        if only_ref:
            parts.append(f"run lacks reference steps {_ranges(only_ref)}")
        if only_run:
            parts.append(f"reference lacks run steps {_ranges(only_run)}")
        raise ValueError("mean_relative_error: step ranges differ: " + "; ".join(parts)
                         + " (use common_steps_only / --common-steps to compare the overlap)")
    rels = []
    for step in common:
        y, yhat = float(reference[step]), float(run[step])
        if y == 0.0:
            raise ValueError(f"mean_relative_error: reference loss at step {step} is 0; relative error undefined")
        rels.append(abs((y - yhat) / y))
    order = sorted(range(len(common)), key=lambda i: -rels[i])[: max(0, worst)]
    return MREReport(
        mre_percent=100.0 * sum(rels) / len(rels),
        n=len(common),
        worst=[(common[i], float(reference[common[i]]), float(run[common[i]]), rels[i]) for i in order],
        steps=common,
        reference=[float(reference[s]) for s in common],
        run=[float(run[s]) for s in common],
        rel_errors=rels,
        ignored_steps=len(only_ref) + len(only_run),
    )


def plot_mre(reports: Mapping[str, MREReport] | MREReport, path: str | os.PathLike, *,
             threshold_percent: Optional[float] = 1.5, title: str = "Loss alignment") -> str:
    """PNG with the reference and run loss curves (top) and the per-step relative error in %
    with each run's MRE (bottom). ``reports`` is one report or ``{label: report}`` of runs
    against the same reference (their reference curve is drawn once)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if isinstance(reports, MREReport):
        reports = {"run": reports}
    if not reports:
        raise ValueError("plot_mre: nothing to plot")
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    first = next(iter(reports.values()))
    top.plot(first.steps, first.reference, color="black", linewidth=1.6, label="reference")
    for label, rep in reports.items():
        top.plot(rep.steps, rep.run, linewidth=1.0, label=label)
        line, = bottom.plot(rep.steps, [100 * r for r in rep.rel_errors], linewidth=0.8,
                            label=f"{label}: MRE {rep.mre_percent:.3f}%")
        bottom.axhline(rep.mre_percent, color=line.get_color(), linestyle=":", linewidth=1.0)
    if threshold_percent is not None:
        bottom.axhline(threshold_percent, color="red", linestyle="--", linewidth=1.0,
                       label=f"threshold {threshold_percent}%")
    top.set_ylabel("training loss")
    top.set_title(title)
    top.legend()
    bottom.set_ylabel("relative error %")
    bottom.set_xlabel("step")
    bottom.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)
