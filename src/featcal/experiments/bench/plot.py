"""The drift figure (the paper's Figure 1): per block, mean feature drift from the experts."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence


def drift_plot(curves: Mapping[str, Sequence[Mapping[str, float]]], path: str | os.PathLike, title: str) -> None:
    """One panel: for each merge, its drift alone (dashed) and + FeatCal (solid), by block."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for i, (name, drift) in enumerate(curves.items()):
        blocks = [int(d["block"]) + 1 for d in drift]
        colour = f"C{i}"
        ax.plot(blocks, [d["before"] for d in drift], "--o", color=colour, label=f"{name}")
        ax.plot(blocks, [d["after"] for d in drift], "-o", color=colour, label=f"{name} + FeatCal")
    ax.set_xlabel("block")
    ax.set_ylabel("mean feature drift from the experts")
    ax.set_title(title)
    ax.set_xticks(sorted({int(d["block"]) + 1 for drift in curves.values() for d in drift}))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


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
