"""Calibrate models or checkpoints the caller holds, from data in memory or sources read here: what
`featcal.calibrate` does without `out=` (api.py), and what the pipeline runs on the merge it loaded before it
writes the folder (pipeline.py). Checks the request, reads the data (task_data.py), then runs one calibration
(core/setting.py) or the label-free hyperparameter search (tuning/); writes nothing."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from featcal.calibration import tuning
from featcal.calibration.core import setting as core
from featcal.calibration.core.inputs import ModelLike
from featcal.calibration.core.result import CalibrationResult
from featcal.calibration.front.task_data import resolve_calibration
from featcal.config import DEFAULT_MAX_LENGTH, FeatCalConfig, check_expert_kinds, run_options
from featcal.errors import ConfigError


def calibrate_models(
    merged: ModelLike, *, base: ModelLike | None, experts: Mapping[str, ModelLike],
    calibration: Mapping[str, Any | Iterable[Any]], config: FeatCalConfig | None = None, progress: bool = True,
    inplace: bool = False, allow_pickle: bool = False, keep_resume_state: bool = False, check_finite: bool = True,
    heads: Mapping[str, Any] | None = None, merge_scaling: float | None = None,
    expert_kind: Mapping[str, str] | None = None, tokenizer: Any = None, max_length: int = DEFAULT_MAX_LENGTH,
    allow_fewer: bool = False,
) -> CalibrationResult:
    """featcal.calibrate without `out=` (api.py's docstring says what each argument does)."""
    config = checked_config(config)
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


def checked_config(config: FeatCalConfig | None) -> FeatCalConfig:
    """`config`, or the default one; anything else refused."""
    config = config if config is not None else FeatCalConfig()
    if not isinstance(config, FeatCalConfig):
        raise ConfigError(f"config must be a FeatCalConfig, not {type(config).__name__}")
    return config
