"""Label-free selection of FeatCal's hyperparameters (issue 17): `tune` in FeatCalConfig.

Why: ρ, λ, α and where the merge starts move FeatCal's result a lot, and the right values differ between
models, while a user has an unlabeled calibration set and nothing else. So each task's calibration
examples are split (seeded) into a fit part and a held-out part; each candidate setting is calibrated on
the fit part and scored on the held-out part by a criterion that needs no labels:

- final-feature drift: mean over tasks of ||h − h_t||² / ||h_t||² at the output of the last block (class
  token only where the model's output is read from it, padding left out), h the candidate's features and
  h_t expert t's, on task t's held-out examples;
- where a task head is given: disagreement with expert t's predictions through that head (fewer is
  better), ties broken by `tune_tiebreak`: the drift above (`drift`, the default) or the mean
  KL(expert t's head softmax ‖ the candidate's) (`soft`), which at 8 examples per task does not reward the
  smaller λ that lowers held-out drift and still generalises worse (docs/tuning.md), or `auto`: `soft` where
  every task has a head and the held-out parts are tiny (`AUTO_SOFT_MAX_HELD`), else `drift`;
- optionally (`tune_min_evidence` z > 0) a step is taken only when its held-out improvement is at least z
  paired standard errors (`evidence`); off by default, because at z = 2 it hurt on every run measured.

The search is a deterministic pattern search along fixed ladders, one knob at a time (the starting merge's
scaling where the merge can be rebuilt, then ρ, λ, α), from the configured values (the paper's by default):
the first candidate IS the configured setting, so the choice never scores worse on the held-out part.
The chosen setting is then refit on ALL calibration examples by a plain calibration.

Cross-fitting (`tune_folds` k ≥ 2; `auto`, the default, where one split would hold out ≤ 4 examples per task):
each task's examples are dealt into k folds, a candidate is calibrated k times, each time without one fold,
and every example is scored by the calibration that did not see it; the scores are pooled (combine_folds).

Reuse: the experts' held-out features and predictions are computed once for all candidates. Statistics
are not shared between candidates: past block 1 every block's statistics are taken on the chain calibrated
with the candidate's own values, so the identity that makes α free (statistics.py) holds within one block
only, and using it would change the method (a per-block choice), not reuse its work.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import logging
import math
import os
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from featcal.blocks.adapters import Adapter, adapter_for
from featcal.blocks.adapters.base import accepted_inputs
from featcal.blocks.heads import load_head
from featcal.calibration import core
from featcal.calibration.distributed import current_group
from featcal.calibration.inputs import (
    adapter_reader,
    as_model,
    check_base_for_rho,
    check_tasks,
    normalise_batches,
    resolve_device,
)
from featcal.calibration.result import CalibrationResult
from featcal.config import DEFAULT_TUNE_HOLDOUT, FeatCalConfig, is_task_vector_merge
from featcal.config import (
    TASK_VECTOR_METHODS as TASK_VECTOR_METHODS,  # merges θ0 + s·v: the method table's, importable here as before
)
from featcal.data.batch import Batch
from featcal.errors import CalibrationDataError, CheckpointError, ConfigError
from featcal.io.checkpoint import read_json
from featcal.io.param_sources import CheckpointSource, ModelSource, ParamSource, load_into
from featcal.io.report import REPORT_NAME, Timer, checkpoint_hashes
from featcal.io.validate import validate_expert_names

log = logging.getLogger("featcal.calibration")

# a task head: an nn.Module applied to the model's pooled output, or a callable head(model, batch) -> logits
Head = nn.Module | Callable[[nn.Module, Batch], torch.Tensor]

# the ladders the search steps along (the configured value is inserted where it is not on one)
SCALING_FACTORS: tuple[float, ...] = (0.5, 0.75, 1.0, 1.5, 2.25, 3.4)  # × the merge's own scaling
LADDERS: dict[str, tuple[float, ...]] = {
    "anchor_blend_rho": (0.0, 0.5, 1.0, 1.6, 2.2, 3.0, 4.0, 6.0, 8.0, 10.0),
    "lambda_ratio": (0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0),
    "teacher_interp_alpha": (0.0, 0.25, 0.5, 0.75, 1.0),
}
MAX_MERGE_SCALING = 10.0  # MergeConfig.scaling's bound
# a calibration runs about three block forwards per example (expert, merged as merged, calibrated);
# scoring a candidate runs one forward of the model over the held-out examples
FORWARDS_PER_CALIBRATION = 3.0

CRITERION = (
    "mean over tasks of ||h - h_expert||^2 / ||h_expert||^2 at the last block's output (class token only where "
    "the output is read from it; padding excluded) on each task's held-out calibration examples; with task "
    "heads, first the mean over tasks of the fraction of held-out examples whose prediction differs from the "
    "expert's, the drift (tune_tiebreak soft: the mean KL from the expert's head softmax to the candidate's) "
    "breaking ties; lower is better"
)


# --- budget ------------------------------------------------------------------------------------------
def candidate_cost(holdout: float, folds: int = 1) -> float:
    """One candidate's cost in calibrations on all the data: its calibrations on the fit parts plus scoring.

    With one split: a calibration on the fit part (1 − holdout) and a forward over the held-out part; with
    `folds` ≥ 2 (cross-fitting): `folds` calibrations on (folds − 1)/folds of the data each, and a forward
    over every example (each is held out once)."""
    if folds == 1:
        return (1.0 - holdout) + holdout / FORWARDS_PER_CALIBRATION
    return (folds - 1) + 1.0 / FORWARDS_PER_CALIBRATION


def max_candidates(budget: float, holdout: float, folds: int = 1) -> int:
    """How many candidates fit in `budget` calibrations once the refit and the experts' scoring are paid."""
    held = holdout if folds == 1 else 1.0
    fixed = 1.0 + held / FORWARDS_PER_CALIBRATION
    return max(1, math.floor((budget - fixed) / candidate_cost(holdout, folds) + 1e-9))


# --- the split ---------------------------------------------------------------------------------------
@dataclass
class Split:
    """Each task's calibration examples cut into a fit part and a held-out part (never mixed)."""

    fit: dict[str, list[Batch]]
    held: dict[str, list[Batch]]
    record: dict[str, dict[str, Any]]


def _task_seed(seed: int, task: str) -> int:
    digest = hashlib.sha256(f"featcal-tune:{seed}:{task}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _held_out_order(seed: int, task: str, n: int) -> torch.Tensor:
    """The seeded order of a task's n examples that both the one split and the folds hold out from."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(_task_seed(seed, task)))


def _batch_size(task: str, index: int, batch: Batch) -> int:
    sizes = {k: (int(v.shape[0]) if v.dim() else None) for k, v in batch.items()}
    if len(set(sizes.values())) != 1 or None in sizes.values():
        raise CalibrationDataError(
            f"task {task!r}, batch {index}: tune splits examples along the first dimension, but the batch's "
            f"tensors have first sizes {sizes}"
        )
    return next(iter(sizes.values()))


def _task_sizes(t: str, batches: list[Batch], needed: int, why: str) -> tuple[list[int], int]:
    sizes = [_batch_size(t, i, b) for i, b in enumerate(batches)]
    n = sum(sizes)
    if n < needed:
        raise CalibrationDataError(
            f"task {t!r} has {n} calibration example(s); tune needs at least {needed} ({why})"
        )
    return sizes, n


def _cut(batches: list[Batch], sizes: list[int], is_held: torch.Tensor) -> tuple[list[Batch], list[Batch]]:
    """(fit batches, held-out batches): each batch's rows cut by `is_held` (padding stays that of the batch)."""
    fit: list[Batch] = []
    held: list[Batch] = []
    offset = 0
    for batch, size in zip(batches, sizes, strict=True):
        rows = is_held[offset:offset + size]
        offset += size
        for keep, dest in ((~rows, fit), (rows, held)):
            idx = keep.nonzero().flatten()
            if len(idx):
                dest.append({k: v.index_select(0, idx.to(v.device)) for k, v in batch.items()})
    return fit, held


def split_calibration(data: Mapping[str, list[Batch]], holdout: float, seed: int) -> Split:
    """Hold out round(holdout·n) of each task's n examples (at least one, leaving at least one to fit).

    Which examples depends only on the seed, the task's name and n. Examples keep their batch: a batch's
    rows are cut into its fit rows and its held-out rows (padding stays that of the batch). Indices in the
    record count examples in the order the task's batches hold them.
    """
    fit: dict[str, list[Batch]] = {}
    held: dict[str, list[Batch]] = {}
    record: dict[str, dict[str, Any]] = {}
    for t, batches in data.items():
        sizes, n = _task_sizes(t, batches, 2, "one to fit, one held out")
        n_held = one_split_held_out(n, holdout)
        perm = _held_out_order(seed, t, n)
        is_held = torch.zeros(n, dtype=torch.bool)
        is_held[perm[:n_held]] = True
        fit[t], held[t] = _cut(batches, sizes, is_held)
        record[t] = {"examples": n, "fit": n - n_held, "held_out": n_held,
                     "held_out_indices": sorted(int(i) for i in perm[:n_held])}
    return Split(fit, held, record)


def split_folds(data: Mapping[str, list[Batch]], folds: int, seed: int) -> list[Split]:
    """Cross-fitting (tune_folds ≥ 2): each task's examples dealt, in a seeded order, into `folds` folds; split
    k holds fold k out and fits on the others, so every example is held out exactly once.

    Why: at 8 examples per task one split holds out 2 per task, and the search stepped on one-example
    differences (docs/tuning.md); folds score every candidate on all 8, at the cost of `folds` calibrations on
    (folds − 1)/folds of the data. The order is split_calibration's (seed, task name, n): fold k takes the
    examples at positions k, k + folds, ... of it.
    """
    splits = [Split({}, {}, {}) for _ in range(folds)]
    for t, batches in data.items():
        sizes, n = _task_sizes(t, batches, folds, f"one per fold of tune_folds {folds}")
        perm = _held_out_order(seed, t, n)
        for k, split in enumerate(splits):
            chosen = perm[k::folds]
            is_held = torch.zeros(n, dtype=torch.bool)
            is_held[chosen] = True
            split.fit[t], split.held[t] = _cut(batches, sizes, is_held)
            split.record[t] = {"examples": n, "fit": n - len(chosen), "held_out": len(chosen),
                               "held_out_indices": sorted(int(i) for i in chosen)}
    return splits


def folds_record(splits: list[Split]) -> dict[str, dict[str, Any]]:
    """featcal.json's `split` for cross-fitting: per task, every fold's held-out indices; each example is
    held out once, so `held_out` is every example."""
    if len(splits) == 1:
        return splits[0].record
    return {t: {"examples": rec["examples"], "folds": len(splits), "fit": [s.record[t]["fit"] for s in splits],
                "held_out": rec["examples"], "fold_indices": [s.record[t]["held_out_indices"] for s in splits]}
            for t, rec in splits[0].record.items()}


# --- settings and scores -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Setting:
    """One candidate: FeatCal's three knobs and (None: not searched) the starting merge's scaling."""

    anchor_blend_rho: float
    lambda_ratio: float
    teacher_interp_alpha: float
    merge_scaling: float | None = None

    def with_(self, knob: str, value: float) -> Setting:
        return dataclasses.replace(self, **{knob: value})

    def as_dict(self) -> dict[str, float | None]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Score:
    """A candidate's held-out score: drift always, disagreement where every task has a head.

    `samples` keeps, per task, each held-out example's share of the drift (scaled so that their mean is the
    task's drift) and, with a head, each prediction's agreement (1/0): what the paired evidence reads.
    """

    drift: float
    disagreement: float | None
    per_task: dict[str, dict[str, float]]
    samples: dict[str, dict[str, torch.Tensor]] = dataclasses.field(default_factory=dict, compare=False, repr=False)
    soft: float | None = None  # mean over tasks of KL(expert's head softmax || candidate's): tune_tiebreak soft

    def verdict(self, other: Score, min_evidence: float = 0.0,
                tiebreak: str = "drift") -> tuple[bool, dict[str, float | None]]:
        """(better, evidence): fewer disagreements, else a tie-break score (the drift, or with
        tiebreak 'soft' the heads' KL) lower by more than round-off; with `min_evidence` > 0 the
        improvement must also be at least that many standard errors (`evidence`).

        Fewer disagreements without that evidence leave the tie-break to decide, as if they were equal;
        more disagreements always lose. min_evidence 0 is the plain comparison.
        """
        z: dict[str, float | None] = {"disagreement": None, tiebreak: None}
        if self.disagreement is not None and other.disagreement is not None and self.disagreement != other.disagreement:
            if self.disagreement > other.disagreement:
                return False, z
            z["disagreement"] = evidence(self.samples, other.samples, "agreement", higher_is_better=True)
            if min_evidence == 0.0 or z["disagreement"] >= min_evidence:
                return True, z
        mine, theirs = (self.drift, other.drift) if tiebreak == "drift" else (self.soft, other.soft)
        z[tiebreak] = evidence(self.samples, other.samples, tiebreak, higher_is_better=False)
        better = mine < theirs * (1.0 - 1e-9)
        return better and (min_evidence == 0.0 or z[tiebreak] >= min_evidence), z


def evidence(new: Mapping[str, Mapping[str, torch.Tensor]], old: Mapping[str, Mapping[str, torch.Tensor]],
             key: str, higher_is_better: bool) -> float:
    """How many standard errors `new` improves on `old` in the mean over tasks of the mean over examples.

    Why: at 8 examples per task the held-out part is 2 per task, where a step can win by one example or a
    sliver of drift (tune_min_evidence; docs/tuning.md has what it did). The two candidates are scored on the same examples,
    so the test is paired: d = the per-example improvement, Δ = mean over tasks of its mean, and the
    within-task variance of d is pooled over tasks (Σ (d − d̄_t)² / Σ (n_t − 1)), so that two examples per
    task still give an estimate. nan where there is none (one example per task), +inf where every d equals
    its task's mean and Δ > 0.
    """
    diffs = []
    for t in new:
        a, b = new[t].get(key), old.get(t, {}).get(key)
        if a is None or b is None or a.shape != b.shape:
            return math.nan
        d = (a - b).double() if higher_is_better else (b - a).double()
        diffs.append(d)
    if not diffs or any(len(d) == 0 for d in diffs):
        return math.nan
    n_tasks = len(diffs)
    delta = sum(float(d.mean()) for d in diffs) / n_tasks
    dof = sum(len(d) - 1 for d in diffs)
    if dof == 0:
        return math.nan
    pooled = sum(float((d - d.mean()).pow(2).sum()) for d in diffs) / dof
    var = pooled * sum(1.0 / len(d) for d in diffs) / n_tasks**2
    if var <= 0.0:
        return math.inf if delta > 0 else (0.0 if delta == 0 else -math.inf)
    return delta / math.sqrt(var)


# --- features and predictions on the held-out part ---------------------------------------------------
class _Stop(Exception):
    """Raised by the last block's hook when nothing after it is needed."""


def _hidden(output: Any) -> torch.Tensor:
    return output[0] if isinstance(output, (tuple, list)) else output


def _to(batch: Batch, device: torch.device) -> Batch:
    return {k: v.to(device) for k, v in batch.items()}


@torch.no_grad()
def final_features(model: nn.Module, adapter: Adapter, batch: Batch, head: Head | None = None, task: str = "",
                   pooling: str = "auto", soft: bool = False):
    """(features, 0/1 token mask or None, the head's predicted classes or None, with `soft` its log-softmax
    or None) from ONE forward where possible; only those leave the device, never a token head's logits.

    Features: the last stack's last block output (only the class token where the stack's output is
    read from it, CLIP/ViT). Without a head the forward stops after that block; an nn.Module head reads
    the model's pooled output of the same forward; a callable head runs the model itself and the block's
    output is taken from that forward (a second, stopped forward only if the head never reached it).
    """
    stack = adapter.stacks(model)[-1]
    block = stack.blocks(model)[-1]
    seen: dict[str, torch.Tensor] = {}
    stop = [head is None]

    def hook(_mod, _args, out):
        seen.setdefault("h", _hidden(out))
        if stop[0]:
            raise _Stop

    handle = block.register_forward_hook(hook)
    out = (None, None)
    try:
        if head is None:
            model(**accepted_inputs(model, batch))
        elif isinstance(head, nn.Module):
            output = model(**accepted_inputs(model, batch))
            out = _head_output(task, head(_pooled(task, output, batch, pooling)), soft)
        else:
            out = _head_output(task, head(model, batch), soft)
            if "h" not in seen:
                stop[0] = True
                model(**accepted_inputs(model, batch))
    except _Stop:
        pass
    finally:
        handle.remove()
    h = seen["h"].float()
    mask = adapter.token_mask(stack, batch, h)
    if stack.class_token_head:
        h = h[:, :1]
        mask = None if mask is None else mask[:, :1]
    return h, mask, *out


def _pooled(task: str, output: Any, batch: Batch, pooling: str = "auto") -> torch.Tensor:
    """What an nn.Module head reads (tune_head_pooling): `pooler_output`, or the attention-masked token mean
    of `last_hidden_state` (sentence encoders), or auto: the first where the model has one."""
    pooled = getattr(output, "pooler_output", None)
    if pooling == "pooler" and pooled is None:
        raise ConfigError(f"head of task {task!r}: tune_head_pooling is 'pooler' but the model's output has no "
                          "pooler_output; use 'mean', or pass a callable head(model, batch) -> logits")
    if pooling != "mean" and pooled is not None:
        return pooled
    h = getattr(output, "last_hidden_state", None)
    if h is None:
        raise ConfigError(
            f"head of task {task!r}: the model's output has no last_hidden_state to pool; "
            "pass a callable head(model, batch) -> logits instead"
        )
    mask = batch.get("attention_mask")
    if mask is None:
        return h.mean(1)
    m = mask.to(h.dtype).unsqueeze(-1)
    return (h * m).sum(1) / m.sum(1).clamp_min(1.0)


def _head_output(task: str, logits: Any, soft: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(predicted classes, log-softmax as (predictions, classes) with `soft`, else None), on the host."""
    if not isinstance(logits, torch.Tensor) or logits.dim() < 1:
        raise ConfigError(f"head of task {task!r} must return logits (a tensor), got {type(logits).__name__}")
    pred = logits.argmax(-1).flatten().cpu()
    if not soft:
        return pred, None
    return pred, torch.log_softmax(logits.detach().float(), -1).reshape(-1, logits.shape[-1]).cpu()


@dataclass
class _Reference:
    """Expert t's features (and predictions) on task t's held-out batches, computed once."""

    features: list[tuple[torch.Tensor, torch.Tensor | None]]
    predictions: list[torch.Tensor] | None
    log_probs: list[torch.Tensor] | None = None  # the head's log-softmax, kept for tune_tiebreak soft only


@torch.no_grad()
def _reference(task: str, expert: nn.Module, adapter: Adapter, batches: list[Batch], head: Head | None,
               pooling: str = "auto", keep_log_probs: bool = False) -> _Reference:
    dev = next(expert.parameters()).device
    feats, preds = [], [] if head is not None else None
    log_probs = [] if head is not None and keep_log_probs else None
    for b in batches:
        h, mask, pred, lp = final_features(expert, adapter, _to(b, dev), head, task, pooling, keep_log_probs)
        feats.append((h.cpu(), None if mask is None else mask.cpu()))  # held on the host for all candidates
        if head is not None:
            preds.append(pred)
            if log_probs is not None:
                log_probs.append(lp)
    return _Reference(feats, preds, log_probs)


@torch.no_grad()
def score(model: nn.Module, adapter: Adapter, held: Mapping[str, list[Batch]], refs: Mapping[str, _Reference],
          heads: Mapping[str, Head], pooling: str = "auto") -> Score:
    """The candidate's held-out score against the experts' references (see CRITERION)."""
    model.eval()
    dev = next(model.parameters()).device
    per_task: dict[str, dict[str, float]] = {}
    samples: dict[str, dict[str, torch.Tensor]] = {}
    for t, batches in held.items():
        head = heads.get(t)
        rel_sums, agrees, kls, count = [], [], [], 0.0
        for i, b in enumerate(batches):
            soft = head is not None and refs[t].log_probs is not None
            h, _, pred, lp = final_features(model, adapter, _to(b, dev), head, t, pooling, soft)
            he, mask = (None if x is None else x.to(h.device) for x in refs[t].features[i])
            rel = (h - he).pow(2).sum(-1) / he.pow(2).sum(-1).clamp_min(1e-12)
            m = torch.ones_like(rel) if mask is None else mask.to(rel)
            rel_sums.append((rel * m).reshape(len(rel), -1).sum(1).double().cpu())  # one sum per example
            count += float(m.sum())
            if head is not None:
                agrees.append((pred == refs[t].predictions[i]).double())
                if soft:
                    ref_lp = refs[t].log_probs[i]
                    kls.append((ref_lp.exp() * (ref_lp - lp)).sum(-1).double())
        sums = torch.cat(rel_sums)
        per_task[t] = {"drift": float(sums.sum()) / max(count, 1.0)}
        samples[t] = {"drift": sums * (len(sums) / max(count, 1.0))}  # their mean is the task's drift
        if head is not None:
            agreement = torch.cat(agrees)
            per_task[t]["agreement"] = float(agreement.sum()) / max(len(agreement), 1)
            samples[t]["agreement"] = agreement
        if kls:
            kl = torch.cat(kls)
            per_task[t]["soft"] = float(kl.mean())
            samples[t]["soft"] = kl
    drift = sum(r["drift"] for r in per_task.values()) / len(per_task)
    disagreement = soft = None
    if heads and all(t in heads for t in held):
        disagreement = sum(1.0 - r["agreement"] for r in per_task.values()) / len(per_task)
        if all("soft" in r for r in per_task.values()):
            soft = sum(r["soft"] for r in per_task.values()) / len(per_task)
    return Score(drift, disagreement, per_task, samples, soft)


def combine_folds(scores: list[Score]) -> Score:
    """A candidate's cross-fitted score: its folds' held-out examples pooled, each one scored by the candidate
    fitted without it. Per task, the drift and agreement are means over all of them (each fold's drift samples
    already average to that fold's drift), so the paired evidence reads every example once."""
    if len(scores) == 1:
        return scores[0]
    per_task: dict[str, dict[str, float]] = {}
    samples: dict[str, dict[str, torch.Tensor]] = {}
    for t in scores[0].per_task:
        parts = [s.samples[t] for s in scores]
        keys = [k for k in parts[0] if all(k in p for p in parts)]
        samples[t] = {k: torch.cat([p[k] for p in parts]) for k in keys}
        per_task[t] = {k: float(v.mean()) for k, v in samples[t].items()}
    drift = sum(r["drift"] for r in per_task.values()) / len(per_task)
    disagreement = soft = None
    if all(s.disagreement is not None for s in scores):
        disagreement = sum(1.0 - r["agreement"] for r in per_task.values()) / len(per_task)
    if all(s.soft is not None for s in scores):
        soft = sum(r["soft"] for r in per_task.values()) / len(per_task)
    return Score(drift, disagreement, per_task, samples, soft)


# --- the starting merge ------------------------------------------------------------------------------
@torch.no_grad()
def rescale_merge(model: nn.Module, base: ParamSource, factor: float) -> None:
    """θ ← θ0 + factor·(θ − θ0) for every floating parameter the base holds, in place (float64 arithmetic).

    For a task-vector merge θ = θ0 + s·v this is the same merge rebuilt at scaling factor·s.
    """
    for name, p in model.named_parameters():
        if not p.is_floating_point() or base.shape(name) != tuple(p.shape):
            continue
        b = base.get(name).to(device=p.device, dtype=torch.float64)
        p.copy_((b + factor * (p.to(torch.float64) - b)).to(p.dtype))


def merge_scaling_from_report(merged_dir: str | os.PathLike, base_dir: str | os.PathLike,
                              expert_dirs: Mapping[str, str | os.PathLike]) -> tuple[float | None, str]:
    """(s, why) when `merged_dir` is a featcal task-vector merge of exactly this base and these experts.

    Why: `featcal calibrate --tune` is given a merged checkpoint, not how it was made; the merge's own
    featcal.json says it, and the checkpoints' hashes tie it to the inputs, so the merge can be rebuilt
    at other scalings. Otherwise (None, the reason) and the scaling is not searched.
    """
    path = Path(merged_dir) / REPORT_NAME
    if not path.is_file():
        return None, f"no {REPORT_NAME} in the merged checkpoint"
    try:
        report = read_json(path)
    except Exception as exc:  # an unreadable report only means the scaling is not searched
        return None, f"{path}: {exc}"
    params = report.get("params") or {}
    method, scaling = params.get("method"), params.get("scaling")
    if report.get("command") != "merge" or not is_task_vector_merge(method):
        return None, f"the merged checkpoint is not a featcal task-vector merge ({report.get('command')}, {method})"
    if isinstance(scaling, bool) or not isinstance(scaling, (int, float)) or not 0 < scaling <= MAX_MERGE_SCALING:
        return None, f"{path}: no usable scaling ({scaling!r})"
    recorded_output = (report.get("output") or {}).get("sha256")
    current = {k: v for k, v in checkpoint_hashes(merged_dir).items() if k != REPORT_NAME}
    if recorded_output != current:  # rebuilding "the merge at another scaling" needs the merge the report describes
        return None, (f"the merged checkpoint's files are not those its {REPORT_NAME} records (changed after the "
                      "merge), so its scaling is not trusted")
    inputs = report.get("inputs") or {}
    recorded_base = (inputs.get("base") or {}).get("sha256")
    recorded_experts = sorted(repr(e.get("sha256")) for e in (inputs.get("experts") or {}).values())
    if recorded_base != checkpoint_hashes(base_dir) or recorded_experts != sorted(
        repr(checkpoint_hashes(d)) for d in expert_dirs.values()
    ):
        return None, "the merged checkpoint was made from another base or other experts"
    return float(scaling), f"{REPORT_NAME} of the merged checkpoint: {method}, scaling {scaling:g}"


def load_heads(paths: Mapping[str, str | os.PathLike], tasks: Iterable[str], tune: bool,
               width: int | None = None) -> dict[str, nn.Module]:
    """Heads saved by featcal (LinearHead / CosineHead safetensors) for `featcal calibrate --tune-head` and
    a run file's `calibrate.heads`; refused in one line before any work (unknown task, no tune, bad file, no
    class, NaN / Inf, or, given the model's feature `width`, another input width: found otherwise only once
    the search has run its first candidate)."""
    if not paths:
        return {}
    if not tune:
        raise ConfigError("heads are used only to score candidates with --tune (tune: true)")
    tasks = list(tasks)
    unknown = [t for t in paths if t not in tasks]
    if unknown:
        raise ConfigError(f"head(s) given for unknown task(s) {unknown} (tasks are {tasks})")
    heads = {}
    for t, p in paths.items():
        try:
            with warnings.catch_warnings():  # torch warns of a zero-class head, which _check_head refuses below
                warnings.simplefilter("ignore", UserWarning)
                heads[t] = load_head(p)
        except CheckpointError as exc:
            raise CheckpointError(f"head of task {t!r}: {exc}") from None
        except Exception as exc:  # a file that is not safetensors at all
            raise CheckpointError(f"head of task {t!r}: cannot read {p}: {exc}") from None
        _check_head(f"head of task {t!r} ({p})", heads[t], width)
    return heads


def _check_head(label: str, head: nn.Module, width: int | None) -> None:
    """At least one class, finite values, and (when known) the input width of the model's pooled features."""
    matrix = next((v for v in head.state_dict().values() if v.dim() == 2), None)
    if matrix is None or matrix.shape[0] < 1:
        raise CheckpointError(f"{label}: it has no class (a {tuple(matrix.shape) if matrix is not None else 'missing'} "
                              "weight); a head scores at least one")
    values = [*head.state_dict().values(), torch.tensor([float(getattr(head, "scale", 1.0))])]
    if not all(bool(torch.isfinite(v.float()).all()) for v in values):
        raise CheckpointError(f"{label}: it holds NaN or Inf values")
    if width is not None and matrix.shape[1] != width:
        raise CheckpointError(f"{label}: it reads {matrix.shape[1]} features but the model's pooled output has {width}")


def _base_source(base: nn.Module | str | os.PathLike, model: nn.Module, allow_pickle: bool) -> ParamSource:
    if isinstance(base, nn.Module):
        return ModelSource(base, "base")
    return CheckpointSource(base, model, "base", allow_pickle=allow_pickle,
                            reader=adapter_reader(base, None, "base", allow_pickle))


def _expert_model(task: str, expert: Any, base: Any, template: nn.Module, allow_pickle: bool,
                  kind: str | None = None) -> nn.Module:
    """Expert t as a whole model for its held-out forwards (a path, LoRA adapter or GGUF file is read as
    calibrate reads it, into a copy of the merged model)."""
    if isinstance(expert, nn.Module):
        return expert.eval()
    model = copy.deepcopy(template)
    label = f"expert {task!r}"
    src = CheckpointSource(expert, model, label, allow_pickle=allow_pickle,
                           reader=adapter_reader(expert, base, label, allow_pickle, kind))
    held = [n for n, p in model.named_parameters(remove_duplicate=False) if src.shape(n) == tuple(p.shape)]
    load_into(model, held, src)
    return model.eval()


# --- the search --------------------------------------------------------------------------------------
def _ladder(knob: str, current: float, start: Setting) -> list[float]:
    if knob == "merge_scaling":
        s0 = float(start.merge_scaling)
        values = {round(s0 * f, 10) for f in SCALING_FACTORS if 0 < s0 * f <= MAX_MERGE_SCALING}
    else:
        values = set(LADDERS[knob])
    return sorted(values | {current, getattr(start, knob)})


# tune_tiebreak "auto": the soft tie-break where a task holds out at most this many examples. With 2 held out per
# task (8 examples, holdout 0.25) it beat the drift tie-break on all five real-weights runs measured, and lost 14
# points on the synthetic preset; with 8 held out (32 examples) drift won twice, soft once; from 64 held out (256
# examples) both chose the same setting (docs/tuning.md). Not the default, for that loss.
AUTO_SOFT_MAX_HELD = 4


def resolve_tiebreak(setting: str, heads: Mapping[str, Any], tasks: Iterable[str], held_out: int) -> tuple[str, str]:
    """(the tie-break that runs, why) for tune_tiebreak `setting`, given the heads and the fewest held-out examples."""
    if setting != "auto":
        return setting, "as configured"
    if any(t not in heads for t in tasks):
        return "drift", "auto: not every task has a head"
    if held_out <= AUTO_SOFT_MAX_HELD:
        return "soft", f"auto: {held_out} held-out example(s) per task (<= {AUTO_SOFT_MAX_HELD})"
    return "drift", f"auto: {held_out} held-out examples per task (> {AUTO_SOFT_MAX_HELD})"


# tune_fixed "auto": λ is held at its configured value where a task holds out at most AUTO_SOFT_MAX_HELD examples.
# At 8 per task (2 held out) the held-out drift rewarded smaller λ with strong paired evidence (z 2.8-4.0) and
# accuracy fell (text seed 2: 26.6 % of the gap against the defaults' 38.3 %); with λ held, the search closed
# 80.6 / 53.3 / 55.7 % on text seeds 0 / 1 / 2, but fell 1.7 points below the defaults on vision-real seed 2, so
# it is not the default (docs/tuning.md).
AUTO_FIXED_SMALL = ("lambda_ratio",)


def resolve_fixed(setting: str | tuple[str, ...], held_out: int) -> tuple[tuple[str, ...], str]:
    """(the knobs held at their configured values, why) for tune_fixed `setting`, given the fewest held-out examples."""
    if setting != "auto":
        return tuple(setting), "as configured"
    if held_out <= AUTO_SOFT_MAX_HELD:
        return AUTO_FIXED_SMALL, (f"auto: {held_out} held-out example(s) per task (<= {AUTO_SOFT_MAX_HELD}): "
                                  "lambda_ratio is not searched")
    return (), f"auto: {held_out} held-out examples per task (> {AUTO_SOFT_MAX_HELD}): every knob is searched"


# tune_folds "auto" (the default): cross-fitting (2 folds) where one split would hold out at most AUTO_SOFT_MAX_HELD
# examples of a task. Measured at 8 per task on nine bench zoos (docs/tuning.md): never below the paper's defaults
# (one split fell 1.0 and 0.9 points below them on text seed 2 and vision-real seed 2) and above one split on eight
# of the nine (vision-real seed 1: 73.8 against 75.1 % of the gap). From 5 held-out examples per task one split
# runs, as measured at 32 and 256 per task.
AUTO_FOLDS_SMALL = 2


def one_split_held_out(n: int, holdout: float) -> int:
    """How many of a task's n examples one split holds out (split_calibration's rule)."""
    return min(n - 1, max(1, round(holdout * n)))


def resolve_folds(setting: str | int, fewest_examples: int, holdout: float) -> tuple[int, str]:
    """(the folds that run, why) for tune_folds `setting`, given the smallest task's number of examples."""
    if setting != "auto":
        return int(setting), "as configured"
    if holdout != DEFAULT_TUNE_HOLDOUT:  # a held-out share asked for is a request for one split
        return 1, f"auto: tune_holdout {holdout:g} asks for one split"
    held = one_split_held_out(fewest_examples, holdout)
    if held <= AUTO_SOFT_MAX_HELD and fewest_examples >= AUTO_FOLDS_SMALL:
        return AUTO_FOLDS_SMALL, (f"auto: one split would hold out {held} example(s) per task (<= "
                                  f"{AUTO_SOFT_MAX_HELD}): {AUTO_FOLDS_SMALL} folds score every example")
    return 1, f"auto: one split holds out {held} example(s) per task"


def check_request(config: FeatCalConfig, base: Any, experts: Mapping[str, Any], heads: Mapping[str, Head] | None,
                  merge_scaling: float | None) -> None:
    """Everything about a tune request that can be refused before any work."""
    if heads is not None:
        if not isinstance(heads, Mapping):
            raise ConfigError(f"heads must map task names to heads, not {type(heads).__name__}")
        unknown = [t for t in heads if t not in experts]
        if unknown:
            raise ConfigError(f"heads given for unknown task(s) {unknown} (tasks are {list(experts)})")
        bad = [t for t, h in heads.items() if not callable(h)]
        if bad:
            raise ConfigError(f"head(s) of task(s) {bad} are neither an nn.Module nor a callable head(model, batch)")
    if config.tune and config.tune_tiebreak == "soft" and (not heads or any(t not in heads for t in experts)):
        missing = sorted(t for t in experts if t not in (heads or {}))
        raise ConfigError(f"tune_tiebreak 'soft' compares the heads' outputs: it needs a head for every task "
                          f"(none for {missing}); give heads or use tune_tiebreak 'drift'")
    if not config.tune:
        if heads:
            raise ConfigError("heads are used only to score candidates when tune=True")
        if merge_scaling is not None:
            raise ConfigError("merge_scaling is used only to search the starting merge when tune=True")
        return
    if merge_scaling is not None:
        if isinstance(merge_scaling, bool) or not isinstance(merge_scaling, (int, float)) or not (
            0 < merge_scaling <= MAX_MERGE_SCALING
        ):
            raise ConfigError(f"merge_scaling must be a number in (0, {MAX_MERGE_SCALING:g}], got {merge_scaling!r}")
        if base is None:
            raise ConfigError("merge_scaling needs the base model (base=): the merge is rebuilt from it")
    if current_group().active:
        raise ConfigError("tune runs in one process; run it without torchrun (the refit alone can be distributed "
                          "by passing the chosen values)")


def calibrate_tuned(
    merged: Any, *, base: Any, experts: Mapping[str, Any], calibration: Mapping[str, Iterable[Any]],
    config: FeatCalConfig, heads: Mapping[str, Head] | None = None, merge_scaling: float | None = None,
    progress: bool = True, inplace: bool = False, allow_pickle: bool = False, keep_resume_state: bool = False,
    check_finite: bool = True, expert_kind: Mapping[str, str] | None = None,
) -> CalibrationResult:
    """Search, score on the held-out part, refit the choice on all data; see the module docstring.

    The result is the refit's (core.calibrate_setting) with `tuning`: the split, every candidate's setting
    and score, the choice, and the seconds spent.
    """
    check_request(config, base, experts, heads, merge_scaling)
    heads = dict(heads or {})
    validate_expert_names(experts.keys())
    check_tasks(experts, calibration)
    check_base_for_rho(config, base)
    model = as_model(merged, "merged model", allow_pickle)
    adapter = adapter_for(model)
    main = adapter.main_input(model, adapter.stacks(model)[0])
    data = {t: normalise_batches(t, calibration[t], main) for t in experts}
    fewest_examples = min(sum(_batch_size(t, i, b) for i, b in enumerate(data[t])) for t in data)
    folds, folds_why = resolve_folds(config.tune_folds, fewest_examples, config.tune_holdout)
    splits = ([split_calibration(data, config.tune_holdout, config.seed)] if folds == 1
              else split_folds(data, folds, config.seed))
    fewest_held = min(sum(s.record[t]["held_out"] for s in splits) for t in data)
    tiebreak, tiebreak_why = resolve_tiebreak(config.tune_tiebreak, heads, experts, fewest_held)
    fixed, fixed_why = resolve_fixed(config.tune_fixed, fewest_held)
    if fewest_held <= AUTO_SOFT_MAX_HELD:  # measured: no one-split rule stayed above the defaults on every preset here
        log.warning("featcal tune: only %d held-out example(s) per task score the candidates: at this size every "
                    "one-split search rule measured fell below the paper's defaults on some preset; cross-fitting "
                    "(tune_folds auto, the default, or 2) scores every example (docs/tuning.md)", fewest_held)
    limit = max_candidates(config.tune_budget, config.tune_holdout, folds)
    start = Setting(config.anchor_blend_rho, config.lambda_ratio, config.teacher_interp_alpha,
                    None if merge_scaling is None else float(merge_scaling))
    searchable = (["merge_scaling"] if start.merge_scaling is not None else []) + (
        ["anchor_blend_rho"] if base is not None else []) + ["lambda_ratio", "teacher_interp_alpha"]
    knobs = [k for k in searchable if k not in fixed]
    base_src = _base_source(base, model, allow_pickle) if start.merge_scaling is not None else None
    template = model  # the search never modifies it: candidates calibrate copies
    # held-out forwards run where calibration runs (calibrate hands its result back where the merge was)
    where = torch.device("cpu") if config.offload_blocks else resolve_device(config.device)
    search_cfg = config.model_copy(update={"tune": False, "resume": False})

    def start_model(s: Setting, target: nn.Module | None = None) -> nn.Module:
        """The merge to calibrate for `s`: the given one, or (another scaling) a copy, or `target`, rebuilt there."""
        if s.merge_scaling == start.merge_scaling:
            return template
        m = copy.deepcopy(template) if target is None else target
        rescale_merge(m, base_src, s.merge_scaling / start.merge_scaling)
        return m

    refs: list[dict[str, _Reference]] = [{} for _ in splits]  # per split: the experts' held-out references
    scores: dict[Setting, Score] = {}
    records: list[dict[str, Any]] = []
    index_of: dict[Setting, int] = {}
    comparisons: list[dict[str, Any]] = []  # each step of the search: who was compared with whom, the evidence
    compared: set[tuple[int, int]] = set()
    search = Timer()

    def evaluate(s: Setting) -> Score | None:
        if s in scores:
            return scores[s]
        if len(scores) >= limit:
            return None
        clock = Timer()
        cfg = search_cfg.model_copy(update={k: v for k, v in s.as_dict().items() if k != "merge_scaling"})
        fold_scores = []
        for k, split in enumerate(splits):  # one split, or each fold held out in turn (tune_folds)
            first = not scores and k == 0
            m = start_model(s)
            out = core.calibrate_setting(m, base=base, experts=experts, calibration=split.fit, config=cfg,
                                         progress=False, inplace=m is not template, allow_pickle=allow_pickle,
                                         check_finite=check_finite and first, expert_kind=expert_kind).model
            if first:  # the first calibration validated every input: now the experts' references, once
                for t in experts:
                    expert = _expert_model(t, experts[t], base, template, allow_pickle, (expert_kind or {}).get(t))
                    if expert is not experts[t]:  # featcal's own copy (a caller's model is not moved)
                        expert.to(where)
                    for held_refs, held_split in zip(refs, splits, strict=True):
                        held_refs[t] = _reference(t, expert, adapter, held_split.held[t], heads.get(t),
                                                  config.tune_head_pooling, keep_log_probs=tiebreak == "soft")
                    del expert
            fold_scores.append(score(out.to(where), adapter, split.held, refs[k], heads, config.tune_head_pooling))
            del out
        sc = combine_folds(fold_scores)
        scores[s] = sc
        index_of[s] = len(records)
        records.append({"index": len(records), **s.as_dict(), "drift": sc.drift, "disagreement": sc.disagreement,
                        **({} if sc.soft is None else {"soft": sc.soft}),
                        "per_task": sc.per_task, "seconds": round(clock.seconds, 3)})
        log.info("featcal tune: candidate %d %s: drift %.6g%s", len(records) - 1, s.as_dict(), sc.drift,
                 "" if sc.disagreement is None else f", disagreement {sc.disagreement:.4f}")
        return sc

    best = start
    best_score = evaluate(start)
    changed = True
    while changed and len(scores) < limit:
        changed = False
        for knob in knobs:
            ladder = _ladder(knob, getattr(best, knob), start)
            i = ladder.index(getattr(best, knob))
            for step in (1, -1):
                moved, j = False, i + step
                while 0 <= j < len(ladder):
                    cand = best.with_(knob, ladder[j])
                    sc = evaluate(cand)
                    if sc is None:
                        break
                    better, z = sc.verdict(best_score, config.tune_min_evidence, tiebreak)
                    pair = (index_of[cand], index_of[best])
                    if pair not in compared:  # a later pass meets scored settings again: recorded once
                        compared.add(pair)
                        comparisons.append({"candidate": pair[0], "against": pair[1],
                                            "z_disagreement": _finite(z["disagreement"]),
                                            f"z_{tiebreak}": _finite(z[tiebreak]),
                                            "accepted": better,
                                            "scored_better": sc.verdict(best_score, 0.0, tiebreak)[0]})
                    if not better:
                        break
                    best, best_score, moved, changed = cand, sc, True, True
                    j += step
                if moved:
                    break
    search_seconds = search.seconds

    refit = Timer()
    final_cfg = config.model_copy(update={**{k: v for k, v in best.as_dict().items() if k != "merge_scaling"},
                                          "tune": False})
    may_modify = inplace or not isinstance(merged, nn.Module)  # a caller's model stays as given unless inplace
    if best.merge_scaling == start.merge_scaling:
        m, in_place = model, may_modify
    else:
        m, in_place = start_model(best, model if may_modify else copy.deepcopy(model)), True
    result = core.calibrate_setting(m, base=base, experts=experts, calibration=data, config=final_cfg,
                                    progress=progress, inplace=in_place, allow_pickle=allow_pickle,
                                    keep_resume_state=keep_resume_state, expert_kind=expert_kind,
                                    check_finite=False)  # every input was scanned by the first candidate
    refit_seconds = refit.seconds
    chosen = index_of[best]
    record = {
        "criterion": CRITERION,
        "heads": sorted(heads),
        "holdout": config.tune_holdout if folds == 1 else None,  # cross-fitting holds every example out once
        "seed": config.seed,
        "folds": folds,
        "folds_setting": config.tune_folds,
        "folds_why": folds_why,
        "split": folds_record(splits),
        "budget": {"calibrations": config.tune_budget, "max_candidates": limit, "candidates": len(records),
                   "candidate_cost": round(candidate_cost(config.tune_holdout, folds), 4)},
        "searched": knobs,
        "fixed": list(fixed),
        "fixed_setting": config.tune_fixed if config.tune_fixed == "auto" else list(config.tune_fixed),
        "fixed_why": fixed_why,
        "start": start.as_dict(),
        "candidates": records,
        "min_evidence": config.tune_min_evidence,
        "comparisons": comparisons,
        "chosen": {"index": chosen, **best.as_dict(), "drift": best_score.drift,
                   "disagreement": best_score.disagreement,
                   **({} if best_score.soft is None else {"soft": best_score.soft})},
        "tiebreak": tiebreak,
        "tiebreak_setting": config.tune_tiebreak,
        "tiebreak_why": tiebreak_why,
        "seconds": {"search": round(search_seconds, 3), "refit": round(refit_seconds, 3),
                    "total_over_refit": round((search_seconds + refit_seconds) / max(refit_seconds, 1e-9), 2)},
    }
    log.info("featcal tune: chose candidate %d of %d %s (held-out drift %.6g, start %.6g); refit on all data",
             chosen, len(records), best.as_dict(), best_score.drift, records[0]["drift"])
    return result.with_tuning(record)


def _finite(z: float | None) -> float | str | None:
    """A z for JSON: a number, or 'inf' / '-inf' / 'nan' spelled out (JSON has no such numbers)."""
    if z is None or math.isfinite(z):
        return None if z is None else round(z, 4)
    return str(z)


def summary_line(record: Mapping[str, Any]) -> str:
    """One line for the command line: how many candidates, the choice, its held-out score against the start's."""
    chosen, first = record["chosen"], record["candidates"][0]
    values = ", ".join(f"{k}={chosen[k]:g}" for k in ("merge_scaling", "anchor_blend_rho", "lambda_ratio",
                                                       "teacher_interp_alpha") if chosen.get(k) is not None)
    line = (f"tune: {len(record['candidates'])} candidate(s) scored on held-out calibration examples; chose "
            f"{values}: held-out drift {chosen['drift']:.4g} (starting setting {first['drift']:.4g})")
    if chosen.get("disagreement") is not None:
        line += f", disagreement with the experts {chosen['disagreement']:.3f} (start {first['disagreement']:.3f})"
    unbacked = sum(1 for c in record.get("comparisons", ()) if c["scored_better"] and not c["accepted"])
    if unbacked:
        line += (f"; {unbacked} step(s) that scored better were not taken (under {record['min_evidence']:g} standard "
                 "errors)")
    return line + f"; search {record['seconds']['search']:.1f} s, refit on all data {record['seconds']['refit']:.1f} s"
