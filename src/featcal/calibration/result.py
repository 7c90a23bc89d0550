"""What a calibration hands back: the calibrated model and what the run measured and kept."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn

if TYPE_CHECKING:
    from featcal.calibration.resume import ResumeStore


@dataclass(frozen=True)
class CalibrationResult:
    """The result of `featcal.calibrate(..., return_result=True)`.

    model: the calibrated model (the merged model's class; the merged model itself with `inplace=True`).
    drift: per calibrated block, {"block", "stack", "layer", "before", "after"} (engine.py).
    end_to_end: the merge's and the calibrated model's final-block drift {"merged", "calibrated", ...}
        (None where the engine did not measure it).
    resume_store: the per-block checkpoint store, kept only with `keep_resume_state=True` (the caller
        deletes it once its output is written), else None.
    tuning: with `config.tune`, the search's record (split, candidates, choice, seconds; tuning.py), what
        featcal.json records under "tuning"; else None.
    final_norm: with `config.calibrate_final_norm`, {"calibrated", "module", "kind", "tokens", "before",
        "after"} (the drift after the norm, as merged and solved), or {"calibrated": False, "why"} for a model
        without one; what featcal.json records under "final_norm"; else None.
    """

    model: nn.Module
    drift: list[dict[str, Any]]
    end_to_end: dict[str, Any] | None = None
    resume_store: ResumeStore | None = None
    tuning: dict[str, Any] | None = None
    final_norm: dict[str, Any] | None = None
    stem_norm: dict[str, Any] | None = None  # with `config.calibrate_stem_norm`: as final_norm, for the stem's norm
    # per stack, the modules of its blocks that keep their merged values and why (a mixture of experts' experts
    # and router, DINOv2's LayerScale, T5's position bias table): what featcal.json records under "kept_merged"
    kept_merged: dict[str, dict[str, str]] | None = None
    calibration_data: dict[str, dict[str, Any]] | None = None  # per task given as a source: how it was read

    def with_tuning(self, record: dict[str, Any]) -> CalibrationResult:
        """The same result carrying the tuning search's record."""
        return dataclasses.replace(self, tuning=record)
