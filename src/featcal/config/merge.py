"""How to merge: `MergeConfig`, the one schema of the merge methods' hyperparameters (each method's own parameter
model takes its fields from here: config/methods.py), and of the RegMean merges' calibration data (DataOptions)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo

from featcal.config.base import parse, seed_field
from featcal.config.data import DataOptions
from featcal.config.method_specs import MethodName, find_method, method_spec


def _per_expert(low: float, high: float, low_open: bool = False, high_open: bool = False):
    """A validator of an expert name -> number mapping: numbers (not booleans), finite, within the bounds; the
    error names the expert (and the field, which a nested location would hide)."""

    def check(v: Any) -> Any:
        if not isinstance(v, Mapping):
            raise ValueError(f"a mapping of expert name -> number, not {v!r}")
        for name, x in v.items():
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
                raise ValueError(f"expert {name!r}: a finite number, not {x!r}")
            if x < low or x > high or (low_open and x == low) or (high_open and x == high):
                raise ValueError(f"expert {name!r}: {x!r} is outside {'(' if low_open else '['}{low:g}, {high:g}"
                                 f"{')' if high_open else ']'}")
        return {str(k): float(x) for k, x in v.items()}

    return BeforeValidator(check)


# per-expert values; mergekit allows negative weights (task negation)
Weight = Annotated[dict[str, float], _per_expert(-100.0, 100.0)]
Densities = Annotated[dict[str, float], _per_expert(0.0, 1.0, low_open=True)]
DropRates = Annotated[dict[str, float], _per_expert(0.0, 1.0, high_open=True)]
# MergeConfig fields that are left out of a report's params while at their defaults
RECIPE_OPTIONS: tuple[str, ...] = ("weights", "densities", "drop_rates", "normalize", "ties_threshold", "dare_rescale")


class MergeConfig(DataOptions):
    """How to merge: the method and its hyperparameters (unused ones are ignored by the method), and how the
    merges that read calibration data (RegMean, RegMean++) read it (DataOptions, shared with FeatCal).

    The fields are the one declaration of the built-in methods' hyperparameters; each method's own parameter model
    (MethodSpec.params) takes its fields from here. A method registered with a parameter model of its own may
    declare further parameters: given here as keywords (or a run file's merge.params), they land in
    `method_options` and are validated by that model.
    """

    concern: ClassVar[str] = "merge method and hyperparameters"

    method: MethodName = Field("task_arithmetic", description="merge method, one of the registry's (method_names())")
    scaling: float = Field(0.3, gt=0.0, le=10.0, description="s in θ0 + s·Σ(θt−θ0) (TA, TIES, DARE)")
    density: float = Field(0.2, gt=0.0, le=1.0, description="TIES: fraction of each task vector kept")
    drop_rate: float = Field(0.5, ge=0.0, lt=1.0, description="DARE: probability p of dropping an entry")
    seed: int = seed_field(
        "DARE: seed of the drop masks; RegMean(++): which calibration examples are drawn; "
        "WUDI: recorded only (it draws no random numbers)",
    )
    alpha: float = Field(0.9, ge=0.0, le=1.0, description="RegMean(++): scale of the Grams' off-diagonal entries")
    steps: int = Field(300, ge=0, description="WUDI: Adam iterations per Linear weight")
    lr: float = Field(1e-5, gt=0.0, description="WUDI: Adam learning rate, in parameter units")
    method_options: dict[str, Any] = Field(
        default_factory=dict, description="parameters of the method's own parameter model that MergeConfig has no "
        "field for (RegMean's and WUDI's exclude, WUDI's device, a registered method's own)",
        json_schema_extra={"flag": None},  # given as keywords (a run file's merge.params), validated by that model
    )
    # --- the recipe's per-expert and mergekit-compatible options (docs/mergekit.md); omitted from featcal.json's
    # params while at their defaults, so that a recipe that does not use them is reported as before
    weights: Weight = Field(
        default_factory=dict, description="per-expert weight w_t (experts not listed: 1): θ0 + s·Σ w_t·τ_t (TA, "
        "TIES, DARE), Σ w_t·θ_t (linear)", json_schema_extra={"flag": "--weight", "metavar": "NAME=W"},
    )
    densities: Densities = Field(
        default_factory=dict, description="per-expert TIES density (experts not listed: density)",
        json_schema_extra={"flag": "--expert-density", "metavar": "NAME=D"},
    )
    drop_rates: DropRates = Field(
        default_factory=dict, description="per-expert DARE drop rate (experts not listed: drop_rate)",
        json_schema_extra={"flag": "--expert-drop-rate", "metavar": "NAME=P"},
    )
    normalize: bool | None = Field(
        None, description="divide the weighted sum of task vectors by the sum of the weights (TIES: of the agreeing "
        "ones); unset: the method's default (task_arithmetic, dare_ta: no; ties, dare_ties, linear: yes)",
    )
    ties_threshold: Literal["global", "per_tensor"] = Field(
        "global", description="TIES trim: 'global' keeps each expert's top-density entries of its whole task vector "
        "(the TIES paper's Algorithm 1), 'per_tensor' those of each tensor, k = max(1, floor(density·n)) "
        "(mergekit's ties)",
    )
    dare_rescale: Literal["inverse", "l1", "none"] = Field(
        "inverse", description="DARE: rescale the kept entries by 1/(1−p) ('inverse', the DARE paper), so that the "
        "tensor keeps its L1 norm ('l1', mergekit's), or not at all",
    )

    @model_validator(mode="before")
    @classmethod
    def _own_parameters(cls, data: Any) -> Any:
        """Keywords this schema lacks but the selected method's parameter model declares go to method_options."""
        if not isinstance(data, Mapping):
            return data
        method = data.get("method", "task_arithmetic")
        spec = find_method(method)
        own = [k for k in data if spec is not None and k not in cls.model_fields and k in spec.params.model_fields]
        if not own:
            return data
        data = dict(data)
        data["method_options"] = {**(data.get("method_options") or {}), **{k: data.pop(k) for k in own}}
        return data

    @field_validator("method_options")
    @classmethod
    def _method_options_valid(cls, v: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        # the selected method's own model validates them, with the fields above (a registered method's own bounds)
        spec = find_method(info.data.get("method", ""))
        if spec is not None:
            shared = {k: info.data[k] for k in spec.params.model_fields if k in info.data and k != "method_options"}
            try:
                spec.params.model_validate({**shared, **v})
            except ValidationError as exc:
                raise ValueError("; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())) from None
        return v

    def method_params(self) -> BaseModel:
        """The selected method's parameter model, validated from this config (ConfigError on a bad value)."""
        spec = method_spec(self.method)
        shared = {k: getattr(self, k) for k in spec.params.model_fields if k in type(self).model_fields}
        return parse(spec.params, {**shared, **self.method_options})


def merge_field(name: str, **changes: Any) -> Any:
    """MergeConfig's field `name` (default, bounds, description) for another model that has the same parameter,
    with `changes` (FieldInfo keywords, e.g. description=...) applied."""
    info = MergeConfig.model_fields[name]
    return FieldInfo.merge_field_infos(info, **changes) if changes else info
