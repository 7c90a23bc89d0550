"""`calibrate(..., config.tune)`: prepare the search, run it, refit the choice on all data, record it."""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from featcal.blocks.adapters import Adapter, adapter_for
from featcal.calibration.core import setting as core
from featcal.calibration.core.inputs import (
    adapter_reader,
    as_model,
    check_base_for_rho,
    check_tasks,
    normalise_batches,
    resolve_device,
)
from featcal.calibration.core.result import CalibrationResult, TunedCandidate, TuningRecord
from featcal.calibration.engine.driver import SearchHooks
from featcal.calibration.engine.expert_tape import ExpertTape
from featcal.calibration.tuning import record as records
from featcal.calibration.tuning import search as rules
from featcal.calibration.tuning.features import NEXT_TOKEN, Head, Reference, expert_reference, has_lm_head
from featcal.calibration.tuning.heads import check_request, check_soft_tiebreak
from featcal.calibration.tuning.merges import base_source, rescale_merge
from featcal.calibration.tuning.per_block import calibrate_per_block, check_block_scope
from featcal.calibration.tuning.score import Score, combine_folds, score
from featcal.calibration.tuning.search import PatternSearch, Setting
from featcal.calibration.tuning.split import (
    AUTO_SOFT_MAX_HELD,
    Split,
    examples,
    fewest_held_out,
    folds_record,
    make_splits,
    resolve_folds,
    resolve_screen,
    screen_split,
)
from featcal.config import FeatCalConfig
from featcal.data.batch import Batch
from featcal.io.read.param_sources import CheckpointSource, ParamSource, load_into
from featcal.io.read.validate import validate_expert_names
from featcal.io.write.report import Timer

log = logging.getLogger("featcal.calibration")


@dataclass
class _Request:
    """The inputs as calibrate was given them, and how to open them."""

    merged: Any
    base: Any
    experts: Mapping[str, Any]
    config: FeatCalConfig
    allow_pickle: bool
    check_finite: bool
    expert_kind: Mapping[str, str]


@dataclass
class _Plan:
    """Everything the search was decided to be, before any calibration runs."""

    model: nn.Module  # the merge as given (loaded); candidates calibrate copies
    adapter: Adapter
    data: dict[str, list[Batch]]
    splits: list[Split]
    folds: int
    folds_why: str
    heads: dict[str, Head]  # what scores each task: a head given, or the LM head (next_token)
    given_heads: list[str]
    next_token: dict[str, Any]
    tiebreak: str
    tiebreak_why: str
    fixed: tuple[str, ...]
    fixed_why: str
    limit: int
    start: Setting
    knobs: list[str]
    screen: list[Split] | None = None  # the splits the screen fits candidates on (tune_screen), None: no screen
    screen_examples: int | None = None
    screen_why: str = ""


def calibrate_tuned(
    merged: Any, *, base: Any, experts: Mapping[str, Any], calibration: Mapping[str, Iterable[Any]],
    config: FeatCalConfig, heads: Mapping[str, Head] | None = None, merge_scaling: float | None = None,
    progress: bool = True, inplace: bool = False, allow_pickle: bool = False, keep_resume_state: bool = False,
    check_finite: bool = True, expert_kind: Mapping[str, str] | None = None,
) -> CalibrationResult:
    """Search, score on the held-out part, refit the choice on all data (tuning/__init__.py).

    The result is the refit's (core.calibrate_setting) with `tuning`: the split, every candidate's setting
    and score, the choice, and the seconds spent.
    """
    check_request(config, base, experts, heads, merge_scaling)
    if config.tune_scope == "block":  # one calibration, each block choosing its own ρ and λ (per_block.py)
        check_block_scope(config, heads)
        return calibrate_per_block(merged, base=base, experts=experts, calibration=calibration, config=config,
                                   progress=progress, inplace=inplace, allow_pickle=allow_pickle,
                                   check_finite=check_finite, expert_kind=expert_kind)
    request = _Request(merged, base, experts, config, allow_pickle, check_finite, dict(expert_kind or {}))
    plan = _plan(request, calibration, dict(heads or {}), merge_scaling)
    search = Timer()
    scorer = _CandidateScorer(request, plan, plan.splits, "full")
    if plan.screen is None:
        walk = PatternSearch(plan.start, plan.knobs, plan.limit, config.tune_min_evidence, plan.tiebreak, scorer)
        best, best_score = walk.run()
        chosen = walk.index_of[best]
    else:  # screen every candidate on a part of the fit data, confirm the best few on all of it
        screen = _CandidateScorer(request, plan, plan.screen, "screen", scorer)
        walk = PatternSearch(plan.start, plan.knobs, plan.limit, config.tune_min_evidence, plan.tiebreak, screen)
        walk.run()
        screen.tapes.clear()  # the screen's fit data is not used again
        best, best_score, chosen = _confirm(plan, walk, scorer, config)
    scorer.tapes.clear()  # the refit runs on all the data: nothing taped applies
    search_seconds = search.seconds
    refit = Timer()
    result = _refit(request, plan, scorer, best, progress, inplace, keep_resume_state)
    refit_seconds = refit.seconds
    seconds = {"search": round(search_seconds, 3), "refit": round(refit_seconds, 3),
               "total_over_refit": round((search_seconds + refit_seconds) / max(refit_seconds, 1e-9), 2)}
    tuning = _record(config, plan, scorer.candidates, walk, chosen, seconds)
    # the configured setting at the choice's size (the screen's, where nothing was confirmed)
    start = next((c for c in scorer.candidates if c.stage == "full"), scorer.candidates[0])
    log.info("featcal tune: chose candidate %d of %d %s (held-out drift %.6g, start %.6g); refit on all data",
             tuning.chosen.index, len(scorer.candidates), best.as_dict(), best_score.drift, start.drift)
    return result.with_tuning(tuning)


def _plan(request: _Request, calibration: Mapping[str, Iterable[Any]], heads: dict[str, Head],
          merge_scaling: float | None) -> _Plan:
    """The inputs checked and opened, the examples split, the auto rules resolved: all before any work."""
    config, experts = request.config, request.experts
    validate_expert_names(experts.keys())
    check_tasks(experts, calibration)
    check_base_for_rho(config, request.base)
    model = as_model(request.merged, "merged model", request.allow_pickle)
    adapter = adapter_for(model)
    main = adapter.main_input(model, adapter.stacks(model)[0])
    data = {t: normalise_batches(t, calibration[t], main) for t in experts}
    fewest_examples = min(examples(t, data[t]) for t in data)
    folds, folds_why = resolve_folds(config.tune_folds, fewest_examples, config.tune_holdout)
    splits = make_splits(data, folds, config.tune_holdout, config.seed)
    fewest_held = fewest_held_out(splits)
    scored, next_token = _scored_heads(config, model, heads, experts)
    tiebreak, tiebreak_why = rules.resolve_tiebreak(config.tune_tiebreak, scored, experts, fewest_held)
    if tiebreak == "soft":
        check_soft_tiebreak(scored, experts, "give heads or use tune_tiebreak 'drift'")
    fixed, fixed_why = rules.resolve_fixed(config.tune_fixed, fewest_held)
    if fewest_held <= AUTO_SOFT_MAX_HELD:  # measured: no one-split rule stayed above the defaults on every preset here
        log.warning("featcal tune: only %d held-out example(s) per task score the candidates: at this size every "
                    "one-split search rule measured fell below the paper's defaults on some preset; cross-fitting "
                    "(tune_folds auto, the default, or 2) scores every example (docs/tuning.md)", fewest_held)
    screen_examples, screen_why = resolve_screen(config.tune_screen, splits)
    screen = None if screen_examples is None else [screen_split(sp, screen_examples, config.seed) for sp in splits]
    start = Setting(config.anchor_blend_rho, config.lambda_ratio, config.teacher_interp_alpha,
                    None if merge_scaling is None else float(merge_scaling))
    searchable = (["merge_scaling"] if start.merge_scaling is not None else []) + (
        ["anchor_blend_rho"] if request.base is not None else []) + ["lambda_ratio", "teacher_interp_alpha"]
    return _Plan(model, adapter, data, splits, folds, folds_why, scored, sorted(heads), next_token, tiebreak,
                 tiebreak_why, fixed, fixed_why, rules.max_candidates(config.tune_budget, config.tune_holdout, folds), start,
                 [k for k in searchable if k not in fixed], screen, screen_examples, screen_why)


def _scored_heads(config: FeatCalConfig, model: nn.Module, heads: dict[str, Head],
                  experts: Mapping[str, Any]) -> tuple[dict[str, Head], dict[str, Any]]:
    """What scores each task's predictions: its head where given, else (tune_next_token, a causal LM) the model's
    own LM head; and featcal.json's record of the choice."""
    if not config.tune_next_token:
        return heads, records.next_token_record(False, "tune_next_token is off")
    if not has_lm_head(model):
        return heads, records.next_token_record(False, f"{type(model).__name__} has no LM head (not a causal LM)")
    lm_tasks = [t for t in experts if t not in heads]
    if not lm_tasks:
        return heads, records.next_token_record(False, "every task has a head of its own")
    why = "the model is a causal LM: its own LM head's next-token predictions score the candidates"
    return {**heads, **{t: NEXT_TOKEN for t in lm_tasks}}, records.next_token_record(True, why, lm_tasks)


class _CandidateScorer:
    """Scores a setting: calibrates the start merge (rebuilt at the setting's scaling) on each of `splits`' fit
    parts, scores it on the held-out part; the experts' references are computed once, after the first calibration
    (which validated every input). A screen's scorer (`stage` "screen") fits on a part of the fit data and shares
    the full scorer's references and list of candidates (`shared`): its held-out parts are the same."""

    def __init__(self, request: _Request, plan: _Plan, splits: list[Split], stage: str,
                 shared: _CandidateScorer | None = None) -> None:
        config = request.config
        self.request, self.plan, self.splits, self.stage = request, plan, splits, stage
        self.base_src = (base_source(request.base, plan.model, request.allow_pickle)
                         if plan.start.merge_scaling is not None else None)
        # held-out forwards run where calibration runs (calibrate hands its result back where the merge was)
        self.where = torch.device("cpu") if config.offload_blocks else resolve_device(config.device)
        self.search_cfg = config.model_copy(update={"tune": False, "resume": False})
        # per split: the experts' references on its held-out part; and every candidate scored, in order
        self.refs: list[dict[str, Reference]] = shared.refs if shared else [{} for _ in splits]
        # per split: the experts' block forwards on its fit part, kept across this scorer's candidates
        cache = int(config.tune_cache_gb * 2**30) // max(1, len(splits))
        self.tapes = [ExpertTape(cache) if cache > 0 else None for _ in splits]
        self.candidates: list[TunedCandidate] = shared.candidates if shared else []

    def start_model(self, s: Setting, target: nn.Module | None = None) -> nn.Module:
        """The merge to calibrate for `s`: the given one, or (another scaling) a copy, or `target`, rebuilt there."""
        start = self.plan.start
        if s.merge_scaling == start.merge_scaling:
            return self.plan.model
        m = copy.deepcopy(self.plan.model) if target is None else target
        rescale_merge(m, self.base_src, s.merge_scaling / start.merge_scaling)
        return m

    def __call__(self, s: Setting) -> Score:
        clock = Timer()
        request, plan = self.request, self.plan
        cfg = self.search_cfg.model_copy(update=s.config_values())
        fold_scores = []
        for k, split in enumerate(self.splits):  # one split, or each fold held out in turn (tune_folds)
            first = not self.candidates and k == 0
            m = self.start_model(s)
            out = core.calibrate_setting(m, base=request.base, experts=request.experts, calibration=split.fit,
                                         config=cfg, progress=False, inplace=m is not plan.model,
                                         allow_pickle=request.allow_pickle, check_finite=request.check_finite and first,
                                         expert_kind=request.expert_kind,
                                         search=SearchHooks(end_to_end=False, expert_tape=self.tapes[k])).model
            if first:  # the first calibration validated every input: now the experts' references, once
                self._references()
            fold_scores.append(score(out.to(self.where), plan.adapter, split.held, self.refs[k], plan.heads,
                                     request.config.tune_head_pooling))
            del out
        sc = combine_folds(fold_scores)
        self.candidates.append(TunedCandidate(len(self.candidates), s, sc.drift, sc.disagreement, sc.per_task,
                                              round(clock.seconds, 3), sc.soft, self.stage))
        log.info("featcal tune: %s candidate %d %s: drift %.6g%s", self.stage, len(self.candidates) - 1, s.as_dict(),
                 sc.drift,
                 "" if sc.disagreement is None else f", disagreement {sc.disagreement:.4f}")
        return sc

    def _references(self) -> None:
        """Every expert's features and predictions on every split's held-out part."""
        request, plan = self.request, self.plan
        for t in request.experts:
            expert = _expert_model(t, request.experts[t], request.base, plan.model, request.allow_pickle,
                                   request.expert_kind.get(t))
            if expert is not request.experts[t]:  # featcal's own copy (a caller's model is not moved)
                expert.to(self.where)
            for held_refs, held_split in zip(self.refs, self.splits, strict=True):
                held_refs[t] = expert_reference(t, expert, plan.adapter, held_split.held[t], plan.heads.get(t),
                                                request.config.tune_head_pooling,
                                                keep_log_probs=plan.tiebreak == "soft")
            del expert
        if plan.next_token["used"]:
            plan.next_token["held_out_positions"] = {
                t: sum(int(p.counts.sum()) for refs in self.refs for p in refs[t].predictions)
                for t in plan.next_token["tasks"]}


def _confirm(plan: _Plan, walk: PatternSearch, scorer: _CandidateScorer,
             config: FeatCalConfig) -> tuple[Setting, Score, int]:
    """The screen's best `tune_confirm` settings and the configured one, each fitted on the whole fit part; the
    choice among them as the walk chooses: from the configured setting, a finalist replaces the best so far only
    where it scores better (so the choice never scores worse than the configured setting at full size).
    (the choice, its score, its index among the candidates)."""
    ranked = sorted(walk.scores, key=lambda s: (_rank_key(walk.scores[s], plan.tiebreak), walk.index_of[s]))
    if config.tune_confirm == 0:  # the screen's best is the choice (its score is the screen's)
        return ranked[0], walk.scores[ranked[0]], walk.index_of[ranked[0]]
    finalists = [plan.start] + [s for s in ranked if s != plan.start][:config.tune_confirm]
    best, best_score = finalists[0], scorer(finalists[0])
    best_index = len(scorer.candidates) - 1
    for s in finalists[1:]:
        sc = scorer(s)
        index = len(scorer.candidates) - 1
        better, record = rules.compare(index, sc, best_index, best_score, config.tune_min_evidence, plan.tiebreak)
        walk.comparisons.append(record)
        if better:
            best, best_score, best_index = s, sc, index
    return best, best_score, best_index


def _rank_key(sc: Score, tiebreak: str) -> tuple[float, float]:
    """A screened score's rank: fewer disagreements first (where scored), then the tie-break's score."""
    second = sc.drift if tiebreak == "drift" or sc.soft is None else sc.soft
    return (0.0 if sc.disagreement is None else sc.disagreement, second)


def _expert_model(task: str, expert: Any, base: Any, template: nn.Module, allow_pickle: bool,
                  kind: str | None = None) -> nn.Module:
    """Expert t as a whole model for its held-out forwards (a path, LoRA adapter or GGUF file is read as
    calibrate reads it, into a copy of the merged model)."""
    if isinstance(expert, nn.Module):
        return expert.eval()
    model = copy.deepcopy(template)
    label = f"expert {task!r}"
    src: ParamSource = CheckpointSource(expert, model, label, allow_pickle=allow_pickle,
                                        reader=adapter_reader(expert, base, label, allow_pickle, kind))
    held = [n for n, p in model.named_parameters(remove_duplicate=False) if src.shape(n) == tuple(p.shape)]
    load_into(model, held, src)
    return model.eval()


def _refit(request: _Request, plan: _Plan, scorer: _CandidateScorer, best: Setting, progress: bool, inplace: bool,
           keep_resume_state: bool) -> CalibrationResult:
    """The chosen setting calibrated on all the data (the caller's model changed only with `inplace`)."""
    final_cfg = request.config.model_copy(update={**best.config_values(), "tune": False})
    may_modify = inplace or not isinstance(request.merged, nn.Module)  # a caller's model stays as given unless inplace
    if best.merge_scaling == plan.start.merge_scaling:
        m, in_place = plan.model, may_modify
    else:
        m, in_place = scorer.start_model(best, plan.model if may_modify else copy.deepcopy(plan.model)), True
    return core.calibrate_setting(m, base=request.base, experts=request.experts, calibration=plan.data,
                                  config=final_cfg, progress=progress, inplace=in_place,
                                  allow_pickle=request.allow_pickle, keep_resume_state=keep_resume_state,
                                  expert_kind=request.expert_kind,
                                  check_finite=False)  # every input was scanned by the first candidate


def _record(config: FeatCalConfig, plan: _Plan, candidates: list[TunedCandidate], walk: PatternSearch, chosen: int,
            seconds: dict[str, float]) -> TuningRecord:
    """featcal.json's "tuning" (result.TuningRecord)."""
    return TuningRecord(
        criterion=records.criterion(plan.next_token["used"]), heads=plan.given_heads,
        holdout=config.tune_holdout if plan.folds == 1 else None,  # cross-fitting holds every example out once
        seed=config.seed, folds=plan.folds, folds_setting=config.tune_folds, folds_why=plan.folds_why,
        split=folds_record(plan.splits),
        budget={"calibrations": config.tune_budget, "max_candidates": plan.limit, "candidates": len(candidates),
                "candidate_cost": round(rules.candidate_cost(config.tune_holdout, plan.folds), 4)},
        screen=_screen_record(config, plan, candidates),
        searched=plan.knobs, fixed=list(plan.fixed),
        fixed_setting=config.tune_fixed if config.tune_fixed == "auto" else list(config.tune_fixed),
        fixed_why=plan.fixed_why, start=plan.start, candidates=candidates, min_evidence=config.tune_min_evidence,
        comparisons=walk.comparisons, chosen=candidates[chosen], tiebreak=plan.tiebreak,
        tiebreak_setting=config.tune_tiebreak, tiebreak_why=plan.tiebreak_why, seconds=seconds,
        next_token=plan.next_token,
    )


def _screen_record(config: FeatCalConfig, plan: _Plan, candidates: list[TunedCandidate]) -> dict[str, Any]:
    """featcal.json's tuning.screen: whether candidates were screened on part of the fit data, on how many examples
    per task, why, and how many were screened and confirmed."""
    out: dict[str, Any] = {"setting": config.tune_screen, "examples_per_task": plan.screen_examples,
                           "why": plan.screen_why}
    if plan.screen is not None:
        out.update(confirm=config.tune_confirm, screened=sum(c.stage == "screen" for c in candidates),
                   confirmed=[c.index for c in candidates if c.stage == "full"],
                   fit={t: r["screen_fit"] for t, r in plan.screen[0].record.items()})
    return out
