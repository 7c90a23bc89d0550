"""One validated schema behind the Python API, the CLI flags and YAML run files.

Every option featcal accepts is a field here, with its default and its valid range, so that a bad
value is rejected with the same message whichever way it arrived, before any work starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from featcal.errors import ConfigError

MergeMethod = Literal[
    "average", "task_arithmetic", "ties", "dare_ta", "dare_ties", "regmean", "regmean++", "wudi"
]
MERGE_METHODS: tuple[str, ...] = MergeMethod.__args__  # type: ignore[attr-defined]
# merges that read calibration data (the others are data-free and refuse it)
CALIBRATED_MERGE_METHODS: tuple[str, ...] = ("regmean", "regmean++")
# merges computed on whole models (featcal.merging.model_mergers); `featcal bench` runs them as --baselines
WHOLE_MODEL_MERGE_METHODS: tuple[str, ...] = ("regmean", "regmean++", "wudi")
# seeds feed torch.Generator.manual_seed (64-bit) and sha256-derived per-tensor seeds
MAX_SEED = 2**63 - 1
MAX_LAMBDA_RATIO = 100.0
MAX_COVARIANCE_EPS = 0.01
DEFAULT_TUNE_BUDGET = 10.0  # --tune-budget default: at most ~10 calibrations' cost, the refit included


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


class MergeConfig(_Strict):
    """How to merge: the method and its hyperparameters (unused ones are ignored by the method)."""

    method: MergeMethod = "task_arithmetic"
    scaling: float = Field(0.3, gt=0.0, le=10.0, description="s in θ0 + s·Σ(θt−θ0) (TA, TIES, DARE)")
    density: float = Field(0.2, gt=0.0, le=1.0, description="TIES: fraction of each task vector kept")
    drop_rate: float = Field(0.5, ge=0.0, lt=1.0, description="DARE: probability p of dropping an entry")
    seed: int = Field(
        0, ge=0, le=MAX_SEED,
        description="DARE: seed of the drop masks; RegMean(++): which calibration examples are drawn; "
        "WUDI: recorded only (it draws no random numbers)",
    )
    alpha: float = Field(0.9, ge=0.0, le=1.0, description="RegMean(++): scale of the Grams' off-diagonal entries")
    steps: int = Field(300, ge=0, description="WUDI: Adam iterations per Linear weight")
    lr: float = Field(1e-5, gt=0.0, description="WUDI: Adam learning rate, in parameter units")
    num_calibration_examples: int = Field(256, ge=1, description="RegMean(++): calibration examples per task")
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


class FeatCalConfig(_Strict):
    """FeatCal hyperparameters (defaults: the authors' demo, ../shared/SPEC.md §2)."""

    # The per-task Grams are normalised to unit Frobenius norm (SPEC §2.6), so both ridge terms compare with
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
    num_calibration_examples: int = Field(256, ge=1, description="examples per task")
    calibration_batch_size: int = Field(16, ge=1)
    cls_token_weight: float = Field(0.01, ge=0.0, le=1.0, description="weight of non-class tokens, last CLIP/ViT block")
    seed: int = Field(0, ge=0, le=MAX_SEED, description="which calibration examples are drawn")
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
    bias_solve: Literal["sequential", "joint"] = Field(
        "sequential", description="Linear biases: sequential (the paper: W without intercept, then b given W) or "
        "joint (W and b in one solve: the exact minimiser of the same objective with an intercept)"
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
        0.25, ge=0.05, le=0.5, description="tune: fraction of each task's calibration examples held out for scoring"
    )
    tune_head_pooling: Literal["auto", "pooler", "mean"] = Field(
        "auto", description="tune: what a task head (a layer, not a callable) reads: the model's pooler_output, the "
        "attention-masked mean of last_hidden_state, or auto (pooler_output where the model has one, else the mean)"
    )

    @field_validator("device")
    @classmethod
    def _device_known(cls, v: str) -> str:
        if v not in ("cpu", "cuda", "auto") and not v.startswith("cuda:"):
            raise ValueError(f"device must be cpu, cuda, cuda:N or auto, not {v!r}")
        return v


class MergeSpec(_Strict):
    """The merge section of a run file: inputs plus how to merge them (and, for RegMean, its data)."""

    base: str
    experts: dict[str, str]
    method: MergeMethod = "task_arithmetic"
    calibration: dict[str, str] | None = Field(None, description="RegMean(++): task -> calibration data")
    params: dict[str, Any] = Field(default_factory=dict)

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
        return parse(FeatCalConfig, self.config)


class RunConfig(_Strict):
    """A whole `featcal run FILE.yaml`: merge, then optionally calibrate, into `out`."""

    merge: MergeSpec
    calibrate: CalibrateSpec | None = None
    out: str
    overwrite: bool = False
    allow_pickle: bool = False


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


def load_run_file(path: str | Path) -> RunConfig:
    """Read and validate a YAML run file: one-line errors for a missing, non-UTF-8 or invalid file."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"run file {p} does not exist")
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
    finally:
        loader.dispose()
    if not isinstance(data, dict):
        raise ConfigError(f"{p} must hold a mapping at the top level")
    return parse(RunConfig, data)
