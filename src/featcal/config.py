"""One validated schema behind the Python API, the CLI flags and YAML run files.

Every option featcal accepts is a field here, with its default and its valid range, so that a bad
value is rejected with the same message whichever way it arrived, before any work starts.
"""

from __future__ import annotations

import math
import os
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    create_model,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo

from featcal.errors import ConfigError

# seeds feed torch.Generator.manual_seed (64-bit) and sha256-derived per-tensor seeds
MAX_SEED = 2**63 - 1
MAX_LAMBDA_RATIO = 100.0
MAX_COVARIANCE_EPS = 0.01
DEFAULT_TUNE_BUDGET = 10.0  # --tune-budget default: at most ~10 calibrations' cost, the refit included
DEFAULT_TUNE_HOLDOUT = 0.25  # --tune-holdout default: the share of each task's examples held out (one split)
TuneKnob = Literal["merge_scaling", "anchor_blend_rho", "lambda_ratio", "teacher_interp_alpha"]  # what --tune searches


def seed_field(description: str) -> Any:
    """The one declaration of a seed (MergeConfig, FeatCalConfig, WUDI's and the baselines' parameter models)."""
    return Field(0, ge=0, le=MAX_SEED, description=description)


def merge_field(name: str, **changes: Any) -> Any:
    """MergeConfig's field `name` (default, bounds, description) for another model that has the same parameter,
    with `changes` (FieldInfo keywords, e.g. description=...) applied."""
    info = MergeConfig.model_fields[name]
    return FieldInfo.merge_field_infos(info, **changes) if changes else info


class _Strict(BaseModel):
    # allow_inf_nan=False: `--lambda-ratio inf` or a NaN ρ would pass every bound check and poison the solves
    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, v: Any, info: ValidationInfo) -> Any:
        # pydantic's lax mode reads True as 1: YAML `scaling: true` would merge at scale 1.0
        if isinstance(v, bool) and info.field_name is not None:
            if cls.model_fields[info.field_name].annotation in (int, float):
                raise ValueError(f"Input should be a number, not the boolean {str(v).lower()}")
        return v


# --- merge methods: the registry ---------------------------------------------------------------------------------

MethodKind = Literal["streaming", "whole_model"]


@dataclass(frozen=True)
class MethodSpec:
    """One merge method of the registry (mergekit's explicit method list is the model).

    `kind`: "streaming" (one tensor at a time) or "whole_model" (computed on whole models, then written tensor by
    tensor); `params`: the pydantic model of the hyperparameters the method reads (built-in methods: a subset of
    MergeConfig's fields, see `params_model`); `needs_calibration`: reads calibration data (the others refuse it);
    `implementation`: the featcal.merging.method.Merger subclass, bound by `featcal.merging.register` (the
    built-in ones when featcal.merging.registry is imported; declared here so that validating a MergeConfig
    needs neither torch nor the merging package).
    """

    name: str
    kind: MethodKind
    params: type[BaseModel]
    needs_calibration: bool = False
    implementation: type | None = None


_METHODS: dict[str, MethodSpec] = {}


def method_names() -> list[str]:
    """Every registered merge method, sorted: what MergeConfig.method, `featcal merge --method` and a run file's
    merge.method accept."""
    return sorted(_METHODS)


def unknown_method_message(method: object) -> str:
    return f"unknown merge method {method!r}; valid methods: {', '.join(method_names())}"


def method_spec(method: str) -> MethodSpec:
    """The registry entry of `method` (ConfigError listing the registered methods if there is none)."""
    spec = _METHODS.get(method) if isinstance(method, str) else None
    if spec is None:
        raise ConfigError(unknown_method_message(method))
    return spec


def find_method(method: str) -> MethodSpec | None:
    """The registry entry of `method`, None if there is none."""
    return _METHODS.get(method)


def add_method(spec: MethodSpec) -> MethodSpec:
    """Add `spec` to the registry, or bind the implementation of a method declared without one. A second
    implementation of one name, or one of another kind than declared, is a ValueError (used by
    featcal.merging.register)."""
    old = _METHODS.get(spec.name)
    if old is not None:
        if old.implementation is not None and spec.implementation is not old.implementation:
            raise ValueError(f"merge method {spec.name!r} is already registered by {old.implementation.__name__}")
        if (old.kind, old.needs_calibration) != (spec.kind, spec.needs_calibration):
            raise ValueError(
                f"merge method {spec.name!r} is declared {old.kind} (needs_calibration={old.needs_calibration}), "
                f"not {spec.kind} (needs_calibration={spec.needs_calibration})"
            )
    _METHODS[spec.name] = spec
    return spec


def _registered(method: str) -> str:
    if method not in _METHODS:
        raise ValueError(unknown_method_message(method))
    return method


# a merge method's name, checked against the registry when validated (a method registered later is accepted)
MethodName = Annotated[str, AfterValidator(_registered)]
# Deprecated alias (it was a Literal of the built-in names): any registered name, see method_names()
MergeMethod = MethodName


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


class MergeConfig(_Strict):
    """How to merge: the method and its hyperparameters (unused ones are ignored by the method).

    The fields are the one declaration of the built-in methods' hyperparameters; each method's own parameter model
    (MethodSpec.params) takes its fields from here. A method registered with a parameter model of its own may
    declare further parameters: given here as keywords (or a run file's merge.params), they land in
    `method_options` and are validated by that model.
    """

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
    num_calibration_examples: int = Field(
        256, ge=1, description="RegMean(++): calibration examples per task (left at the default: at most that many)"
    )
    calibration_batch_size: int = Field(16, ge=1, description="RegMean(++): examples per forward")
    text_column: str | None = Field(
        None, min_length=1, description="RegMean(++): the column of JSONL / parquet / saved-dataset data holding "
        "the texts; unset: a column named text, sentence, ..., else the one candidate string column (several are "
        "refused)",
    )
    allow_test_split: bool = Field(
        False, description="RegMean(++): accept a saved dataset of test data (its only split 'test', or saved from "
        "a test split) as calibration data"
    )
    text_unit: Literal["line", "paragraph", "file"] | None = Field(
        None, description="RegMean(++): one example of a plain-text file; unset: a folder's files, a single file's "
        "blank-line paragraphs"
    )
    data_format: Literal["image", "text"] | None = Field(
        None, description="RegMean(++): read a folder holding several kinds of files as its images or its text "
        "files, or any file as plain text"
    )
    pack_texts: bool | None = Field(
        None, description="RegMean(++): concatenate documents and cut them into max_length-token windows; unset: "
        "plain-text files read by a decoder are packed"
    )
    method_options: dict[str, Any] = Field(
        default_factory=dict, description="parameters of the method's own parameter model that MergeConfig has no "
        "field for (a registered method's; the built-in methods take none)",
    )
    # --- the recipe's per-expert and mergekit-compatible options (docs/mergekit.md); omitted from featcal.json's
    # params while at their defaults, so that a recipe that does not use them is reported as before
    weights: Weight = Field(
        default_factory=dict, description="per-expert weight w_t (experts not listed: 1): θ0 + s·Σ w_t·τ_t (TA, "
        "TIES, DARE), Σ w_t·θ_t (linear)",
    )
    densities: Densities = Field(
        default_factory=dict, description="per-expert TIES density (experts not listed: density)",
    )
    drop_rates: DropRates = Field(
        default_factory=dict, description="per-expert DARE drop rate (experts not listed: drop_rate)",
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
        spec = _METHODS.get(method) if isinstance(method, str) else None
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
        spec = _METHODS.get(info.data.get("method", ""))
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


class MethodParams(_Strict):
    """Base of a merge method's parameter model."""


def params_model(name: str, *fields: str, base: type[BaseModel] = MethodParams, **changes: Any) -> type[BaseModel]:
    """A parameter model made of MergeConfig's `fields` (their one declaration: default, bounds, description);
    `changes` (field -> FieldInfo keywords, e.g. {"description": ...}) adjust a field for this model."""
    made: dict[str, Any] = {}
    for f in fields:
        info = MergeConfig.model_fields[f]
        if f in changes:
            info = FieldInfo.merge_field_infos(info, **changes[f])
        made[f] = (info.annotation, info)
    return create_model(name, __base__=base, **made)


_TIES_OPTIONS = ("weights", "densities", "normalize", "ties_threshold")
_DARE_OPTIONS = ("weights", "drop_rates", "normalize", "dare_rescale")
BUILTIN_METHODS: tuple[MethodSpec, ...] = tuple(add_method(s) for s in (
    MethodSpec("average", "streaming", params_model("AverageParams")),
    MethodSpec("linear", "streaming", params_model("LinearParams", "weights", "normalize")),
    MethodSpec("task_arithmetic", "streaming", params_model("TaskArithmeticParams", "scaling", "weights", "normalize")),
    MethodSpec("ties", "streaming", params_model("TiesParams", "scaling", "density", *_TIES_OPTIONS)),
    MethodSpec("dare_ta", "streaming", params_model("DareTaskArithmeticParams", "scaling", "drop_rate", "seed",
                                                    *_DARE_OPTIONS)),
    MethodSpec("dare_ties", "streaming", params_model("DareTiesParams", "scaling", "density", "drop_rate", "seed",
                                                      *dict.fromkeys(_TIES_OPTIONS + _DARE_OPTIONS))),
    MethodSpec("regmean", "whole_model", params_model("RegMeanMergeParams", "alpha"), needs_calibration=True),
    MethodSpec("regmean++", "whole_model", params_model("RegMeanPlusPlusMergeParams", "alpha"), needs_calibration=True),
    MethodSpec("wudi", "whole_model", params_model("WudiMergeParams", "steps", "lr", "seed")),
))
# Built-in methods only (the registry, method_names() / method_spec(), also holds methods registered later)
MERGE_METHODS: tuple[str, ...] = tuple(s.name for s in BUILTIN_METHODS)
# merges that read calibration data (the others are data-free and refuse it)
CALIBRATED_MERGE_METHODS: tuple[str, ...] = tuple(s.name for s in BUILTIN_METHODS if s.needs_calibration)
# merges computed on whole models (featcal.merging.model_mergers); `featcal bench` runs them as --baselines
WHOLE_MODEL_MERGE_METHODS: tuple[str, ...] = tuple(s.name for s in BUILTIN_METHODS if s.kind == "whole_model")


class FeatCalConfig(_Strict):
    """FeatCal hyperparameters (defaults: the authors' demo, docs/method.md §6)."""

    # The per-task Grams are normalised to unit Frobenius norm (docs/method.md §5), so both ridge terms compare with
    # O(1): λ = 100 already pins every weight to the anchor, and an ε past 0.01 stops being a jitter and
    # shrinks every Linear weight toward zero (ε = 1e300 zeroed them all). Larger values are typos.
    lambda_ratio: float = Field(
        0.05, ge=0.0, le=MAX_LAMBDA_RATIO, description="ridge λ toward the anchor (at most 100: the anchor itself)"
    )
    anchor_blend_rho: float = Field(
        2.2, ge=0.0, le=10.0, description="anchor Ā = ρ·θm + (1−ρ)·θ0 (0: the base, 1: the merge, >1 extrapolates)"
    )
    teacher_interp_alpha: float = Field(0.25, ge=0.0, le=1.0, description="x~ = α·xe + (1−α)·xs")
    covariance_eps: float = Field(
        1e-8, ge=0.0, le=MAX_COVARIANCE_EPS, description="ε added to the Gram diagonal, a jitter (at most 0.01)"
    )
    calibrate_bias: bool = True
    calibrate_layernorm: bool = True
    num_calibration_examples: int = Field(
        256, ge=1, description="examples per task; left at the default, a task holding fewer uses them all (with a "
        "warning), while a number given is required (fewer are refused unless --allow-fewer)"
    )
    calibration_batch_size: int = Field(16, ge=1)
    cls_token_weight: float = Field(0.01, ge=0.0, le=1.0, description="weight of non-class tokens, last CLIP/ViT block")
    seed: int = seed_field("which calibration examples are drawn")
    chain_dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="dtype in which block-input chains are stored between blocks"
    )
    spill_dir: Path | None = Field(None, description="spill block-input chains to this directory instead of RAM")
    device: str = Field("cpu", description="torch device for the block forwards and solves")
    offload_blocks: bool = Field(
        False, description="keep both models and the chains on the CPU and put only the block being calibrated "
        "(of the merged model and of the expert template) and one batch on --device"
    )
    resume: bool = Field(True, description="checkpoint calibrated blocks so that rerunning a killed run resumes it")
    checkpoint_every: int = Field(
        1, ge=1, description="write a resume checkpoint (all chains) after every N-th block and after the last one"
    )
    resume_dir: Path | None = Field(
        None, description="where the per-block checkpoints go (featcal calibrate: .<out>.featcal-resume beside --out)"
    )
    text_column: str | None = Field(
        None, min_length=1, description="the column of JSONL / parquet / saved-dataset data holding the texts; "
        "unset: a column named text, sentence, ..., else the one candidate string column (several are refused)",
    )
    allow_test_split: bool = Field(
        False, description="accept a saved dataset of test data (its only split 'test', or saved from a test "
        "split) as calibration data"
    )
    text_unit: Literal["line", "paragraph", "file"] | None = Field(
        None, description="one example of a plain-text file: a line, a blank-line paragraph or a whole file; unset: "
        "a folder's files, a single file's paragraphs (docs/data.md)"
    )
    data_format: Literal["image", "text"] | None = Field(
        None, description="read a folder holding several kinds of files as its images or its text files, or any "
        "file as plain text; unset: known from the folder's content or the file's suffix"
    )
    pack_texts: bool | None = Field(
        None, description="concatenate documents and cut them into max_length-token windows; unset: plain-text "
        "files read by a decoder (a causal LM) are packed, everything else is one example per record"
    )
    bias_solve: Literal["sequential", "joint"] = Field(
        "sequential", description="Linear biases: sequential (the paper: W without intercept, then b given W) or "
        "joint (W and b in one solve: the exact minimiser of the same objective with an intercept)"
    )
    block_statistics: Literal["as_merged", "sequential", "sequential_one_pass"] = Field(
        "as_merged", description="where a block's merged-side statistics are taken: with the whole block as merged "
        "(the paper) or 'sequential': each module's after the modules before it in the block's forward are "
        "calibrated (one more block forward per group of modules sharing an input; docs/variants.md), or "
        "'sequential_one_pass': the same statistics and solution with one forward per batch and side, every batch's "
        "forward paused at each stage while it is solved (holds all of them at once: more memory)"
    )
    calibrate_final_norm: bool = Field(
        False, description="also solve the norm between the last block and the head (CLIP post_layernorm, DINOv2 / "
        "ViT layernorm, Llama / Gemma 3 model.norm, T5's last final_layer_norm) as the in-block norms are, from the "
        "final chains; a no-op, logged, for models without one (BERT); off: the paper's method (docs/variants.md)"
    )
    calibrate_stem_norm: bool = Field(
        False, description="also solve the norm inside the stem whose output is block 0's input (BERT "
        "embeddings.LayerNorm, CLIP pre_layrnorm) as the in-block norms are, before block 0; a no-op, logged, for "
        "models without one; off: the paper's method (docs/variants.md)"
    )
    tune: bool = Field(
        False, description="choose anchor_blend_rho, lambda_ratio, teacher_interp_alpha (and a task-vector merge's "
        "scaling, where known) by a label-free score on held-out calibration examples, then refit on all of them "
        "(docs/tuning.md)"
    )
    tune_budget: float = Field(
        DEFAULT_TUNE_BUDGET, ge=3.0, le=100.0,
        description="tune: cost of the search and the final refit together, in calibrations on all the data",
    )
    tune_holdout: float = Field(
        DEFAULT_TUNE_HOLDOUT, ge=0.05, le=0.5,
        description="tune: fraction of each task's calibration examples held out for scoring (one split: tune_folds 1)"
    )
    tune_folds: Literal["auto"] | int = Field(
        "auto",
        description="tune: 1 scores candidates on one held-out part (tune_holdout); k >= 2 cross-fits: each task's "
        "examples are dealt into k folds, every candidate is calibrated k times, each time without one fold, and "
        "scored on the fold it did not see, so every example is held out once; 'auto': 2 where one split would "
        "hold out at most 4 examples per task, else 1 (the default; docs/tuning.md)",
    )
    tune_min_evidence: float = Field(
        0.0, ge=0.0, le=10.0,
        description="tune: a candidate replaces the best so far only if its held-out improvement is at least this "
        "many standard errors (paired over the held-out examples, within-task variance pooled over tasks); 0 (the "
        "default) takes any improvement; 2 was measured to hurt at 8 examples per task (docs/tuning.md)",
    )
    tune_tiebreak: Literal["drift", "soft", "auto"] = Field(
        "drift", description="tune, with heads: what decides between candidates whose disagreement with the experts "
        "is equal: the final-feature drift (default) or 'soft', the mean KL divergence from the expert's head softmax "
        "to the candidate's on the held-out examples (needs a head for every task), or 'auto': soft where every task "
        "has a head and at most 4 examples per task are held out, else drift (docs/tuning.md)",
    )
    tune_fixed: Literal["auto"] | tuple[TuneKnob, ...] = Field(
        (), description="tune: knobs held at their configured values instead of searched, comma-separated, from "
        "merge_scaling, anchor_blend_rho, lambda_ratio, teacher_interp_alpha; or 'auto': lambda_ratio where at most "
        "4 examples per task are held out, else none (docs/tuning.md)",
    )
    tune_head_pooling: Literal["auto", "pooler", "mean"] = Field(
        "auto", description="tune: what a task head (a layer, not a callable) reads: the model's pooler_output, the "
        "attention-masked mean of last_hidden_state, or auto (pooler_output where the model has one, else the mean)"
    )
    tune_next_token: bool = Field(
        True, description="tune, causal LMs: score candidates first by agreement with the experts' next-token "
        "predictions (the argmax of the model's own LM head at every non-padding position of the held-out "
        "calibration windows, no labels), the drift breaking ties; off, or a model without an LM head: the drift "
        "alone, unless task heads are given (docs/tuning.md)",
    )

    @field_validator("tune_fixed", mode="before")
    @classmethod
    def _knob_list(cls, v: Any) -> Any:
        """A comma-separated string (the command line's, a YAML scalar) is a list; a knob named twice is one."""
        if isinstance(v, str):
            if v.strip() == "auto":
                return "auto"
            v = [k.strip() for k in v.split(",") if k.strip()]
        if isinstance(v, (list, tuple)):
            knobs = typing.get_args(TuneKnob)
            bad = [k for k in v if k not in knobs]
            if bad:
                raise ValueError(f"unknown knob(s) {', '.join(map(str, bad))}; choose from {', '.join(knobs)}, "
                                 "or 'auto'")
            return tuple(dict.fromkeys(v))
        raise ValueError(f"a comma-separated list of knobs or 'auto', not {v!r}")

    @field_validator("tune_folds", mode="before")
    @classmethod
    def _folds(cls, v: Any) -> Any:
        """1 to 10 folds, or 'auto'; the command line's string is read as a number."""
        if isinstance(v, str) and v.strip() == "auto":
            return "auto"
        if isinstance(v, str) and v.strip().isdigit():
            v = int(v.strip())
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 10:
            raise ValueError(f"a number of folds from 1 to 10, or 'auto', not {v!r}")
        return v

    @model_validator(mode="after")
    def _one_way_to_hold_out(self) -> FeatCalConfig:
        """Cross-fitting holds every example out once: a held-out fraction beside it would be silently ignored."""
        if self.tune_folds != "auto" and self.tune_folds > 1 and self.tune_holdout != DEFAULT_TUNE_HOLDOUT:
            raise ValueError(f"tune_holdout {self.tune_holdout:g} and tune_folds {self.tune_folds} are alternatives: "
                             "cross-fitting holds every example out once; drop one of them")
        return self

    @field_validator("device")
    @classmethod
    def _device_known(cls, v: str) -> str:
        if v not in ("cpu", "cuda", "auto") and not v.startswith("cuda:"):
            raise ValueError(f"device must be cpu, cuda, cuda:N or auto, not {v!r}")
        return v


# a run file's per-expert entry key -> the MergeConfig field that holds it
EXPERT_ENTRY_KEYS = {"weight": "weights", "density": "densities", "drop_rate": "drop_rates"}


class MergeSpec(_Strict):
    """The merge section of a run file: inputs plus how to merge them (and, for RegMean, its data). An expert
    is a path, or an entry {path, weight, density, drop_rate} carrying its own recipe values."""

    base: str
    experts: dict[str, str]
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

    @field_validator("experts")
    @classmethod
    def _non_empty(cls, v: dict[str, str]) -> dict[str, str]:
        if not v:
            raise ValueError("at least one expert is needed")
        return v

    def merge_config(self) -> MergeConfig:
        return parse(MergeConfig, {"method": self.method, **self.params})


class CalibrateSpec(_Strict):
    """The calibration section of a run file: data per task plus FeatCal hyperparameters."""

    calibration: dict[str, str]
    config: dict[str, Any] = Field(default_factory=dict)
    heads: dict[str, str] | None = Field(
        None, description="tune: task -> a classification head saved by featcal (safetensors), to score candidates "
        "by agreement with the experts' predictions"
    )

    def featcal_config(self) -> FeatCalConfig:
        return check_tune_options(parse(FeatCalConfig, self.config), "calibrate.config")


class MergedSpec(_Strict):
    """A run file's `merged:` section, instead of `merge:`: an existing merge (featcal's, mergekit's, any) to
    calibrate, with the base and experts it was merged from."""

    path: str
    base: str
    experts: dict[str, str]

    @field_validator("experts")
    @classmethod
    def _non_empty(cls, v: dict[str, str]) -> dict[str, str]:
        if not v:
            raise ValueError("at least one expert is needed")
        return v


class RunOptions(_Strict):
    """What a run is told besides the methods' parameters: how it reads its inputs and writes its output.

    The same model validates `featcal merge` / `calibrate` / `plan` flags (--overwrite, --allow-pickle,
    --max-length, --allow-fewer), the keywords of featcal.merge, and a run file's top-level keys. The torch
    device stays a FeatCalConfig field (`device`), where the calibration reads it.
    """

    overwrite: bool = Field(False, description="replace a non-empty output directory (one featcal wrote)")
    allow_pickle: bool = Field(False, description="accept pickled (*.bin) checkpoints (read with weights_only)")
    max_length: int = Field(128, description="truncate calibration texts to this many tokens")
    allow_fewer: bool = Field(
        False, description="use all examples of a task holding fewer than num_calibration_examples (with a warning)"
    )
    expert_kind: dict[str, Literal["full", "adapter"]] = Field(
        default_factory=dict, description="task -> full or adapter: how to read an expert folder holding both full "
        "weights and a LoRA / PEFT adapter (refused without it)"
    )

    @field_validator("max_length")
    @classmethod
    def _at_least_one(cls, v: int) -> int:
        if v < 1:
            raise ValueError(f"max_length must be at least 1, got {v}")
        return v


OutputDtype = Literal["float32", "bfloat16", "float16"]


class OutputOptions(_Strict):
    """What the written checkpoint holds besides the weights' values: `featcal merge` / `calibrate` flags
    (--dtype, --tokenizer-source), featcal.merge's keywords and a run file's top-level keys (mergekit's dtype,
    out_dtype and tokenizer_source)."""

    dtype: OutputDtype | None = Field(
        None, description="floating dtype of the written weights (computed in float32 either way); unset: the "
        "base's (merge), the merged checkpoint's (calibrate)",
    )
    tokenizer_source: str | None = Field(
        None, min_length=1, description="merge: whose tokenizer the output carries: 'base' or an expert's name; "
        "unset: the base's, completed by what every expert agrees on and the base lacks (a chat template), and a "
        "conflict among the experts is refused (docs/outputs.md)",
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


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping (PyYAML keeps the last silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor` overrides are what merge keys are for
                continue
            key, line = self.construct_object(key_node, deep=True), key_node.start_mark.line + 1
            try:
                if key in seen:
                    raise ConfigError(
                        f"{self.name}, line {line}: key {key!r} is given twice in one mapping (first on line "
                        f"{seen[key]}); YAML would keep only the last, so remove one"
                    )
                seen[key] = line
            except TypeError:  # an unhashable key: the base loader refuses it
                continue
        return super().construct_mapping(node, deep=deep)


# A run file is a few dozen lines; these bounds keep a crafted one (nested 20,000 levels deep, or YAML aliases
# expanding to billions of values) from exhausting the stack or memory before it is validated.
MAX_RUN_FILE_BYTES = 16 << 20
MAX_RUN_FILE_DEPTH = 64
MAX_RUN_FILE_VALUES = 100_000


def _check_run_file_shape(path: Path, data: Any) -> None:
    """Refuse a run file deeper than MAX_RUN_FILE_DEPTH, or holding more than MAX_RUN_FILE_VALUES values once
    its aliases are expanded (counted per distinct node, so an alias bomb costs no more to count than to read)."""
    sizes: dict[int, int] = {}

    def walk(node: Any, depth: int) -> int:
        if depth > MAX_RUN_FILE_DEPTH:
            raise ConfigError(f"{path} nests its values too deeply for a run file (at most {MAX_RUN_FILE_DEPTH} levels)")
        if not isinstance(node, (dict, list)):
            return 1
        if id(node) not in sizes:
            children = [*node.keys(), *node.values()] if isinstance(node, dict) else node
            sizes[id(node)] = 1 + sum(walk(c, depth + 1) for c in children)
            if sizes[id(node)] > MAX_RUN_FILE_VALUES:
                raise ConfigError(f"{path} holds over {MAX_RUN_FILE_VALUES} values once its YAML aliases are expanded; "
                                  "a run file is far smaller")
        return sizes[id(node)]

    walk(data, 0)


def load_run_file(path: str | Path) -> RunConfig:
    """Read and validate a YAML run file: one-line errors for a missing, non-UTF-8 or invalid file."""
    return run_config(read_run_data(path))


def run_config(data: dict[str, Any]) -> RunConfig:
    """A run file's mapping, validated (the run options first, with the CLI flags' own errors)."""
    run_options(**{k: v for k, v in data.items() if k in RunOptions.model_fields})
    return parse(RunConfig, data)


def read_run_data(path: str | Path) -> dict[str, Any]:
    """A YAML run file's top-level mapping, not yet validated (a mergekit YAML is translated before)."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"run file {p} does not exist")
    if p.is_file() and p.stat().st_size > MAX_RUN_FILE_BYTES:
        raise ConfigError(f"{p} is {p.stat().st_size >> 20} MiB; a run file is at most {MAX_RUN_FILE_BYTES >> 20} MiB")
    raw = p.read_bytes()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise ConfigError(
            f"{p}, line {line}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start}); save it as UTF-8"
        ) from None
    loader = _UniqueKeyLoader(text)
    loader.name = str(p)
    try:
        data = loader.get_single_data()
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p} is not valid YAML: {exc}") from None
    except RecursionError:
        raise ConfigError(f"{p} nests its values too deeply for a run file (at most {MAX_RUN_FILE_DEPTH} levels)") from None
    finally:
        loader.dispose()
    _check_run_file_shape(p, data)
    if not isinstance(data, dict):
        raise ConfigError(f"{p} must hold a mapping at the top level")
    return data
