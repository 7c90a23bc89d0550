"""metrics.json and the printed table: per task and average, for merge and merge+FeatCal, beside the paper."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from featcal.experiments.reproduce.settings import Setting

STAGES = (("merged", "merge"), ("featcal", "+FeatCal"))


def _avg(values: list[float]) -> float | None:
    return round(sum(values) / len(values), 4) if values else None


def build_metrics(setting: Setting, evals: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> dict[str, Any]:
    """evals[stage][task] is an evaluation dict holding a 'score' (or 'accuracy')."""
    ref = setting.reference
    results: dict[str, Any] = {}
    for stage, _ in STAGES:
        per_task = {t: _score(evals.get(stage, {}).get(t)) for t in setting.task_names}
        known = [v for v in per_task.values() if v is not None]
        results[stage] = {"per_task": per_task, "average": _avg(known) if len(known) == len(per_task) else None}
    everything = set(setting.task_names) == _reference_tasks(setting)
    reference: dict[str, Any] = {"source": ref.source, "note": None}
    for stage, per_task, published in (("merged", ref.merge, ref.merge_avg), ("featcal", ref.featcal, ref.featcal_avg)):
        cells = {t: per_task.get(t) for t in setting.task_names}
        if everything:
            average = published
        elif all(v is not None for v in cells.values()):
            average = _avg([float(v) for v in cells.values() if v is not None])
            reference["note"] = "paper averages recomputed over the tasks run here"
        else:
            average = None  # the paper gives only an all-task average: not comparable to a subset
        reference[stage] = {"per_task": cells, "average": average}
    return {
        "setting": setting.name,
        "metric": setting.metric,
        "tasks": list(setting.task_names),
        "results": results,
        "reference": reference,
        "details": {stage: dict(evals.get(stage, {})) for stage, _ in STAGES},
    }


def _reference_tasks(setting: Setting) -> set[str]:
    """All tasks of the registered setting of this name (the paper's averages cover exactly these)."""
    from featcal.experiments.reproduce.settings import SETTINGS

    return set(SETTINGS[setting.name].task_names) if setting.name in SETTINGS else set(setting.task_names)


def _score(ev: Mapping[str, Any] | None) -> float | None:
    if ev is None:
        return None
    for key in ("score", "accuracy"):
        if key in ev and ev[key] is not None:
            return float(ev[key])
    return None


CELL = 10


def _cell(v: float | None) -> str:
    return f"{v:{CELL}.1f}" if v is not None else f"{'-':>{CELL}}"


def format_table(metrics: Mapping[str, Any]) -> str:
    """A fixed-width table: task | merge | paper | +FeatCal | paper."""
    res, ref = metrics["results"], metrics["reference"]
    width = max([len("average")] + [len(t) for t in metrics["tasks"]])
    header = f"{'task':<{width}} " + "".join(
        f"{label:>{CELL}}{'paper':>{CELL}}" for _, label in STAGES
    )
    lines = [f"{metrics['setting']}: {metrics['metric']}", header, "-" * len(header)]
    scored = any(res[stage]["per_task"].get(t) is not None or ref[stage]["per_task"].get(t) is not None
                 for stage, _ in STAGES for t in metrics["tasks"])
    for task in metrics["tasks"] if scored else ():  # MergeBench: scored outside featcal, averages only
        row = f"{task:<{width}} "
        for stage, _ in STAGES:
            row += _cell(res[stage]["per_task"].get(task)) + _cell(ref[stage]["per_task"].get(task))
        lines.append(row)
    row = f"{'average':<{width}} "
    for stage, _ in STAGES:
        row += _cell(res[stage]["average"]) + _cell(ref[stage]["average"])
    lines += ["-" * len(header), row]
    if ref.get("note"):
        lines.append(f"(paper column: {ref['note']})")
    return "\n".join(lines) + "\n"
