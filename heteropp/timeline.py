"""Timeline plots (PNG): one row per stage, one bar per action; a simulated iteration, or a
simulated and a measured one above each other on one time axis."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from .simulator import SimResult

_COLORS = {"F": "#4C72B0", "R": "#8C8C8C", "I": "#DD8452", "W": "#55A868", "B": "#C44E52", "UPDATE": "#8172B3"}
Row = tuple[int, str, int, float, float]  # (stage, kind, micro-batch, start, end)


def _draw(ax, rows: Sequence[Row], comm: Sequence[Row], labels: list[str] | None, max_stages: int) -> None:
    from matplotlib.patches import Patch

    stages = sorted({s for s, *_ in rows})[:max_stages]
    kinds = set()
    for s, kind, mb, start, end in rows:
        if s < max_stages:
            ax.broken_barh([(start, end - start)], (s - 0.4, 0.8), facecolors=_COLORS.get(kind, "k"), edgecolor="none")
            kinds.add(kind)
    for boundary, d, mb, start, arrive in comm:
        if boundary < max_stages:
            y = boundary + (0.45 if d == "F" else 0.55)
            ax.plot([start, arrive], [y, y], color="#937860", lw=0.6, alpha=0.6)
    ax.set_yticks(stages)
    ax.set_yticklabels([labels[s] if labels else f"stage {s}" for s in stages], fontsize=7)
    ax.invert_yaxis()
    ax.legend(handles=[Patch(color=c, label=k) for k, c in _COLORS.items() if k in kinds], loc="upper right", fontsize=7)


def plot_timeline(result: SimResult, path: str | Path, title: str = "", stage_labels: list[str] | None = None,
                  max_stages: int = 64) -> Path:
    """Write replica 0's compute actions (and its messages, thin bars) as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len({s for s, *_ in result.timeline} & set(range(max_stages)))
    fig, ax = plt.subplots(figsize=(14, 0.35 * n + 1.8))
    _draw(ax, result.timeline, result.comm_timeline, stage_labels, max_stages)
    ax.set_xlabel("time (s)")
    ax.set_title(title or f"iteration {result.iteration_time:.3f} s, bubble {100 * result.bubble_fraction:.1f}%")
    return _save(fig, path)


def plot_measured_vs_simulated(result: SimResult, measured: Sequence[Row], measured_time: float, path: str | Path,
                               stage_labels: list[str] | None = None, title: str = "") -> Path:
    """The simulated iteration above the measured one, on one time axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len({s for s, *_ in result.timeline})
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(14, 0.7 * n + 3), sharex=True)
    _draw(top, result.timeline, result.comm_timeline, stage_labels, 64)
    top.set_title(f"simulated: {result.iteration_time:.3f} s per iteration", fontsize=9)
    _draw(bottom, measured, [], stage_labels, 64)
    bottom.set_title(f"measured: {measured_time:.3f} s per iteration (median step)", fontsize=9)
    bottom.set_xlabel("time (s)")
    if title:
        fig.suptitle(title)
    return _save(fig, path)


def plot_panels(panels: Sequence[tuple[str, Sequence[Row], Sequence[Row]]], path: str | Path,
                stage_labels: list[str] | None = None, title: str = "") -> Path:
    """Several timelines above each other on one time axis: (title, compute rows, message rows)
    per panel (message rows may be empty: a measured run records no transfers)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = max(len({s for s, *_ in rows}) for _, rows, _ in panels)
    fig, axes = plt.subplots(len(panels), 1, figsize=(14, (0.35 * n + 0.9) * len(panels) + 1), sharex=True,
                             squeeze=False)
    for ax, (name, rows, comm) in zip(axes[:, 0], panels):
        _draw(ax, rows, comm, stage_labels, 64)
        ax.set_title(name, fontsize=9)
    axes[-1, 0].set_xlabel("time (s)")
    if title:
        fig.suptitle(title)
    return _save(fig, path)


def _save(fig, path: str | Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
