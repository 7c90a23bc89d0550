"""What every baseline takes in: models (objects or checkpoint paths) and per-task calibration batches.

The baselines accept the same calibration data as FeatCal: a mapping task -> batches, where a batch
is a tensor (passed positionally, e.g. pixel values) or a dict of model keyword arguments. A single
batch is accepted where a list of batches is, so small tests stay short. Everything here checks its
input before any forward pass, so a bad task name or a mismatched checkpoint fails in milliseconds.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Union

import torch
from torch import nn

from featcal.errors import CalibrationDataError, CheckpointError

Batch = Union[torch.Tensor, Mapping[str, Any]]
ModelLike = Union[nn.Module, str, os.PathLike]
FeatureFn = Callable[[nn.Module, Batch], torch.Tensor]


def as_batches(data: Batch | Iterable[Batch], task: str) -> list[Batch]:
    """Normalise one task's calibration data to a list of batches (a lone batch becomes a list of one)."""
    if isinstance(data, (torch.Tensor, Mapping)):
        batches = [data]
    else:
        try:
            batches = list(data)
        except TypeError:
            raise CalibrationDataError(
                f"calibration data for task {task!r} must be a tensor, a dict of model inputs, or a list "
                f"of those, not {type(data).__name__}"
            ) from None
    if not batches:
        raise CalibrationDataError(f"calibration data for task {task!r} is empty")
    for i, b in enumerate(batches):
        if not isinstance(b, (torch.Tensor, Mapping)):
            raise CalibrationDataError(
                f"batch {i} of task {task!r} is a {type(b).__name__}; expected a tensor or a dict of model inputs"
            )
        if batch_size(b) == 0:
            raise CalibrationDataError(f"batch {i} of task {task!r} holds no examples")
    return batches


def calibration_batches(
    calibration: Mapping[str, Batch | Iterable[Batch]] | None, tasks: Iterable[str]
) -> dict[str, list[Batch]]:
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


def batch_size(batch: Batch) -> int:
    """Number of examples in a batch (first dimension of its first tensor)."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 0
    for v in batch.values():
        if isinstance(v, torch.Tensor) and v.dim():
            return int(v.shape[0])
    raise CalibrationDataError(f"batch with keys {sorted(batch)} holds no tensor")


def to_device(batch: Batch, device: torch.device | str) -> Batch:
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def call_model(model: nn.Module, batch: Batch):
    """Run `model` on a batch: a dict is spread as keyword arguments, a tensor passed positionally."""
    if isinstance(batch, torch.Tensor):
        return model(batch)
    return model(**batch)


def pooled_features(model: nn.Module, batch: Batch) -> torch.Tensor:
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
        from featcal.io.models import load_model

        return load_model(model)
    raise CheckpointError(f"{what} must be a model or a checkpoint path, not {type(model).__name__}")


def validate_family_inputs(base: ModelLike, experts: Mapping[str, ModelLike]) -> None:
    """The merge library's family check (config, tensor names, shapes, finite values), before any load.

    Checkpoint paths are checked from their headers and streamed one tensor at a time, so a bad third
    expert is refused before the first one is even loaded.
    """
    from featcal.io.inputs import open_source
    from featcal.io.validate import validate_family

    if not isinstance(experts, Mapping) or not experts:
        raise CheckpointError("experts must be a non-empty mapping task -> model or checkpoint path")
    validate_family(
        open_source(base, label="base"),
        {t: open_source(m, label=f"expert {t!r}") for t, m in experts.items()},
    )


def load_family(base: ModelLike, experts: Mapping[str, ModelLike]) -> tuple[nn.Module, dict[str, nn.Module]]:
    """Base and experts as models, validated as one family first."""
    validate_family_inputs(base, experts)
    return load(base, "base"), {t: load(m, f"expert {t!r}") for t, m in experts.items()}


def model_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")
