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
from featcal.merging.mergekit_arithmetic import (
    arithmetic_dtype,
    generalized_task_arithmetic,
    magnitude_trim,
    mergekit_linear,
    random_drop,
)
from featcal.merging.method import Merger, register
from featcal.merging.methods import (
    DisjointMean,
    dare,
    dare_mask,
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

    def __init__(self, config) -> None:
        super().__init__(config)
        self.mergekit: str | None = getattr(self.method_params, "mergekit_arithmetic", None)

    def merge_tensor(self, name: str, base: Tensor, experts: Iterator[tuple[str, Tensor]]) -> Tensor:
        if self.mergekit is not None:
            thetas = list(experts)
            dtype = arithmetic_dtype(self.mergekit, [theta.dtype for _, theta in thetas])
            return mergekit_linear([theta.to(dtype) for _, theta in thetas],
                                   [self.config.weights.get(e, 1.0) for e, _ in thetas], self.config.normalize is not False)
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
    consensus: bool = False  # TIES' sign election (mergekit's arithmetic: merge_as_mergekit)

    def __init__(self, config) -> None:
        super().__init__(config)
        self.mergekit: str | None = getattr(self.method_params, "mergekit_arithmetic", None)
        self.base_dtypes: dict[str, torch.dtype] = {}

    def prepare(self, family: Family, *, progress: bool = False) -> None:
        """The stored dtypes of the base (mergekit's arithmetic dtype 'inputs' promotes them with the experts')."""
        if self.mergekit is not None:
            self.base_dtypes = {n: family.base.meta(n)[1] for n in family.floating_names}

    @property
    def normalize(self) -> bool:
        return self.normalize_default if self.config.normalize is None else self.config.normalize

    def weight(self, expert: str) -> float:
        return self.config.weights.get(expert, 1.0)

    def generator(self, expert: str, name: str) -> torch.Generator:
        """DARE's mask generator of (seed, expert, tensor)."""
        return torch.Generator().manual_seed(derive_seed(self.config.seed, expert, name))

    def drop_rate(self, expert: str) -> float:
        return self.config.drop_rates.get(expert, self.config.drop_rate)

    def task_vector(self, expert: str, name: str, theta: Tensor, base: Tensor) -> Tensor:
        tau = task_vector(theta, base)
        if self.drop:
            tau = dare(tau, self.drop_rate(expert), self.generator(expert, name), self.config.dare_rescale)
        return tau

    def mergekit_delta(self, expert: str, name: str, delta: Tensor) -> Tensor:
        """δt as mergekit sparsifies it (DARE: featcal's seeded mask, mergekit's rescale in its dtype)."""
        p = self.drop_rate(expert) if self.drop else 0.0
        if p == 0.0:
            return delta
        keep = dare_mask(delta.shape, p, self.generator(expert, name))
        return random_drop(delta, keep, self.config.dare_rescale, p)

    def merge_as_mergekit(self, name: str, base: Tensor, experts: Iterator[tuple[str, Tensor]]) -> Tensor:
        """mergekit's generalized task arithmetic on this tensor, in its dtype (featcal.merging.mergekit_arithmetic):
        every expert's task vector held at once, as mergekit holds them."""
        thetas = list(experts)
        stored = [self.base_dtypes.get(name, base.dtype), *(theta.dtype for _, theta in thetas)]
        theta0 = base.to(arithmetic_dtype(self.mergekit, stored))
        weights = [self.weight(e) for e, _ in thetas]
        deltas = [self.mergekit_delta(e, name, theta.to(theta0.dtype) - theta0) for e, theta in thetas]
        del thetas
        return generalized_task_arithmetic(theta0, deltas, weights, consensus=self.consensus,
                                           normalize=self.normalize, scaling=self.config.scaling)


def weight_divisor(total_weight: float) -> float:
    """What normalize divides by: Σ w_t, or 1 where it is (nearly) zero (mergekit's rule)."""
    return 1.0 if abs(total_weight) < 1e-8 else total_weight


@register("task_arithmetic")
class TaskArithmetic(_TaskVectorMerger):
    """θ0 + s · Σt w_t·τt (divided by Σt w_t with normalize)."""

    def merge_tensor(self, name: str, base: Tensor, experts: Iterator[tuple[str, Tensor]]) -> Tensor:
        if self.mergekit is not None:
            return self.merge_as_mergekit(name, base, experts)
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
    consensus = True

    def __init__(self, config) -> None:
        super().__init__(config)
        self.thresholds: dict[str, float] = {}
        self.selection_dtype = torch.float32

    def density(self, expert: str) -> float:
        return self.config.densities.get(expert, self.config.density)

    @property
    def per_tensor(self) -> bool:
        """Trim each tensor at its own threshold (ties_threshold per_tensor; always in mergekit's arithmetic)."""
        return self.config.ties_threshold == "per_tensor" or self.mergekit is not None

    def prepare(self, family: Family, *, progress: bool = False) -> None:
        """κt = the exact k-th largest |τt| over all of expert t's floating tensors (streamed radix select);
        nothing to prepare for per-tensor thresholds."""
        super().prepare(family, progress=progress)
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

    def mergekit_delta(self, expert: str, name: str, delta: Tensor) -> Tensor:
        """DARE's drop (dare_ties), then mergekit's exactly-k magnitude trim at the expert's density."""
        return magnitude_trim(super().mergekit_delta(expert, name, delta), self.density(expert))

    def merge_tensor(self, name: str, base: Tensor, experts: Iterator[tuple[str, Tensor]]) -> Tensor:
        if self.mergekit is not None:
            return self.merge_as_mergekit(name, base, experts)
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
