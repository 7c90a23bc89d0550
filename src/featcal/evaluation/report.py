"""What `featcal eval` writes: eval.json's gap rows, the Markdown table and the plot.

The table has one section per metric, models × tasks with a mean column; the role rows come first
(base, merged, calibrated, experts: each expert on its own task), and a last section gives each model's
share of the merge → experts gap closed, per task and on the task means (as the paper reports it). A
score taken on examples the model was calibrated on (--allow-calibration-overlap) is marked.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

from featcal.evaluation.metrics import GAP_RELATIVE_TOLERANCE, gap_closed, no_gap_reason

GAP = "gap_closed"
OVERLAP_MARK = " ⚠"
# how each metric is labelled in the table, and which way is better
METRIC_LABELS = {
    "loss": "mean token loss (nats, lower is better)", "perplexity": "perplexity (lower is better)",
    "next_token_accuracy": "next-token accuracy (%)", "accuracy": "accuracy (%)", "macro_f1": "macro-F1 (%)",
    "exact_match": "exact match (%)",
}


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def metric_table(results: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    """metric -> model -> task -> value."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for r in results:
        out.setdefault(r["metric"], {}).setdefault(r["model"], {})[r["task"]] = r["value"]
    return out


def gap_rows(results: Sequence[Mapping[str, Any]], primary: Mapping[str, tuple[str, bool]],
             tasks: Sequence[str]) -> list[dict[str, Any]]:
    """Each model's share of the merged -> experts gap closed on its primary metric, per task and on the
    task means ("mean"); [] without a merged row and an experts row. `primary`: model -> (metric, higher is
    better)."""
    table = metric_table(results)
    rows = []
    for model, (metric, higher) in primary.items():
        if model in ("merged", "experts"):
            continue
        by_model = table.get(metric, {})
        merged, experts, mine = by_model.get("merged"), by_model.get("experts"), by_model.get(model)
        if not (merged and experts and mine):
            continue
        shared = [t for t in tasks if t in merged and t in experts and t in mine]
        for t in shared:
            rows.append(_gap_row(model, t, metric, (mine[t], merged[t], experts[t]), higher))
        if shared:
            means = [_mean([d[t] for t in shared]) for d in (mine, merged, experts)]
            rows.append(_gap_row(model, "mean", metric, means, higher))
    return rows


def _gap_row(model: str, task: str, metric: str, values: Sequence[float], higher: bool) -> dict[str, Any]:
    """One gap row; with no gap to close, its value is None and `reason` says why (metrics.no_gap_reason)."""
    mine, merged, experts = values
    row = {"model": model, "task": task, "metric": metric,
           "value": gap_closed(mine, merged, experts, higher_is_better=higher)}
    reason = no_gap_reason(merged, experts, higher_is_better=higher)
    if reason is not None:
        row["reason"] = reason
    return row


def _cell(value: float | None, percent_share: bool = False) -> str:
    if value is None:
        return "n/a"
    if percent_share:
        return f"{100 * value:.1f}%"
    if math.isinf(value) or math.isnan(value):
        return str(value)
    return f"{value:.0f}" if abs(value) >= 1000 else f"{value:.4g}"


def _gap_cell(row: Mapping[str, Any]) -> str:
    return "n/a (no gap)" if row["value"] is None and row.get("reason") else _cell(row["value"], True)


def eval_table(report: Mapping[str, Any]) -> str:
    """The Markdown table of eval.json (see the module docstring)."""
    tasks = list(report["tasks"])
    flagged = {(o["model"], o["task"]) for o in report.get("calibration_overlap") or []}
    lines = ["# featcal eval", ""]
    for metric, by_model in metric_table(report["results"]).items():
        lines += [f"## {METRIC_LABELS.get(metric, metric)}", "", "| model | " + " | ".join(tasks) + " | mean |",
                  "|---" * (len(tasks) + 2) + "|"]
        for model, by_task in by_model.items():
            cells = [_cell(by_task.get(t)) + (OVERLAP_MARK if (model, t) in flagged and t in by_task else "")
                     if t in by_task else "" for t in tasks]
            mean = _cell(_mean([by_task[t] for t in tasks])) if all(t in by_task for t in tasks) else ""
            lines.append(f"| {model} | " + " | ".join(cells) + f" | {mean} |")
        lines.append("")
    gap = report.get(GAP) or []
    if gap:
        lines += ["## share of the merge → experts gap closed", "",
                  "| model | metric | " + " | ".join(tasks) + " | on the means |", "|---" * (len(tasks) + 3) + "|"]
        for model in dict.fromkeys(g["model"] for g in gap):
            mine = {g["task"]: g for g in gap if g["model"] == model}
            metric = next(iter(mine.values()))["metric"]
            cells = [_gap_cell(mine[t]) if t in mine else "" for t in tasks]
            mean = _gap_cell(mine["mean"]) if "mean" in mine else ""
            lines.append(f"| {model} | {metric} | " + " | ".join(cells) + f" | {mean} |")
        lines += ["", "(model − merged) / (experts − merged) on the metric named; n/a (no gap) where the experts are "
                  f"no better than the merge, or better by no more than {GAP_RELATIVE_TOLERANCE:g} of the metric's "
                  "scale (rounding).", ""]
    if flagged:
        lines += [f"{OVERLAP_MARK.strip()} scored on examples the model was calibrated on "
                  "(--allow-calibration-overlap): not a held-out score.", ""]
    lm = report.get("lm_eval") or {}
    if lm.get("results"):
        lines += ["## lm-evaluation-harness", "", "| model | task | metric | value |", "|---|---|---|---|"]
        lines += [f"| {r['model']} | {r['task']} | {r['metric']} | {_cell(r['value'])} |" for r in lm["results"]]
        lines.append("")
    return "\n".join(lines)


def eval_plot(report: Mapping[str, Any], path: str | os.PathLike) -> None:
    """One panel per metric: grouped bars, a group per task, a bar per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tables = metric_table(report["results"])
    tasks = list(report["tasks"])
    fig, axes = plt.subplots(len(tables), 1, figsize=(max(6.4, 1.2 * len(tasks) + 3), 3.2 * len(tables)),
                             squeeze=False)
    for ax, (metric, by_model) in zip(axes[:, 0], tables.items(), strict=True):
        width = 0.8 / max(len(by_model), 1)
        for i, (model, by_task) in enumerate(by_model.items()):
            xs = [j + i * width for j, t in enumerate(tasks) if t in by_task]
            ax.bar(xs, [by_task[t] for t in tasks if t in by_task], width, label=model, color=f"C{i}")
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(tasks))], tasks)
        ax.set_ylabel(METRIC_LABELS.get(metric, metric), fontsize=8)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
