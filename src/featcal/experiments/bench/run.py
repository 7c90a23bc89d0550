"""`featcal bench`: experts, base, and each merge alone and + FeatCal, on an offline zoo.

Zoos are vision (pixel_values, pooler features) or text (input_ids + attention_mask, mean pooling);
the zoo's manifest says which, and every evaluation, calibration batch and drift curve follows it.
Every merged model comes from featcal's own `merge`, every calibrated one from featcal's own
`calibrate`; the zoo only supplies checkpoints, frozen heads and fixed data splits. Calibration draws
from the zoo's calibration split (never the test split). The cost of calibration is compared, in the
same run, with its floor: one forward of the merged model and of every expert over the same data.
FeatCal variants (`--featcal-variants`, FEATCAL_VARIANTS) add calibrated rows beside the reference's, each
row naming its `variant` (docs/variants.md). `--rows` picks the row set (bench/rows.py): the full sweep, or the
demo's few rows; one progress bar (bench/progress.py) counts the run's stages, the zoo build's experts included.
"""

from __future__ import annotations

import copy
import logging
import os
import shlex
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from featcal.config import FeatCalConfig, is_task_vector_merge, method_names, method_spec, registered_methods
from featcal.data.batch import Batch
from featcal.errors import ConfigError, OutputExistsError
from featcal.evaluation.classification import accuracy
from featcal.evaluation.features import Inputs, batches, head_rows, num_examples
from featcal.experiments.bench.baselines import (
    SURGERY_BASELINES,
    check_surgery_features,
    merge_baseline_rows,
    parse_baselines,
    surgery_rows,
)
from featcal.experiments.bench.cost import arithmetic_cost_ratio
from featcal.experiments.bench.memory import PeakRSS
from featcal.experiments.bench.metrics import BELOW_FLOOR, gap_closed, mean, normalised_accuracy
from featcal.experiments.bench.progress import RunProgress
from featcal.experiments.bench.regime import regime
from featcal.experiments.bench.rows import (
    ROW_SETS,
    RowPlan,
    check_demo_settings,
    demo_plan,
    full_plan,
)
from featcal.experiments.bench.table import variant_tag
from featcal.experiments.zoo.presets import get_preset
from featcal.io.write.report import Timer, build_report

log = logging.getLogger(__name__)

DEFAULT_METHODS = ("average", "task_arithmetic", "ties")  # vision presets; a text preset names its own


def bench_methods() -> dict[str, dict[str, Any]]:
    """The merges `featcal bench` can run, each with its paper's settings: every method of the method table that
    declares them (`MethodSpec.defaults`; WUDI's steps come from the preset, 300 the authors')."""
    return {s.name: dict(s.defaults) for s in registered_methods() if s.defaults is not None}


MERGE_PARAMS: dict[str, dict[str, Any]] = bench_methods()  # the built-in ones (registered later: bench_methods())
REGIME_METHODS = ("task_arithmetic", "regmean", "wudi")  # merged for the regime line when not benched
# --featcal-variants: what each changes in the bench's FeatCalConfig (docs/variants.md). "tuned" also gets
# what the bench knows and `featcal calibrate` would be told: the zoo's heads and a task-vector merge's scaling.
FEATCAL_VARIANTS: dict[str, dict[str, Any]] = {
    "reference": {},  # the paper's method, as configured: today's rows
    "joint_bias": {"bias_solve": "joint"},
    "final_norm": {"calibrate_final_norm": True},
    "sequential": {"block_statistics": "sequential"},
    "sequential_one_pass": {"block_statistics": "sequential_one_pass"},  # the same solution, fewer forwards
    "stem_norm": {"calibrate_stem_norm": True},
    "tuned": {"tune": True},
    "tuned_soft": {"tune": True, "tune_tiebreak": "soft"},  # agreement ties broken by the heads' KL, not the drift
    "tuned_auto": {"tune": True, "tune_tiebreak": "auto"},  # soft on tiny held-out parts, else drift
    "blockwise": {"tune": True, "tune_scope": "block"},  # ρ and λ chosen per block inside one calibration's pass
    "fixed_lambda": {"tune_fixed": ("lambda_ratio",)},  # with a tuned variant (tuned+fixed_lambda): λ not searched
    # with a tuned variant (tuned+scaling_only): only the merge's scaling searched, FeatCal at its configured values
    "scaling_only": {"tune_fixed": ("anchor_blend_rho", "lambda_ratio", "teacher_interp_alpha")},
    "cross_fit": {"tune_folds": 2},  # with a tuned variant (tuned+cross_fit): candidates scored on every example
    "one_split": {"tune_folds": 1},  # with a tuned variant: one held-out split at every size (before tune_folds)
    "screened": {"tune_screen": "auto"},  # with a tuned variant: candidates screened on 32 per task, the best confirmed
    "unconfirmed": {"tune_confirm": 0},  # with tuned+screened: the screen's best is the choice, nothing confirmed
    "screened16": {"tune_screen": 16},  # with a tuned variant: candidates screened on 16 per task (issue 50)
}


@dataclass
class BenchSettings:
    preset: str = "default"
    seed: int = 0
    calib_sizes: tuple[int, ...] = (256,)
    methods: tuple[str, ...] | None = None  # None: the preset's bench_methods, else DEFAULT_METHODS
    zoo_dir: Path | None = None  # default: zoo-cache/<preset>-seed<seed>
    base_cache: Path | None = None  # pretrained bases shared between zoo builds
    rebuild_zoo: bool = False  # rebuild a zoo cache built from another preset, seed or zoo version
    featcal: FeatCalConfig = field(default_factory=FeatCalConfig)
    eval_batch_size: int = 256
    baselines: tuple[str, ...] = ()  # see featcal.experiments.bench.baselines: none by default
    baseline_params: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> run_baseline params
    surgery_features: str = "recomputed"  # SURGERY_FEATURES: "cached" for accuracy figures at a fraction of the time

    sources: Path | None = None  # text presets: the downloaded data archives (featcal.experiments.zoo.text_sources)
    wudi_steps: int | None = None  # WUDI's steps in the bench merge and regime line (None: the preset's)
    featcal_variants: tuple[str, ...] = ("reference",)  # FEATCAL_VARIANTS; the first is the summary's and drift's
    rows: str = "full"  # ROW_SETS (bench/rows.py): the full sweep, or the demo's rows at calib_sizes' one size

    def resolved_zoo_dir(self) -> Path:
        return self.zoo_dir or Path("zoo-cache") / f"{self.preset}-seed{self.seed}"

    def resolved_methods(self) -> tuple[str, ...]:
        if self.rows == "demo":
            return self.plan().merges
        if self.methods is not None:
            return self.methods
        return tuple(getattr(get_preset(self.preset), "bench_methods", DEFAULT_METHODS))

    def plan(self) -> RowPlan:
        """The rows this run computes (bench/rows.py)."""
        if self.rows == "demo":
            return demo_plan(self.calib_sizes[0], get_preset(self.preset).calibration)
        return full_plan(self.resolved_methods(), self.calib_sizes, self.featcal_variants)

    def merge_params(self, method: str) -> dict[str, Any]:
        if method == "wudi":
            default = getattr(get_preset(self.preset), "wudi_steps", 300)
            return {"steps": default if self.wudi_steps is None else self.wudi_steps}
        return bench_methods()[method]


def validate(settings: BenchSettings) -> None:
    """Reject bad settings before any model is built or loaded."""
    preset = get_preset(settings.preset)
    if settings.rows not in ROW_SETS:
        raise ConfigError(f"unknown --rows {settings.rows!r}; choose from {', '.join(ROW_SETS)}")
    if not settings.calib_sizes:
        raise ConfigError("--calib-sizes needs at least one size")
    if settings.rows == "demo":
        check_demo_settings(settings.methods, settings.calib_sizes, settings.featcal_variants, settings.baselines)
    for n in settings.calib_sizes:
        if n < 1 or n > preset.calibration:
            raise ConfigError(
                f"calibration size {n} is out of range: the {preset.name} zoo holds {preset.calibration} "
                "calibration examples per task (test data is never used for calibration)"
            )
    methods = settings.resolved_methods()
    benched = bench_methods()
    bad = [m for m in methods if m not in benched]
    if bad or not methods:
        others = [m for m in method_names() if m not in benched]
        raise ConfigError(f"unknown merge methods {bad}; choose from {', '.join(benched)}"
                          + (f" ({', '.join(others)}: --baselines)" if others else ""))
    parse_baselines(settings.baselines)
    check_surgery_features(settings.surgery_features)
    _validate_baseline_params(settings)
    check_variants(settings.featcal_variants)
    if settings.wudi_steps is not None and settings.wudi_steps < 0:
        raise ConfigError(f"--wudi-steps must be at least 0, got {settings.wudi_steps}")
    if preset.modality == "text":
        from featcal.experiments.zoo.build import cached
        from featcal.experiments.zoo.text_build import check_text_inputs

        if cached(settings.resolved_zoo_dir(), preset, settings.seed) is None:  # the zoo will be built
            check_text_inputs(settings.sources)
    from featcal.experiments.zoo.vision_presets import VisionRealPreset

    if isinstance(preset, VisionRealPreset):
        from featcal.experiments.zoo.build import cached
        from featcal.experiments.zoo.vision_build import check_vision_inputs

        if cached(settings.resolved_zoo_dir(), preset, settings.seed) is None:  # the zoo will be built
            check_vision_inputs(preset, settings.sources)


def variant_options(variant: str) -> dict[str, Any]:
    """The FeatCalConfig changes of one variant: a FEATCAL_VARIANTS name, or several joined by "+"
    ("tuned+sequential_one_pass": the search with the sequential statistics); parts that set one option (two
    alternatives), an unknown or repeated part, or "reference" in a combination are refused."""
    parts = [p.strip() for p in variant.split("+")]
    bad = [p for p in parts if p not in FEATCAL_VARIANTS]
    if bad:
        where = f" in {variant!r}" if len(parts) > 1 else ""
        raise ConfigError(f"unknown FeatCal variants {bad}{where}; choose from {', '.join(FEATCAL_VARIANTS)}, "
                          "or join several with '+'")
    if len(parts) > 1 and "reference" in parts:
        raise ConfigError(f"FeatCal variant {variant!r}: 'reference' is the configured method and cannot be combined")
    if len(set(parts)) < len(parts):
        raise ConfigError(f"FeatCal variant {variant!r} names one variant twice")
    options: dict[str, Any] = {}
    for part in parts:
        for key, value in FEATCAL_VARIANTS[part].items():
            if key in options:  # alternatives (tuned / tuned_soft, sequential / sequential_one_pass)
                raise ConfigError(f"FeatCal variant {variant!r}: two of its parts set {key}; combine variants that change "
                                  "different options")
            options[key] = value
    for key, part in (("tune_fixed", "fixed_lambda or scaling_only"), ("tune_folds", "cross_fit or one_split"),
                      ("tune_screen", "screened or screened16"), ("tune_confirm", "unconfirmed")):
        if key in options and not options.get("tune"):
            raise ConfigError(f"FeatCal variant {variant!r}: {part} changes how a tuned variant searches; "
                              f"combine it with one (tuned+{part.split()[0]})")
    return options


def check_variants(variants: Sequence[str]) -> None:
    """Unknown, repeated, conflicting or no FeatCal variants are refused before any work."""
    if not variants:
        raise ConfigError(f"no FeatCal variant given; choose from {', '.join(FEATCAL_VARIANTS)}")
    for v in variants:
        variant_options(v)
    twice = sorted({v for v in variants if list(variants).count(v) > 1})
    if twice:
        raise ConfigError(f"FeatCal variants given twice: {', '.join(twice)}")


def _validate_baseline_params(settings: BenchSettings) -> None:
    """Parameters of a baseline that is not run, or that its schema refuses, fail before any work."""
    from featcal.config import parse
    from featcal.experiments.baselines.api import baselines

    for name, params in settings.baseline_params.items():
        if name not in settings.baselines:
            raise ConfigError(f"parameters given for baseline {name!r}, which is not in --baselines")
        parse(baselines()[name][0], params)


def _evaluate(model, heads: Mapping[str, Any], tests: Mapping[str, tuple], batch: int,
              pooling: str = "pooler") -> dict[str, float]:
    return {t: accuracy(model, heads[t], x, y, batch, pooling) for t, (x, y) in tests.items()}


def _batches(x: Inputs, size: int, trim: bool = True) -> list[Batch]:
    return batches(x, size, trim)


@torch.no_grad()
def forward_floor_seconds(merged, experts: Mapping[str, Any], calibration: Mapping[str, Sequence[dict]]) -> float:
    """Wall time of one forward of the merged model over all calibration data and of each expert over
    its own task's data: the least any calibration that looks at both sides' features can cost."""
    timer = Timer()
    for task, task_batches in calibration.items():
        for b in task_batches:
            merged(**b)
            experts[task](**b)
    return timer.seconds


@torch.no_grad()
def feature_drift(model, experts: Mapping[str, Any], calibration: Mapping[str, Sequence[dict]]) -> list[float]:
    """Per block, mean over tasks of E_tokens ||h_model - h_expert||² / ||h_expert||² at the block's
    output, each model run end to end on its task's calibration data (the paper's Figure 1 metric,
    the same quantity the engine logs)."""
    per_task = []
    for task, task_batches in calibration.items():
        sums: list[float] = []
        count = 0.0
        for b in task_batches:
            hm = model(**b, output_hidden_states=True).hidden_states[1:]
            he = experts[task](**b, output_hidden_states=True).hidden_states[1:]
            mask = b.get("attention_mask")  # text: padding tokens do not count
            w = torch.ones(hm[0].shape[:2]) if mask is None else mask.to(torch.float32)
            rel = [((m - e).pow(2).sum(-1) / e.pow(2).sum(-1).clamp_min(1e-12) * w).sum().item()
                   for m, e in zip(hm, he, strict=True)]
            sums = rel if not sums else [a + r for a, r in zip(sums, rel, strict=True)]
            count += float(w.sum())
        per_task.append([v / count for v in sums])
    return [sum(col) / len(col) for col in zip(*per_task, strict=True)]


def _warm_up(zoo, base, experts: Mapping[str, Any], pools: Mapping[str, Inputs], progress: bool) -> None:
    """One small, untimed merge and calibration, so that lazy imports and first-call allocations are
    not charged to whichever method happens to be timed first."""
    from featcal.calibration.front.api import calibrate
    from featcal.merging.api import merge

    merged = copy.deepcopy(base)
    merged.load_state_dict(merge(zoo.base_dir, zoo.expert_dirs, "average", progress=False))
    tiny = {t: _batches(head_rows(p, 2), 2) for t, p in pools.items()}
    calibrate(merged, base=base, experts=experts, calibration=tiny,
              config=FeatCalConfig(num_calibration_examples=2), progress=False)
    forward_floor_seconds(merged, experts, tiny)


def _json_record(d: Mapping[str, Any]) -> dict[str, Any]:
    """A drift record with tensors and numpy scalars turned into plain numbers."""
    return {k: (v if isinstance(v, str | int) else float(v)) for k, v in d.items()}


def _row(method: str, calibrated: bool, per_task: dict[str, float], seconds: float, rss: float, **extra) -> dict:
    return {"method": method, "calibrated": calibrated, "average_accuracy": mean(per_task), "per_task": per_task,
            "seconds": round(seconds, 3), "peak_rss_mb": round(rss, 1), **extra}


def _tokens(pools: Mapping[str, Inputs]) -> int | None:
    """Mean non-padding tokens per calibration text (None for images: the config knows them)."""
    masks = [p["attention_mask"] for p in pools.values() if isinstance(p, Mapping) and "attention_mask" in p]
    if not masks:
        return None
    return max(1, round(float(torch.cat([m.sum(1).float() for m in masks]).mean())))


def _examples_per_task(calibration: Mapping[str, list]) -> int:
    """The most examples any task's calibration batches hold: what RegMean(++) is told to read."""
    return max(sum(num_examples(b) for b in bs) for bs in calibration.values())


def _merge(zoo, method: str, params: dict[str, Any], calibration: Mapping[str, list], progress: bool):
    """featcal's own merge of the zoo's experts; RegMean(++) read the given calibration batches."""
    from featcal.merging.api import merge

    if method_spec(method).needs_calibration:
        return merge(zoo.base_dir, zoo.expert_dirs, method, progress=progress, calibration=calibration,
                     num_calibration_examples=_examples_per_task(calibration), **params)
    return merge(zoo.base_dir, zoo.expert_dirs, method, progress=progress, **params)


def _regime_record(rows: list[dict], zoo, base, heads, tests, settings: BenchSettings, calibration,
                   pooling: str, bar: RunProgress) -> dict[str, Any]:
    """The regime line's numbers: from the benched rows, merging TA / RegMean / WUDI only where absent."""
    found = {r["method"]: r["average_accuracy"] for r in rows if not r["calibrated"] and not r.get("baseline")}
    extra_seconds: dict[str, float] = {}
    for method in REGIME_METHODS:
        if method not in found:
            with bar.stage(f"{method} for the regime line"):
                timer = Timer()
                merged = copy.deepcopy(base)
                merged.load_state_dict(_merge(zoo, method, settings.merge_params(method), calibration, False))
                found[method] = mean(_evaluate(merged, heads, tests, settings.eval_batch_size, pooling))
                extra_seconds[method] = round(timer.seconds, 2)
                del merged
    experts_average = mean({r["task"]: r["average_accuracy"] for r in rows if r["method"] == "expert"})
    record = regime(found["base"], found["task_arithmetic"], experts_average, found["regmean"], found["wudi"],
                    MERGE_PARAMS["task_arithmetic"]["scaling"], _examples_per_task(calibration))
    record["merged_for_the_regime_only"] = extra_seconds  # method -> seconds (merge + evaluation)
    return record


def run_bench(settings: BenchSettings, progress: bool = True) -> dict[str, Any]:
    """Run the whole benchmark in memory and return its report (see `write_bench` for the files).

    `progress` draws one bar over the whole run (bench/progress.py); every stage's own bar stays off, transformers'
    loading and saving bars included, so `progress=False` silences them all."""
    from tqdm.contrib.logging import logging_redirect_tqdm

    from featcal.io.read.models import hf_progress_bars

    with hf_progress_bars(False), logging_redirect_tqdm():
        return _run_bench(settings, progress)


@dataclass
class _Run:
    """What every stage of one bench run reads: its settings, the zoo with its frozen heads and test splits,
    and (once loaded) the experts and the base."""

    settings: BenchSettings
    progress: bool  # the stages' own bars: off, the run's one bar (`bar`) counts them
    zoo: Any
    bar: RunProgress
    plan: RowPlan
    heads: dict[str, Any] = field(default_factory=dict)
    tests: dict[str, tuple] = field(default_factory=dict)
    experts: dict[str, Any] = field(default_factory=dict)
    base: Any = None
    expert_acc: dict[str, float] = field(default_factory=dict)

    @property
    def tasks(self) -> list[str]:
        return self.zoo.tasks

    @property
    def pooling(self) -> str:
        return self.zoo.pooling

    @property
    def experts_average(self) -> float:
        return mean(self.expert_acc)

    def evaluate(self, model) -> dict[str, float]:
        return _evaluate(model, self.heads, self.tests, self.settings.eval_batch_size, self.pooling)


@dataclass
class _CalibrationSets:
    """The calibration split's batches every merge shares, each a fixed prefix of the split."""

    largest: dict[str, list[Batch]]  # FeatCal's and the data merges', at the largest size
    largest_untrimmed: dict[str, list[Batch]]  # the trained baselines concatenate batches: one width (same examples)
    drift_probe: dict[str, list[Batch]]  # a fixed slice for the drift curves
    regime: dict[str, list[Batch]]  # what the regime line's RegMean reads (the full sweep: `largest`)


def _planned_stages(settings: BenchSettings, plan: RowPlan, zoo_built: bool) -> int:
    """The run's stages before any work: the experts the zoo build trains, loading the experts and the base, the
    warm-up, each merge and each calibrated or baseline row, the regime line's own merges."""
    preset = get_preset(settings.preset)
    surgeries = sum(1 for b in settings.baselines if b in SURGERY_BASELINES)
    merge_baselines = 1 if any(b not in SURGERY_BASELINES for b in settings.baselines) else 0
    per_merge = sum(1 + len(plan.calibrated[m]) + surgeries for m in plan.merges)
    regime_only = sum(1 for m in REGIME_METHODS if m not in plan.merges)
    return ((len(preset.tasks) if zoo_built else 0) + 3 + per_merge + (plan.best_merge_row is not None)
            + merge_baselines + regime_only)


def _run_bench(settings: BenchSettings, progress: bool) -> dict[str, Any]:
    from featcal.experiments.zoo.build import cached

    validate(settings)
    load_before = os.getloadavg()
    total = Timer()
    plan = settings.plan()
    zoo_built = cached(settings.resolved_zoo_dir(), get_preset(settings.preset), settings.seed) is None
    bar = RunProgress(_planned_stages(settings, plan, zoo_built), progress)
    try:
        zoo_timer = Timer()
        run = _Run(settings, False, _ready_zoo(settings, bar), bar, plan)
        zoo_seconds = zoo_timer.seconds
        bar.catch_up(len(run.tasks) if zoo_built else 0)  # a builder that reports no experts: counted here
        run.heads, run.tests = run.zoo.heads(), run.zoo.test_splits()
        with bar.stage("experts"):
            rows = _expert_rows(run)
        with bar.stage("base"):
            rows.append(_base_row(run))
        pools = {t: run.zoo.split(t, "calibration")[0] for t in run.tasks}
        with bar.stage("warm-up"):
            _warm_up(run.zoo, run.base, run.experts, pools, False)
        sets = _calibration_sets(settings, pools, plan.regime_size)
        drift_curves: dict[str, list[dict]] = {}
        best: _Merged | None = None  # the best merge alone (demo: kept for its + FeatCal row)
        for method in plan.merges:
            method_rows, merged = _method_rows(run, method, pools, sets, drift_curves)
            rows += method_rows
            alone = method_rows[0]
            if plan.best_merge_row is not None and (best is None or alone["average_accuracy"] > best.average):
                best = _Merged(method, merged, alone["average_accuracy"], alone["seconds"], alone["feature_drift"])
        rows += _best_merge_rows(run, best, pools, sets, drift_curves)
        if any(b not in SURGERY_BASELINES for b in settings.baselines):
            with bar.stage("baselines"):
                rows += merge_baseline_rows(settings.baselines, base=run.base, experts=run.experts,
                                            calibration=sets.largest, heads=run.heads, tests=run.tests,
                                            expert_acc=run.expert_acc, params=settings.baseline_params,
                                            batch=settings.eval_batch_size, progress=False, pooling=run.pooling)
        base_row = next(r for r in rows if r["method"] == "base")
        base_row["normalised_accuracy"] = normalised_accuracy(base_row["per_task"], run.expert_acc)
        regime_record = _regime_record(rows, run.zoo, run.base, run.heads, run.tests, settings, sets.regime,
                                       run.pooling, bar)
    finally:
        bar.close()
    log.info("%s", regime_record["line"])
    return _report(run, rows, regime_record, drift_curves, pools, zoo_seconds=zoo_seconds,
                   load_before=load_before, total=total)


@dataclass
class _Merged:
    """A merge alone, kept while the run looks for the best one (demo)."""

    method: str
    model: Any
    average: float
    seconds: float
    drift: list[float]


def _best_merge_rows(run: _Run, best: _Merged | None, pools: Mapping[str, Inputs], sets: _CalibrationSets,
                     drift_curves: dict[str, list[dict]]) -> list[dict]:
    """The demo's last row: the best merge alone + FeatCal, unless that merge already has this very row."""
    planned = run.plan.best_merge_row
    if planned is None or best is None:
        return []
    if not run.plan.best_needs_row(best.method):
        run.bar.add(-1)  # the best merge is one whose + FeatCal row is already there (TA, say)
        return []
    with run.bar.stage(f"{best.method} + FeatCal ({planned.size}/task), the best merge"):
        row, calibrated_drift = _featcal_row(run, best.method, run.settings.merge_params(best.method), best.model,
                                             planned.size, pools, sets.drift_probe, merge_seconds=best.seconds,
                                             merge_avg=best.average, variant=planned.variant)
    row["best_merge"] = True
    drift_curves[best.method] = [{"block": i, "before": b, "after": a}
                                 for i, (b, a) in enumerate(zip(best.drift, calibrated_drift, strict=True))]
    return [row]


def _ready_zoo(settings: BenchSettings, bar: RunProgress):
    """The zoo the bench runs on: reused when cached, else built (--rebuild-zoo replaces a stale one), each
    expert trained counted on the run's bar."""
    from featcal.experiments.zoo.build import build_zoo
    from featcal.experiments.zoo.store import MANIFEST

    # --rebuild-zoo replaces a stale zoo, never a directory that is not a zoo at all
    rebuild = settings.rebuild_zoo and (settings.resolved_zoo_dir() / MANIFEST).is_file()
    try:
        return build_zoo(settings.resolved_zoo_dir(), settings.preset, settings.seed, progress=False,
                         base_cache=settings.base_cache, overwrite=rebuild, sources=settings.sources,
                         on_expert=lambda task: bar.tick(f"zoo: expert {task} trained"))
    except OutputExistsError as e:  # build_zoo's advice names `featcal zoo build`'s flag, not the bench's
        if settings.rebuild_zoo:  # given, yet the folder holds no zoo.json: not a zoo it may replace
            raise OutputExistsError(
                f"{settings.resolved_zoo_dir()} is not empty and holds no {MANIFEST}: --rebuild-zoo replaces only a "
                "zoo featcal built; choose another --zoo-dir, or empty that folder yourself"
            ) from e
        raise OutputExistsError(
            f"{settings.resolved_zoo_dir()} holds a zoo built from another preset, seed or zoo version (an older "
            "featcal, say); pass --rebuild-zoo to rebuild it there, or --zoo-dir to build one elsewhere"
        ) from e


def recorded_accuracies(zoo, key: str) -> dict[str, float] | None:
    """The zoo build's own test accuracies (`base_accuracy`, `expert_accuracy`) per task, where it recorded them:
    the same models, heads and test splits the bench scores, so the demo reads them instead of scoring again."""
    tasks = zoo.manifest.get("tasks", {})
    found = {t: tasks.get(t, {}).get(key) for t in zoo.tasks}
    return None if any(not isinstance(v, float) for v in found.values()) else found


def _reused(run: _Run, key: str) -> dict[str, float] | None:
    """The zoo's recorded accuracies where the row set reuses them (the demo), else None: scored here."""
    return recorded_accuracies(run.zoo, key) if run.settings.rows == "demo" else None


def _expert_rows(run: _Run) -> list[dict]:
    """Load every expert (kept in `run`) and score it on its own task (the demo: the zoo build's score)."""
    from featcal.io.read.models import load_model

    rows = []
    recorded = _reused(run, "expert_accuracy")
    for t in run.tasks:
        with PeakRSS() as rss:
            timer = Timer()
            run.experts[t] = load_model(run.zoo.expert_dir(t))
            acc = recorded[t] if recorded else accuracy(run.experts[t], run.heads[t], *run.tests[t],
                                                        run.settings.eval_batch_size, run.pooling)
        extra = {"accuracy_from": "zoo build"} if recorded else {}
        rows.append(_row("expert", False, {t: acc}, timer.seconds, rss.mb, task=t, **extra))
        log.info("expert %s: %.4f", t, acc)
    run.expert_acc = {r["task"]: r["average_accuracy"] for r in rows}
    return rows


def _base_row(run: _Run) -> dict:
    """Load the base (kept in `run`) and score it on every task (the demo: the zoo build's scores)."""
    from featcal.io.read.models import load_model

    recorded = _reused(run, "base_accuracy")
    with PeakRSS() as rss:
        timer = Timer()
        run.base = load_model(run.zoo.base_dir)
        per_task = recorded or run.evaluate(run.base)
    log.info("base: %.4f", mean(per_task))
    return _row("base", False, per_task, timer.seconds, rss.mb, **({"accuracy_from": "zoo build"} if recorded else {}))


def _calibration_sets(settings: BenchSettings, pools: Mapping[str, Inputs], regime_size: int) -> _CalibrationSets:
    n_max = max(settings.calib_sizes)
    batch_size = settings.featcal.calibration_batch_size
    largest = {t: _batches(head_rows(p, n_max), batch_size) for t, p in pools.items()}
    return _CalibrationSets(
        largest=largest,
        largest_untrimmed={t: _batches(head_rows(p, n_max), batch_size, trim=False) for t, p in pools.items()},
        drift_probe={t: _batches(head_rows(p, 64), 64) for t, p in pools.items()},
        regime=largest if regime_size == n_max else {t: _batches(head_rows(p, regime_size), batch_size)
                                                     for t, p in pools.items()},
    )


def _method_rows(run: _Run, method: str, pools: Mapping[str, Inputs], sets: _CalibrationSets,
                 drift_curves: dict[str, list[dict]]) -> tuple[list[dict], Any]:
    """One merge's rows: the merge alone, + FeatCal at each planned size and variant (the plan's drift row's
    curve goes into `drift_curves`), then the Surgery baselines on top of it; (rows, the merged model)."""
    settings, bar = run.settings, run.bar
    params = settings.merge_params(method)
    with bar.stage(method):
        with PeakRSS() as rss:
            timer = Timer()
            state = _merge(run.zoo, method, params, sets.largest, run.progress)
            merged = copy.deepcopy(run.base)
            merged.load_state_dict(state)
            merge_seconds = timer.seconds
            per_task = run.evaluate(merged)
        merged_drift = feature_drift(merged, run.experts, sets.drift_probe)
    merge_avg = mean(per_task)
    extra = {"calibration_examples_of_merge": max(settings.calib_sizes)} if method_spec(method).needs_calibration else {}
    rows = [_row(method, False, per_task, merge_seconds, rss.mb, params=params, feature_drift=merged_drift,
                 normalised_accuracy=normalised_accuracy(per_task, run.expert_acc), gap_closed=0.0, **extra)]
    log.info("%s: %.4f (%.1fs)", method, merge_avg, merge_seconds)
    for planned in run.plan.calibrated[method]:
        with bar.stage(f"{method} + FeatCal{variant_tag(planned.variant)} ({planned.size}/task)"):
            row, calibrated_drift = _featcal_row(run, method, params, merged, planned.size, pools, sets.drift_probe,
                                                 merge_seconds=merge_seconds, merge_avg=merge_avg,
                                                 variant=planned.variant)
        rows.append(row)
        if planned == run.plan.drift_rows.get(method):
            drift_curves[method] = [{"block": i, "before": b, "after": a}
                                    for i, (b, a) in enumerate(zip(merged_drift, calibrated_drift, strict=True))]
    for name in (b for b in settings.baselines if b in SURGERY_BASELINES):
        with bar.stage(f"{method} + {name}"):
            rows += surgery_rows((name,), merge=method, merged=merged, merge_average=merge_avg,
                                 experts=run.experts, calibration=sets.largest_untrimmed, heads=run.heads,
                                 tests=run.tests, expert_acc=run.expert_acc, params=settings.baseline_params,
                                 batch=settings.eval_batch_size, progress=run.progress, pooling=run.pooling,
                                 recompute_features=settings.surgery_features == "recomputed")
    return rows, merged


def _tune_arguments(run: _Run, method: str, params: Mapping[str, Any]) -> dict[str, Any]:
    """What the "tuned" variant's search is told: each task's frozen head, read on the pooled features the
    bench evaluates, and the merge's scaling where the merge is a task-vector merge (so it can be searched)."""
    from featcal.evaluation.features import features

    heads = {t: (lambda model, batch, h=run.heads[t]: h(features(model, batch, run.pooling))) for t in run.tasks}
    return {"heads": heads, "merge_scaling": params.get("scaling") if is_task_vector_merge(method) else None}


def _variant_record(variant: str, result) -> dict[str, Any]:
    """What a non-reference row adds: the final or stem norm's record, the search's choice (each part of a
    "+" combination adds its own)."""
    options = variant_options(variant)
    out: dict[str, Any] = {}
    if options.get("calibrate_final_norm"):
        out["final_norm"] = result.final_norm
    if options.get("calibrate_stem_norm"):
        out["stem_norm"] = result.stem_norm
    if result.tuning is not None and result.tuning.get("scope") == "block":  # blockwise: each block's choice
        out["tuning_blocks"] = [{k: b[k] for k in ("stack", "layer", "chosen", "held_out_drift", "start_drift")}
                                for b in result.tuning["blocks"]]
    elif result.tuning is not None:  # the tuned variants
        rec = result.tuning
        out.update({"tuning_chosen": rec["chosen"], "tuning_criterion": rec.get("criterion"),
                    "tuning_min_evidence": rec.get("min_evidence"),
                    "tuning_candidates": [{k: v for k, v in c.items() if k != "per_task"} for c in rec["candidates"]],
                    "tuning_comparisons": rec.get("comparisons", []),
                    # search / refit / their sum over the refit: a ratio to one calibration taken inside the row,
                    # so a machine slowing between rows does not move it
                    "tuning_seconds": rec.get("seconds")})
    return out


def _featcal_row(run: _Run, method: str, params: dict[str, Any], merged, n: int, pools: Mapping[str, Inputs],
                 drift_probe: Mapping[str, list], *, merge_seconds: float, merge_avg: float,
                 variant: str = "reference") -> tuple[dict, list[float]]:
    """The merge + FeatCal (`variant`, FEATCAL_VARIANTS or a "+" combination) on `n` calibration examples per task, timed against
    its forward floor; (its row, its feature drift per block)."""
    from featcal.calibration.front.api import calibrate

    cfg = run.settings.featcal.model_copy(update={"num_calibration_examples": n, **variant_options(variant)})
    calibration = {t: _batches(head_rows(pools[t], n), cfg.calibration_batch_size) for t in run.tasks}
    tune = _tune_arguments(run, method, params) if cfg.tune and cfg.tune_scope == "model" else {}
    floor = forward_floor_seconds(merged, run.experts, calibration)
    with PeakRSS() as rss:
        timer = Timer()
        result = calibrate(merged, base=run.zoo.base_dir, experts=run.experts, calibration=calibration,
                           config=cfg, progress=run.progress, **tune)
        calibrated = result.model
        calib_seconds = timer.seconds
    per_task = run.evaluate(calibrated)
    engine_drift = [_json_record(d) for d in result.drift]
    calibrated_drift = feature_drift(calibrated, run.experts, drift_probe)
    avg = mean(per_task)
    row = _row(method, True, per_task, merge_seconds + calib_seconds, rss.mb, params=params,
               calibration_examples=n, calibration_seconds=round(calib_seconds, 4),
               forward_floor_seconds=round(floor, 4), cost_ratio=calib_seconds / floor,
               normalised_accuracy=normalised_accuracy(per_task, run.expert_acc),
               gap_closed=gap_closed(avg, merge_avg, run.experts_average),
               feature_drift=calibrated_drift, engine_drift=engine_drift, variant=variant,
               **_variant_record(variant, result))
    if calib_seconds < floor:
        row["cost_ratio_note"] = BELOW_FLOOR
        log.warning("%s + FeatCal [%s] (%d/task): calibration %.2fs under its forward floor %.2fs: %s", method,
                    variant, n, calib_seconds, floor, BELOW_FLOOR)
    log.info("%s + FeatCal [%s] (%d/task): %.4f (%.1fs, floor %.1fs)", method, variant, n, avg, calib_seconds, floor)
    return row, calibrated_drift


def _report(run: _Run, rows: list[dict], regime_record: dict[str, Any], drift_curves: dict[str, list[dict]],
            pools: Mapping[str, Inputs], *, zoo_seconds: float, load_before: tuple[float, ...],
            total: Timer) -> dict[str, Any]:
    settings, zoo = run.settings, run.zoo
    methods = settings.resolved_methods()
    return build_report(
        "bench",
        {"preset": settings.preset, "seed": settings.seed, "rows": settings.rows,
         "calib_sizes": list(settings.calib_sizes), "regime_calibration_examples": run.plan.regime_size,
         "methods": list(methods), "featcal_variants": list(run.plan.variants()),
         "baselines": list(settings.baselines), "surgery_features": settings.surgery_features,
         "baseline_params": settings.baseline_params, "merge_params": {m: settings.merge_params(m) for m in methods},
         "featcal": settings.featcal.model_dump(mode="json"), "zoo_dir": str(settings.resolved_zoo_dir())},
        command_line=shlex.join(["featcal", *sys.argv[1:]]) if Path(sys.argv[0]).name == "featcal" else shlex.join(sys.argv),
        seed=settings.seed,
        tasks=run.tasks,
        experts_average=run.experts_average,
        rows=rows,
        summary=summarise(rows, run.experts_average, settings,
                          arithmetic_cost_ratio(run.base.config, _tokens(pools))),
        regime=regime_record,
        drift=drift_curves,
        zoo={"root": str(zoo.root), "fingerprint": zoo.manifest["fingerprint"], "modality": zoo.modality,
             "pooling": run.pooling, "regime_at_build": zoo.manifest["regime"],
             "seconds_to_ready": round(zoo_seconds, 2)},
        load_average={"start": load_before, "end": os.getloadavg()},
        threads=torch.get_num_threads(),
        total_seconds=round(total.seconds, 2),
    )


def summarise(rows: list[dict], experts_average: float, settings: BenchSettings,
              arithmetic_ratio: float) -> dict[str, Any]:
    """Headline numbers: per merge, accuracy alone and calibrated, gap closed and cost ratio, per size (the
    first variant's; every variant's under `variants`); beside the measured cost ratios, the exact method's
    arithmetic ratio to the floor (bench/cost.py)."""
    out: dict[str, Any] = {"experts_average": experts_average, "cost_ratio_arithmetic": arithmetic_ratio}
    base = next(r for r in rows if r["method"] == "base")
    out["base_average"] = base["average_accuracy"]
    variants = settings.plan().variants()
    for method in settings.resolved_methods():
        alone = next(r for r in rows if r["method"] == method and not r["calibrated"])
        per_variant = {}
        for variant in variants:
            cal = {r["calibration_examples"]: r for r in rows
                   if r["method"] == method and r["calibrated"] and r.get("variant", "reference") == variant}
            per_variant[variant] = {
                "calibrated_average": {n: r["average_accuracy"] for n, r in cal.items()},
                "gap_closed": {n: r["gap_closed"] for n, r in cal.items()},
                "cost_ratio": {n: r["cost_ratio"] for n, r in cal.items()},
            }
        out[method] = {"merge_average": alone["average_accuracy"], **per_variant[variants[0]],
                       "variants": per_variant}
    return out


def write_bench(report: dict[str, Any], out: str | os.PathLike, overwrite: bool = False) -> Path:
    """Write bench.json, table.md, drift.png (and calib_sizes.png for a sweep) atomically into `out`."""
    import json

    from featcal.experiments.bench.plot import drift_plot, sample_efficiency_plot
    from featcal.experiments.bench.table import bench_table
    from featcal.io.write.atomic import atomic_output_dir

    with atomic_output_dir(out, overwrite) as tmp:
        (tmp / "bench.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
        (tmp / "table.md").write_text(bench_table(report))
        if report["drift"] and all(report["drift"].values()):
            n = max(report["params"]["calib_sizes"])
            drift_plot(report["drift"], tmp / "drift.png",
                       f"{report['params']['preset']} zoo: feature drift by block ({n} calibration examples/task)")
        sizes = report["params"]["calib_sizes"]
        if len(sizes) > 1:
            points = {m: {int(k): v for k, v in s["calibrated_average"].items()}
                      for m, s in report["summary"].items() if isinstance(s, dict) and "calibrated_average" in s}
            baselines = {"experts": report["experts_average"],
                         **{m: report["summary"][m]["merge_average"] for m in points}}
            sample_efficiency_plot(points, baselines, tmp / "calib_sizes.png")
    return Path(out)
