"""Token-weighted Gram sums Σ w·x xᵀ, Σ w·x, Σ w, accumulated batch by batch: shared by FeatCal's
statistics and RegMean's.

Σ w·x xᵀ is symmetric, so from SYM_MIN_D features on only its block-upper triangle is accumulated: d is
split into `gram_chunks(d)` column chunks and chunk i adds its rows' products with chunks i..k, (k+1)/(2k) of
the plain product's multiply-adds. The lower triangle is filled once, when the sums are read (`full_sxx`).
SYM_MIN_D and SYM_CHUNK were timed with benchmarks/gram_micro.py (docs/bench-scaling.md: 1.2–1.7× faster at 2 threads).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

_F32 = torch.float32
_F64 = torch.float64

WeightFn = Callable[[str, torch.Tensor], "torch.Tensor | None"]  # (module name, its input) -> token weights


SYM_MIN_D = 256  # below this width the plain product (one addmm) is used
SYM_CHUNK = 256  # target width of a column chunk of the symmetric accumulation


def gram_chunks(d: int) -> int:
    """Column chunks of a d×d Gram's symmetric accumulation; 1 means the plain product."""
    if d < SYM_MIN_D:
        return 1
    return max(2, round(d / SYM_CHUNK))


def chunk_bounds(d: int, k: int) -> list[int]:
    """Chunk i covers columns [bounds[i], bounds[i+1]); widths differ by at most one when k does not divide d."""
    return [i * d // k for i in range(k + 1)]


def add_gram_(sxx: torch.Tensor, xw: torch.Tensor, x: torch.Tensor, chunks: int) -> None:
    """sxx += xwᵀ x, in place: the whole product (chunks 1) or only its block-upper triangle."""
    if chunks == 1:
        sxx.addmm_(xw.T, x)  # in place: no in×in temporary per batch
        return
    bounds = chunk_bounds(sxx.shape[0], chunks)
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        sxx[lo:hi, lo:].addmm_(xw[:, lo:hi].T, x[:, lo:])


def symmetrised(sxx: torch.Tensor, chunks: int) -> torch.Tensor:
    """The full Gram from a block-upper one, its upper triangle mirrored (a new tensor, exactly symmetric),
    or `sxx` itself when it is already full."""
    if chunks == 1:
        return sxx
    return mirror_upper_(sxx.clone(), chunks)


def mirror_upper_(out: torch.Tensor, chunks: int) -> torch.Tensor:
    """`out`'s block-upper triangle mirrored below its diagonal, in place; returns `out`.

    Block by block: each diagonal block mirrors its own upper triangle, and the blocks below it are the
    transposes of those right of it, so the part below the diagonal is written once (no full-size
    triangle temporaries: this runs for every group, task and block).
    """
    if chunks == 1:
        return out
    bounds = chunk_bounds(out.shape[0], chunks)
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        diag = out[lo:hi, lo:hi]
        diag.copy_(torch.triu(diag) + torch.triu(diag, 1).T)
        out[hi:, lo:hi] = out[lo:hi, hi:].T
    return out


def _flat(x: torch.Tensor, dtype: torch.dtype = _F32) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1]).to(dtype)


def flat_tokens(x: torch.Tensor, w: torch.Tensor | None, dtype: torch.dtype = _F32):
    """x as tokens × features in `dtype`, without its zero-weight tokens (padding: they add nothing).

    Returns (x, w flat or None when every token weighs 1, keep: the kept tokens' mask, None when all are);
    `select_tokens(other, keep)` brings another tensor of the same tokens into the same shape.
    """
    x = _flat(x, dtype)
    if w is None:
        return x, None, None
    w = w.reshape(-1).to(dtype)
    keep = w > 0
    if bool(keep.all()):
        return x, w, None
    return x[keep], w[keep], keep


def select_tokens(t: torch.Tensor, keep: torch.Tensor | None, dtype: torch.dtype = _F32) -> torch.Tensor:
    t = _flat(t, dtype)
    return t if keep is None else t[keep]


def prepare_tokens(x: torch.Tensor, w: torch.Tensor | None, *more: torch.Tensor, dtype: torch.dtype = _F32):
    """Flatten to tokens × features in `dtype` and drop zero-weight tokens (padding): they add nothing.

    w None means every token weighs 1 (no multiply needed). Returns (x, w or None, *more).
    """
    x, w, keep = flat_tokens(x, w, dtype)
    return (x, w, *(select_tokens(m, keep, dtype) for m in more))


def weighted(x: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor:
    return x if w is None else x * w[:, None]


def weight_total(x: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor | float:
    """Σw of tokens × d `x`: its row count when every token weighs 1 (a Python number: a tensor made
    from it would be a host-to-device copy per batch on a GPU)."""
    return float(x.shape[0]) if w is None else w.sum()


@dataclass
class GramSums:
    """Σw, Σ w·x and Σ w·x xᵀ of one module input: featcal's one streaming weighted-Gram accumulator.

    FeatCal shares one per group of modules reading the same input (float32 sums, all-reduced across
    ranks); RegMean keeps one per Linear in float64 (featcal.merging.regmean_grams). Either way zero-weight
    tokens (padding) are dropped before any product.
    """

    sw: torch.Tensor
    sx: torch.Tensor
    sxx: torch.Tensor  # block-upper triangle only when chunks > 1: read it through full_sxx()
    chunks: int = 1  # column chunks of the symmetric accumulation (gram_chunks); 1: sxx is the full product

    @classmethod
    def zeros(cls, d: int, device: torch.device, dtype: torch.dtype = _F32) -> GramSums:
        z = torch.zeros((), dtype=dtype, device=device)
        return cls(z, torch.zeros(d, dtype=dtype, device=device), torch.zeros(d, d, dtype=dtype, device=device),
                   gram_chunks(d))

    def add(self, x: torch.Tensor, w: torch.Tensor | None) -> None:
        """Accumulate x (..., d) with token weights w (...) or None (all 1), in the sums' dtype."""
        x, w = prepare_tokens(x, w, dtype=self.sxx.dtype)
        self.add_tokens(x, w)

    def add_tokens(self, x: torch.Tensor, w: torch.Tensor | None) -> None:
        """Accumulate tokens × d `x` already in the sums' dtype, with weights w (all > 0) or None (all 1)."""
        xw = weighted(x, w)
        self.sw += weight_total(x, w)
        self.sx += xw.sum(0)
        add_gram_(self.sxx, xw, x, self.chunks)

    def full_sxx(self) -> torch.Tensor:
        """Σ w·x xᵀ, whole (a new tensor when only its block-upper triangle is held)."""
        return symmetrised(self.sxx, self.chunks)

    def means(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(Σw, E_w[x], E_w[x xᵀ]) in float64, or None when no token carried weight."""
        sw = self.sw.to(_F64)
        if float(sw) <= 0:
            return None
        # widened into one new float64 tensor, mirrored and scaled in place: the same values as mirroring, widening
        # and dividing out of place, without the 2-3 extra in×in temporaries (each a fresh mapping whose pages
        # fault in: 7.2 % of a 1B-shape calibration's engine time, 3.4 % after; docs/scaling.md)
        sxx = mirror_upper_(self.sxx.to(_F64, copy=True), self.chunks)
        return sw, self.sx.to(_F64) / sw, sxx.div_(sw)

    def merge_(self, other: GramSums) -> None:
        self.sw += other.sw
        self.sx += other.sx
        if other.chunks == self.chunks:  # the same layout: the triangles add up
            self.sxx += other.sxx
        else:
            self.sxx = self.full_sxx() + other.full_sxx()
            self.chunks = 1
