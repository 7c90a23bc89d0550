"""Accuracy of a baseline predictor with a frozen task head, the same call for every kind of baseline.

The benchmark's heads read pooled features; a merge baseline's features are its model's, a surgery
baseline's are the merged model's corrected for the task. `BaselineResult.features` hides the
difference, so this one function scores all five baselines against the heads the zoo ships.
"""

from __future__ import annotations

import torch
from torch import nn

from featcal.evaluation.metrics import accuracy
from featcal.experiments.baselines.api import BaselineResult


@torch.no_grad()
def task_accuracy(
    result: BaselineResult,
    task: str,
    head: nn.Module,
    inputs: torch.Tensor,
    labels: torch.Tensor,
    batch_size: int = 256,
    input_name: str = "pixel_values",
) -> float:
    """Top-1 accuracy in [0, 1] of head(result.features(task, batch)) over `inputs` (first dim: examples)."""
    y = torch.as_tensor(labels)
    if len(y) == 0 or len(y) != len(inputs):
        raise ValueError(f"task {task!r}: {len(inputs)} inputs and {len(y)} labels")
    result.model.eval()
    preds = [
        head(result.features(task, {input_name: inputs[i : i + batch_size]})).argmax(-1)
        for i in range(0, len(inputs), batch_size)
    ]
    return accuracy(torch.cat(preds), y)
