"""Calibrate a merged checkpoint on disk into a new checkpoint directory, with its featcal.json report.

The order is what makes the command safe to run on big models: every input is checked first
(checkpoints exist and are safetensors, task names agree, the output directory is free, the data
loads for this model), then the models are loaded and calibrated, and only then is anything
written, through a temporary directory renamed into place.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from featcal.config import FeatCalConfig
from featcal.data.calibration import load_calibration_batches, load_model_config
from featcal.data.preprocess import (
    IMAGE_PROCESSOR_FILES,
    TOKENIZER_FILES,
    Batch,
    has_processor_files,
    model_modality,
)
from featcal.errors import CalibrationDataError, CheckpointError, ConfigError
from featcal.io.atomic import atomic_output_dir, check_output_dir
from featcal.io.checkpoint import CheckpointReader, copy_side_files, resolve_checkpoint
from featcal.io.models import load_model
from featcal.io.report import Timer, build_report, checkpoint_hashes, peak_rss_mb, write_report

log = logging.getLogger(__name__)


def check_task_names(experts: Mapping[str, Any], calibration_sources: Mapping[str, Any]) -> list[str]:
    """The task names, in the experts' order; refuse any task that lacks its expert or its data."""
    if not experts:
        raise ConfigError("at least one expert is needed (--expert NAME=PATH)")
    no_data = [t for t in experts if t not in calibration_sources]
    no_expert = [t for t in calibration_sources if t not in experts]
    problems = []
    if no_data:
        problems.append(f"task(s) {', '.join(map(repr, no_data))} have an expert but no calibration data (--calib NAME=DATA)")
    if no_expert:
        problems.append(f"task(s) {', '.join(map(repr, no_expert))} have calibration data but no expert (--expert NAME=PATH)")
    if problems:
        raise ConfigError("; ".join(problems))
    return list(experts)


def _checkpoint(label: str, path_or_id: str | Path, allow_pickle: bool) -> Path:
    """Resolve and validate one input checkpoint (headers only), naming it in any error."""
    try:
        path = resolve_checkpoint(path_or_id, allow_pickle=allow_pickle)
        CheckpointReader(path, allow_pickle=allow_pickle)
    except CheckpointError as exc:
        raise CheckpointError(f"{label}: {exc}") from None
    return path


def _model_type(path: Path) -> str | None:
    try:
        return json.loads((path / "config.json").read_text()).get("model_type")
    except (OSError, json.JSONDecodeError):
        return None


def _check_same_architecture(inputs: Mapping[str, Path]) -> None:
    types = {label: _model_type(p) for label, p in inputs.items()}
    reference = types["merged"]
    odd = [f"{label} ({t})" for label, t in types.items() if t != reference]
    if odd:
        raise CheckpointError(f"all checkpoints must share the merged model's type ({reference}); these differ: {', '.join(odd)}")


def processor_dir(merged: Path, base: Path) -> Path:
    """Where the preprocessing files live: the merged checkpoint, else the base (merges often lack them)."""
    modality = model_modality(load_model_config(merged))
    for candidate in (merged, base):
        if has_processor_files(candidate, modality):
            return candidate
    return merged  # the loader then falls back (vision) or explains what is missing (text)


def _copy_processor_files(src: Path, dst: Path) -> None:
    for name in IMAGE_PROCESSOR_FILES + TOKENIZER_FILES + ("special_tokens_map.json", "merges.txt"):
        if (src / name).is_file() and not (dst / name).exists():
            shutil.copy2(src / name, dst / name)


def batches_sha256(batches: list[Batch]) -> str:
    """A fingerprint of exactly the tensors calibration saw (cheaper and more exact than hashing the source)."""
    h = hashlib.sha256()
    for batch in batches:
        for key in sorted(batch):
            t = batch[key].contiguous()
            h.update(f"{key}:{t.dtype}:{tuple(t.shape)}".encode())
            h.update(t.numpy().tobytes())
    return h.hexdigest()


def _count(batches: list[Batch]) -> int:
    return sum(int(next(iter(b.values())).shape[0]) for b in batches)


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
    max_length: int = 128,
    allow_fewer: bool = False,
) -> dict[str, Any]:
    """Calibrate the merged checkpoint toward its experts and write the result (+ featcal.json) to `out`.

    Returns the report that was written. Nothing is written if anything fails.
    """
    total = Timer()
    tasks = check_task_names(experts, calibration_sources)
    out_path = check_output_dir(out, overwrite)
    merged_dir = _checkpoint("merged model", merged, allow_pickle)
    base_dir = _checkpoint("base model", base, allow_pickle)
    expert_dirs = {t: _checkpoint(f"expert {t!r}", experts[t], allow_pickle) for t in tasks}
    inputs = {"merged": merged_dir, "base": base_dir, **{f"expert {t!r}": d for t, d in expert_dirs.items()}}
    _check_same_architecture(inputs)
    clash = [label for label, d in inputs.items() if d.resolve() == out_path.resolve()]
    if clash:
        raise ConfigError(f"the output directory {out_path} is an input ({', '.join(clash)}); choose another --out")
    for t in tasks:
        if not Path(calibration_sources[t]).expanduser().exists():
            raise CalibrationDataError(f"calibration data for task {t!r}: {calibration_sources[t]} does not exist")

    load = Timer()
    data_dir = processor_dir(merged_dir, base_dir)
    calibration: dict[str, list[Batch]] = {}
    for t in tasks:
        try:
            calibration[t] = load_calibration_batches(
                calibration_sources[t], model_dir=data_dir, num_examples=config.num_calibration_examples,
                batch_size=config.calibration_batch_size, seed=config.seed, max_length=max_length,
                allow_fewer=allow_fewer, progress=progress,
            )
        except CalibrationDataError as exc:
            raise CalibrationDataError(f"task {t!r}: {exc}") from None
    data_seconds = load.seconds
    merged_model = load_model(merged_dir, allow_pickle=allow_pickle)
    load_seconds = load.seconds

    from featcal.calibration.api import calibrate

    work = Timer()
    with torch.no_grad():
        calibrated = calibrate(
            merged_model, base=str(base_dir), experts={t: str(d) for t, d in expert_dirs.items()},
            calibration=calibration, config=config, progress=progress, inplace=True, allow_pickle=allow_pickle,
        )
    calibrate_seconds = work.seconds

    hashing = Timer()
    inputs_report = {
        "merged": {"path": str(merged_dir), "sha256": checkpoint_hashes(merged_dir)},
        "base": {"path": str(base_dir), "sha256": checkpoint_hashes(base_dir)},
        "experts": {t: {"path": str(d), "sha256": checkpoint_hashes(d)} for t, d in expert_dirs.items()},
        "calibration": {
            t: {"source": str(calibration_sources[t]), "examples": _count(b), "batches": len(b),
                "tensors_sha256": batches_sha256(b)}
            for t, b in calibration.items()
        },
        "processor_dir": str(data_dir),
    }
    hash_seconds = hashing.seconds

    save = Timer()
    with atomic_output_dir(out_path, overwrite) as tmp:
        copy_side_files(merged_dir, tmp)  # tokenizer / processor files first: save_pretrained's config wins
        if data_dir != merged_dir:
            _copy_processor_files(data_dir, tmp)  # the output preprocesses like the data it was calibrated on
        calibrated.save_pretrained(tmp)
        report = build_report(
            "calibrate",
            {**config.model_dump(mode="json"), "max_length": max_length, "allow_fewer": allow_fewer},
            inputs=inputs_report,
            drift=getattr(calibrated, "featcal_drift", None),
            output={"path": str(out_path), "sha256": checkpoint_hashes(tmp)},
        )
        report["seconds"] = {  # load includes load_data; save excludes the final fsync and rename
            "load": round(load_seconds, 3), "load_data": round(data_seconds, 3), "calibrate": round(calibrate_seconds, 3),
            "hash_inputs": round(hash_seconds, 3), "save": round(save.seconds, 3), "total": round(total.seconds, 3),
        }
        report["peak_rss_mb"] = round(peak_rss_mb(), 1)
        write_report(tmp, report)
    log.info("calibrated checkpoint written to %s (%.1f s)", out_path, total.seconds)
    return report
