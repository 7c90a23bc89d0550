"""One entry point for every comparison baseline, returning one kind of predictor.

    result = run_baseline("surgery", merged=m, experts=E, calibration=D)      # post-merge modules
    result = run_baseline("regmean++", base=b, experts=E, calibration=D)       # a merge of its own
    logits = heads[task](result.features(task, batch))                         # the same for both kinds

`features(task, batch)` is the representation a task head reads: the merged backbone's features
(feature_fn, default pooler_output), corrected by the task's module for surgery/probsurgery. Merge
baselines (regmean, regmean++, wudi) ignore the task and `merged` (they build their own merge) and
expose it as `result.model`. `result.wall_time_s` is the whole cost (loading, forwards, training or
solving), measured with time.perf_counter, for benchmark rows.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from featcal.config import parse, registered_methods
from featcal.data.batch import BatchLike
from featcal.data.inputs import (
    FeatureFn,
    ModelLike,
    calibration_batches,
    load,
    model_device,
    pooled_features,
    to_device,
)
from featcal.errors import ConfigError
from featcal.experiments.baselines.params import ProbSurgeryParams, SurgeryParams
from featcal.experiments.baselines.surgery import SurgeryModules

# the baselines that train modules on top of a merge: name -> (parameter schema, inputs it needs besides experts)
SURGERY_BASELINES: dict[str, tuple[type, tuple[str, ...]]] = {
    "surgery": (SurgeryParams, ("merged", "calibration")),
    "probsurgery": (ProbSurgeryParams, ("merged", "calibration")),
}


def baselines() -> dict[str, tuple[type, tuple[str, ...]]]:
    """Every baseline: name -> (parameter schema, inputs it needs besides experts). Besides Surgery and
    ProbSurgery, each whole-model merge of the method table (RegMean, RegMean++, WUDI, any registered later),
    with its one parameter model."""
    merges = {s.name: (s.params, ("base", "calibration") if s.needs_calibration else ("base",))
              for s in registered_methods() if s.kind == "whole_model"}
    return {**SURGERY_BASELINES, **merges}


BASELINES = baselines()  # the built-in ones (methods registered later: baselines())


@dataclass
class BaselineResult:
    """A baseline's predictor: `features(task, batch)` for task heads, plus what a benchmark row reports."""

    name: str
    model: nn.Module
    feature_fn: FeatureFn
    wall_time_s: float
    params: dict[str, Any]
    surgery: SurgeryModules | None = None
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def needs_task_id(self) -> bool:
        """Surgery-type predictors correct features per task; merges are task-agnostic."""
        return self.surgery is not None

    @torch.no_grad()
    def features(self, task: str, batch: BatchLike) -> torch.Tensor:
        f = self.feature_fn(self.model, to_device(batch, model_device(self.model)))
        return self.surgery.apply(task, f) if self.surgery is not None else f

    def summary(self) -> dict[str, Any]:
        """JSON-ready facts for a report row."""
        out = {"baseline": self.name, "wall_time_s": round(self.wall_time_s, 4), "params": self.params,
               "timings": {k: round(v, 4) for k, v in self.timings.items()}}
        if self.surgery is not None:
            out["extra_parameters"] = self.surgery.num_parameters()
            out["final_loss"] = {t: h[-1] for t, h in self.surgery.history.items()}
        return out


def run_baseline(
    name: str,
    *,
    merged: ModelLike | None = None,
    base: ModelLike | None = None,
    experts: Mapping[str, ModelLike],
    calibration: Mapping[str, BatchLike | list[BatchLike]] | None = None,
    feature_fn: FeatureFn | None = None,
    recompute_features: bool = False,
    progress: bool = True,
    **params: Any,
) -> BaselineResult:
    """Run baseline `name` (one of BASELINES) and return its predictor; inputs are checked first.

    recompute_features (surgery, probsurgery): run the frozen merged model and the expert on every
    training batch, as the authors' code does, instead of caching their features once. The modules
    are the same (up to float rounding); the cost is the published procedure's.
    """
    known = baselines()
    if name not in known:
        raise ConfigError(f"unknown baseline {name!r}; choose one of {', '.join(known)}")
    if recompute_features and name not in SURGERY_BASELINES:
        raise ConfigError(f"recompute_features applies to surgery and probsurgery, not {name!r}")
    schema, needs = known[name]
    if "plus_plus" in params:
        raise ConfigError("choose the baseline 'regmean' or 'regmean++' instead of passing plus_plus")
    cfg = parse(schema, params)
    given = {"merged": merged, "base": base, "calibration": calibration}
    missing = [k for k in needs if given[k] is None]
    if missing:
        raise ConfigError(f"baseline {name!r} needs {' and '.join(missing)}")
    if not isinstance(experts, Mapping) or not experts:
        raise ConfigError("experts must be a non-empty mapping task -> model or checkpoint path")
    if calibration is not None and "calibration" in needs:
        calibration = calibration_batches(calibration, experts)
    fn = feature_fn or pooled_features
    kwargs = cfg.model_dump()

    start = time.perf_counter()
    timings: dict[str, float] = {}
    surgery = None
    if name in SURGERY_BASELINES:
        from featcal.experiments.baselines.probsurgery import train_probsurgery
        from featcal.experiments.baselines.surgery import train_surgery
        from featcal.experiments.baselines.training import cached_task_data, collect_features, live_task_data

        model = load(merged, "merged model").eval()
        if recompute_features:
            experts_m = {t: load(m, f"expert {t!r}").eval() for t, m in experts.items()}
            data = live_task_data(model, experts_m, calibration, fn)
        else:
            data = cached_task_data(*collect_features(model, experts, calibration, fn, progress=progress))
        prep = "setup_s" if recompute_features else "features_s"  # live: features are part of training
        timings[prep] = time.perf_counter() - start
        train = train_surgery if name == "surgery" else train_probsurgery
        surgery = train(data, cfg, progress=progress)
        timings["train_s"] = time.perf_counter() - start - timings[prep]
    else:  # a whole-model merge, dispatched through the method table to its implementation
        from featcal.merging.model_mergers import merge_models

        model = merge_models(name, base, experts, params=cfg, batches=calibration if "calibration" in needs else None,
                             progress=progress).eval()
    elapsed = time.perf_counter() - start
    if recompute_features:
        kwargs["recompute_features"] = True
    return BaselineResult(name, model, fn, elapsed, kwargs, surgery, timings)
