"""What a run is told besides the methods' parameters: how it reads its inputs (RunOptions), what the written
checkpoint holds (OutputOptions), and a whole YAML run file (RunConfig: merge or merged, calibrate, out)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, Field, field_validator, model_validator

from featcal.config.base import DEFAULT_MAX_LENGTH, StrictModel, parse
from featcal.config.featcal import FeatCalConfig
from featcal.config.merge import MergeConfig
from featcal.config.method_specs import MethodName
from featcal.errors import ConfigError


def _some_experts(v: dict[str, str]) -> dict[str, str]:
    if not v:
        raise ValueError("at least one expert is needed")
    return v


Experts = Annotated[dict[str, str], AfterValidator(_some_experts)]  # task -> checkpoint, at least one
# a run file's per-expert entry key -> the MergeConfig field that holds it
EXPERT_ENTRY_KEYS = {"weight": "weights", "density": "densities", "drop_rate": "drop_rates"}


class MergeSpec(StrictModel):
    """The merge section of a run file: inputs plus how to merge them (and, for RegMean, its data). An expert
    is a path, or an entry {path, weight, density, drop_rate} carrying its own recipe values."""

    base: str
    experts: Experts
    method: MethodName = "task_arithmetic"
    calibration: dict[str, str] | None = Field(None, description="RegMean(++): task -> calibration data")
    params: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _expert_entries(cls, data: Any) -> Any:
        """An expert given as {path, weight, density, drop_rate} (a per-expert entry) is its path, and its values
        go to params' weights / densities / drop_rates; naming one expert in both places is refused."""
        if not isinstance(data, Mapping) or not isinstance(data.get("experts"), Mapping):
            return data
        data, params = dict(data), dict(data.get("params") or {})
        experts = {}
        for name, entry in data["experts"].items():
            if not isinstance(entry, Mapping):
                experts[name] = entry
                continue
            unknown = sorted(set(entry) - {"path", *EXPERT_ENTRY_KEYS})
            if unknown or "path" not in entry:
                raise ValueError(f"expert {name!r}: an entry holds path (required) and optionally "
                                 f"{', '.join(EXPERT_ENTRY_KEYS)}" + (f", not {', '.join(unknown)}" if unknown else ""))
            experts[name] = entry["path"]
            for key, field in EXPERT_ENTRY_KEYS.items():
                if key in entry:
                    values = dict(params.get(field) or {})
                    if name in values:
                        raise ValueError(f"expert {name!r}: {key} is given both in its entry and in params.{field}")
                    params[field] = {**values, name: entry[key]}
        data["experts"], data["params"] = experts, params
        return data

    def merge_config(self) -> MergeConfig:
        return parse(MergeConfig, {"method": self.method, **self.params})


class CalibrateSpec(StrictModel):
    """The calibration section of a run file: data per task plus FeatCal hyperparameters."""

    calibration: dict[str, str]
    config: dict[str, Any] = Field(default_factory=dict)
    heads: dict[str, str] | None = Field(
        None, description="tune: task -> a classification head saved by featcal (safetensors), to score candidates "
        "by agreement with the experts' predictions"
    )

    def featcal_config(self) -> FeatCalConfig:
        return check_tune_options(parse(FeatCalConfig, self.config), "calibrate.config")


class MergedSpec(StrictModel):
    """A run file's `merged:` section, instead of `merge:`: an existing merge (featcal's, mergekit's, any) to
    calibrate, with the base and experts it was merged from."""

    path: str
    base: str
    experts: Experts


class RunOptions(StrictModel):
    """What a run is told besides the methods' parameters: how it reads its inputs and writes its output.

    The same model validates `featcal merge` / `calibrate` / `plan` flags (--overwrite, --allow-pickle,
    --max-length, --allow-fewer), the keywords of featcal.merge, and a run file's top-level keys. The torch
    device stays a FeatCalConfig field (`device`), where the calibration reads it.
    """

    concern: ClassVar[str] = "reading the inputs, writing the output"

    overwrite: bool = Field(False, description="replace a non-empty output directory (one featcal wrote)")
    allow_pickle: bool = Field(False, description="accept pickled (*.bin) checkpoints (read with weights_only)")
    max_length: int = Field(DEFAULT_MAX_LENGTH, description="truncate calibration texts to this many tokens")
    allow_fewer: bool = Field(
        False, description="use all examples of a task holding fewer than num_calibration_examples (with a warning)"
    )
    expert_kind: dict[str, Literal["full", "adapter"]] = Field(
        default_factory=dict, description="task -> full or adapter: how to read an expert folder holding both full "
        "weights and a LoRA / PEFT adapter (refused without it)",
        json_schema_extra={"flag": "--expert-kind", "metavar": "NAME=KIND"},
    )

    @field_validator("max_length")
    @classmethod
    def _at_least_one(cls, v: int) -> int:
        if v < 1:
            raise ValueError(f"max_length must be at least 1, got {v}")
        return v


OutputDtype = Literal["float32", "bfloat16", "float16"]


class OutputOptions(StrictModel):
    """What the written checkpoint holds besides the weights' values: `featcal merge` / `calibrate` flags
    (--dtype, --tokenizer-source, --hub-id), featcal.merge's and featcal.calibrate's keywords and a run file's
    top-level keys (mergekit's dtype, out_dtype and tokenizer_source)."""

    concern: ClassVar[str] = "the written checkpoint"

    dtype: OutputDtype | None = Field(
        None, description="floating dtype of the written weights (computed in float32 either way); unset: the "
        "base's (merge), the merged checkpoint's (calibrate)",
    )
    tokenizer_source: str | None = Field(
        None, min_length=1, description="merge: whose tokenizer the output carries: 'base' or an expert's name; "
        "unset: the base's, completed by what every expert agrees on and the base lacks (a chat template), and a "
        "conflict among the experts is refused (docs/outputs.md)",
    )
    hub_id: dict[str, str] = Field(
        default_factory=dict, description="the hub id the model card names an input by (ROLE: base or an expert's "
        "name), where its own record (a hub cache path, config.json's _name_or_path) names none; an input without "
        "one is named by a relative path, not in the card's base_model (docs/outputs.md)",
        json_schema_extra={"flag": "--hub-id", "metavar": "ROLE=ID"},
    )


class RunConfig(RunOptions, OutputOptions):
    """A whole `featcal run FILE.yaml`: merge (or take an existing merge), then optionally calibrate, into `out`;
    the run options (overwrite, allow_pickle, max_length, allow_fewer, dtype, tokenizer_source) are top-level
    keys. A mergekit YAML is translated into this first (featcal.merging.mergekit_config)."""

    merge: MergeSpec | None = None
    merged: MergedSpec | None = Field(None, description="an existing merge to calibrate, instead of `merge:`")
    calibrate: CalibrateSpec | None = None
    out: str

    @model_validator(mode="after")
    def _one_source_of_the_merge(self) -> RunConfig:
        if (self.merge is None) == (self.merged is None):
            raise ValueError("give either merge: (merge, then calibrate if asked) or merged: (an existing merge to "
                             "calibrate), not both" if self.merge is not None else "a run file needs merge: or merged:")
        if self.merged is not None and self.calibrate is None:
            raise ValueError("merged: names a merge to calibrate, so a calibrate: section is needed")
        if self.merged is not None and self.tokenizer_source is not None:
            raise ValueError("tokenizer_source applies to a merge; a merged: run keeps the merge's tokenizer")
        return self

    def run_options(self) -> RunOptions:
        return RunOptions(**{k: getattr(self, k) for k in RunOptions.model_fields})

    def output_options(self) -> OutputOptions:
        return OutputOptions(**{k: getattr(self, k) for k in OutputOptions.model_fields})


def check_tune_options(config: FeatCalConfig, where: str = "") -> FeatCalConfig:
    """Refuse tune_* options the user gave (CLI flags, a run file's calibrate.config) without `tune`: they only
    change how the search runs, so they would be silently ignored. The Python API's FeatCalConfig stays
    permissive: featcal's own refit builds such configs."""
    given = sorted(f for f in config.model_fields_set if f.startswith("tune_"))
    if given and not config.tune:
        at = f"{where}: " if where else ""
        raise ConfigError(f"{at}{', '.join(given)} given without tune: they only change how tune searches, so they "
                          "would be ignored; add tune (--tune, tune: true) or drop them")
    return config


def check_expert_kinds(kinds: Mapping[str, str], experts: Mapping[str, Any]) -> None:
    """Every task named by `expert_kind` (--expert-kind NAME=KIND) must be an expert: a typo would leave the
    folder it meant ambiguous."""
    unknown = [t for t in kinds if t not in experts]
    if unknown:
        raise ConfigError(f"expert_kind names {unknown[0]!r}, which is not an expert (experts are {list(experts)})")
    not_folders = [t for t in kinds if not isinstance(experts[t], (str, os.PathLike))]
    if not_folders:
        raise ConfigError(f"expert_kind names {not_folders[0]!r}, which is given as a "
                          f"{type(experts[not_folders[0]]).__name__}, not a folder: there is nothing to choose")


def run_options(**values: Any) -> RunOptions:
    """RunOptions from keyword values (CLI flags, featcal.merge's keywords), ConfigError on a bad one."""
    return parse(RunOptions, values)
