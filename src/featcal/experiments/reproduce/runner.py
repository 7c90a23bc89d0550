"""`featcal reproduce SETTING`: Task Arithmetic (s=0.3) -> FeatCal -> evaluation, resumable, in one DIR.

Order: validate options -> resolve every model and dataset id (one message if any is missing) ->
check DIR (a resumed run must have the same parameters) -> open and check every data split ->
only then load models, merge, calibrate and evaluate. metrics.json, metrics.txt and
run_config.json are rewritten at the end of every run.
"""

from __future__ import annotations

import logging
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from featcal.config import parse
from featcal.errors import ConfigError
from featcal.experiments.reproduce.clip import ClipPipeline
from featcal.experiments.reproduce.mergebench import MergeBenchPipeline
from featcal.experiments.reproduce.options import ReproduceOptions
from featcal.experiments.reproduce.pipeline import Pipeline
from featcal.experiments.reproduce.report import build_metrics, format_table
from featcal.experiments.reproduce.resolve import Sources, resolve_all
from featcal.experiments.reproduce.rundir import RunDir
from featcal.experiments.reproduce.settings import get_setting
from featcal.experiments.reproduce.t5_glue import T5GluePipeline
from featcal.io.write.report import Timer, package_versions, peak_rss_mb

log = logging.getLogger(__name__)

PIPELINES: dict[str, type[Pipeline]] = {
    "clip": ClipPipeline,
    "glue": T5GluePipeline,
    "mergebench": MergeBenchPipeline,
}


def _more_versions() -> dict[str, str]:
    out = {}
    for name in ("datasets", "huggingface_hub", "tokenizers"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:  # pragma: no cover - all are dependencies
            out[name] = "unknown"
    return out


def _check_dirs(opts: ReproduceOptions) -> Sources:
    for flag, path in (("--model-dir", opts.model_dir), ("--data-dir", opts.data_dir)):
        if path is not None and not Path(path).is_dir():
            raise ConfigError(f"{flag} {path} is not a directory")
    return Sources(opts.model_dir, opts.data_dir)


def reproduce(options: ReproduceOptions | dict[str, Any], *, echo: bool = True) -> dict[str, Any]:
    """Run one paper setting end to end into `options.out`; returns the metrics written there."""
    opts = options if isinstance(options, ReproduceOptions) else parse(ReproduceOptions, dict(options))
    timer = Timer()
    setting = get_setting(opts.setting).restrict(opts.tasks)
    opts.featcal_config()  # validates the FeatCal side of the options now
    sources = _check_dirs(opts)
    resolved = resolve_all(setting, sources)
    rundir = RunDir(opts.out)
    identity = {**opts.identity(), "tasks": list(setting.task_names)}  # order-free
    rundir.check(identity)
    pipeline = PIPELINES[setting.family](setting, resolved, rundir, opts)
    data_summary = pipeline.preflight()
    record = {
        "options": opts.model_dump(mode="json"),
        "setting": {"name": setting.name, "family": setting.family, "base": setting.base_id,
                    "experts": {t.name: t.expert_id for t in setting.tasks},
                    "datasets": {t.name: t.data.label for t in setting.tasks}},
        "featcal": opts.featcal_config().model_dump(mode="json"),
        "merge": {"method": "task_arithmetic", "scaling": pipeline.scaling},
        "resolved": resolved.describe(),
        "data": data_summary,
        "argv": sys.argv,
        "versions": {**package_versions(), **_more_versions()},
        "device": pipeline.device,
    }
    resumed = rundir.claim(identity, record)
    log.info("%s %s in %s", "resuming" if resumed else "starting", setting.name, rundir.path)

    merged_dir = pipeline.merged()
    featcal_dir = pipeline.calibrated(merged_dir)
    stages = {"merged": merged_dir, "featcal": featcal_dir}
    evals = pipeline.evaluate(stages)

    metrics = build_metrics(setting, evals)
    metrics.update(pipeline.extra_outputs(stages))
    metrics["checkpoints"] = {k: str(v) for k, v in stages.items()}
    metrics["seconds"] = {**pipeline.timings, "total": round(timer.seconds, 3)}
    metrics["peak_rss_mb"] = round(peak_rss_mb(), 1)
    table = format_table(metrics)
    rundir.write_json("metrics.json", metrics)
    rundir.write_text("metrics.txt", table)
    rundir.claim(identity, {**record, "seconds": metrics["seconds"], "resumed": resumed})
    if echo:
        print(table, end="")
        for stage, command in metrics.get("evaluate_with", {}).items():
            print(f"evaluate {stage}: {command}")
    return metrics
