"""Validated hyperparameters of each baseline, with the published defaults (see docs/baselines.md).

One schema per method, so a bad value or an unknown option is refused with the same ConfigError
whether it came from Python, the CLI or a YAML file, before any model is loaded.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SurgeryParams(_Strict):
    """Representation Surgery (Yang et al., ICML 2024): defaults of the authors' code."""

    rank: int = Field(16, ge=1, description="bottleneck width of down/up projections")
    lr: float = Field(1e-3, gt=0.0, description="Adam learning rate (betas 0.9, 0.999; no weight decay)")
    steps: int = Field(500, ge=1, description="Adam steps per task (authors: 5 rounds x 100 batches)")
    batch_size: int = Field(16, ge=1, description="calibration examples per step")
    seed: int = Field(0, ge=0, description="initialisation, batch order")


class ProbSurgeryParams(_Strict):
    """ProbSurgery (Wei et al., ICML 2025): defaults of the authors' code."""

    rank: int = Field(128, ge=1, description="hidden width shared by the mean and log-variance heads")
    lr: float = Field(1e-3, gt=0.0, description="Adam learning rate (betas 0.9, 0.999; no weight decay)")
    steps: int = Field(500, ge=1, description="Adam steps per task (authors: 5 rounds x 100 batches)")
    batch_size: int = Field(16, ge=1, description="calibration examples per step")
    kl_weight: float = Field(1e-4, ge=0.0, description="weight of the KL term next to the L1 distance")
    seed: int = Field(0, ge=0, description="initialisation, batch order, reparameterisation noise")


class RegMeanParams(_Strict):
    """RegMean (Jin et al., ICLR 2023) and RegMean++ (forward-order, merged-model inputs)."""

    alpha: float = Field(0.9, ge=0.0, le=1.0, description="scale of the off-diagonal Gram entries")
    plus_plus: bool = Field(False, description="RegMean++: Grams from the merged model's own propagated inputs")
    exclude: tuple[str, ...] = Field((), description="regexes of Linear module names to average instead")


class WudiParams(_Strict):
    """WUDI merging (Cheng et al., 2025): defaults of the published code (FusionBench)."""

    steps: int = Field(300, ge=0, description="Adam iterations per linear layer")
    lr: float = Field(1e-5, gt=0.0, description="Adam learning rate, in parameter units")
    seed: int = Field(0, ge=0, description="kept for a uniform API; the method draws no random numbers")
    device: str = Field("cpu", description="torch device of the per-layer optimisation")
    exclude: tuple[str, ...] = Field((), description="regexes of Linear module names to average instead")
