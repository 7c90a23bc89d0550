"""ProbSurgery (Wei et al., ICML 2025, "Representation Surgery in Model Merging with Probabilistic Modeling").

Same place as Surgery, but the representation bias is a Gaussian per sample:
    h = ReLU(down(f)),  μ = mean(h),  log σ² = logvar(h)       (down: d→r, mean/logvar: r→d, no biases)
    training:  z = μ + ε·exp(½ log σ²), ε ~ N(0, I);  f' = f − z
    loss = mean_{B,d} |f' − f_t|  +  kl_weight · KL,
    KL = mean_B [ −½ Σ_d (1 + log σ² − μ² − σ²) ]   (KL(N(μ, σ²) ‖ N(0, I)), summed over d, mean over batch)
    inference: f' = f − μ (the mean of the bias distribution).
Defaults of the authors' code: r = 128, kl_weight = 1e-4, Adam lr 1e-3, `down` Kaiming-uniform,
both heads zero-initialised (so inference starts as the identity; the training samples start at σ = 1).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from featcal.config import parse
from featcal.experiments.baselines.params import ProbSurgeryParams
from featcal.experiments.baselines.surgery import SurgeryModules
from featcal.experiments.baselines.training import TaskData, cached_task_data, fit_modules


class ProbSurgeryModule(nn.Module):
    """One task's probabilistic bias model; forward(f) = f − μ(f) (inference)."""

    def __init__(self, dim: int, rank: int, generator: torch.Generator | None = None) -> None:
        super().__init__()
        self.down = nn.Linear(dim, rank, bias=False)
        self.mean = nn.Linear(rank, dim, bias=False)
        self.logvar = nn.Linear(rank, dim, bias=False)
        nn.init.kaiming_uniform_(self.down.weight, a=math.sqrt(5), generator=generator)
        nn.init.zeros_(self.mean.weight)
        nn.init.zeros_(self.logvar.weight)

    def moments(self, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = F.relu(self.down(features))
        return self.mean(h), self.logvar(h)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        mu, _ = self.moments(features)
        return features - mu


def kl_standard_normal(mu: torch.Tensor, logvar: torch.Tensor) -> torch.Tensor:
    """KL(N(μ, σ²) ‖ N(0, I)) summed over features, averaged over the batch."""
    return torch.mean(-0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp(), dim=1))


def probsurgery_loss(module: ProbSurgeryModule, kl_weight: float):
    """L1 between (f − reparameterised sample) and the expert's features, plus the weighted KL."""

    def loss(merged: torch.Tensor, expert: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        mu, logvar = module.moments(merged)
        eps = torch.randn(mu.shape, generator=generator, dtype=mu.dtype)
        z = mu + eps * torch.exp(0.5 * logvar)
        return F.l1_loss(merged - z, expert) + kl_weight * kl_standard_normal(mu, logvar)

    return loss


def fit_probsurgery(
    merged_features: Mapping[str, torch.Tensor],
    expert_features: Mapping[str, torch.Tensor],
    rank: int = 128,
    lr: float = 1e-3,
    steps: int = 500,
    batch_size: int = 16,
    kl_weight: float = 1e-4,
    seed: int = 0,
) -> SurgeryModules:
    """Train one ProbSurgery module per task on cached features [N_t, d]; deterministic given `seed`."""
    params = parse(
        ProbSurgeryParams,
        dict(rank=rank, lr=lr, steps=steps, batch_size=batch_size, kl_weight=kl_weight, seed=seed),
    )
    return train_probsurgery(cached_task_data(merged_features, expert_features), params)


def train_probsurgery(data: Mapping[str, TaskData], params: ProbSurgeryParams,
                      progress: bool = True) -> SurgeryModules:
    """ProbSurgery on any per-task data source (cached or live features)."""
    modules, history = fit_modules(
        data, lambda dim, g: ProbSurgeryModule(dim, params.rank, g),
        lambda m: probsurgery_loss(m, params.kl_weight),
        lr=params.lr, steps=params.steps, batch_size=params.batch_size, seed=params.seed, desc="probsurgery",
        progress=progress,
    )
    return SurgeryModules(modules, history, params)
