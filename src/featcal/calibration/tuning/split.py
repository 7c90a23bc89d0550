"""Which calibration examples score the candidates: one seeded held-out split, or folds (cross-fitting).

Each task's examples are cut by a seeded order that depends only on the seed, the task's name and its
number of examples. Examples keep their batch: a batch's rows are cut into its fit rows and its held-out
rows (padding stays that of the batch). Indices in the records count examples in the order the task's
batches hold them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from featcal.config import DEFAULT_TUNE_HOLDOUT
from featcal.data.batch import Batch
from featcal.errors import CalibrationDataError

# A task holding out at most this many examples is "small": tune_folds, tune_tiebreak and tune_fixed "auto"
# act there (search.py has what was measured for each).
AUTO_SOFT_MAX_HELD = 4
# tune_folds "auto" (the default): cross-fitting (2 folds) where one split would hold out at most AUTO_SOFT_MAX_HELD
# examples of a task. Measured at 8 per task on nine bench zoos (docs/tuning.md): never below the paper's defaults
# (one split fell 1.0 and 0.9 points below them on text seed 2 and vision-real seed 2) and above one split on eight
# of the nine (vision-real seed 1: 73.8 against 75.1 % of the gap). From 5 held-out examples per task one split
# runs, as measured at 32 and 256 per task.
AUTO_FOLDS_SMALL = 2
# tune_screen "auto": the search's candidates are first fitted on this many examples per task where the smallest
# task's fit part holds at least AUTO_SCREEN_MIN_FIT (one split); the best are confirmed on the whole fit part.
AUTO_SCREEN_EXAMPLES = 32
AUTO_SCREEN_MIN_FIT = 64


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


def batch_size(task: str, index: int, batch: Batch) -> int:
    """How many examples a batch holds (its tensors' common first size); refused where they differ."""
    sizes = {k: (int(v.shape[0]) if v.dim() else None) for k, v in batch.items()}
    if len(set(sizes.values())) != 1 or None in sizes.values():
        raise CalibrationDataError(
            f"task {task!r}, batch {index}: tune splits examples along the first dimension, but the batch's "
            f"tensors have first sizes {sizes}"
        )
    return next(iter(sizes.values()))


def examples(task: str, batches: list[Batch]) -> int:
    """How many examples a task's batches hold."""
    return sum(batch_size(task, i, b) for i, b in enumerate(batches))


def _task_sizes(t: str, batches: list[Batch], needed: int, why: str) -> tuple[list[int], int]:
    sizes = [batch_size(t, i, b) for i, b in enumerate(batches)]
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
    """Hold out round(holdout·n) of each task's n examples (at least one, leaving at least one to fit)."""
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


def make_splits(data: Mapping[str, list[Batch]], folds: int, holdout: float, seed: int) -> list[Split]:
    """One split (folds 1) or the folds' splits."""
    return [split_calibration(data, holdout, seed)] if folds == 1 else split_folds(data, folds, seed)


def folds_record(splits: list[Split]) -> dict[str, dict[str, Any]]:
    """featcal.json's `split` for cross-fitting: per task, every fold's held-out indices; each example is
    held out once, so `held_out` is every example."""
    if len(splits) == 1:
        return splits[0].record
    return {t: {"examples": rec["examples"], "folds": len(splits), "fit": [s.record[t]["fit"] for s in splits],
                "held_out": rec["examples"], "fold_indices": [s.record[t]["held_out_indices"] for s in splits]}
            for t, rec in splits[0].record.items()}


def fewest_held_out(splits: list[Split]) -> int:
    """The fewest examples any task holds out over all the splits (what the "auto" rules read)."""
    tasks = splits[0].record
    return min(sum(s.record[t]["held_out"] for s in splits) for t in tasks)


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


def resolve_screen(setting: str | int, splits: list[Split]) -> tuple[int | None, str]:
    """(examples per task the screen fits each candidate on, or None: no screen; why) for tune_screen `setting`."""
    fewest_fit = min(rec["fit"] for s in splits for rec in s.record.values())
    return screen_examples(setting, fewest_fit, len(splits))


def screen_examples(setting: str | int, fewest_fit: int, folds: int) -> tuple[int | None, str]:
    """resolve_screen from the numbers alone (what a plan knows before any data is split)."""
    if setting == "off":
        return None, "off: every candidate is fitted on the whole fit part"
    if folds > 1:
        return None, f"{setting}: cross-fitting (a small set) fits every candidate on its folds: no screen"
    if setting == "auto":
        if fewest_fit < AUTO_SCREEN_MIN_FIT:
            return None, f"auto: the smallest task fits {fewest_fit} example(s) (< {AUTO_SCREEN_MIN_FIT}): no screen"
        return AUTO_SCREEN_EXAMPLES, (f"auto: the smallest task fits {fewest_fit} examples (>= {AUTO_SCREEN_MIN_FIT}): "
                                      f"candidates screened on {AUTO_SCREEN_EXAMPLES} per task")
    if int(setting) >= fewest_fit:
        return None, f"{setting} per task >= the smallest task's {fewest_fit} fit examples: no screen"
    return int(setting), "as configured"


def screen_split(split: Split, n: int, seed: int) -> Split:
    """The screen's split: each task's fit part cut to whole batches holding about n examples (a seeded choice of
    batches, so the engine still sees full batches), the held-out part as it is.

    Whole batches: cutting rows out of every batch would leave many tiny batches, whose per-batch costs then
    dominate; batches are taken in a seeded order until n examples are held (the last may pass n)."""
    fit: dict[str, list[Batch]] = {}
    record: dict[str, dict[str, Any]] = {}
    for t, batches in split.fit.items():
        sizes = [batch_size(t, i, b) for i, b in enumerate(batches)]
        order = torch.randperm(len(batches), generator=torch.Generator().manual_seed(_task_seed(seed, f"screen:{t}")))
        chosen, held = [], 0
        for i in order.tolist():
            if held >= n:
                break
            chosen.append(i)
            held += sizes[i]
        fit[t] = [batches[i] for i in sorted(chosen)]
        record[t] = {**split.record[t], "screen_fit": held, "screen_batches": sorted(chosen)}
    return Split(fit, split.held, record)
