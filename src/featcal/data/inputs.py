"""What every baseline takes in: models (objects or checkpoint paths) and per-task calibration batches.

The baselines accept the same calibration data as FeatCal: a mapping task -> batches, where a batch
is a tensor (passed positionally, e.g. pixel values) or a dict of model keyword arguments. A single
batch is accepted where a list of batches is, so small tests stay short. Everything here checks its
input before any forward pass, so a bad task name or a mismatched checkpoint fails in milliseconds.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from typing import Union

import torch
from torch import nn

from featcal.data.batch import BatchLike, as_batches, batch_size
from featcal.errors import CalibrationDataError, CheckpointError

ModelLike = Union[nn.Module, str, os.PathLike]
FeatureFn = Callable[[nn.Module, BatchLike], torch.Tensor]

__all__ = ["BatchLike", "FeatureFn", "ModelLike", "as_batches", "batch_size", "calibration_batches", "call_model",
           "load", "load_family", "model_device", "pooled_features", "to_device", "validate_family_inputs"]


def calibration_batches(
    calibration: Mapping[str, BatchLike | Iterable[BatchLike]] | None, tasks: Iterable[str]
) -> dict[str, list[BatchLike]]:
    """Per-task batch lists for exactly `tasks`; a missing task is an error that names it."""
    if calibration is None:
        raise CalibrationDataError("this baseline needs calibration data (task -> batches); none was given")
    if not isinstance(calibration, Mapping):
        raise CalibrationDataError(
            f"calibration must map task names to batches, not be a {type(calibration).__name__}"
        )
    tasks = list(tasks)
    missing = [t for t in tasks if t not in calibration]
    if missing:
        raise CalibrationDataError(
            f"no calibration data for task(s) {', '.join(map(repr, missing))}; "
            f"calibration has {', '.join(map(repr, calibration)) or 'nothing'}"
        )
    return {t: as_batches(calibration[t], t) for t in tasks}


def to_device(batch: BatchLike, device: torch.device | str) -> BatchLike:
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def call_model(model: nn.Module, batch: BatchLike):
    """Run `model` on a batch: a dict is spread as keyword arguments, a tensor passed positionally."""
    if isinstance(batch, torch.Tensor):
        return model(batch)
    return model(**batch)


def pooled_features(model: nn.Module, batch: BatchLike) -> torch.Tensor:
    """Default feature function: the model output's `pooler_output` (CLIP/ViT/BERT pooled features)."""
    out = call_model(model, batch)
    pooled = getattr(out, "pooler_output", None)
    if pooled is None:
        raise CalibrationDataError(
            f"{type(model).__name__} returns no pooler_output; pass feature_fn(model, batch) -> [B, d] "
            "saying which representation the surgery modules should correct"
        )
    return pooled


def load(model: ModelLike, what: str) -> nn.Module:
    """A model object as is, or a checkpoint path loaded through featcal's one safe loader."""
    if isinstance(model, nn.Module):
        return model
    if isinstance(model, (str, os.PathLike)):
        from featcal.io.read.models import load_model

        return load_model(model)
    raise CheckpointError(f"{what} must be a model or a checkpoint path, not {type(model).__name__}")


def validate_family_inputs(base: ModelLike, experts: Mapping[str, ModelLike]) -> None:
    """The merge library's family check (config, tensor names, shapes, finite values), before any load.

    Checkpoint paths are checked from their headers and streamed one tensor at a time, so a bad third
    expert is refused before the first one is even loaded.
    """
    from featcal.io.read.family import open_family
    from featcal.io.read.validate import validate_family

    if not isinstance(experts, Mapping) or not experts:
        raise CheckpointError("experts must be a non-empty mapping task -> model or checkpoint path")
    family = open_family(base, experts)
    validate_family(family.base, family.experts)


def load_family(base: ModelLike, experts: Mapping[str, ModelLike]) -> tuple[nn.Module, dict[str, nn.Module]]:
    """Base and experts as models, validated as one family first."""
    validate_family_inputs(base, experts)
    return load(base, "base"), {t: load(m, f"expert {t!r}") for t, m in experts.items()}


def model_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")
