"""Token-weighted Gram sums Σ w·x xᵀ, Σ w·x, Σ w, accumulated batch by batch: shared by FeatCal's
statistics and RegMean's."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

_F32 = torch.float32
_F64 = torch.float64

WeightFn = Callable[[str, torch.Tensor], "torch.Tensor | None"]  # (module name, its input) -> token weights


def _flat(x: torch.Tensor, dtype: torch.dtype = _F32) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1]).to(dtype)


def _prepare(x: torch.Tensor, w: torch.Tensor | None, *more: torch.Tensor, dtype: torch.dtype = _F32):
    """Flatten to tokens × features in `dtype` and drop zero-weight tokens (padding): they add nothing.

    w None means every token weighs 1 (no multiply needed). Returns (x, w or None, *more).
    """
    xs = [_flat(x, dtype), *(_flat(m, dtype) for m in more)]
    if w is None:
        return (xs[0], None, *xs[1:])
    w = w.reshape(-1).to(dtype)
    keep = w > 0
    if not bool(keep.all()):
        xs = [t[keep] for t in xs]
        w = w[keep]
    return (xs[0], w, *xs[1:])


def _weighted(x: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor:
    return x if w is None else x * w[:, None]


def _total(x: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor:
    return x.new_tensor(float(x.shape[0])) if w is None else w.sum()


@dataclass
class GramSums:
    """Σw, Σ w·x and Σ w·x xᵀ of one module input: featcal's one streaming weighted-Gram accumulator.

    FeatCal shares one per group of modules reading the same input (float32 sums, all-reduced across
    ranks); RegMean keeps one per Linear in float64 (featcal.merging.regmean_grams). Either way zero-weight
    tokens (padding) are dropped before any product.
    """

    sw: torch.Tensor
    sx: torch.Tensor
    sxx: torch.Tensor

    @classmethod
    def zeros(cls, d: int, device: torch.device, dtype: torch.dtype = _F32) -> GramSums:
        z = torch.zeros((), dtype=dtype, device=device)
        return cls(z, torch.zeros(d, dtype=dtype, device=device), torch.zeros(d, d, dtype=dtype, device=device))

    def add(self, x: torch.Tensor, w: torch.Tensor | None) -> None:
        """Accumulate x (..., d) with token weights w (...) or None (all 1), in the sums' dtype."""
        x, w = _prepare(x, w, dtype=self.sxx.dtype)
        xw = _weighted(x, w)
        self.sw += _total(x, w)
        self.sx += xw.sum(0)
        self.sxx.addmm_(xw.T, x)  # in place: no in×in temporary per batch

    def means(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(Σw, E_w[x], E_w[x xᵀ]) in float64, or None when no token carried weight."""
        sw = self.sw.to(_F64)
        if float(sw) <= 0:
            return None
        return sw, self.sx.to(_F64) / sw, self.sxx.to(_F64) / sw

    def merge_(self, other: GramSums) -> None:
        self.sw += other.sw
        self.sx += other.sx
        self.sxx += other.sxx
