"""`featcal.calibrate`: the public entry point. Checks the request, then runs one calibration (core/setting.py)
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
  LoRA / PEFT adapter (refused without it).
- `out`: the folder `featcal calibrate --out` writes, by the same writer (pipeline.py: the weights in the merge's
  stored dtype or `dtype`, config and generation config, tokenizer and chat template, task heads, README.md model
  card, featcal.json), atomically; an existing non-empty folder is refused before any work unless `overwrite`.
  It takes checkpoints on disk or hub ids for `merged`, `base` and the experts, calibration sources (paths or hub
  dataset ids) and `heads` as head files (--tune-head), as the CLI does, so that featcal.json can name and hash
  every input; the data is read with the checkpoints' own tokenizer (`tokenizer` is refused), and the resume state
  is deleted once the folder is in place (`keep_resume_state` is refused). `hub_id` (role -> hub id; role "base"
  or an expert's name): how the card names an input whose own record names none (io/write/card.py). The result's
  `.model` is the calibrated model as written."""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

from featcal.calibration.core.inputs import ModelLike, adapter_reader, resolve_device
from featcal.calibration.core.result import CalibrationResult
from featcal.calibration.front.in_memory import calibrate_models, checked_config
from featcal.config import DEFAULT_MAX_LENGTH, FeatCalConfig, OutputOptions, parse, run_options
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
    out: str | os.PathLike | None = None,
    overwrite: bool = False,
    dtype: str | None = None,
    hub_id: Mapping[str, str] | None = None,
) -> CalibrationResult:
    """Calibrate a merged model toward its experts with FeatCal (docs/method.md); returns a CalibrationResult,
    whose `.model` is the calibrated model (a copy of a model passed as `merged` unless `inplace=True`).

    merged, base, experts: transformers models, or checkpoint paths / hub ids (read block by block from their
    safetensors, never loaded whole). calibration: per task, what `featcal calibrate --calib` takes, or
    model-ready batches. With `out`, also writes the folder `featcal calibrate --out` writes (the module docstring
    says what it takes, and what every other argument does).
    """
    if return_result is not None:
        _warn_return_result()
    config = checked_config(config)
    if out is not None:
        return _calibrate_into(merged, out, base=base, experts=experts, calibration=calibration, config=config,
                               progress=progress, allow_pickle=allow_pickle, check_finite=check_finite, heads=heads,
                               merge_scaling=merge_scaling, expert_kind=expert_kind, max_length=max_length,
                               allow_fewer=allow_fewer, overwrite=overwrite, dtype=dtype, hub_id=hub_id,
                               refused={"tokenizer": tokenizer is not None, "keep_resume_state": keep_resume_state})
    if dtype is not None or hub_id or overwrite:
        raise ConfigError("dtype=, hub_id= and overwrite= describe the folder calibrate writes: give out= too")
    return calibrate_models(merged, base=base, experts=experts, calibration=calibration, config=config,
                            progress=progress, inplace=inplace, allow_pickle=allow_pickle,
                            keep_resume_state=keep_resume_state, check_finite=check_finite, heads=heads,
                            merge_scaling=merge_scaling, expert_kind=expert_kind, tokenizer=tokenizer,
                            max_length=max_length, allow_fewer=allow_fewer)


def _calibrate_into(merged: ModelLike, out: str | os.PathLike, *, base: ModelLike | None,
                    experts: Mapping[str, ModelLike], calibration: Mapping[str, Any], heads: Mapping[str, Any] | None,
                    refused: Mapping[str, bool], **options: Any) -> CalibrationResult:
    """calibrate(..., out=): the CLI's pipeline (calibration/front/pipeline.py), which checks everything before any
    work, calibrates and writes the folder; refused (ConfigError) for what it cannot name in featcal.json."""
    from featcal.calibration.front.pipeline import CalibrateRequest, calibrate_to_dir

    given = [f"{name}=" for name, on in refused.items() if on]
    if given:
        raise ConfigError(f"calibrate(out=...) takes no {' or '.join(given)}: the folder is written as featcal "
                          "calibrate --out writes it (the data read with the checkpoints' own tokenizer, the resume "
                          "state deleted once it is in place)")
    if base is None:
        raise ConfigError("calibrate(out=...) needs base=: the folder's featcal.json names and hashes it")
    if not isinstance(experts, Mapping) or not isinstance(calibration, Mapping):
        raise ConfigError("calibrate(out=...): experts and calibration are mappings task -> checkpoint / data source")
    _paths_only("merged", {"": merged})
    _paths_only("base", {"": base})
    _paths_only("experts", experts)
    _paths_only("calibration", calibration)
    _paths_only("heads", heads or {})
    return calibrate_to_dir(CalibrateRequest(
        merged, base, experts, calibration, out, config=options["config"],
        options=run_options(**{k: options[k] for k in ("overwrite", "allow_pickle", "max_length", "allow_fewer")},
                            expert_kind=options["expert_kind"] or {}),
        outputs=parse(OutputOptions, {"dtype": options["dtype"], "hub_id": dict(options["hub_id"] or {})}),
        heads=heads, merge_scaling=options["merge_scaling"], check_finite=options["check_finite"],
        progress=options["progress"],
    )).result


def _paths_only(what: str, given: Mapping[str, Any]) -> None:
    """With out=, each of `given` must be a path or a hub id (featcal.json records and hashes it)."""
    for name, value in given.items():
        if not isinstance(value, (str, os.PathLike)):
            label = f"{what}[{name!r}]" if name else what
            raise ConfigError(f"calibrate(out=...): {label} is a {type(value).__name__}; out= takes checkpoints, data "
                              "and heads as paths or hub ids (what featcal.json names and hashes); for models or "
                              "data in memory, call calibrate without out= and save result.model yourself")


_warned: list[bool] = []


def _warn_return_result() -> None:
    """Once per process: `return_result` is a no-op kept so that callers passing it keep working."""
    if not _warned:
        _warned.append(True)
        warnings.warn("featcal.calibrate(return_result=...) is deprecated and does nothing: calibrate always "
                      "returns a CalibrationResult (the model is its .model)", DeprecationWarning, stacklevel=3)
