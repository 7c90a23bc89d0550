"""Benchmark rows for the comparison baselines (Surgery, ProbSurgery, RegMean, RegMean++, WUDI).

Every baseline is run through `featcal.experiments.baselines.run_baseline` on the same checkpoints and the same
calibration batches FeatCal gets, and scored with the same frozen heads via `task_accuracy`, so its
row sits next to FeatCal's in bench.json and the table. Surgery-type baselines run on top of a merge
and retrain per merge; the merge baselines (regmean, regmean++, wudi) run once per bench.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from featcal.config import WHOLE_MODEL_MERGE_METHODS, method_spec
from featcal.errors import ConfigError
from featcal.evaluation.features import batch_of, feature_fn, num_examples
from featcal.experiments.bench.memory import PeakRSS
from featcal.experiments.bench.metrics import gap_closed, mean, normalised_accuracy

SURGERY_BASELINES = ("surgery", "probsurgery")
MERGE_BASELINES = WHOLE_MODEL_MERGE_METHODS  # the method table's whole-model merges
ALL_BASELINES = SURGERY_BASELINES + MERGE_BASELINES
RECOMPUTE_NOTE = "recompute_features=True: frozen merged model and expert re-run every step (the authors' procedure)"
CACHED_NOTE = ("recompute_features=False: features of the frozen merged model and expert computed once (same "
               "modules as the authors' procedure to round-off; seconds are not the authors' cost)")
# --surgery-features: how Surgery-type baselines get their features in the bench
SURGERY_FEATURES = ("recomputed", "cached")


def check_surgery_features(value: str) -> None:
    if value not in SURGERY_FEATURES:
        raise ConfigError(f"--surgery-features must be one of {', '.join(SURGERY_FEATURES)}, not {value!r}")


def parse_baselines(text: str | Sequence[str] | None) -> tuple[str, ...]:
    """'surgery,wudi' / 'all' / '' -> validated names in a fixed order; ConfigError names an unknown one."""
    names = [s.strip() for s in (text.split(",") if isinstance(text, str) else (text or ())) if s.strip()]
    if names == ["all"]:
        return ALL_BASELINES
    bad = [n for n in names if n not in ALL_BASELINES]
    if bad:
        raise ConfigError(f"unknown baselines {bad}; choose from {', '.join(ALL_BASELINES)} or 'all'")
    return tuple(n for n in ALL_BASELINES if n in names)


def _examples_per_task(calibration: Mapping[str, list]) -> int:
    return max(sum(num_examples(b) for b in batches) for batches in calibration.values())


def _score(result, heads: Mapping[str, Any], tests: Mapping[str, tuple], batch: int) -> dict[str, float]:
    """Accuracy through the frozen heads; text test sets (dicts) are fed batch by batch, trimmed."""
    import torch

    from featcal.evaluation.metrics import accuracy
    from featcal.experiments.baselines.evaluate import task_accuracy

    out = {}
    for t, (x, y) in tests.items():
        if not isinstance(x, Mapping):
            out[t] = task_accuracy(result, t, heads[t], x, y, batch)
            continue
        result.model.eval()
        with torch.no_grad():
            n = num_examples(x)
            pred = torch.cat([heads[t](result.features(t, batch_of(x, i, min(i + batch, n)))).argmax(-1)
                              for i in range(0, n, batch)])
        out[t] = accuracy(pred, y)
    return out


def baseline_row(
    result,
    per_task: dict[str, float],
    rss_mb: float,
    expert_acc: Mapping[str, float],
    *,
    merge: str | None = None,
    merge_average: float | None = None,
    calibration_examples: int | None = None,
) -> dict[str, Any]:
    """One bench.json row in the shared row interface, plus `baseline: true` and what the method was."""
    avg = mean(per_task)
    experts_average = mean(expert_acc)
    row: dict[str, Any] = {
        "method": result.name, "calibrated": False, "baseline": True, "average_accuracy": avg,
        "per_task": per_task, "seconds": round(result.wall_time_s, 3), "peak_rss_mb": round(rss_mb, 1),
        "normalised_accuracy": normalised_accuracy(per_task, expert_acc),
        "params": result.params, "timings": result.summary()["timings"],
    }
    if merge is not None:
        row["merge"] = merge
        row["gap_closed"] = gap_closed(avg, merge_average, experts_average)
        row["note"] = RECOMPUTE_NOTE if result.params.get("recompute_features") else CACHED_NOTE
    if calibration_examples is not None:
        row["calibration_examples"] = calibration_examples
    if result.surgery is not None:
        row["extra_parameters"] = result.surgery.num_parameters()
    return row


def surgery_rows(
    names: Sequence[str],
    *,
    merge: str,
    merged,
    merge_average: float,
    experts: Mapping[str, Any],
    calibration: Mapping[str, list],
    heads: Mapping[str, Any],
    tests: Mapping[str, tuple],
    expert_acc: Mapping[str, float],
    params: Mapping[str, dict],
    batch: int,
    progress: bool = True,
    pooling: str = "pooler",
    recompute_features: bool = True,
) -> list[dict[str, Any]]:
    """Surgery/ProbSurgery on top of one merge, trained on FeatCal's calibration batches.

    recompute_features (the default) runs the frozen models every step, the authors' procedure and cost;
    False computes the features once: the same trained modules to round-off (tests/experiments/test_baselines_api.py),
    in a fraction of the time, for accuracy figures only (--surgery-features cached)."""
    from featcal.experiments.baselines.api import run_baseline

    rows = []
    n = _examples_per_task(calibration)
    for name in (n_ for n_ in names if n_ in SURGERY_BASELINES):
        with PeakRSS() as rss:
            res = run_baseline(name, merged=merged, experts=experts, calibration=calibration,
                               feature_fn=feature_fn(pooling), recompute_features=recompute_features,
                               progress=progress,
                               **params.get(name, {}))
        per_task = _score(res, heads, tests, batch)
        rows.append(baseline_row(res, per_task, rss.mb, expert_acc, merge=merge, merge_average=merge_average,
                                 calibration_examples=n))
        del res
    return rows


def merge_baseline_rows(
    names: Sequence[str],
    *,
    base,
    experts: Mapping[str, Any],
    calibration: Mapping[str, list],
    heads: Mapping[str, Any],
    tests: Mapping[str, tuple],
    expert_acc: Mapping[str, float],
    params: Mapping[str, dict],
    batch: int,
    progress: bool = True,
    pooling: str = "pooler",
) -> list[dict[str, Any]]:
    """RegMean, RegMean++ (on the calibration batches) and WUDI (data-free): one row each."""
    from featcal.experiments.baselines.api import run_baseline

    rows = []
    n = _examples_per_task(calibration)
    for name in (n_ for n_ in names if n_ in MERGE_BASELINES):
        data = calibration if method_spec(name).needs_calibration else None
        with PeakRSS() as rss:
            res = run_baseline(name, base=base, experts=experts, calibration=data, progress=progress,
                               feature_fn=feature_fn(pooling), **params.get(name, {}))
        per_task = _score(res, heads, tests, batch)
        rows.append(baseline_row(res, per_task, rss.mb, expert_acc,
                                 calibration_examples=None if data is None else n))
        del res
    return rows
