"""The built-in merge methods: each one's registry entry (config/method_specs.py), in one table.

Every fact about a method lives in its entry: its kind, its one parameter model (made of MergeConfig's fields,
plus the method's own), whether it reads calibration data, whether it is a task-vector merge, the settings of
its paper and the paper. Adding a method is one registration: an entry here for a built-in method, or
`featcal.merging.register(...)` on its implementation for any other (docs/extending.md).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, Field, create_model
from pydantic.fields import FieldInfo

from featcal.config.base import StrictModel
from featcal.config.merge import MergeConfig, merge_field
from featcal.config.method_specs import MethodSpec, add_method, is_task_vector_merge


class MethodParams(StrictModel):
    """Base of a merge method's parameter model."""


# the methods' parameters that MergeConfig has no field for: a mergekit YAML's arithmetic (linear, task_arithmetic,
# ties, dare_ta, dare_ties; featcal.merging.mergekit_arithmetic, docs/mergekit.md)
METHOD_FIELDS: dict[str, FieldInfo] = {
    "mergekit_arithmetic": FieldInfo.from_annotated_attribute(
        Literal["float32", "float16", "bfloat16", "float64", "inputs"] | None,  # type: ignore[arg-type]
        Field(None, description="compute as mergekit 0.1.x does, in this dtype ('inputs': the inputs' own, "
              "promoted): its order of operations, its exactly-k per-tensor TIES trim (a descending argsort of "
              "|τ|), its sign election (a zero sum counts as +); a mergekit YAML sets it to its `dtype:`. Unset: "
              "featcal's float32 arithmetic (docs/mergekit.md)"),
    ),
}


def params_model(name: str, *fields: str, base: type[BaseModel] = MethodParams, **changes: Any) -> type[BaseModel]:
    """A parameter model made of MergeConfig's `fields` (their one declaration: default, bounds, description) and
    METHOD_FIELDS'; `changes` (field -> FieldInfo keywords, e.g. {"description": ...}) adjust a field for this
    model."""
    made: dict[str, Any] = {}
    for f in fields:
        info = METHOD_FIELDS[f] if f in METHOD_FIELDS else MergeConfig.model_fields[f]
        if f in changes:
            info = FieldInfo.merge_field_infos(info, **changes[f])
        made[f] = (info.annotation, info)
    return create_model(name, __base__=base, **made)


def _patterns(value: Any) -> Any:
    """Regexes of module names: a lone string is one pattern (not its letters); each must compile."""
    patterns = (value,) if isinstance(value, str) else value
    for p in patterns if isinstance(patterns, (list, tuple)) else ():
        try:
            re.compile(p)
        except (re.error, TypeError) as exc:
            raise ValueError(f"{p!r} is not a regular expression ({exc})") from None
    return patterns


ModulePatterns = Annotated[tuple[str, ...], BeforeValidator(_patterns)]
# options of a method's own that a report leaves out while at their defaults (recipes that do not use them are
# reported as before they existed)
REPORTED_WHEN_SET: tuple[str, ...] = ("weights", "densities", "drop_rates", "normalize", "ties_threshold",
                                      "dare_rescale", "exclude", "device", "mergekit_arithmetic")


class RegMeanParams(MethodParams):
    """RegMean (Jin et al., ICLR 2023) and RegMean++ (forward-order, merged-model inputs): which of the two is the
    method's name, not a parameter."""

    alpha: float = merge_field("alpha", description="scale of the off-diagonal Gram entries")
    exclude: ModulePatterns = Field((), description="regexes of Linear module names to average instead")


class WudiParams(MethodParams):
    """WUDI merging (Cheng et al., 2025): defaults of the published code (FusionBench)."""

    steps: int = merge_field("steps", description="Adam iterations per linear layer")
    lr: float = merge_field("lr", description="Adam learning rate, in parameter units")
    seed: int = merge_field("seed", description="kept for a uniform API; the method draws no random numbers")
    device: str = Field("cpu", description="torch device of the per-layer optimisation")
    exclude: ModulePatterns = Field((), description="regexes of Linear module names to average instead")


_TIES_OPTIONS = ("weights", "densities", "normalize", "ties_threshold")
_DARE_OPTIONS = ("weights", "drop_rates", "normalize", "dare_rescale")
_MERGEKIT = "mergekit_arithmetic"
_TA = "Ilharco et al., Editing Models with Task Arithmetic, ICLR 2023"
_TIES = "Yadav et al., TIES-Merging: Resolving Interference When Merging Models, NeurIPS 2023"
_DARE = "Yu et al., Language Models are Super Mario (DARE), ICML 2024"
_REGMEAN = "Jin et al., Dataless Knowledge Fusion by Merging Weights of Language Models, ICLR 2023"
BUILTIN_METHODS: tuple[MethodSpec, ...] = tuple(add_method(s) for s in (
    MethodSpec("average", "streaming", params_model("AverageParams"), defaults={},
               reference="Wortsman et al., Model soups, ICML 2022"),
    MethodSpec("linear", "streaming", params_model("LinearParams", "weights", "normalize", _MERGEKIT),
               reference="mergekit's linear merge (a weighted average)"),
    MethodSpec("task_arithmetic", "streaming",
               params_model("TaskArithmeticParams", "scaling", "weights", "normalize", _MERGEKIT),
               task_vector=True, defaults={"scaling": 0.3}, reference=_TA),
    MethodSpec("ties", "streaming", params_model("TiesParams", "scaling", "density", *_TIES_OPTIONS, _MERGEKIT),
               task_vector=True, defaults={"density": 0.2, "scaling": 1.0}, reference=_TIES),
    MethodSpec("dare_ta", "streaming", params_model("DareTaskArithmeticParams", "scaling", "drop_rate", "seed",
                                                    *_DARE_OPTIONS, _MERGEKIT),
               task_vector=True, defaults={"drop_rate": 0.5, "scaling": 0.3, "seed": 0}, reference=_DARE),
    MethodSpec("dare_ties", "streaming", params_model("DareTiesParams", "scaling", "density", "drop_rate", "seed",
                                                      *dict.fromkeys(_TIES_OPTIONS + _DARE_OPTIONS), _MERGEKIT),
               task_vector=True, defaults={"drop_rate": 0.5, "density": 0.2, "scaling": 1.0, "seed": 0},
               reference=_DARE),
    MethodSpec("regmean", "whole_model", RegMeanParams, needs_calibration=True, defaults={"alpha": 0.9},
               reference=_REGMEAN),
    MethodSpec("regmean++", "whole_model", RegMeanParams, needs_calibration=True, defaults={"alpha": 0.9},
               reference="RegMean++: RegMean with the merged model's own propagated inputs, blocks in forward "
               "order (2025)"),
    MethodSpec("wudi", "whole_model", WudiParams, defaults={},  # bench: steps from the preset (300: the authors')
               reference="Cheng et al., WUDI merging, 2025 (arXiv 2503.08099)"),
))
# Built-in methods only (the registry, method_names() / method_spec(), also holds methods registered later)
MERGE_METHODS: tuple[str, ...] = tuple(s.name for s in BUILTIN_METHODS)
# merges that read calibration data (the others are data-free and refuse it)
CALIBRATED_MERGE_METHODS: tuple[str, ...] = tuple(s.name for s in BUILTIN_METHODS if s.needs_calibration)
# merges computed on whole models (featcal.merging.model_mergers); `featcal bench` runs them as --baselines
WHOLE_MODEL_MERGE_METHODS: tuple[str, ...] = tuple(s.name for s in BUILTIN_METHODS if s.kind == "whole_model")
# task-vector merges θ0 + s·v of the built-in methods (any registered method: `is_task_vector_merge`)
TASK_VECTOR_METHODS: tuple[str, ...] = tuple(s.name for s in BUILTIN_METHODS if is_task_vector_merge(s.name))
