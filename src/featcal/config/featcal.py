"""FeatCal's options, cut by concern: what is solved, which data, where it runs, how a killed run resumes, and
the label-free search (`tune`). `FeatCalConfig` is all five together.

Each concern is a model of its own (SolveOptions, DataOptions, ExecutionOptions, ResumeOptions, TuneOptions),
with its own validators, so that code that needs one concern can take just that one (`config.tune_options`)
and the CLI groups its flags by concern. A FeatCalConfig takes its options flat, as every release has
(`FeatCalConfig(lambda_ratio=0.1)`, a run file's `calibrate.config: {tune: true}`), or by section
(`FeatCalConfig(solve={"lambda_ratio": 0.1})`, `calibrate.config: {tune: {tune: true, tune_budget: 5}}`), and
is stored, compared and written (featcal.json's params, resume fingerprints) flat, as before the cut.
"""

from __future__ import annotations

import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from featcal.config.base import Device, StrictModel
from featcal.config.data import DataOptions

MAX_LAMBDA_RATIO = 100.0
MAX_COVARIANCE_EPS = 0.01
DEFAULT_TUNE_BUDGET = 10.0  # --tune-budget default: at most ~10 calibrations' cost, the refit included
DEFAULT_TUNE_HOLDOUT = 0.25  # --tune-holdout default: the share of each task's examples held out (one split)
TuneKnob = Literal["merge_scaling", "anchor_blend_rho", "lambda_ratio", "teacher_interp_alpha"]  # what --tune searches


class SolveOptions(StrictModel):
    """What the closed-form solves compute (defaults: the authors' demo; docs/method.md §5, §6)."""

    concern: ClassVar[str] = "FeatCal: what is solved"

    # The per-task Grams are normalised to unit Frobenius norm (docs/method.md §4), so both ridge terms compare with
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
    cls_token_weight: float = Field(0.01, ge=0.0, le=1.0, description="weight of non-class tokens, last CLIP/ViT block")
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


class ExecutionOptions(StrictModel):
    """Where the work runs and where its intermediate chains are kept; never what is computed."""

    concern: ClassVar[str] = "execution: device and memory (never what is computed)"

    chain_dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="dtype in which block-input chains are stored between blocks"
    )
    spill_dir: Path | None = Field(None, description="spill block-input chains to this directory instead of RAM")
    device: Device = Field("cpu", description="torch device for the block forwards and solves")
    offload_blocks: bool = Field(
        False, description="keep both models and the chains on the CPU and put only the block being calibrated "
        "(of the merged model and of the expert template) and one batch on --device"
    )



class ResumeOptions(StrictModel):
    """How a killed calibration resumes from per-block checkpoints."""

    concern: ClassVar[str] = "resuming a killed run"

    resume: bool = Field(True, description="checkpoint calibrated blocks so that rerunning a killed run resumes it")
    checkpoint_every: int = Field(
        1, ge=1, description="write a resume checkpoint (all chains) after every N-th block and after the last one"
    )
    resume_dir: Path | None = Field(
        None, description="where the per-block checkpoints go (featcal calibrate: .<out>.featcal-resume beside --out)"
    )


class TuneOptions(StrictModel):
    """The label-free hyperparameter search (docs/tuning.md)."""

    concern: ClassVar[str] = "tune: the label-free search (docs/tuning.md)"

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
    tune_scope: Literal["model", "block"] = Field(
        "model", description="tune: 'model' searches one setting for the whole model, each candidate a calibration "
        "(about ten in all); 'block' chooses anchor_blend_rho and lambda_ratio block by block inside one calibration's "
        "pass, each candidate a solve and one block forward over the held-out examples (docs/tuning.md)",
    )
    tune_screen: Literal["auto", "off"] | int = Field(
        "off",
        description="tune: examples per task each candidate of the search is first fitted on (whole batches of the "
        "fit part, a seeded choice), scored on the whole held-out part; the best tune_confirm settings and the "
        "configured one are then fitted on the whole fit part and the choice made among them; 'off' (the default "
        "until the benches on real weights have compared the two): every candidate on the whole fit part; 'auto': "
        "32 where the smallest task fits at least 64 examples with one split, else off (docs/tuning.md)",
    )
    tune_confirm: int = Field(
        2, ge=0, le=10,
        description="tune, with a screen: how many of the screen's best settings are confirmed on the whole fit part "
        "(the configured setting is always confirmed too); 0: none, the screen's best is the choice, refitted on all "
        "data (docs/tuning.md)",
    )
    tune_cache_gb: float = Field(
        2.0, ge=0.0, le=1024.0,
        description="tune: GiB of host memory the model-wide search may keep of the experts' block forwards on the "
        "fit data, recorded by the first candidate and replayed for the others (they do not depend on the merge or "
        "the knobs: the same values, computed once); past it later blocks are recomputed; 0: off (docs/tuning.md)",
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

    @field_validator("tune_screen", mode="before")
    @classmethod
    def _screen(cls, v: Any) -> Any:
        """At least 2 examples per task, 'auto' or 'off'; the command line's string is read as a number."""
        if isinstance(v, str) and v.strip() in ("auto", "off"):
            return v.strip()
        if isinstance(v, str) and v.strip().isdigit():
            v = int(v.strip())
        if isinstance(v, bool) or not isinstance(v, int) or v < 2:
            raise ValueError(f"a number of examples per task (at least 2), 'auto' or 'off', not {v!r}")
        return v

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
    def _one_way_to_hold_out(self) -> TuneOptions:
        """Cross-fitting holds every example out once: a held-out fraction beside it would be silently ignored."""
        if self.tune_folds != "auto" and self.tune_folds > 1 and self.tune_holdout != DEFAULT_TUNE_HOLDOUT:
            raise ValueError(f"tune_holdout {self.tune_holdout:g} and tune_folds {self.tune_folds} are alternatives: "
                             "cross-fitting holds every example out once; drop one of them")
        return self



# FeatCalConfig's sections, by the name a nested input gives them (`solve: {...}`); `resume` and `tune` are also
# flags of their sections: given a mapping they are the section, given a value the flag
SECTIONS: dict[str, type[StrictModel]] = {
    "solve": SolveOptions, "data": DataOptions, "execution": ExecutionOptions, "resume": ResumeOptions,
    "tune": TuneOptions,
}


class FeatCalConfig(TuneOptions, ResumeOptions, ExecutionOptions, DataOptions, SolveOptions):  # fields: solve first
    """FeatCal's options (defaults: the authors' demo, docs/method.md §6): the five concerns together."""

    @model_validator(mode="before")
    @classmethod
    def _flatten_sections(cls, data: Any) -> Any:
        """Sections (`solve: {lambda_ratio: 0.1}`) become the flat options they hold; an option given both in a
        section and flat, or in the wrong section, is refused."""
        if not isinstance(data, Mapping) or not any(_is_section(k, v) for k, v in data.items()):
            return data
        flat = {k: v for k, v in data.items() if not _is_section(k, v)}
        for name, section in data.items():
            if not _is_section(name, section):
                continue
            values = section.model_dump(exclude_unset=True) if isinstance(section, BaseModel) else dict(section)
            fields = SECTIONS[name].model_fields
            for key, value in values.items():
                if key not in fields:
                    raise ValueError(f"{name}.{key}: not an option of the {name} section (it holds "
                                     f"{', '.join(fields)})")
                if key in flat:
                    raise ValueError(f"{key} is given both in the {name} section and on its own; give it once")
                flat[key] = value
        return flat

    def section(self, name: str) -> StrictModel:
        """The options of one concern (a SECTIONS name), as their own model."""
        model = SECTIONS[name]
        return model.model_construct(_fields_set=self.model_fields_set & set(model.model_fields),
                                     **{k: getattr(self, k) for k in model.model_fields})

    # each concern's options as their own model: config.solve_options, .data_options, ... (`section`)
    solve_options = property(lambda self: self.section("solve"), doc="the solve options (SolveOptions)")
    data_options = property(lambda self: self.section("data"), doc="the calibration data options (DataOptions)")
    execution_options = property(lambda self: self.section("execution"), doc="where it runs (ExecutionOptions)")
    resume_options = property(lambda self: self.section("resume"), doc="how it resumes (ResumeOptions)")
    tune_options = property(lambda self: self.section("tune"), doc="the search's options (TuneOptions)")


def _is_section(name: str, value: Any) -> bool:
    return name in SECTIONS and isinstance(value, (Mapping, BaseModel))

