"""RegMean's statistics and its closed-form solve, as pure functions plus one streaming accumulator.

Per Linear and task, G_t = mean over tokens of x xᵀ (x: the Linear's input, in float64). Means rather
than sums, as in the reference code, so tasks with more tokens do not outweigh the others.
The merge sums are additive over tasks, so experts are visited one at a time and only
A = Σ_t G̃_t (in×in) and B = Σ_t G̃_t W_tᵀ (in×out) are kept, whatever the number of experts.

This duplicates what the FeatCal calibrator's statistics module accumulates for C = E[xs xsᵀ]; the two
should share one streaming weighted-Gram accumulator once both exist (see docs/baselines.md).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch
from torch import nn


def scale_off_diagonal(gram: torch.Tensor, alpha: float) -> torch.Tensor:
    """G̃ = α·G + (1−α)·diag(G): off-diagonal entries scaled by α, the diagonal kept."""
    return alpha * gram + (1.0 - alpha) * torch.diag_embed(torch.diagonal(gram))


def regmean_solve(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """W = (A⁻¹ B)ᵀ, with A = Σ G̃_t, B = Σ G̃_t W_tᵀ; pseudo-inverse where A is singular."""
    try:
        chol = torch.linalg.cholesky(a)
        wt = torch.cholesky_solve(b, chol)
    except torch.linalg.LinAlgError:
        wt = torch.linalg.pinv(a, hermitian=True) @ b
    return wt.T


def regmean_weight(grams: list[torch.Tensor], weights: list[torch.Tensor], alpha: float = 0.9) -> torch.Tensor:
    """RegMean of one Linear weight from each task's Gram [in, in] and weight [out, in]."""
    scaled = [scale_off_diagonal(g.double(), alpha) for g in grams]
    a = sum(scaled)
    b = sum(g @ w.double().T for g, w in zip(scaled, weights, strict=True))
    return regmean_solve(a, b).to(weights[0].dtype)


class GramAccumulator:
    """Running mean of x xᵀ over all tokens fed to each watched Linear (forward hooks)."""

    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.counts: dict[str, int] = {}

    def add(self, name: str, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).double()
        xtx = x.T @ x
        if name in self.sums:
            self.sums[name] += xtx
            self.counts[name] += x.shape[0]
        else:
            self.sums[name], self.counts[name] = xtx, x.shape[0]

    def mean(self, name: str) -> torch.Tensor | None:
        """E[x xᵀ] for `name`, or None if the module never ran."""
        if not self.counts.get(name):
            return None
        return self.sums[name] / self.counts[name]

    @contextmanager
    def watching(self, modules: Mapping[str, nn.Module]) -> Iterator[GramAccumulator]:
        """Accumulate the inputs of `modules` (name -> Linear) while the context is open."""
        handles = [
            m.register_forward_hook(lambda _m, args, _out, name=name: self.add(name, args[0]))
            for name, m in modules.items()
        ]
        try:
            yield self
        finally:
            for h in handles:
                h.remove()


class RegMeanSums:
    """A = Σ_t G̃_t and B = Σ_t G̃_t W_tᵀ for one Linear, accumulated expert by expert."""

    def __init__(self, alpha: float) -> None:
        self.alpha = alpha
        self.a: torch.Tensor | None = None
        self.b: torch.Tensor | None = None

    def add(self, gram: torch.Tensor | None, weight: torch.Tensor) -> None:
        if gram is None:  # the module saw no input for this task: RegMean gives that expert no say
            return
        g = scale_off_diagonal(gram.double(), self.alpha)
        gw = g @ weight.detach().double().T
        self.a = g if self.a is None else self.a + g
        self.b = gw if self.b is None else self.b + gw

    def solve(self) -> torch.Tensor | None:
        """The merged weight [out, in] in float64, or None if no task fed this Linear any input."""
        if self.a is None or not torch.any(self.a):
            return None
        return regmean_solve(self.a, self.b)
