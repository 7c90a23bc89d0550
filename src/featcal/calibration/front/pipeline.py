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
from featcal.calibration.core.inputs import check_variant_packages, resolve_device
from featcal.calibration.core.result import CalibrationResult
from featcal.calibration.front.in_memory import calibrate_models
from featcal.calibration.maths.distributed import RankGroup, current_group
from featcal.calibration.resume.store import default_resume_dir, discard_on_error
from featcal.calibration.tuning import load_heads, merge_scaling_from_report
from featcal.config import (
    FeatCalConfig,
    OutputOptions,
    RunOptions,
    calibration_options,
    check_expert_kinds,
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
from featcal.io.read.checkpoint import HEADS_DIR, CheckpointReader, copy_side_files, read_json
from featcal.io.read.family import BASE, MERGED, expert_label, is_gguf, open_family
from featcal.io.read.hashes import checkpoint_hashes
from featcal.io.read.models import hf_progress_bars, load_config, load_model
from featcal.io.read.validate import check_finite_state
from featcal.io.write.atomic import (
    atomic_output_dir,
    check_output_dir,
    check_replaceable,
    refuse_output_over_inputs,
)
from featcal.io.write.card import check_hub_ids, replaced_files, write_card
from featcal.io.write.report import Timer, build_report, peak_rss_mb, write_report
from featcal.io.write.tokenizer import TokenizerPlan, input_folder, plan_tokenizer

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
class CalibrateRequest:
    """One disk-to-disk calibration (`featcal calibrate`, a run file's `calibrate:`, featcal.calibrate(..., out=)):
    the merged checkpoint (None: check everything but the merge, against the base, as `featcal run` does before
    merging), the base, the experts (task -> checkpoint), each task's calibration source, the output folder;
    the calibration's settings (`config`); how the inputs are read and the output written (`options`: overwrite,
    allow_pickle, max_length, allow_fewer, expert_kind); what the written checkpoint holds (`outputs`: dtype,
    hub_id; a tokenizer_source is refused: the calibrated model keeps the merge's tokenizer).

    `heads` (task -> head file, --tune-head) and `merge_scaling` (the s of a task-vector merge θ0 + s·v) serve
    `config.tune`. `check_finite=False` skips the NaN / Inf scan of the inputs (for callers that just scanned them,
    as `featcal run` does). `progress`: progress bars on stderr."""

    merged: str | os.PathLike | None
    base: str | os.PathLike
    experts: Mapping[str, str | os.PathLike]
    calibration: Mapping[str, str | os.PathLike]
    out: str | os.PathLike
    config: FeatCalConfig = field(default_factory=FeatCalConfig)
    options: RunOptions = field(default_factory=RunOptions)
    outputs: OutputOptions = field(default_factory=OutputOptions)
    heads: Mapping[str, str | os.PathLike] | None = None
    merge_scaling: float | None = None
    check_finite: bool = True
    progress: bool = True


@dataclass(frozen=True)
class CalibratedCheckpoint:
    """What a disk-to-disk calibration did: the folder written, its featcal.json (`report`; on a rank other than
    0 under torchrun, which writes nothing, a short record of that rank's drift), and the CalibrationResult, whose
    model is the calibrated model as written. `main`: this process wrote the folder (rank 0, or no torchrun)."""

    out: Path
    report: dict[str, Any]
    result: CalibrationResult
    main: bool = True


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


def check_calibration_inputs(request: CalibrateRequest, *, check_device: bool = True) -> CheckedInputs:
    """Every check that needs no model loaded, cheapest first; raises a FeatCalError naming the culprit.

    Task names agree, the options are usable, the output directory is free and is no input, every
    checkpoint is safetensors (or allowed pickle) with the same architecture, tensor names and
    shapes, the config loads without custom code, each task's data exists and fits the model's
    modality and size, and (`request.check_finite`) no checkpoint holds NaN/Inf. `request.merged=None` checks
    everything but the merged model, against the base (what `featcal run` does before merging).
    `options.expert_kind`: task -> full / adapter, for expert folders holding both (refused without it). The heads
    (--tune-head files) and the spill directory must not lie in the output either: replacing it would delete them.
    `check_device=False` (featcal plan): the device need not exist here.
    """
    r, merged, experts, calibration_sources, config = (request, request.merged, request.experts, request.calibration,
                                                       request.config)
    tasks = check_task_names(experts, calibration_sources)
    expert_kind = dict(r.options.expert_kind)
    check_expert_kinds(expert_kind, experts)
    check_options(config, r.options.max_length, check_device)
    if r.outputs.tokenizer_source is not None:
        raise ConfigError("tokenizer_source is a merge option: the calibrated model keeps the merge's tokenizer")
    out_path = check_output_dir(r.out, r.options.overwrite)
    # every input opened once, headers only (a GGUF file is dequantised for the finite scan alone)
    family = open_family(r.base, {t: experts[t] for t in tasks}, merged, allow_pickle=r.options.allow_pickle,
                         expert_kind=expert_kind, header_only=True, base_name="base model")
    inputs = {label: family.path(label) for label in family.items}  # merged, base, experts: their folders
    reference = MERGED if merged is not None else BASE
    family.check_model_types(reference)
    refuse_output_over_inputs(out_path, {**inputs, **{f"calibration data {t!r}": calibration_sources[t] for t in tasks},
                                         **{f"head of task {t!r}": h for t, h in (r.heads or {}).items()}})
    check_resume_dir(config, out_path, inputs)
    check_spill_dir(config, out_path, inputs)
    check_replaceable(out_path, r.options.overwrite)
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
                            options=calibration_options(config, max_length=r.options.max_length,
                                                        allow_fewer=r.options.allow_fewer))
    if data.in_memory:  # featcal.json names and hashes each task's source
        raise CalibrationDataError(f"task(s) {', '.join(map(repr, data.in_memory))}: calibration data written beside a "
                                   "checkpoint must be a source (a path or a hub dataset id), not batches in memory")
    data.check()
    as_read = _scan_finite(family, tasks, config, r.check_finite, merged is not None, r.progress)  # costliest, last
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


def calibrate_to_dir(request: CalibrateRequest) -> CalibratedCheckpoint:
    """Calibrate the merged checkpoint toward its experts and write the result (+ featcal.json, README.md) to
    `request.out`: the one writer of a calibrated folder, behind `featcal calibrate`, `featcal run` and
    `featcal.calibrate(..., out=)` (which sits on this floor, and so this writer with it; jobs/ above builds the
    request from flags and run files).

    Returns the CalibratedCheckpoint: the report written, whose `warnings` list what featcal warned about during the
    run (e.g. a Gram matrix that needed the pseudo-inverse fallback), and the CalibrationResult. Nothing is written
    if anything fails, and the calibrated weights are checked for NaN/Inf before anything is. With `config.tune`,
    `merge_scaling` is the s of a task-vector merge θ0 + s·v (featcal run knows it; else it is read from the merged
    checkpoint's featcal.json when that ties it to these inputs), and the report's `tuning` records every candidate
    and the choice (tuning/); `heads` (task -> a head saved by featcal) add agreement with the experts' predictions
    to its score. `outputs.dtype` ('float32', 'bfloat16', 'float16'): the written weights' floating dtype (default:
    the merged checkpoint's stored one). `outputs.hub_id` (role -> hub id; role "base" or an expert's name): how the
    model card names an input whose own record names no hub id (io/write/card.py).
    """
    with hf_progress_bars(request.progress):
        return _calibrate_to_dir(request)


@dataclass(frozen=True)
class _Calibrated:
    """What the calibration stage of _calibrate_to_dir leaves for the writing: the checks' findings, the config
    as run (its resume directory set), the data as loaded and recorded, the result and the stages' seconds."""

    checked: CheckedInputs
    config: FeatCalConfig
    merged_dir: Path
    calibration: dict[str, list[Batch]]
    read_as: dict[str, dict]
    result: CalibrationResult
    tokenizer: TokenizerPlan | None
    scaling_from: str | None
    seconds: dict[str, float]


def _calibrate_to_dir(r: CalibrateRequest) -> CalibratedCheckpoint:
    total = Timer()
    if r.merged is None:
        raise ConfigError("calibrate_to_dir needs the merged checkpoint to calibrate")
    check_hub_ids(r.outputs.hub_id, r.experts)
    with _WarningLog() as warnings:
        done = _calibrate_checked(r)

    hashing = Timer()
    inputs_report = _inputs_report(done.merged_dir, done.checked, r.calibration, done.calibration, done.read_as)
    seconds = {**done.seconds, "hash_inputs": hashing.seconds}

    result, out = done.result, done.checked.out
    group = current_group()
    if not group.is_main:  # under torchrun only rank 0 writes; the others wait for it, then tidy up
        return CalibratedCheckpoint(out, _leave_writing_to_rank_0(group, result), result, main=False)
    report = _write_calibrated(result, done.checked, done.merged_dir, r.options.overwrite, _ReportParts(
        params={**done.config.model_dump(mode="json"), "max_length": r.options.max_length,
                "allow_fewer": r.options.allow_fewer},
        inputs_report=inputs_report, warnings=warnings.messages, seconds=seconds, total=total,
        tuning=_tuning_report(result, done.scaling_from, r.heads), tokenizer=done.tokenizer, hub_ids=r.outputs.hub_id,
    ))
    group.barrier()
    if result.resume_store is not None:  # the checkpoint is safely in place: the resume state has served
        result.resume_store.delete()
    log.info("calibrated checkpoint written to %s (%.1f s)", out, total.seconds)
    return CalibratedCheckpoint(out, report, result)


def _calibrate_checked(r: CalibrateRequest) -> _Calibrated:
    """Check every input, load the data and the merge, calibrate it, cast it to the written dtype and check it."""
    allow_pickle = r.options.allow_pickle
    checked = check_calibration_inputs(r)
    head_layers = load_heads(r.heads or {}, checked.tasks, r.config.tune,  # refused here, before any work
                             feature_width(load_config(checked.merged or r.merged)))
    config = _with_resume_dir(r.config, checked.out)
    merged_dir = Path(checked.merged or r.merged)

    load = Timer()
    calibration, read_as = _load_calibration(checked, config, r.progress)
    data_seconds = load.seconds
    tokenizer = _tokenizer_plan(checked, merged_dir)  # refused here, before any work
    # loaded (and computed) in float32; written in --dtype, else the merge's stored dtype
    dtype = r.outputs.dtype
    out_dtype = getattr(torch, dtype) if dtype is not None else stored_float_dtype(merged_dir, allow_pickle)
    merged_model = load_model(merged_dir, allow_pickle=allow_pickle)
    load_seconds = load.seconds

    tune, scaling_from = _tune_arguments(config, r.merge_scaling, merged_dir, checked, head_layers)
    work = Timer()
    result = _calibrate_loaded(merged_model, checked, calibration, config, r.progress, allow_pickle, tune)
    calibrate_seconds = work.seconds
    _cast_and_check(result, out_dtype)
    seconds = {"load": load_seconds, "load_data": data_seconds, "calibrate": calibrate_seconds}
    return _Calibrated(checked, config, merged_dir, calibration, read_as, result, tokenizer, scaling_from, seconds)


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
    template every expert agrees on where it lacks one (io/write/tokenizer.py); a disagreement among the experts is
    logged, not refused (calibrate keeps the merge's tokenizer, which a merge tool chose)."""
    experts = {t: input_folder(d) for t, d in checked.experts.items()}
    try:
        plan = plan_tokenizer(checked.data_dir, experts)
    except ConfigError as exc:
        log.warning("the calibrated model keeps the merge's tokenizer: %s", exc)
        return None
    return plan if plan.source == "base" else None  # the merge's own tokenizer files are never swapped


@dataclass(frozen=True)
class _ReportParts:
    """What featcal.json takes from the run besides the result: the parameters, the inputs' record, the warnings,
    the stages' seconds and the whole run's timer, the search's record, the tokenizer written, the hub ids given."""

    params: dict[str, Any]
    inputs_report: dict[str, Any]
    warnings: list[str]
    seconds: dict[str, float]
    total: Timer
    tuning: dict[str, Any] | None
    tokenizer: TokenizerPlan | None = None
    hub_ids: Mapping[str, str] | None = None


def _write_calibrated(result: CalibrationResult, checked: CheckedInputs, merged_dir: Path, overwrite: bool,
                      parts: _ReportParts) -> dict[str, Any]:
    """The calibrated checkpoint, its preprocessing files, task heads, featcal.json and model card, through a
    temporary directory renamed into place; the report written."""
    calibrated, out_path, data_dir = result.model, checked.out, checked.data_dir
    tokenizer, tuning = parts.tokenizer, parts.tuning
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
            "calibrate", parts.params, inputs=parts.inputs_report, drift=result.drift_records(),
            end_to_end_drift=result.end_to_end, warnings=parts.warnings,
            output={"path": str(out_path), "sha256": checkpoint_hashes(tmp),
                    "dtype": str(next(calibrated.parameters()).dtype).removeprefix("torch.")},
        )
        report["seconds"] = {  # load includes load_data; save excludes the final fsync and rename
            **{k: round(v, 3) for k, v in parts.seconds.items()}, "save": round(save.seconds, 3),
            "total": round(parts.total.seconds, 3),
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
        write_card(tmp, report, merged_report, parts.hub_ids)  # records each input's hub id in the report too
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
