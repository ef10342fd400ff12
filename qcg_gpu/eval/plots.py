"""Sweep plots like the paper's Figures 3-6: one panel per metric, the swept parameter on x, each point
with its 95% bootstrap interval as an error bar."""

from __future__ import annotations

from pathlib import Path

from ..capabilities import require
from .metrics import metric_base

PANELS = ("judge", "R", "RR")  # the first of these a sweep has goes in the left panel
LABELS = {"judge": "judge accuracy (%)", "R": "evidence recall (%)", "RR": "reciprocal rank (x100)"}


def plot_sweep(name: str, rows: list[dict], path: str | Path) -> None:
    """``rows`` as Harness.sweep returns them; ``seeds`` draws one line per gamma over n."""
    matplotlib = require("matplotlib")
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    x = "n" if name == "seeds" else next(k for k in rows[0] if k in ("hops", "knn_k", "alpha"))
    series = "gamma" if name == "seeds" else None
    names = [key for key in rows[0] if metric_base(key) in PANELS and "_" not in key]  # R@5, not R@5_multi
    metrics = sorted(names, key=lambda key: PANELS.index(metric_base(key)))
    fig, axes = plt.subplots(1, len(metrics), figsize=(4.2 * len(metrics), 3.2), squeeze=False)
    for ax, metric in zip(axes[0], metrics):
        for value in dict.fromkeys(row.get(series) for row in rows):
            line = [row for row in rows if row.get(series) == value]
            y = [100 * row[metric] for row in line]
            low = [100 * row.get(f"{metric}_ci_low", row[metric]) for row in line]
            high = [100 * row.get(f"{metric}_ci_high", row[metric]) for row in line]
            ax.errorbar(  # the bars: each point's 95% bootstrap interval over the questions
                [row[x] for row in line],
                y,
                yerr=[[a - b for a, b in zip(y, low)], [b - a for a, b in zip(y, high)]],
                marker="o",
                capsize=3,
                label=f"{series} = {value}" if series else None,
            )
        ax.set_xlabel({"knn_k": "k (kNN neighbours)", "n": "n (most seed nodes)", "hops": "h (hops)"}.get(x, x))
        ax.set_ylabel(f"{metric}, {LABELS[metric_base(metric)]}" if "@" in metric else LABELS[metric])
        ax.grid(alpha=0.3)
        if series:
            ax.legend()
    fig.suptitle(f"QCG-RAG sweep: {name}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
