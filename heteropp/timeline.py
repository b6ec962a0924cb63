"""Timeline plot (PNG) of a simulated iteration: one row per stage, one bar per action."""
from __future__ import annotations

from pathlib import Path

from .simulator import SimResult

_COLORS = {"F": "#4C72B0", "R": "#8C8C8C", "I": "#DD8452", "W": "#55A868", "B": "#C44E52"}


def plot_timeline(result: SimResult, path: str | Path, title: str = "", stage_labels: list[str] | None = None,
                  max_stages: int = 64) -> Path:
    """Write replica 0's compute actions (and its messages, thin bars) as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    stages = sorted({s for s, *_ in result.timeline})[:max_stages]
    fig, ax = plt.subplots(figsize=(14, 0.35 * len(stages) + 1.8))
    bars: dict[str, list] = {}
    for s, kind, mb, start, end in result.timeline:
        if s < max_stages:
            bars.setdefault(kind, []).append((s, start, end - start))
    for kind, items in bars.items():
        for s, start, width in items:
            ax.broken_barh([(start, width)], (s - 0.4, 0.8), facecolors=_COLORS.get(kind, "k"), edgecolor="none")
    for boundary, d, mb, start, arrive in result.comm_timeline:
        if boundary < max_stages:
            y = boundary + (0.45 if d == "F" else 0.55)
            ax.plot([start, arrive], [y, y], color="#937860", lw=0.6, alpha=0.6)
    ax.set_yticks(stages)
    ax.set_yticklabels([stage_labels[s] if stage_labels else f"stage {s}" for s in stages], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("time (s)")
    ax.set_title(title or f"iteration {result.iteration_time:.3f} s, bubble {100 * result.bubble_fraction:.1f}%")
    ax.legend(handles=[Patch(color=c, label=k) for k, c in _COLORS.items() if k in bars], loc="upper right", fontsize=7)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
