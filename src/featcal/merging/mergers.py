"""The built-in streaming mergers: average, task_arithmetic, ties, dare_ta, dare_ties.

Each applies the maths of featcal.merging.methods to one tensor at a time; see that module for the
definitions. Accumulators have the shape of one tensor, whatever the number of experts.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor
from tqdm.auto import tqdm

from featcal.merging.family import Family
from featcal.merging.method import Merger, register
from featcal.merging.methods import DisjointMean, dare, derive_seed, keep_count, task_vector
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


class _TaskVectorMerger(Merger):
    """Shared by the methods built on task vectors τt = θt − θ0 (optionally DARE-sparsified)."""

    drop: bool = False

    def task_vector(self, expert: str, name: str, theta: Tensor, base: Tensor) -> Tensor:
        tau = task_vector(theta, base)
        if self.drop:
            g = torch.Generator().manual_seed(derive_seed(self.config.seed, expert, name))
            tau = dare(tau, self.config.drop_rate, g)
        return tau


@register("task_arithmetic")
class TaskArithmetic(_TaskVectorMerger):
    """θ0 + s · Σt τt."""

    def merge_tensor(self, name: str, base: Tensor, experts: Iterator[tuple[str, Tensor]]) -> Tensor:
        total = torch.zeros(base.shape, dtype=base.dtype)
        for expert, theta in experts:
            total += self.task_vector(expert, name, theta, base)
            del theta
        return base + self.config.scaling * total


@register("dare_ta")
class DareTaskArithmetic(TaskArithmetic):
    """θ0 + s · Σt dare(τt), masks seeded per (seed, expert, tensor)."""

    drop = True


@register("ties")
class Ties(_TaskVectorMerger):
    """TIES: trim each task vector at its global top-`density` magnitude, elect signs, disjoint mean."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.thresholds: dict[str, float] = {}
        self.selection_dtype = torch.float32

    def prepare(self, family: Family, *, progress: bool = False) -> None:
        """κt = the exact k-th largest |τt| over all of expert t's floating tensors (streamed radix select)."""
        self.selection_dtype = family.selection_dtype()
        numel = family.floating_numel()
        k = keep_count(numel, self.config.density)
        if k == numel:  # keep everything: no threshold to find
            self.thresholds = {e: 0.0 for e in family.experts}
            return
        selectors = {e: StreamingKthLargest(k, self.selection_dtype) for e in family.experts}
        passes = next(iter(selectors.values())).passes
        for p in range(passes):
            names = tqdm(
                family.floating_names, desc=f"{self.name} thresholds, pass {p + 1}/{passes}", unit="tensor",
                disable=not progress, leave=False,
            )
            for name in names:
                base = family.base_tensor(name)
                for expert, theta in family.expert_tensors(name):
                    tau = self.task_vector(expert, name, theta, base)
                    del theta
                    selectors[expert].observe(tau.abs())
                    del tau
            for s in selectors.values():
                s.end_pass()
        self.thresholds = {e: s.value for e, s in selectors.items()}

    def trim(self, expert: str, tau: Tensor) -> Tensor:
        keep = tau.abs().to(self.selection_dtype) >= self.thresholds[expert]
        return torch.where(keep, tau, torch.zeros((), dtype=tau.dtype))

    def merge_tensor(self, name: str, base: Tensor, experts: Iterator[tuple[str, Tensor]]) -> Tensor:
        acc = DisjointMean(base.shape, base.dtype)
        for expert, theta in experts:
            tau = self.task_vector(expert, name, theta, base)
            del theta
            acc.add(self.trim(expert, tau))
            del tau
        return base + self.config.scaling * acc.result()


@register("dare_ties")
class DareTies(Ties):
    """TIES on DARE-sparsified task vectors (the same seeded masks in the threshold and merge passes)."""

    drop = True
