"""The bench's figures: the drift figure (the paper's Figure 1, drawn by evaluation/drift_plot.py, which
`featcal calibrate --plot` shares) and accuracy against calibration examples per task."""

from __future__ import annotations

import os
from collections.abc import Mapping

from featcal.evaluation.drift_plot import drift_plot  # noqa: F401  (re-exported: bench/run.py draws it from here)


def sample_efficiency_plot(points: Mapping[str, Mapping[int, float]], baselines: Mapping[str, float],
                           path: str | os.PathLike) -> None:
    """Average accuracy against calibration examples per task, one line per merge; baselines flat."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for i, (name, by_n) in enumerate(points.items()):
        ns = sorted(by_n)
        ax.plot(ns, [100 * by_n[n] for n in ns], "-o", color=f"C{i}", label=f"{name} + FeatCal")
    for j, (name, acc) in enumerate(baselines.items()):
        ax.axhline(100 * acc, linestyle=":", color=f"C{j + len(points)}", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("calibration examples per task")
    ax.set_ylabel("average accuracy (%)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
