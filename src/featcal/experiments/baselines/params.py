"""Validated hyperparameters of each baseline, with the published defaults (see docs/baselines.md).

One schema per method (a seed is declared once, featcal.config.seed_field), so a bad value or an unknown option is refused with the same ConfigError
whether it came from Python, the CLI or a YAML file, before any model is loaded.
"""

from __future__ import annotations

from pydantic import Field

from featcal.config import FrozenStrictModel, seed_field


class SurgeryParams(FrozenStrictModel):
    """Representation Surgery (Yang et al., ICML 2024): defaults of the authors' code."""

    rank: int = Field(16, ge=1, description="bottleneck width of down/up projections")
    lr: float = Field(1e-3, gt=0.0, description="Adam learning rate (betas 0.9, 0.999; no weight decay)")
    steps: int = Field(500, ge=1, description="Adam steps per task (authors: 5 rounds x 100 batches)")
    batch_size: int = Field(16, ge=1, description="calibration examples per step")
    seed: int = seed_field("initialisation, batch order")


class ProbSurgeryParams(FrozenStrictModel):
    """ProbSurgery (Wei et al., ICML 2025): defaults of the authors' code."""

    rank: int = Field(128, ge=1, description="hidden width shared by the mean and log-variance heads")
    lr: float = Field(1e-3, gt=0.0, description="Adam learning rate (betas 0.9, 0.999; no weight decay)")
    steps: int = Field(500, ge=1, description="Adam steps per task (authors: 5 rounds x 100 batches)")
    batch_size: int = Field(16, ge=1, description="calibration examples per step")
    kl_weight: float = Field(1e-4, ge=0.0, description="weight of the KL term next to the L1 distance")
    seed: int = seed_field("initialisation, batch order, reparameterisation noise")
