"""What a calibration hands back: the calibrated model and what the run measured and kept, typed.

The records are frozen dataclasses. Each also reads as the mapping featcal.json holds (`record["before"]`,
`dict(record)`, `as_dict()`), the shape `calibrate` returned before they were typed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn

if TYPE_CHECKING:
    from featcal.calibration.resume.store import ResumeStore


class _AsMapping(Mapping[str, Any]):
    """A record read as the JSON mapping `as_dict()` gives (what featcal.json holds)."""

    def as_dict(self) -> dict[str, Any]:
        raise NotImplementedError

    def __getitem__(self, key: str) -> Any:
        return self.as_dict()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.as_dict())

    def __len__(self) -> int:
        return len(self.as_dict())


@dataclass(frozen=True, eq=False)
class DriftRow(_AsMapping):
    """One calibrated block's drift (drift.py): mean over valid tokens and tasks of ‖hm − he‖² / ‖he‖² with
    the block as merged (`before`) and calibrated (`after`); `block` counts blocks over all stacks in forward
    order. `before_batches`: where `before` was measured when not on every batch (sequential_one_pass)."""

    block: int
    stack: str
    layer: int
    before: float
    after: float
    before_batches: str | None = None

    @classmethod
    def from_dict(cls, row: Mapping[str, Any]) -> DriftRow:
        return cls(**{f.name: row[f.name] for f in dataclasses.fields(cls) if f.name in row})

    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        if self.before_batches is None:
            del out["before_batches"]
        return out


@dataclass(frozen=True)
class TunedSetting:
    """One candidate of the tune search: FeatCal's three knobs and (None: not searched) the merge's scaling."""

    anchor_blend_rho: float
    lambda_ratio: float
    teacher_interp_alpha: float
    merge_scaling: float | None = None

    def with_(self, knob: str, value: float) -> TunedSetting:
        return dataclasses.replace(self, **{knob: value})

    def as_dict(self) -> dict[str, float | None]:
        return dataclasses.asdict(self)

    def config_values(self) -> dict[str, float]:
        """The FeatCalConfig fields it sets (the merge's scaling is not one)."""
        return {k: v for k, v in self.as_dict().items() if k != "merge_scaling"}


@dataclass(frozen=True, eq=False)
class TunedCandidate(_AsMapping):
    """One scored candidate: its setting, held-out drift, disagreement with the experts (None without heads or
    an LM head), the soft tie-break's KL (where it ran), per-task figures and the seconds it took."""

    index: int
    setting: TunedSetting
    drift: float
    disagreement: float | None
    per_task: dict[str, dict[str, float]]
    seconds: float
    soft: float | None = None
    # "full": fitted on the whole fit part; "screen": on tune_screen's part of it (scores of the two differ in kind)
    stage: str = "full"

    def as_dict(self) -> dict[str, Any]:
        return {"index": self.index, **self.setting.as_dict(), "drift": self.drift, "disagreement": self.disagreement,
                **({} if self.soft is None else {"soft": self.soft}), "per_task": self.per_task,
                "seconds": self.seconds, "stage": self.stage}


@dataclass(frozen=True, eq=False)
class TuningComparison(_AsMapping):
    """One step of the search: candidate `candidate` against the best so far (`against`), the paired evidence
    (z) in disagreement and in the tie-break, whether it was accepted and whether it merely scored better."""

    candidate: int
    against: int
    z_disagreement: float | str | None
    tiebreak: str
    z_tiebreak: float | str | None
    accepted: bool
    scored_better: bool

    def as_dict(self) -> dict[str, Any]:
        return {"candidate": self.candidate, "against": self.against, "z_disagreement": self.z_disagreement,
                f"z_{self.tiebreak}": self.z_tiebreak, "accepted": self.accepted, "scored_better": self.scored_better}


@dataclass(frozen=True, eq=False)
class TuningRecord(_AsMapping):
    """What `tune` did (tuning/): how the examples were split, what was searched and held, every candidate and
    comparison, the choice, the seconds; featcal.json's "tuning" is `as_dict()`. `next_token`: whether the
    candidates were scored by agreement with the experts' next-token predictions (a causal LM) and why."""

    criterion: str
    heads: list[str]
    holdout: float | None
    seed: int
    folds: int
    folds_setting: str | int
    folds_why: str
    split: dict[str, dict[str, Any]]
    budget: dict[str, Any]
    searched: list[str]
    fixed: list[str]
    fixed_setting: str | list[str]
    fixed_why: str
    start: TunedSetting
    candidates: list[TunedCandidate]
    min_evidence: float
    comparisons: list[TuningComparison]
    chosen: TunedCandidate
    tiebreak: str
    tiebreak_setting: str
    tiebreak_why: str
    seconds: dict[str, float]
    next_token: dict[str, Any] | None = None
    screen: dict[str, Any] | None = None  # tune_screen: what was screened on how many examples, what confirmed

    def as_dict(self) -> dict[str, Any]:
        chosen = self.chosen.as_dict()
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out.update(start=self.start.as_dict(), candidates=[c.as_dict() for c in self.candidates],
                   comparisons=[c.as_dict() for c in self.comparisons],
                   chosen={k: v for k, v in chosen.items() if k not in ("per_task", "seconds")})
        for optional in ("next_token", "screen"):
            if out[optional] is None:
                del out[optional]
        return out


@dataclass(frozen=True, eq=False)
class BlockTuningRecord(_AsMapping):
    """What `tune` with tune_scope "block" did (block_tuning.py): the split, the knobs, and per block the setting
    chosen on the held-out examples with every setting scored; featcal.json's "tuning" is `as_dict()`."""

    criterion: str
    holdout: float
    seed: int
    split: dict[str, dict[str, Any]]
    searched: list[str]
    start: dict[str, float]
    limit_per_block: int
    blocks: list[dict[str, Any]]
    seconds: dict[str, float]
    scope: str = "block"

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


@dataclass(frozen=True)
class CalibrationResult:
    """What `featcal.calibrate` returns.

    model: the calibrated model (the merged model's class; the merged model itself with `inplace=True`).
    drift: per calibrated block, a DriftRow (block, stack, layer, before, after).
    end_to_end: the merge's and the calibrated model's final-block drift {"merged", "calibrated", ...}
        (None where the engine did not measure it).
    resume_store: the per-block checkpoint store, kept only with `keep_resume_state=True` (the caller
        deletes it once its output is written), else None.
    tuning: with `config.tune`, the search's TuningRecord (what featcal.json records under "tuning"); else None.
    final_norm: with `config.calibrate_final_norm`, {"calibrated", "module", "kind", "tokens", "before",
        "after"} (the drift after the norm, as merged and solved), or {"calibrated": False, "why"} for a model
        without one; what featcal.json records under "final_norm"; else None.
    """

    model: nn.Module
    drift: list[DriftRow]
    end_to_end: dict[str, Any] | None = None
    resume_store: ResumeStore | None = None
    tuning: TuningRecord | BlockTuningRecord | None = None
    final_norm: dict[str, Any] | None = None
    stem_norm: dict[str, Any] | None = None  # with `config.calibrate_stem_norm`: as final_norm, for the stem's norm
    # per stack, the modules of its blocks that keep their merged values and why (a mixture of experts' experts
    # and router, DINOv2's LayerScale, T5's position bias table): what featcal.json records under "kept_merged"
    kept_merged: dict[str, dict[str, str]] | None = None
    calibration_data: dict[str, dict[str, Any]] | None = None  # per task given as a source: how it was read
    # where the experts' weights lived: {"experts": "resident" | "streamed", "why"} (expert_placement.py), recorded
    # in featcal.json under "placement"
    placement: dict[str, str] | None = None

    def with_tuning(self, record: TuningRecord | BlockTuningRecord) -> CalibrationResult:
        """The same result carrying the tuning search's record."""
        return dataclasses.replace(self, tuning=record)

    def drift_records(self) -> list[dict[str, Any]]:
        """The drift rows as featcal.json holds them."""
        return [row.as_dict() for row in self.drift]
