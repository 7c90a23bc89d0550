"""Representation Surgery (Yang et al., ICML 2024, arXiv 2402.02705).

Per task t, a bottleneck on the merged model's final representation f estimates the representation
bias and removes it:  f' = f − up(ReLU(down(f))),  down: d→r, up: r→d, no biases, `up` zero-initialised
(so Surgery starts as the identity), `down` Kaiming-uniform (a=√5, PyTorch's Linear default).
Trained with Adam (lr 1e-3) on unlabeled calibration inputs to minimise the mean L1 distance between
f' and expert t's feature f_t on the same input; the merged backbone stays frozen. Inference needs
the task id: `apply(task, f)`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from featcal.config import parse
from featcal.experiments.baselines.params import SurgeryParams
from featcal.experiments.baselines.training import TaskData, cached_task_data, fit_modules


class SurgeryModule(nn.Module):
    """One task's bottleneck: forward(f) = f − up(ReLU(down(f)))."""

    def __init__(self, dim: int, rank: int, generator: torch.Generator | None = None) -> None:
        super().__init__()
        self.down = nn.Linear(dim, rank, bias=False)
        self.up = nn.Linear(rank, dim, bias=False)
        nn.init.kaiming_uniform_(self.down.weight, a=math.sqrt(5), generator=generator)
        nn.init.zeros_(self.up.weight)

    def bias(self, features: torch.Tensor) -> torch.Tensor:
        """The estimated representation bias of the merged features."""
        return self.up(F.relu(self.down(features)))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return features - self.bias(features)


class SurgeryModules:
    """Trained per-task modules (Surgery or ProbSurgery) and each task's training-loss history."""

    def __init__(self, modules: Mapping[str, nn.Module], history: Mapping[str, list[float]], params) -> None:
        self.modules = dict(modules)
        self.history = dict(history)
        self.params = params

    @property
    def tasks(self) -> list[str]:
        return list(self.modules)

    @torch.no_grad()
    def apply(self, task: str, features: torch.Tensor) -> torch.Tensor:
        """Corrected features for `task` (ProbSurgery: the mean of its bias distribution is removed)."""
        if task not in self.modules:
            from featcal.errors import ConfigError

            raise ConfigError(f"no surgery module for task {task!r}; trained tasks: {self.tasks}")
        module = self.modules[task]
        weight = next(module.parameters())
        return module(features.to(device=weight.device, dtype=weight.dtype)).to(features.device, features.dtype)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """All module weights, keyed `<task>.<param>` (for safetensors saving)."""
        return {f"{t}.{k}": v.detach().clone() for t, m in self.modules.items() for k, v in m.state_dict().items()}

    def num_parameters(self) -> int:
        return sum(p.numel() for m in self.modules.values() for p in m.parameters())


def surgery_loss(module: SurgeryModule):
    """Mean L1 distance between the corrected merged features and the expert's features."""

    def loss(merged: torch.Tensor, expert: torch.Tensor, _generator: torch.Generator) -> torch.Tensor:
        return F.l1_loss(module(merged), expert)

    return loss


def fit_surgery(
    merged_features: Mapping[str, torch.Tensor],
    expert_features: Mapping[str, torch.Tensor],
    rank: int = 16,
    lr: float = 1e-3,
    steps: int = 500,
    batch_size: int = 16,
    seed: int = 0,
) -> SurgeryModules:
    """Train one Surgery module per task on cached features [N_t, d]; deterministic given `seed`."""
    params = parse(SurgeryParams, dict(rank=rank, lr=lr, steps=steps, batch_size=batch_size, seed=seed))
    return train_surgery(cached_task_data(merged_features, expert_features), params)


def train_surgery(data: Mapping[str, TaskData], params: SurgeryParams, progress: bool = True) -> SurgeryModules:
    """Surgery on any per-task data source (cached or live features)."""
    modules, history = fit_modules(
        data, lambda dim, g: SurgeryModule(dim, params.rank, g), surgery_loss,
        lr=params.lr, steps=params.steps, batch_size=params.batch_size, seed=params.seed, desc="surgery",
        progress=progress,
    )
    return SurgeryModules(modules, history, params)
