"""The one calibration batch type, and what callers may hand in instead.

`Batch` is what the calibrator runs and every loader produces: a dict of model keyword inputs
(pixel_values; or input_ids, attention_mask[, decoder_input_ids, ...]). `BatchLike` is what the
in-memory entry points (merges that read data, the baselines) also accept: a bare tensor, passed to the
model positionally (e.g. pixel values), or any mapping of keyword inputs. `as_batches` turns one task's
data into a list of `BatchLike`, a lone batch becoming a list of one.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Union

import torch

from featcal.errors import CalibrationDataError

Batch = dict[str, torch.Tensor]
BatchLike = Union[torch.Tensor, Mapping[str, Any]]


def batch_size(batch: BatchLike) -> int:
    """Number of examples in a batch (first dimension of its first tensor)."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 0
    for v in batch.values():
        if isinstance(v, torch.Tensor) and v.dim():
            return int(v.shape[0])
    raise CalibrationDataError(f"batch with keys {sorted(batch)} holds no tensor")


def as_batches(data: BatchLike | Iterable[BatchLike], task: str) -> list[BatchLike]:
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
