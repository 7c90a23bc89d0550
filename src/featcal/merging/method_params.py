"""Validated hyperparameters of the data-assisted merges RegMean(++) and WUDI, with the published defaults."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


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
