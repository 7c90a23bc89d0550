"""The one strictness rule every option model follows, and the one way a validation error reaches the user.

Why one base: a NaN ρ, `--lambda-ratio inf` or YAML `scaling: true` (read as 1 by pydantic's lax mode) pass
every bound check and poison the work much later; before this base there were three, with different rules
for inf / NaN. Every option model of featcal (merge and FeatCal settings, the run file, the baselines' and the
merge methods' parameters, `featcal eval` and `featcal reproduce` options) derives from `StrictModel`.
"""

from __future__ import annotations

import types
import typing
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
)

from featcal.errors import ConfigError

# seeds feed torch.Generator.manual_seed (64-bit) and sha256-derived per-tensor seeds
MAX_SEED = 2**63 - 1
# calibration texts are cut to this many tokens unless told otherwise (--max-length, max_length=): one default
DEFAULT_MAX_LENGTH = 128


class StrictModel(BaseModel):
    """Unknown keys refused, no inf / NaN, no boolean where a number is meant, assignments validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, v: Any, info: ValidationInfo) -> Any:
        # pydantic's lax mode reads True as 1: YAML `scaling: true` would merge at scale 1.0
        if isinstance(v, bool) and info.field_name is not None:
            if _numeric(cls.model_fields[info.field_name].annotation):
                raise ValueError(f"Input should be a number, not the boolean {str(v).lower()}")
        return v


def _numeric(annotation: Any) -> bool:
    """int, float, or either of them `| None` (an optional number is a number when given)."""
    members = typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, types.UnionType) \
        else (annotation,)
    members = [m for m in members if m is not type(None)]
    return bool(members) and all(m in (int, float) for m in members)


class FrozenStrictModel(StrictModel):
    """A StrictModel whose instances do not change once validated (parameter sets passed around as values)."""

    model_config = ConfigDict(frozen=True, validate_assignment=False)


def _device_name(v: str) -> str:
    if v not in ("cpu", "cuda", "auto") and not v.startswith("cuda:"):
        raise ValueError(f"device must be cpu, cuda, cuda:N or auto, not {v!r}")
    return v


Device = Annotated[str, AfterValidator(_device_name)]  # a torch device name featcal runs on, or auto


def seed_field(description: str) -> Any:
    """The one declaration of a seed (MergeConfig, FeatCalConfig, WUDI's and the baselines' parameter models)."""
    return Field(0, ge=0, le=MAX_SEED, description=description)


def parse(model: type[BaseModel], data: dict[str, Any]):
    """Validate `data` into `model`, turning pydantic's errors into one readable ConfigError."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            where = ".".join(str(p) for p in err["loc"]) or model.__name__
            problems.append(f"{where}: {err['msg']}")
        raise ConfigError(f"invalid {model.__name__}: " + "; ".join(problems)) from None
