"""A candidate's held-out score, and how two scores compare.

- final-feature drift: mean over tasks of ||h − h_t||² / ||h_t||² at the output of the last block (class
  token only where the model's output is read from it, padding left out), h the candidate's features and
  h_t expert t's, on task t's held-out examples;
- where every task has a head: disagreement with expert t's predictions through it (fewer is better): a
  classifier head's classes, or a causal LM's next-token predictions at every valid position (the
  fraction of those positions whose argmax differs from the expert's); ties broken by `tune_tiebreak`:
  the drift, or the mean KL(expert's softmax ‖ the candidate's) (`soft`);
- optionally (`tune_min_evidence` z > 0) a step is taken only when its held-out improvement is at least z
  paired standard errors (`evidence`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from featcal.blocks.adapters import Adapter
from featcal.calibration.tuning.features import Head, Predictions, Reference, final_features, on_device
from featcal.data.batch import Batch


@dataclass(frozen=True)
class Score:
    """A candidate's held-out score: drift always, disagreement where every task has a head.

    `samples` keeps, per task, each held-out example's share of the drift (scaled so that their mean is the
    task's drift) and, with a head, each prediction's agreement (1/0; next-token predictions: each example's
    agreeing positions, scaled likewise): what the paired evidence reads.
    """

    drift: float
    disagreement: float | None
    per_task: dict[str, dict[str, float]]
    samples: dict[str, dict[str, torch.Tensor]] = dataclasses.field(default_factory=dict, compare=False, repr=False)
    soft: float | None = None  # mean over tasks of KL(expert's softmax || candidate's): tune_tiebreak soft

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
    sliver of drift (tune_min_evidence; docs/tuning.md has what it did). The two candidates are scored on the same
    examples, so the test is paired: d = the per-example improvement, Δ = mean over tasks of its mean, and the
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


class _TaskTally:
    """One task's held-out sums over its batches: drift per example, and the predictions' agreement and KL."""

    def __init__(self) -> None:
        self.rel_sums: list[torch.Tensor] = []
        self.count = 0.0
        self.agrees: list[torch.Tensor] = []  # per prediction (a classifier head) or per example (next token)
        self.kls: list[torch.Tensor] = []
        self.positions: list[torch.Tensor] = []  # next token: valid positions per example

    def add_drift(self, h: torch.Tensor, he: torch.Tensor, mask: torch.Tensor | None) -> None:
        rel = (h - he).pow(2).sum(-1) / he.pow(2).sum(-1).clamp_min(1e-12)
        m = torch.ones_like(rel) if mask is None else mask.to(rel)
        self.rel_sums.append((rel * m).reshape(len(rel), -1).sum(1).double().cpu())  # one sum per example
        self.count += float(m.sum())

    def add_predictions(self, pred: Predictions, ref: Predictions) -> None:
        agree = (pred.ids == ref.ids).double()
        kl = None
        if ref.log_probs is not None:
            kl = (ref.log_probs.exp() * (ref.log_probs - pred.log_probs)).sum(-1).double()
        if pred.counts is not None:  # next-token predictions: summed per example
            example = torch.repeat_interleave(torch.arange(len(pred.counts)), pred.counts)
            agree = torch.zeros(len(pred.counts), dtype=torch.float64).index_add_(0, example, agree)
            kl = None if kl is None else torch.zeros(len(pred.counts), dtype=torch.float64).index_add_(0, example, kl)
            self.positions.append(pred.counts.double())
        self.agrees.append(agree)
        if kl is not None:
            self.kls.append(kl)

    def record(self, per_task: dict[str, float], samples: dict[str, torch.Tensor]) -> None:
        """The task's means into `per_task`, its per-example samples (their mean: the task's) into `samples`."""
        sums = torch.cat(self.rel_sums)
        per_task["drift"] = float(sums.sum()) / max(self.count, 1.0)
        samples["drift"] = sums * (len(sums) / max(self.count, 1.0))  # their mean is the task's drift
        if not self.agrees:
            return
        agreement = torch.cat(self.agrees)
        kl = torch.cat(self.kls) if self.kls else None
        if self.positions:  # per example, scaled so that the mean is the token-level fraction
            tokens = float(torch.cat(self.positions).sum())
            scale = len(agreement) / max(tokens, 1.0)
            per_task["agreement"] = float(agreement.sum()) / max(tokens, 1.0)
            samples["agreement"] = agreement * scale
            if kl is not None:
                per_task["soft"] = float(kl.sum()) / max(tokens, 1.0)
                samples["soft"] = kl * scale
            return
        per_task["agreement"] = float(agreement.sum()) / max(len(agreement), 1)
        samples["agreement"] = agreement
        if kl is not None:
            per_task["soft"] = float(kl.mean())
            samples["soft"] = kl


@torch.no_grad()
def score(model: nn.Module, adapter: Adapter, held: Mapping[str, list[Batch]], refs: Mapping[str, Reference],
          heads: Mapping[str, Head], pooling: str = "auto") -> Score:
    """The candidate's held-out score against the experts' references (see the module docstring)."""
    model.eval()
    per_task: dict[str, dict[str, float]] = {}
    samples: dict[str, dict[str, torch.Tensor]] = {}
    for t, batches in held.items():
        head = heads.get(t)
        tally = _TaskTally()
        for i, b in enumerate(batches):
            ref = None if refs[t].predictions is None else refs[t].predictions[i]
            soft = head is not None and ref is not None and ref.log_probs is not None
            h, _, pred = final_features(model, adapter, on_device(b, model), head, t, pooling, soft)
            he, mask = (None if x is None else x.to(h.device) for x in refs[t].features[i])
            tally.add_drift(h, he, mask)
            if head is not None:
                tally.add_predictions(pred, ref)
        per_task[t], samples[t] = {}, {}
        tally.record(per_task[t], samples[t])
    return _mean_over_tasks(per_task, samples, every_task_scored=bool(heads) and all(t in heads for t in held))


def _mean_over_tasks(per_task: dict[str, dict[str, float]], samples: dict[str, dict[str, torch.Tensor]],
                     every_task_scored: bool) -> Score:
    drift = sum(r["drift"] for r in per_task.values()) / len(per_task)
    disagreement = soft = None
    if every_task_scored:
        disagreement = sum(1.0 - r["agreement"] for r in per_task.values()) / len(per_task)
        if all("soft" in r for r in per_task.values()):
            soft = sum(r["soft"] for r in per_task.values()) / len(per_task)
    return Score(drift, disagreement, per_task, samples, soft)


def combine_folds(scores: list[Score]) -> Score:
    """A candidate's cross-fitted score: its folds' held-out examples pooled, each one scored by the candidate
    fitted without it. Per task, the drift and agreement are means over all of them (each fold's samples
    already average to that fold's value), so the paired evidence reads every example once."""
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
