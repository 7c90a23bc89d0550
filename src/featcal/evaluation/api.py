"""featcal.evaluate: any number of models on any number of tasks, one table, written atomically.

    featcal.evaluate({"sst2": "sst2_test.jsonl"}, base="base", merged="merged", calibrated="calibrated",
                     experts={"sst2": "expert_sst2"}, out="eval")

Everything that can be refused is refused before the first forward (evaluation/plan.py), the leakage
guard included (evaluation/leakage.py). Each model is loaded once, scored on its tasks, and dropped
before the next is loaded. With `out`, eval.json, table.md and eval.png are written through a temporary
folder renamed into place.
"""

from __future__ import annotations

import gc
import logging
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from featcal.config import parse
from featcal.data.preprocess import model_modality
from featcal.errors import ConfigError, FeatCalError
from featcal.evaluation import leakage
from featcal.evaluation import lm_eval as harness
from featcal.evaluation.metrics import check_metric_packages
from featcal.evaluation.options import EvalOptions
from featcal.evaluation.plan import EXPERTS, EvalPlan, build_plan
from featcal.evaluation.report import GAP, eval_plot, eval_table, gap_rows
from featcal.io.process.extras import installed
from featcal.io.read.models import hf_progress_bars
from featcal.io.write.report import Timer, build_report

log = logging.getLogger(__name__)

EVAL_JSON, TABLE_MD, PLOT_PNG = "eval.json", "table.md", "eval.png"


def evaluate(
    tasks: Mapping[str, str | Path] | None = None,
    models: Mapping[str, str | Path] | None = None,
    *,
    base: str | Path | None = None,
    merged: str | Path | None = None,
    calibrated: str | Path | None = None,
    experts: Mapping[str, str | Path] | None = None,
    out: str | Path | None = None,
    overwrite: bool = False,
    lm_eval: str | Sequence[str] | None = None,
    progress: bool = True,
    **options: Any,
) -> dict[str, Any]:
    """Score every model on every task (each expert on its own task) and return eval.json's content.

    `tasks`: task name -> data (what calibration reads: JSONL, parquet, a saved dataset, an image folder).
    `models`: name -> checkpoint folder or hub id; `base` / `merged` / `calibrated` / `experts` (task ->
    checkpoint) are the roles, from which the share of the merge → experts gap closed is computed.
    `lm_eval`: lm-evaluation-harness task names, run on every model when the harness is installed, else
    their commands are returned (and printed by the CLI). `options`: EvalOptions' fields.
    """
    opts = parse(EvalOptions, options)
    tasks = dict(tasks or {})
    lm_tasks = harness.parse_tasks(lm_eval) if lm_eval is not None else None
    if not tasks and lm_tasks is None:
        raise ConfigError("nothing to evaluate: give --task NAME=DATA (or --lm-eval TASKS)")
    if out is not None:
        _check_output(out, overwrite, tasks, models, base, merged, calibrated, experts)
    total = Timer()
    plan = build_plan(tasks, models, base=base, merged=merged, calibrated=calibrated, experts=experts, options=opts)
    if lm_tasks:
        for entry in plan.entries:
            harness.check_checkpoint_path(entry.path.resolve(), entry.name)
    check_metric_packages({m for e in plan.entries for m in e.kind.metrics})
    found = [o for e in plan.entries
             for o in leakage.overlaps(e.name, e.path, [plan.sets[t] for x, t in plan.pairs if x is e],
                                       model_modality(e.config))]
    leakage.guard(found, opts.allow_calibration_overlap)
    with hf_progress_bars(progress):  # --no-progress silences transformers' loading bars too
        results = _score(plan, opts, progress, {(o.model, o.task) for o in found})
    primary = {plan.row_name(e): (e.kind.primary, e.kind.better_is_higher(e.kind.primary)) for e in plan.entries}
    report = build_report(
        "eval",
        {**opts.model_dump(mode="json"), "tasks": {t: str(d) for t, d in tasks.items()},
         "lm_eval": list(lm_tasks) if lm_tasks else None},
        models=_models_record(plan),
        tasks={t: {"source": str(s.path), "kind": s.kind, "examples": len(s), **s.read_as} for t, s in plan.sets.items()},
        results=results,
        **{GAP: gap_rows(results, primary, list(plan.sets))},
        calibration_overlap=[o.record() for o in found],
    )
    seconds = round(total.seconds, 3)
    if out is None:
        if lm_tasks:
            with tempfile.TemporaryDirectory(prefix="featcal-lm-eval-") as tmp:
                report["lm_eval"] = _lm_eval(plan, lm_tasks, Path(tmp), opts)
        report["seconds"] = seconds
        return report
    _write_eval(out, overwrite, report, seconds, plan, (lm_tasks, opts))
    return report


def _write_eval(out: str | Path, overwrite: bool, report: dict[str, Any], seconds: float, plan: EvalPlan,
                lm: tuple[Any, EvalOptions]) -> None:
    """The output folder, atomically: the harness's results (`lm`: its tasks, if any, and the options), eval.json
    (completed in place: lm_eval, seconds), table.md and, with matplotlib, eval.png."""
    from featcal.io.write.atomic import atomic_output_dir
    from featcal.io.write.report import write_report

    lm_tasks, opts = lm
    with atomic_output_dir(out, overwrite) as tmp:
        if lm_tasks:
            report["lm_eval"] = _lm_eval(plan, lm_tasks, tmp / "lm_eval", opts, Path(out) / "lm_eval")
        report["seconds"] = seconds
        write_report(tmp, report, EVAL_JSON)
        (tmp / TABLE_MD).write_text(eval_table(report))
        if report["results"] and installed("matplotlib"):
            eval_plot(report, tmp / PLOT_PNG)
        elif report["results"]:
            log.warning("%s not drawn: it needs matplotlib (pip install 'featcal[plot]'); eval.json and %s hold "
                        "every figure", PLOT_PNG, TABLE_MD)


def _check_output(out, overwrite: bool, tasks, models, base, merged, calibrated, experts) -> None:
    """Refuse, before any work, an output that exists, is not featcal's, or holds an input."""
    from featcal.io.write.atomic import check_output_dir, check_replaceable, refuse_output_over_inputs

    check_output_dir(out, overwrite)
    check_replaceable(out, overwrite, marker=EVAL_JSON)
    inputs = {**{f"--task {t}": d for t, d in tasks.items()}, **{f"--model {n}": p for n, p in (models or {}).items()},
              **{f"--expert {t}": p for t, p in (experts or {}).items()},
              **{f"--{r}": p for r, p in (("base", base), ("merged", merged), ("calibrated", calibrated)) if p}}
    refuse_output_over_inputs(out, inputs)


def _score(plan: EvalPlan, opts: EvalOptions, progress: bool, overlapping: set[tuple[str, str]]) -> list[dict]:
    """eval.json's result rows: each model loaded once, scored on its tasks, then dropped."""
    results: list[dict[str, Any]] = []
    for entry in plan.entries:
        mine = [t for e, t in plan.pairs if e is entry]
        if not mine:
            continue
        runner = plan.runners[entry.name]
        log.info("evaluating %s (%s, %s) on %s", entry.name, entry.kind.name, entry.source, ", ".join(mine))
        model = runner.load_model()
        for task in mine:
            scored = runner.score(model, plan.sets[task], progress=progress)
            for metric in entry.kind.metrics:
                row = {"model": plan.row_name(entry), "task": task, "metric": metric,
                       "value": scored.values[metric], "examples": scored.examples, **scored.details}
                if (entry.name, task) in overlapping:
                    row["calibration_overlap"] = True
                results.append(row)
        del model
        gc.collect()
    return results


def _models_record(plan: EvalPlan) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for e in plan.entries:
        if e.role == "expert":
            record = out.setdefault(EXPERTS, {"role": EXPERTS, "kind": e.kind.name, "paths": {}})
            record["paths"][e.task] = e.source
        else:
            out[e.name] = {"role": e.role, "kind": e.kind.name, "path": e.source}
    return out


def _lm_eval(plan: EvalPlan, tasks: Sequence[str], work: Path, opts: EvalOptions,
             shown: Path | None = None) -> dict[str, Any]:
    """Run the harness on every model (when installed), else the commands that would; `shown`: where its
    outputs will be once the output folder is in place (what the commands name)."""
    shown = shown or work
    names = {e.name: e for e in plan.entries}
    commands = {n: harness.lm_eval_command(e.path.resolve(), tasks, (shown / n).resolve(), opts.batch_size, dtype=None,
                                           device=opts.device)
                for n, e in names.items()}
    if not harness.installed():
        return {"tasks": list(tasks), "ran": False, "commands": commands,
                "note": "lm-evaluation-harness is not installed here (pip install 'featcal[lm-eval]'); run these"}
    rows, failures = [], {}
    for n, e in names.items():
        try:
            rows += harness.result_rows(n, harness.run(e.path.resolve(), tasks, work / n, batch_size=opts.batch_size,
                                                       device=opts.device, shown=shown / n))
        except FeatCalError as exc:
            failures[n] = str(exc)
            log.error("%s", exc)
    return {"tasks": list(tasks), "ran": True, "commands": commands, "results": rows, "failed": failures}
