"""Calibrate a merged checkpoint on disk into a new checkpoint directory, with its featcal.json report.

The order is what makes the command safe to run on big models: every input is checked first
(`check_calibration_inputs`: task names agree, options are usable, the output directory is free,
checkpoints are safetensors of one architecture with the same tensors and no NaN/Inf, the data fits
this model), then the models are loaded and calibrated, the result is checked for NaN/Inf, and only
then is anything written, through a temporary directory renamed into place.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from featcal.blocks.support import check_config
from featcal.calibration.distributed import RankGroup, current_group
from featcal.calibration.in_memory import calibrate_models
from featcal.calibration.inputs import check_variant_packages, resolve_device
from featcal.calibration.result import CalibrationResult
from featcal.calibration.resume import default_resume_dir, discard_on_error
from featcal.calibration.tuning import load_heads, merge_scaling_from_report
from featcal.config import (
    DEFAULT_MAX_LENGTH,
    FeatCalConfig,
    OutputOptions,
    calibration_options,
    check_expert_kinds,
    parse,
    run_options,
)
from featcal.data.batch import Batch
from featcal.data.calibration import DataReader, check_task_names
from featcal.data.calibration_set import CalibrationSet, open_calibration
from featcal.data.preprocess import (
    IMAGE_PROCESSOR_FILES,
    TOKENIZER_FILES,
    has_processor_files,
    model_modality,
)
from featcal.errors import CalibrationDataError, CheckpointError, ConfigError
from featcal.io.atomic import (
    atomic_output_dir,
    check_output_dir,
    check_replaceable,
    refuse_output_over_inputs,
)
from featcal.io.card import check_hub_ids, replaced_files, write_card
from featcal.io.checkpoint import CheckpointReader, copy_side_files, read_json
from featcal.io.family import BASE, MERGED, expert_label, is_gguf, open_family
from featcal.io.models import hf_progress_bars, load_config, load_model
from featcal.io.report import Timer, build_report, checkpoint_hashes, peak_rss_mb, write_report
from featcal.io.task_heads import HEADS_DIR
from featcal.io.tokenizer import TokenizerPlan, input_folder, plan_tokenizer
from featcal.io.validate import check_finite_state

log = logging.getLogger(__name__)


def check_options(config: FeatCalConfig, max_length: int, check_device: bool = True) -> None:
    """Options whose problems would otherwise surface only after data and models are loaded.

    `check_device=False` (featcal plan): the device need not exist here, a GPU run may be planned anywhere."""
    if not isinstance(config, FeatCalConfig):
        raise ConfigError(f"config must be a FeatCalConfig, not {type(config).__name__}")
    if max_length < 1:
        raise ConfigError(f"max_length must be at least 1, got {max_length}")
    if check_device:
        resolve_device(config.device, offload=config.offload_blocks)  # e.g. cuda asked for on a machine without it
        check_variant_packages(config)
    spill = config.spill_dir
    if spill is not None:
        spill = Path(spill).expanduser()
        if spill.exists() and not spill.is_dir():
            raise ConfigError(f"spill_dir {spill} exists and is not a directory")
        existing = next(p for p in (spill, *spill.parents) if p.exists())
        if not os.access(existing, os.W_OK | os.X_OK):
            raise ConfigError(f"spill_dir {spill}: cannot create files under {existing} (permission denied)")


@dataclass(frozen=True)
class CheckedInputs:
    """What check_calibration_inputs established: resolved directories, in task order."""

    tasks: list[str]
    out: Path
    merged: Path | None
    base: Path
    experts: dict[str, Path]
    data_dir: Path
    expert_kind: dict[str, str] = field(default_factory=dict)  # task -> full / adapter, where the user said
    read_as: dict[str, dict[str, Any]] = field(default_factory=dict)  # input label -> how it was read (featcal.json)
    # the experts' NaN / Inf check left to the calibration, which makes it as it reads each block (prefetch.py)
    finite_as_read: bool = False
    data: CalibrationSet | None = None  # each task's data, checked: what the load reuses

    def kinds(self) -> dict[str, str]:
        """expert_kind by input label ("expert 'NAME'"), as the reader helpers take it."""
        return {expert_label(t): k for t, k in self.expert_kind.items()}


def check_calibration_inputs(
    merged: str | Path | None,
    *,
    base: str | Path,
    experts: Mapping[str, str | Path],
    calibration_sources: Mapping[str, str | Path],
    config: FeatCalConfig,
    out: str | Path,
    overwrite: bool = False,
    allow_pickle: bool = False,
    max_length: int = DEFAULT_MAX_LENGTH,
    allow_fewer: bool = False,
    check_finite: bool = True,
    progress: bool = False,
    check_device: bool = True,
    expert_kind: Mapping[str, str] | None = None,
    heads: Mapping[str, str | Path] | None = None,
) -> CheckedInputs:
    """Every check that needs no model loaded, cheapest first; raises a FeatCalError naming the culprit.

    Task names agree, the options are usable, the output directory is free and is no input, every
    checkpoint is safetensors (or allowed pickle) with the same architecture, tensor names and
    shapes, the config loads without custom code, each task's data exists and fits the model's
    modality and size, and (`check_finite`) no checkpoint holds NaN/Inf. `merged=None` checks
    everything but the merged model, against the base (what `featcal run` does before merging).
    `expert_kind`: task -> full / adapter, for expert folders holding both (refused without it). `heads`
    (--tune-head files) and the spill directory must not lie in the output either: replacing it would delete them.
    """
    tasks = check_task_names(experts, calibration_sources)
    expert_kind = dict(run_options(expert_kind=expert_kind or {}).expert_kind)
    check_expert_kinds(expert_kind, experts)
    check_options(config, max_length, check_device)
    out_path = check_output_dir(out, overwrite)
    # every input opened once, headers only (a GGUF file is dequantised for the finite scan alone)
    family = open_family(base, {t: experts[t] for t in tasks}, merged, allow_pickle=allow_pickle,
                         expert_kind=expert_kind, header_only=True, base_name="base model")
    inputs = {label: family.path(label) for label in family.items}  # merged, base, experts: their folders
    reference = MERGED if merged is not None else BASE
    family.check_model_types(reference)
    refuse_output_over_inputs(out_path, {**inputs, **{f"calibration data {t!r}": calibration_sources[t] for t in tasks},
                                         **{f"head of task {t!r}": h for t, h in (heads or {}).items()}})
    check_resume_dir(config, out_path, inputs)
    check_spill_dir(config, out_path, inputs)
    check_replaceable(out_path, overwrite)
    family.check_consistent(reference)
    if reference == BASE and is_gguf(family.base):  # no tokenizer files to check with
        raise CheckpointError(f"base model: {inputs[BASE]} is a GGUF file; featcal run checks the calibration data "
                              "against the base's tokenizer files: run featcal merge, then featcal calibrate on its "
                              "output")
    model_config = load_config(inputs[reference])
    check_config(model_config)  # an architecture featcal cannot calibrate: refused from its config, no weights read
    expert_dirs = {t: inputs[expert_label(t)] for t in tasks}
    data_dir = processor_dir(inputs[reference], inputs[BASE], model_config)
    data = open_calibration({t: calibration_sources[t] for t in tasks},
                            reader=DataReader(data_dir, model_config, experts=expert_dirs),
                            options=calibration_options(config, max_length=max_length, allow_fewer=allow_fewer))
    if data.in_memory:  # featcal.json names and hashes each task's source
        raise CalibrationDataError(f"task(s) {', '.join(map(repr, data.in_memory))}: calibration data written beside a "
                                   "checkpoint must be a source (a path or a hub dataset id), not batches in memory")
    data.check()
    as_read = _scan_finite(family, tasks, config, check_finite, merged is not None, progress)  # the costliest, last
    read_as = {label: family.kind(label) for label in family.items if label != MERGED}
    return CheckedInputs(tasks, out_path, inputs.get(MERGED), inputs[BASE], expert_dirs, data_dir, expert_kind, read_as,
                         finite_as_read=as_read, data=data)


def _scan_finite(family: Any, tasks: list[str], config: FeatCalConfig, check_finite: bool, calibrating: bool,
                 progress: bool) -> bool:
    """With `check_finite`, refuse NaN / Inf in the inputs, one tensor at a time. The experts, streamed block by
    block, are left to the calibration, which checks each tensor as it reads it (prefetch.py; not when a merge
    comes first, nor with --tune, whose merges at other scalings read every tensor): returns whether it must."""
    as_read = check_finite and calibrating and not config.tune
    if check_finite:
        family.scan_finite(progress=progress, skip=[expert_label(t) for t in tasks] if as_read else ())
    return as_read


def check_resume_dir(config: FeatCalConfig, out: Path, inputs: Mapping[str, Path]) -> None:
    """A `--resume-dir` must not sit in (or be) a checkpoint featcal reads, nor the output it writes:
    its files would change the input's identity (and its content), or stop the output's final rename."""
    if config.resume and config.resume_dir is not None:
        _refuse_inside("resume", config.resume_dir, out, inputs)


def check_spill_dir(config: FeatCalConfig, out: Path, inputs: Mapping[str, Path]) -> None:
    """A `--spill-dir` must not be (or lie inside) the output, which replacing would delete with the chains
    in it, nor a checkpoint featcal reads."""
    if config.spill_dir is not None:
        _refuse_inside("spill", config.spill_dir, out, inputs)


def _refuse_inside(what: str, given: str | os.PathLike, out: Path, inputs: Mapping[str, Path]) -> None:
    """ConfigError naming --{what}-dir when `given` is, or lies inside, an input's folder or the output."""
    directory = Path(given).expanduser().resolve()
    for label, d in {**inputs, "output": out}.items():
        d = Path(d).expanduser().resolve()
        if directory == d or d in directory.parents:
            where = "is" if directory == d else "lies inside"
            raise ConfigError(f"the {what} directory {given} {where} the {label} directory {d}; "
                              f"choose another --{what}-dir")


def feature_width(config: Any) -> int | None:
    """The width of the features a task head reads (pooler_output or the mean of last_hidden_state): the
    config's hidden size; None where it declares none."""
    width = getattr(config, "hidden_size", None)
    return width if isinstance(width, int) and not isinstance(width, bool) else None


def processor_dir(merged: Path, base: Path, config=None) -> Path:
    """Where the preprocessing files live: the merged checkpoint, else the base (merges often lack them).
    `config`: the merged checkpoint's config when the caller already read it."""
    modality = model_modality(config if config is not None else load_config(merged, error=CalibrationDataError))
    for candidate in (merged, base):
        if has_processor_files(candidate, modality):
            return candidate
    return merged  # the loader then falls back (vision) or explains what is missing (text)


def stored_float_dtype(path: Path, allow_pickle: bool = False) -> torch.dtype | None:
    """The one floating dtype a checkpoint's tensors are stored in, from the headers; None if they mix.

    Why: calibration loads and computes in float32, but an fp16 / bf16 merge must be written back
    16-bit (half the size, its config's dtype kept), as `featcal merge` keeps the base's dtype.
    """
    reader = CheckpointReader(path, allow_pickle=allow_pickle)
    floating = {dtype for dtype in (reader.meta(k)[1] for k in reader.keys()) if dtype.is_floating_point}
    if len(floating) == 1:
        return floating.pop()
    log.warning("%s stores tensors in several floating dtypes (%s): the calibrated model is written in float32",
                path, ", ".join(sorted(str(d).removeprefix("torch.") for d in floating)))
    return None


def _copy_processor_files(src: Path, dst: Path) -> None:
    for name in IMAGE_PROCESSOR_FILES + TOKENIZER_FILES + ("special_tokens_map.json", "merges.txt"):
        if (src / name).is_file() and not (dst / name).exists():
            shutil.copy2(src / name, dst / name)


class _WarningLog(logging.Handler):
    """Collects featcal's warnings during a run (solver fallbacks, data shortfalls) for the report."""

    def __init__(self, limit: int = 200) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []
        self.limit = limit

    def emit(self, record: logging.LogRecord) -> None:
        if len(self.messages) < self.limit:
            self.messages.append(f"{record.name}: {record.getMessage()}")

    def __enter__(self) -> _WarningLog:
        logging.getLogger("featcal").addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        logging.getLogger("featcal").removeHandler(self)


def calibrate_to_dir(
    merged: str | Path,
    *,
    base: str | Path,
    experts: Mapping[str, str | Path],
    calibration_sources: Mapping[str, str | Path],
    config: FeatCalConfig,
    out: str | Path,
    overwrite: bool = False,
    allow_pickle: bool = False,
    progress: bool = True,
    max_length: int = DEFAULT_MAX_LENGTH,
    allow_fewer: bool = False,
    check_finite: bool = True,
    merge_scaling: float | None = None,
    heads: Mapping[str, str | Path] | None = None,
    expert_kind: Mapping[str, str] | None = None,
    dtype: str | None = None,
    hub_id: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Calibrate the merged checkpoint toward its experts and write the result (+ featcal.json, README.md) to `out`.

    Returns the report that was written; its `warnings` list what featcal warned about during the run
    (e.g. a Gram matrix that needed the pseudo-inverse fallback). Nothing is written if anything fails,
    and the calibrated weights are checked for NaN/Inf before anything is. `check_finite=False` skips
    the NaN/Inf scan of the inputs (for callers that just scanned them, as `featcal run` does).
    With `config.tune`, `merge_scaling` is the s of a task-vector merge θ0 + s·v (featcal run knows it; else
    it is read from the merged checkpoint's featcal.json when that ties it to these inputs), and the
    report's `tuning` records every candidate and the choice (tuning/); `heads` (task -> a head saved by
    featcal) add agreement with the experts' predictions to its score. `dtype` ('float32', 'bfloat16',
    'float16'): the written weights' floating dtype (default: the merged checkpoint's stored one). `hub_id`
    (role -> hub id; role "base" or an expert's name): how the model card names an input whose own record names
    no hub id (io/card.py).
    """
    return calibrate_into(
        merged, base=base, experts=experts, calibration_sources=calibration_sources, config=config, out=out,
        overwrite=overwrite, allow_pickle=allow_pickle, progress=progress, max_length=max_length,
        allow_fewer=allow_fewer, check_finite=check_finite, merge_scaling=merge_scaling, heads=heads,
        expert_kind=expert_kind, dtype=dtype, hub_id=hub_id,
    )[0]


def calibrate_into(merged: str | Path, *, progress: bool = True, dtype: str | None = None,
                   hub_id: Mapping[str, str] | None = None, **kwargs: Any) -> tuple[dict[str, Any], CalibrationResult]:
    """`calibrate_to_dir` (its arguments), returning the report written and the CalibrationResult, whose model is
    the calibrated model as written: the one writer of a calibrated folder, behind `featcal calibrate --out`,
    `featcal run` and `featcal.calibrate(..., out=)`."""
    options = parse(OutputOptions, {"dtype": dtype, "hub_id": dict(hub_id or {})})
    with hf_progress_bars(progress):
        return _calibrate_to_dir(merged, progress=progress, dtype=options.dtype, hub_id=options.hub_id, **kwargs)


def _calibrate_to_dir(
    merged: str | Path, *, base: str | Path, experts: Mapping[str, str | Path],
    calibration_sources: Mapping[str, str | Path], config: FeatCalConfig, out: str | Path, overwrite: bool,
    allow_pickle: bool, progress: bool, max_length: int, allow_fewer: bool, check_finite: bool,
    merge_scaling: float | None = None, heads: Mapping[str, str | Path] | None = None,
    expert_kind: Mapping[str, str] | None = None, dtype: str | None = None, hub_id: Mapping[str, str],
) -> tuple[dict[str, Any], CalibrationResult]:
    total = Timer()
    if merged is None:
        raise ConfigError("calibrate_to_dir needs the merged checkpoint to calibrate")
    check_hub_ids(hub_id, experts)
    with _WarningLog() as warnings:
        checked = check_calibration_inputs(
            merged, base=base, experts=experts, calibration_sources=calibration_sources, config=config, out=out,
            overwrite=overwrite, allow_pickle=allow_pickle, max_length=max_length, allow_fewer=allow_fewer,
            check_finite=check_finite, progress=progress, expert_kind=expert_kind, heads=heads,
        )
        head_layers = load_heads(heads or {}, checked.tasks, config.tune,  # refused here, before any work
                                 feature_width(load_config(checked.merged or merged)))
        config = _with_resume_dir(config, checked.out)
        merged_dir = Path(checked.merged or merged)

        load = Timer()
        calibration, read_as = _load_calibration(checked, config, progress)
        data_seconds = load.seconds
        tokenizer = _tokenizer_plan(checked, merged_dir)  # refused here, before any work
        # loaded (and computed) in float32; written in --dtype, else the merge's stored dtype
        out_dtype = getattr(torch, dtype) if dtype is not None else stored_float_dtype(merged_dir, allow_pickle)
        merged_model = load_model(merged_dir, allow_pickle=allow_pickle)
        load_seconds = load.seconds

        tune, scaling_from = _tune_arguments(config, merge_scaling, merged_dir, checked, head_layers)
        work = Timer()
        result = _calibrate_loaded(merged_model, checked, calibration, config, progress, allow_pickle, tune)
        calibrate_seconds = work.seconds
        _cast_and_check(result, out_dtype)

    hashing = Timer()
    inputs_report = _inputs_report(merged_dir, checked, calibration_sources, calibration, read_as)
    hash_seconds = hashing.seconds

    group = current_group()
    if not group.is_main:  # under torchrun only rank 0 writes; the others wait for it, then tidy up
        return _leave_writing_to_rank_0(group, result), result
    seconds = {"load": load_seconds, "load_data": data_seconds, "calibrate": calibrate_seconds,
               "hash_inputs": hash_seconds}
    report = _write_calibrated(
        result, checked, merged_dir, overwrite,
        params={**config.model_dump(mode="json"), "max_length": max_length, "allow_fewer": allow_fewer},
        inputs_report=inputs_report, warnings=warnings.messages, seconds=seconds, total=total,
        tuning=_tuning_report(result, scaling_from, heads), tokenizer=tokenizer, hub_ids=hub_id,
    )
    group.barrier()
    if result.resume_store is not None:  # the checkpoint is safely in place: the resume state has served
        result.resume_store.delete()
    log.info("calibrated checkpoint written to %s (%.1f s)", checked.out, total.seconds)
    return report, result


# --- the stages of _calibrate_to_dir, in the order they run ----------------------------------------
def _with_resume_dir(config: FeatCalConfig, out_path: Path) -> FeatCalConfig:
    """`resume` without a `resume_dir`: killed runs resume from beside the output."""
    if config.resume and config.resume_dir is None:
        return config.model_copy(update={"resume_dir": default_resume_dir(out_path)})
    return config


def _load_calibration(checked: CheckedInputs, config: FeatCalConfig,
                      progress: bool) -> tuple[dict[str, list[Batch]], dict[str, dict]]:
    """Each task's calibration batches, and what featcal.json records of each task's data: the data the checks
    opened, drew and preprocessed (`checked.data`), not read again."""
    loaded = checked.data.load(batch_size=config.calibration_batch_size, progress=progress)
    return loaded.batches, loaded.records


def _tune_arguments(
    config: FeatCalConfig, merge_scaling: float | None, merged_dir: Path, checked: CheckedInputs,
    head_layers: Mapping[str, Any],
) -> tuple[dict[str, Any], str | None]:
    """With --tune, what lets the search rebuild the merge at other scalings (and score with heads), and
    where the merge's scaling came from; ({}, None or the caller) without."""
    scaling_from = "given by the caller" if merge_scaling is not None else None
    if not config.tune:
        return {}, scaling_from
    if merge_scaling is None:
        merge_scaling, scaling_from = merge_scaling_from_report(merged_dir, checked.base, checked.experts)
    return {"merge_scaling": merge_scaling, "heads": head_layers or None}, scaling_from


def _calibrate_loaded(
    merged_model: torch.nn.Module, checked: CheckedInputs, calibration: dict[str, list[Batch]],
    config: FeatCalConfig, progress: bool, allow_pickle: bool, tune: dict[str, Any],
) -> CalibrationResult:
    """featcal.calibrate on the loaded merge, in place; base and experts streamed from their files."""
    with torch.no_grad():
        return calibrate_models(
            merged_model, base=str(checked.base), experts={t: str(d) for t, d in checked.experts.items()},
            calibration=calibration, config=config, progress=progress, inplace=True, allow_pickle=allow_pickle,
            keep_resume_state=True,
            check_finite=checked.finite_as_read,  # the experts as read; the other checkpoints were scanned before
            expert_kind=checked.expert_kind, **tune,
        )


def _cast_and_check(result: CalibrationResult, out_dtype: torch.dtype | None) -> None:
    """Cast back to the merge's stored dtype (fp16 / bf16 stay 16-bit), then refuse NaN/Inf (fp16 overflow
    too); resuming cannot help a non-finite result, so its resume state goes."""
    if out_dtype is not None:
        result.model.to(out_dtype)
    with discard_on_error(result.resume_store):
        check_finite_state("the calibrated model", result.model.state_dict())


def _inputs_report(
    merged_dir: Path, checked: CheckedInputs, calibration_sources: Mapping[str, str | Path],
    calibration: Mapping[str, list[Batch]], read_as: Mapping[str, dict],
) -> dict[str, Any]:
    """featcal.json's `inputs`: every checkpoint's hashes, every task's data and its tensors' hash."""
    base_dir = checked.base
    return {
        "merged": {"path": str(merged_dir), "sha256": checkpoint_hashes(merged_dir)},
        "base": {"path": str(base_dir), "sha256": checkpoint_hashes(base_dir), **checked.read_as.get(BASE, {})},
        "experts": {t: {"path": str(d), "sha256": checkpoint_hashes(d), **checked.read_as.get(expert_label(t), {})}
                    for t, d in checked.experts.items()},
        "calibration": {t: {**read_as[t], "source": str(calibration_sources[t])} for t in calibration},
        "processor_dir": str(checked.data_dir),
    }


def _leave_writing_to_rank_0(group: RankGroup, result: CalibrationResult) -> dict[str, Any]:
    """A rank other than 0 waits for rank 0 to write, then deletes its own resume state."""
    group.barrier()
    if result.resume_store is not None:
        result.resume_store.delete()
    return {"command": "calibrate", "drift": result.drift_records(), "rank": group.rank}


def _tuning_report(result: CalibrationResult, scaling_from: str | None,
                   heads: Mapping[str, str | Path] | None) -> dict[str, Any] | None:
    """featcal.json's `tuning` (with --tune): the search's record, where the scaling came from, the heads."""
    if result.tuning is None:
        return None
    return {**result.tuning.as_dict(), "merge_scaling_from": scaling_from,
            "head_files": {t: str(p) for t, p in (heads or {}).items()}}


def _tokenizer_plan(checked: CheckedInputs, merged_dir: Path) -> TokenizerPlan | None:
    """The calibrated output carries the merge's tokenizer (else the base's: `data_dir`), completed by a chat
    template every expert agrees on where it lacks one (io/tokenizer.py); a disagreement among the experts is
    logged, not refused (calibrate keeps the merge's tokenizer, which a merge tool chose)."""
    experts = {t: input_folder(d) for t, d in checked.experts.items()}
    try:
        plan = plan_tokenizer(checked.data_dir, experts)
    except ConfigError as exc:
        log.warning("the calibrated model keeps the merge's tokenizer: %s", exc)
        return None
    return plan if plan.source == "base" else None  # the merge's own tokenizer files are never swapped


def _write_calibrated(
    result: CalibrationResult, checked: CheckedInputs, merged_dir: Path, overwrite: bool, *,
    params: dict[str, Any], inputs_report: dict[str, Any], warnings: list[str], seconds: dict[str, float],
    total: Timer, tuning: dict[str, Any] | None, tokenizer: TokenizerPlan | None = None,
    hub_ids: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The calibrated checkpoint, its preprocessing files, task heads, featcal.json and model card, through a
    temporary directory renamed into place; the report written."""
    calibrated, out_path, data_dir = result.model, checked.out, checked.data_dir
    save = Timer()
    with discard_on_error(result.resume_store), atomic_output_dir(out_path, overwrite) as tmp:
        copy_side_files(merged_dir, tmp)  # tokenizer / processor files first: save_pretrained's config wins
        if data_dir != merged_dir:
            _copy_processor_files(data_dir, tmp)  # the output preprocesses like the data it was calibrated on
        if tokenizer is not None:
            tokenizer.write(tmp)
        if (merged_dir / HEADS_DIR).is_dir():  # a featcal merge's per-task heads go on with the model
            shutil.copytree(merged_dir / HEADS_DIR, tmp / HEADS_DIR)
        calibrated.save_pretrained(tmp)
        report = build_report(
            "calibrate", params, inputs=inputs_report, drift=result.drift_records(), end_to_end_drift=result.end_to_end,
            warnings=warnings,
            output={"path": str(out_path), "sha256": checkpoint_hashes(tmp),
                    "dtype": str(next(calibrated.parameters()).dtype).removeprefix("torch.")},
        )
        report["seconds"] = {  # load includes load_data; save excludes the final fsync and rename
            **{k: round(v, 3) for k, v in seconds.items()}, "save": round(save.seconds, 3),
            "total": round(total.seconds, 3),
        }
        report["peak_rss_mb"] = round(peak_rss_mb(), 1)
        if tuning is not None:
            report["tuning"] = tuning
        if result.final_norm is not None:  # calibrate_final_norm: what was solved (absent by default)
            report["final_norm"] = result.final_norm
        if result.stem_norm is not None:  # calibrate_stem_norm: likewise
            report["stem_norm"] = result.stem_norm
        if result.kept_merged:  # block parameters left as merged (a mixture of experts' experts, LayerScale, ...)
            report["kept_merged"] = result.kept_merged
        if result.placement is not None:  # where the experts' weights lived (expert_placement.py)
            report["placement"] = result.placement
        merged_report = _merged_report(merged_dir)
        if merged_report is not None and merged_report.get("task_heads") and (tmp / HEADS_DIR).is_dir():
            report["task_heads"] = merged_report["task_heads"]
        if tokenizer is not None and tokenizer.template is not None:
            report["tokenizer"] = {**tokenizer.report(tmp), "source": "the merge's"}
        replaced = replaced_files({"merged": merged_dir})
        if replaced:
            report["replaced_input_files"] = replaced
        write_card(tmp, report, merged_report, hub_ids)  # records each input's hub id in the report too
        write_report(tmp, report)
    return report


def _merged_report(merged_dir: Path) -> dict[str, Any] | None:
    """The merged checkpoint's own featcal.json (a featcal merge), None for another tool's merge, or for one that
    is no JSON object (read after the calibration: a crafted file must not lose the run to a traceback)."""
    path = merged_dir / "featcal.json"
    try:
        report = read_json(path) if path.is_file() else None
    except CheckpointError:
        return None
    return report if isinstance(report, dict) else None
