"""`featcal.calibrate`: the public entry point. Checks the request, then runs one calibration (core.py)
or the label-free hyperparameter search (tuning/); either way a CalibrationResult comes back (result.py).

The arguments of `calibrate` in full:

- `calibration`: per task, a path, a hub dataset id `NAME[:CONFIG][@SPLIT]`, a `datasets.Dataset`, a list of
  texts, chat conversations, records or PIL images (docs/data.md), sampled and tokenised as the CLI does it with
  `config`'s data options (num_calibration_examples, seed, text_column, text_unit, pack_texts, ...), texts cut
  to `max_length` tokens, `allow_fewer` as --allow-fewer; or model-ready batches (a tensor for the model's main
  input, or a dict of keyword inputs, or a list of those), used as given. Sources are read with `tokenizer` (a
  tokenizer, or a folder holding it / the image processor), else the one saved with the merged model or the
  base (task_data.py); the result's `.calibration_data` says how each source was read. The calibrated model
  is the merged model's class.
- The result (result.py) holds `.model`, `.drift` (a DriftRow per block: block, stack, layer, before, after),
  `.end_to_end = {"merged", "calibrated", ...}` (final-block drift; a warning is logged when worse),
  `.resume_store` (with `keep_resume_state`) and `.tuning` (a TuningRecord, with `config.tune`).
  `return_result` is deprecated and does nothing: the result always comes back.
- With `config.resume_dir` every finished block is checkpointed there and a rerun with the same inputs
  continues after the last finished block; the state is deleted on success unless `keep_resume_state` (the
  caller deletes it once its output is written); `config.checkpoint_every` spaces the checkpoints. With
  `config.offload_blocks` the models and chains stay on the CPU and only the block being calibrated goes to
  `config.device` (placement.py).
- `check_finite`: every parameter the run reads is checked for NaN/Inf: the merged model's and the base's, and
  the experts given in memory, before any work (one tensor at a time); the experts read from files as each
  block is read, ahead of the block that needs it (prefetch.py). Under an initialised torch.distributed process
  group the batches are shared out over the ranks and the statistics all-reduced (distributed.py).
- With `config.tune` the hyperparameters are first chosen on held-out calibration examples without labels,
  then refit on all of them (tuning/; the result's `.tuning` records the search): `heads` (task -> nn.Module on
  the pooled output, or callable head(model, batch) -> logits) add agreement with the experts' predictions to
  the score (a causal LM's own next-token predictions do without them: `config.tune_next_token`), and
  `merge_scaling` (the s of a task-vector merge θ0 + s·v) lets the search rebuild the merge at other scalings.
- `expert_kind` (task -> "full" or "adapter"): how to read an expert folder holding both full weights and a
  LoRA / PEFT adapter (refused without it)."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

from featcal.calibration import core, tuning
from featcal.calibration.inputs import ModelLike, adapter_reader, resolve_device
from featcal.calibration.result import CalibrationResult
from featcal.calibration.task_data import resolve_calibration
from featcal.config import DEFAULT_MAX_LENGTH, FeatCalConfig, check_expert_kinds, run_options
from featcal.errors import ConfigError

# re-exported: callers that read a checkpoint as calibrate does, or check a device as it does
__all__ = ["CalibrationResult", "ModelLike", "adapter_reader", "calibrate", "resolve_device"]


def calibrate(
    merged: ModelLike,
    *,
    base: ModelLike | None = None,
    experts: Mapping[str, ModelLike],
    calibration: Mapping[str, Any | Iterable[Any]],
    config: FeatCalConfig | None = None,
    progress: bool = True,
    inplace: bool = False,
    allow_pickle: bool = False,
    keep_resume_state: bool = False,
    check_finite: bool = True,
    heads: Mapping[str, Any] | None = None,
    merge_scaling: float | None = None,
    return_result: bool | None = None,
    expert_kind: Mapping[str, str] | None = None,
    tokenizer: Any = None,
    max_length: int = DEFAULT_MAX_LENGTH,
    allow_fewer: bool = False,
) -> CalibrationResult:
    """Calibrate a merged model toward its experts with FeatCal (docs/method.md); returns a CalibrationResult,
    whose `.model` is the calibrated model (a copy of a model passed as `merged` unless `inplace=True`).

    merged, base, experts: transformers models, or checkpoint paths / hub ids (read block by block from their
    safetensors, never loaded whole). calibration: per task, what `featcal calibrate --calib` takes, or
    model-ready batches. The module docstring says what every other argument does.
    """
    if return_result is not None:
        _warn_return_result()
    config = _checked_config(config)
    kinds = _checked_request(config, base, experts, heads, merge_scaling, expert_kind)
    calibration, data_records = resolve_calibration(
        merged, base=base, experts=experts, calibration=calibration, config=config, tokenizer=tokenizer,
        max_length=max_length, allow_fewer=allow_fewer, progress=progress,
    )
    common = dict(base=base, experts=experts, calibration=calibration, config=config, progress=progress,
                  inplace=inplace, allow_pickle=allow_pickle, keep_resume_state=keep_resume_state,
                  check_finite=check_finite, expert_kind=kinds)
    result = _run(merged, config, heads, merge_scaling, common)
    if data_records:
        result = dataclasses.replace(result, calibration_data=data_records)
    return result


def _checked_request(config: FeatCalConfig, base: ModelLike | None, experts: Mapping[str, ModelLike],
                     heads: Mapping[str, Any] | None, merge_scaling: float | None,
                     expert_kind: Mapping[str, str] | None) -> dict[str, str]:
    """What can be refused before any data is read: the expert kinds (returned, checked against the experts)
    and the search's own arguments."""
    kinds = run_options(expert_kind=expert_kind or {}).expert_kind
    if isinstance(experts, Mapping):
        check_expert_kinds(kinds, experts)
    tuning.check_request(config, base, experts, heads, merge_scaling)
    return kinds


def _run(merged: ModelLike, config: FeatCalConfig, heads: Mapping[str, Any] | None, merge_scaling: float | None,
         common: dict[str, Any]) -> CalibrationResult:
    """One calibration at `config`'s setting, or (`config.tune`) the search and its refit."""
    if config.tune:
        return tuning.calibrate_tuned(merged, heads=heads, merge_scaling=merge_scaling, **common)
    return core.calibrate_setting(merged, **common)


_warned: list[bool] = []


def _warn_return_result() -> None:
    """Once per process: `return_result` is a no-op kept so that callers passing it keep working."""
    if not _warned:
        _warned.append(True)
        warnings.warn("featcal.calibrate(return_result=...) is deprecated and does nothing: calibrate always "
                      "returns a CalibrationResult (the model is its .model)", DeprecationWarning, stacklevel=3)


def _checked_config(config: FeatCalConfig | None) -> FeatCalConfig:
    config = config if config is not None else FeatCalConfig()
    if not isinstance(config, FeatCalConfig):
        raise ConfigError(f"config must be a FeatCalConfig, not {type(config).__name__}")
    return config
