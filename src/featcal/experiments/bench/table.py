"""The printed benchmark table (also saved as DIR/table.md), built from the report's rows."""

from __future__ import annotations

from typing import Any


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.1f}"


def variant_tag(variant: str) -> str:
    """How a FeatCal variant is named after "+ FeatCal" in tables and printed lines; the reference keeps its label."""
    return "" if variant == "reference" else f" [{variant}]"


def _label(row: dict[str, Any]) -> str:
    if row["method"] == "experts":
        return "experts (each on its task)"
    if row.get("baseline") and row.get("merge"):
        how = "recomputed" if row.get("params", {}).get("recompute_features") else "cached features"
        return f"{row['merge']} + {row['method']} ({row['calibration_examples']}/task, {how})"
    if row.get("baseline"):
        return f"{row['method']} (baseline)"
    if row["calibrated"]:
        return f"{row['method']} + FeatCal{variant_tag(row.get('variant', 'reference'))} ({row['calibration_examples']}/task)"
    return row["method"]


def bench_table(report: dict[str, Any]) -> str:
    """A Markdown table: per-task accuracy, average, normalised accuracy, gap closed, cost."""
    tasks: list[str] = report["tasks"]
    experts = {r["task"]: r for r in report["rows"] if r["method"] == "expert"}
    combined = {
        "method": "experts", "calibrated": False, "per_task": {t: experts[t]["average_accuracy"] for t in tasks},
        "average_accuracy": report["experts_average"], "normalised_accuracy": 1.0,
        "seconds": sum(r["seconds"] for r in experts.values()), "peak_rss_mb": max(r["peak_rss_mb"] for r in experts.values()),
    }
    rows = [combined] + [r for r in report["rows"] if r["method"] != "expert"]
    head = ["model", *tasks, "avg", "norm", "gap closed", "s", "cost ×floor", "peak RSS MiB"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [_label(r), *(_pct(r["per_task"].get(t)) for t in tasks), _pct(r["average_accuracy"]),
                 _pct(r.get("normalised_accuracy")),
                 _pct(r.get("gap_closed")) if r["calibrated"] or r.get("merge") else "",
                 f"{r['seconds']:.1f}",
                 (f"{r['cost_ratio']:.2f}" + (" (error: below the floor)" if r.get("cost_ratio_note") else ""))
                 if "cost_ratio" in r else "",
                 f"{r['peak_rss_mb']:.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
