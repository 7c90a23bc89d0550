"""The drift figure (the paper's Figure 1): per block, mean feature drift from the experts, before and after
calibration. Drawn by `featcal bench` (one curve pair per merge) and `featcal calibrate --plot` (one pair, as
drift.png beside the checkpoint); matplotlib comes with the `plot` extra."""

from __future__ import annotations

import io
import os
from collections.abc import Mapping, Sequence

from featcal.io.process.extras import require

PLOT_PNG = "drift.png"


def _ticks(drift: Sequence[Mapping]) -> tuple[list[int], list[str]]:
    """Block positions (1-based) and their labels: "stack.layer" when the rows span several stacks."""
    blocks = sorted({int(d["block"]) for d in drift})
    stacks = {d.get("stack") for d in drift}
    if len(stacks) > 1 and all("layer" in d for d in drift):
        names = {int(d["block"]): f"{d['stack']}.{d['layer']}" for d in drift}
        return [b + 1 for b in blocks], [names[b] for b in blocks]
    return [b + 1 for b in blocks], [str(b + 1) for b in blocks]


def _figure(curves: Mapping[str, Sequence[Mapping[str, float]]], title: str, after: str = "{} + FeatCal"):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for i, (name, drift) in enumerate(curves.items()):
        blocks = [int(d["block"]) + 1 for d in drift]
        colour = f"C{i}"
        ax.plot(blocks, [d["before"] for d in drift], "--o", color=colour, label=f"{name}")
        ax.plot(blocks, [d["after"] for d in drift], "-o", color=colour, label=after.format(name))
    ax.set_xlabel("block")
    ax.set_ylabel("mean feature drift from the experts")
    ax.set_title(title)
    positions, labels = _ticks([d for drift in curves.values() for d in drift])
    ax.set_xticks(positions, labels, rotation=0 if labels == [str(p) for p in positions] else 45)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig, plt


def drift_plot(curves: Mapping[str, Sequence[Mapping[str, float]]], path: str | os.PathLike, title: str) -> None:
    """One panel: for each merge, its drift alone (dashed) and + FeatCal (solid), by block."""
    fig, plt = _figure(curves, title)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def calibration_drift_png(drift: Sequence[Mapping[str, float]], title: str) -> bytes:
    """A calibration's own figure (report["drift"]), as PNG bytes for an atomic write. Each block's "before" is
    the block as merged run on the calibrated model's inputs to it (what the calibration was measured against)."""
    require("plot", "the drift figure (--plot)")
    fig, plt = _figure({"block as merged (calibrated inputs)": drift}, title, after="calibrated")
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=120)
    plt.close(fig)
    return buffer.getvalue()
