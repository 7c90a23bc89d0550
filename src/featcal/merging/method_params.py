"""Validated hyperparameters of the data-assisted merges RegMean(++) and WUDI, with the published defaults.

The parameters MergeConfig also has (alpha, steps, lr, seed) take its declaration (default and bounds); the
others (plus_plus, exclude, device) are the algorithms' own.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from featcal.config import merge_field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RegMeanParams(_Strict):
    """RegMean (Jin et al., ICLR 2023) and RegMean++ (forward-order, merged-model inputs)."""

    alpha: float = merge_field("alpha", description="scale of the off-diagonal Gram entries")
    plus_plus: bool = Field(False, description="RegMean++: Grams from the merged model's own propagated inputs")
    exclude: tuple[str, ...] = Field((), description="regexes of Linear module names to average instead")


class WudiParams(_Strict):
    """WUDI merging (Cheng et al., 2025): defaults of the published code (FusionBench)."""

    steps: int = merge_field("steps", description="Adam iterations per linear layer")
    lr: float = merge_field("lr", description="Adam learning rate, in parameter units")
    seed: int = merge_field("seed", description="kept for a uniform API; the method draws no random numbers")
    device: str = Field("cpu", description="torch device of the per-layer optimisation")
    exclude: tuple[str, ...] = Field((), description="regexes of Linear module names to average instead")
