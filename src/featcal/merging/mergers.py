"""The built-in streaming mergers: average, linear, task_arithmetic, ties, dare_ta, dare_ties.

Each applies the maths of featcal.merging.methods to one tensor at a time; see that module for the
definitions. Accumulators have the shape of one tensor, whatever the number of experts.

Per-expert weights w_t (and densities, drop rates) and `normalize` generalise the methods the way
mergekit's do (docs/mergekit.md): θ0 + s·Σ w_t·τt, divided by Σ w_t with normalize; TIES elects the
sign of Σ w_t·τ̂t and averages the agreeing w_t·τ̂t with their weights. At unit weights and the
defaults the results are the unweighted methods', bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor
from tqdm.auto import tqdm

from featcal.merging.family import Family
from featcal.merging.method import Merger, register
from featcal.merging.methods import (
    DisjointMean,
    dare,
    derive_seed,
    floor_keep_count,
    keep_count,
    kth_largest,
    task_vector,
)
from featcal.merging.selection import StreamingKthLargest


@register("average")
class Average(Merger):
    """(1/T) Σ θt."""

    def merge_tensor(self, name: str, base: Tensor, experts: Iterator[tuple[str, Tensor]]) -> Tensor:
        total = torch.zeros(base.shape, dtype=base.dtype)
        count = 0
        for _, theta in experts:
            total += theta.to(base.dtype)
            count += 1
            del theta  # let the expert tensor go before the next one is read
        return total / count


@register("linear")
class Linear(Merger):
    """Σ w_t·θt / Σ w_t (normalize, the default) or Σ w_t·θt: a weighted average of the experts' weights
    (mergekit's linear; the base counts only when it is also given as an expert)."""

    def merge_tensor(self, name: str, base: Tensor, experts: Iterator[tuple[str, Tensor]]) -> Tensor:
        total = torch.zeros(base.shape, dtype=base.dtype)
        weight_sum = 0.0
        for expert, theta in experts:
            w = self.config.weights.get(expert, 1.0)
            total.add_(theta.to(base.dtype), alpha=w)
            weight_sum += w
            del theta
        return total / weight_sum if self.config.normalize is not False else total


class _TaskVectorMerger(Merger):
    """Shared by the methods built on task vectors τt = θt − θ0 (optionally DARE-sparsified)."""

    drop: bool = False
    normalize_default: bool = False

    @property
    def normalize(self) -> bool:
        return self.normalize_default if self.config.normalize is None else self.config.normalize

    def weight(self, expert: str) -> float:
        return self.config.weights.get(expert, 1.0)

    def task_vector(self, expert: str, name: str, theta: Tensor, base: Tensor) -> Tensor:
        tau = task_vector(theta, base)
        if self.drop:
            g = torch.Generator().manual_seed(derive_seed(self.config.seed, expert, name))
            tau = dare(tau, self.config.drop_rates.get(expert, self.config.drop_rate), g, self.config.dare_rescale)
        return tau


def weight_divisor(total_weight: float) -> float:
    """What normalize divides by: Σ w_t, or 1 where it is (nearly) zero (mergekit's rule)."""
    return 1.0 if abs(total_weight) < 1e-8 else total_weight


@register("task_arithmetic")
class TaskArithmetic(_TaskVectorMerger):
    """θ0 + s · Σt w_t·τt (divided by Σt w_t with normalize)."""

    def merge_tensor(self, name: str, base: Tensor, experts: Iterator[tuple[str, Tensor]]) -> Tensor:
        total = torch.zeros(base.shape, dtype=base.dtype)
        weight_sum = 0.0
        for expert, theta in experts:
            w = self.weight(expert)
            tau = self.task_vector(expert, name, theta, base)
            total += tau if w == 1.0 else tau * w
            weight_sum += w
            del theta, tau
        if self.normalize:
            total /= weight_divisor(weight_sum)
        return base + self.config.scaling * total


@register("dare_ta")
class DareTaskArithmetic(TaskArithmetic):
    """θ0 + s · Σt dare(τt), masks seeded per (seed, expert, tensor)."""

    drop = True


@register("ties")
class Ties(_TaskVectorMerger):
    """TIES: trim each task vector at its top-`density` magnitudes (of the whole task vector, or of each tensor
    with ties_threshold per_tensor), elect signs, disjoint (weighted) mean."""

    normalize_default = True

    def __init__(self, config) -> None:
        super().__init__(config)
        self.thresholds: dict[str, float] = {}
        self.selection_dtype = torch.float32

    def density(self, expert: str) -> float:
        return self.config.densities.get(expert, self.config.density)

    @property
    def per_tensor(self) -> bool:
        return self.config.ties_threshold == "per_tensor"

    def prepare(self, family: Family, *, progress: bool = False) -> None:
        """κt = the exact k-th largest |τt| over all of expert t's floating tensors (streamed radix select);
        nothing to prepare for per-tensor thresholds."""
        if self.per_tensor:
            return
        self.selection_dtype = family.selection_dtype()
        numel = family.floating_numel()
        keep = {e: keep_count(numel, self.density(e)) for e in family.experts}
        self.thresholds = {e: 0.0 for e, k in keep.items() if k == numel}  # keep everything: no threshold to find
        selectors = {e: StreamingKthLargest(k, self.selection_dtype) for e, k in keep.items() if k != numel}
        if not selectors:
            return
        passes = next(iter(selectors.values())).passes
        for p in range(passes):
            names = tqdm(
                family.floating_names, desc=f"{self.name} thresholds, pass {p + 1}/{passes}", unit="tensor",
                disable=not progress, leave=False,
            )
            for name in names:
                base = family.base_tensor(name)
                for expert, theta in family.expert_tensors(name):
                    if expert not in selectors:
                        continue
                    tau = self.task_vector(expert, name, theta, base)
                    del theta
                    selectors[expert].observe(tau.abs())
                    del tau
            for s in selectors.values():
                s.end_pass()
        self.thresholds.update({e: s.value for e, s in selectors.items()})

    def trim(self, expert: str, tau: Tensor) -> Tensor:
        if self.per_tensor:
            k = floor_keep_count(tau.numel(), self.density(expert))
            if k == tau.numel():
                return tau
            threshold = kth_largest(tau.abs(), k)
            return torch.where(tau.abs() >= threshold, tau, torch.zeros((), dtype=tau.dtype))
        keep = tau.abs().to(self.selection_dtype) >= self.thresholds[expert]
        return torch.where(keep, tau, torch.zeros((), dtype=tau.dtype))

    def merge_tensor(self, name: str, base: Tensor, experts: Iterator[tuple[str, Tensor]]) -> Tensor:
        acc = DisjointMean(base.shape, base.dtype)
        for expert, theta in experts:
            tau = self.task_vector(expert, name, theta, base)
            del theta
            acc.add(self.trim(expert, tau), self.weight(expert))
            del tau
        return base + self.config.scaling * acc.result(self.normalize)


@register("dare_ties")
class DareTies(Ties):
    """TIES on DARE-sparsified task vectors (the same seeded masks in the threshold and merge passes)."""

    drop = True
