"""`featcal run FILE.yaml` as a use case: a whole merge (and optional calibration) described by one YAML file.

    merge:
      base: path/to/base
      experts: {mnist: path/to/mnist, svhn: path/to/svhn}
      method: ties                   # or regmean / regmean++ (with calibration:), wudi
      params: {density: 0.2, scaling: 0.3}
      # calibration: {mnist: data/mnist, svhn: data/svhn}   # regmean, regmean++ only
    calibrate:                       # optional
      calibration: {mnist: data/mnist, svhn: data/svhn}
      config: {num_calibration_examples: 64}
    out: runs/ties-featcal
    overwrite: false                 # run options (RunOptions), as the CLI flags: also allow_pickle,
    max_length: 128                  # max_length (calibration texts' tokens), allow_fewer

An expert may be an entry {path: ..., weight: 0.5, density: 0.3, drop_rate: 0.1} (its own recipe values).
`merged: {path: a/merge, base: ..., experts: {...}}` instead of `merge:` calibrates an existing merge.
A mergekit configuration (merge_method, base_model, models, ...) is read too, alone or with a
`calibrate:` section (featcal.merging.mergekit_config, docs/mergekit.md); RunRequest.out gives its output.

Relative paths are taken relative to the YAML file's directory (so a run file works from any
working directory); an input that does not exist there is passed on as given (e.g. a hub id).
Everything is validated before work starts, the calibration's inputs included (against the base,
before merging). With `calibrate:`, the merge goes to a temporary directory beside `out`, is
calibrated into `out`, and is then removed, whether the run succeeds, fails or is interrupted.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from featcal.config import RunConfig, RunOptions, is_task_vector_merge, read_run_data, run_config
from featcal.errors import ConfigError
from featcal.io.write.atomic import (
    check_output_dir,
    check_replaceable,
    make_owned,
    owned_name,
    refuse_output_over_inputs,
    sweep_stale,
)

__all__ = ["RunRequest", "RunResult", "execute", "load", "resolve_paths", "run_file"]


@dataclass(frozen=True)
class RunRequest:
    """One `featcal run`: the run file, and the output directory where the file names none (`featcal run --out`;
    relative to the working directory). `progress`: progress bars on stderr."""

    file: str | os.PathLike
    out: str | os.PathLike | None = None
    progress: bool = True


@dataclass(frozen=True)
class RunResult:
    """What a run did: its output directory (a loadable checkpoint with its featcal.json) and that report."""

    out: Path
    merged: bool  # the run merged (its `merge:` section, or a mergekit configuration)
    calibrated: bool  # the run calibrated (a `calibrate:` section)
    method: str | None  # the merge method (None for a `merged:` run, which merges nothing)
    experts: tuple[str, ...]  # the tasks, in the file's order
    calibrated_from: str | None  # a `merged:` run: the merge it calibrated
    report: Mapping[str, Any] = field(default_factory=dict)  # the output's featcal.json

    def summary(self) -> str:
        """The line `featcal run` ends with."""
        if self.calibrated_from is not None:
            return f"calibrated {self.calibrated_from} toward {len(self.experts)} experts into {self.out}"
        what = "merged and calibrated" if self.calibrated else "merged"
        return f"{what} {len(self.experts)} experts with {self.method} into {self.out}"


def _input_path(value: str, root: Path) -> str:
    p = Path(value).expanduser()
    if p.is_absolute():
        return str(p)
    return str(root / p) if (root / p).exists() else value


def _output_path(value: str, root: Path) -> Path:
    p = Path(value).expanduser()
    return p if p.is_absolute() else root / p


def resolve_paths(run: RunConfig, root: Path) -> RunConfig:
    """A copy of `run` with relative paths resolved against `root` (the run file's directory)."""
    update: dict = {"out": str(_output_path(run.out, root))}
    if run.merge is not None:
        update["merge"] = run.merge.model_copy(update={
            "base": _input_path(run.merge.base, root),
            "experts": {t: _input_path(p, root) for t, p in run.merge.experts.items()},
            "calibration": None if run.merge.calibration is None
            else {t: _input_path(p, root) for t, p in run.merge.calibration.items()},
        })
    if run.merged is not None:
        update["merged"] = run.merged.model_copy(update={
            "path": _input_path(run.merged.path, root), "base": _input_path(run.merged.base, root),
            "experts": {t: _input_path(p, root) for t, p in run.merged.experts.items()},
        })
    if run.calibrate is not None:
        config = dict(run.calibrate.config)
        for key in ("resume_dir", "spill_dir"):  # directories featcal writes: from the file's folder, like `out`
            if isinstance(config.get(key), str):
                config[key] = str(_output_path(config[key], root))
        update["calibrate"] = run.calibrate.model_copy(update={
            "calibration": {t: _input_path(p, root) for t, p in run.calibrate.calibration.items()},
            "config": config,
            "heads": None if run.calibrate.heads is None
            else {t: _input_path(p, root) for t, p in run.calibrate.heads.items()},
        })
    return run.model_copy(update=update)


def load(path: Path, out: str | os.PathLike | None = None) -> RunConfig:
    """A run file, featcal's or mergekit's (translated: featcal.merging.mergekit_config), with `out` (the
    --out flag, relative to the working directory) where the file names none; paths resolved."""
    from featcal.merging.mergekit_config import is_mergekit, translate

    data = read_run_data(path)
    if is_mergekit(data):
        data = translate(data, str(path))
    if out is not None:
        if "out" in data and _output_path(str(data["out"]), path.resolve().parent) != Path(out).resolve():
            raise ConfigError(f"{path} names out: {data['out']} and --out names {out}; give one of them")
        data = {**data, "out": str(Path(out).resolve())}
    elif "out" not in data:
        raise ConfigError(f"{path} names no out: directory; add one, or pass --out DIR")
    return resolve_paths(run_config(data), path.resolve().parent)


def run_file(request: RunRequest | str | os.PathLike, /, **options: Any) -> RunResult:
    """Run a run file (featcal's or a mergekit configuration): merge, then calibrate when it has a `calibrate:`
    section, as `featcal run FILE` does, into its `out:` directory.

    `request`: a RunRequest, or the file's path with RunRequest's other fields as keywords
    (`featcal.run("run.yaml", out="runs/x", progress=False)`). Everything is checked before work starts;
    raises a FeatCalError naming the culprit. Returns the RunResult (output directory, what was done, featcal.json).
    """
    if not isinstance(request, RunRequest):
        request = RunRequest(request, **options)
    elif options:
        raise TypeError("run_file takes a RunRequest or a file with keywords, not both")
    path = Path(request.file)
    run = load(path, request.out)
    refuse_output_over_inputs(run.out, {"run file": path})  # `out: .` with overwrite would delete the file itself
    out = execute(run, progress=request.progress)
    from featcal.io.read.checkpoint import read_json

    report = read_json(out / "featcal.json") if (out / "featcal.json").is_file() else {}
    source = run.merged if run.merged is not None else run.merge
    return RunResult(
        out=out, merged=run.merge is not None, calibrated=run.calibrate is not None,
        method=run.merge.method if run.merge is not None else None, experts=tuple(source.experts),
        calibrated_from=run.merged.path if run.merged is not None else None, report=report,
    )


def execute(run: RunConfig, *, progress: bool = True) -> Path:
    """Merge (or take the `merged:` merge), then calibrate if asked; returns the output directory."""
    from featcal.merging.calibration_data import check_calibration_request

    if run.merged is not None:
        return _calibrate_existing(run, progress=progress)
    merge_config = run.merge.merge_config()
    calibration = run.merge.calibration  # RegMean(++)'s own data (the merge checks its sources before it works)
    check_calibration_request(merge_config.method, run.merge.experts, calibration)
    out = check_output_dir(run.out, run.overwrite)
    refuse_output_over_inputs(out, {"base": run.merge.base, **{f"expert {t!r}": p for t, p in run.merge.experts.items()},
                                    **{f"calibration data {t!r}": p for t, p in (calibration or {}).items()}})
    check_replaceable(out, run.overwrite)
    if run.calibrate is None:
        _merge(run, out, run.run_options(), progress)
        return out

    from featcal.calibration.front.pipeline import calibrate_to_dir, check_calibration_inputs, feature_width
    from featcal.calibration.tuning import load_heads

    featcal_config = run.calibrate.featcal_config()
    tune_scaling = featcal_config.tune and is_task_vector_merge(merge_config.method)
    request = _calibrate_request(run, None, run.merge.base, run.merge.experts, out=out, progress=progress,
                                 merge_scaling=merge_config.scaling if tune_scaling else None)  # tune may rebuild
    # everything the calibration will check, against the base, BEFORE the merge (the merge scans for NaN)
    check_calibration_inputs(request)
    load_heads(run.calibrate.heads or {}, run.merge.experts, featcal_config.tune,  # refused before the merge too
               feature_width(_base_config(run.merge.base)))
    out.parent.mkdir(parents=True, exist_ok=True)
    sweep_stale(out.parent, f".featcal-merge-{out.name}-")  # a killed run's scratch merge (a whole checkpoint)
    scratch = owned_name(f".featcal-merge-{out.name}-", out.parent)
    try:
        make_owned(scratch)
        merged_dir = scratch / "merged"
        _merge(run, merged_dir, run.run_options().model_copy(update={"overwrite": False}), progress)
        calibrate_to_dir(dataclasses.replace(request, merged=merged_dir))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return out


def _merge(run: RunConfig, out: Path, options: RunOptions, progress: bool) -> None:
    """The run's `merge:` section, merged into `out` (with the run's options and output options)."""
    from featcal.merging.api import MergeRequest, merge_to

    merge_to(MergeRequest(run.merge.base, run.merge.experts, run.merge.merge_config(), out=out, options=options,
                          outputs=run.output_options(), calibration=run.merge.calibration, progress=progress))


def _calibrate_request(run: RunConfig, merged: str | Path | None, base: str, experts: Mapping[str, str], *,
                       out: str | Path, progress: bool, merge_scaling: float | None = None):
    """The run's `calibrate:` section as a CalibrateRequest, check_finite off (the run's merge scans its inputs; a
    `merged:` run turns it on)."""
    from featcal.calibration.front.pipeline import CalibrateRequest
    from featcal.config import OutputOptions

    return CalibrateRequest(
        merged, base, experts, run.calibrate.calibration, out, config=run.calibrate.featcal_config(),
        options=run.run_options(), outputs=OutputOptions(dtype=run.dtype, hub_id=run.hub_id),
        heads=run.calibrate.heads, merge_scaling=merge_scaling, check_finite=False, progress=progress,
    )


def _base_config(base: str):
    """The base's transformers config (None for a GGUF base, refused later by the calibration checks)."""
    from featcal.io.read.checkpoint import resolve_checkpoint
    from featcal.io.read.models import load_config

    try:
        return load_config(resolve_checkpoint(base))
    except Exception:  # the checks before named the problem, if any; the width is then not checked here
        return None


def _calibrate_existing(run: RunConfig, *, progress: bool) -> Path:
    """A `merged:` run: calibrate that merge into `out` (the calibration checks it like featcal calibrate)."""
    from featcal.calibration.front.pipeline import calibrate_to_dir

    merged = run.merged
    refuse_output_over_inputs(run.out, {"merged model": merged.path})
    request = _calibrate_request(run, merged.path, merged.base, merged.experts, out=run.out, progress=progress)
    calibrate_to_dir(dataclasses.replace(request, check_finite=True))
    return Path(run.out)
