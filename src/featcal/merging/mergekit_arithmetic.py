"""mergekit's arithmetic, for a mergekit YAML (the methods' `mergekit_arithmetic` parameter; docs/mergekit.md).

featcal's own mergers compute in float32 and cast once at the end; mergekit 0.1.x casts its inputs to the YAML's
`dtype` (linear then accumulates in float32) and computes task_arithmetic, ties, dare_linear and dare_ties in that
dtype (bfloat16: every step rounded
to bfloat16), trims TIES at exactly k = max(1, floor(density·n)) entries per tensor chosen by a descending argsort
of |δ| (in bfloat16 many magnitudes tie at the threshold, and the sort decides which of them survive), elects the
sign of the weighted sum with a zero sum counting as +, and multiplies by its weights as a tensor of that dtype
(0.6 is 0.6015625 in bfloat16). These functions follow mergekit's operations one for one (its
merge_methods/generalized_task_arithmetic.py and sparsify.py), so that a mergekit YAML gives mergekit's tensors:
tests/merging/test_mergekit.py compares them with mergekit's own output in bfloat16. They hold every expert's
task vector (linear: every input) of one tensor at once, as mergekit does (featcal's own streaming merge holds
one).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

L1_EPS = 1e-7  # mergekit's: below it, a norm is not rescaled to


def arithmetic_dtype(setting: str, dtypes: Iterable[torch.dtype]) -> torch.dtype:
    """The dtype mergekit computes in: the YAML's `dtype` (its inputs are cast to it), else ('inputs') the
    inputs' own dtypes promoted together."""
    if setting != "inputs":
        return getattr(torch, setting)
    out: torch.dtype | None = None
    for d in dtypes:
        out = d if out is None else torch.promote_types(out, d)
    return out if out is not None else torch.float32


def magnitude_trim(delta: Tensor, density: float) -> Tensor:
    """mergekit's `sparsify.magnitude` (no rescale): exactly k = max(1, floor(density·n)) entries kept, those
    first in a descending argsort of |δ| (computed in float32), the rest zeroed; density ≥ 1 keeps everything."""
    if density >= 1 or delta.numel() == 0:
        return delta
    k = max(1, int(density * delta.numel()))
    mask = torch.zeros(delta.numel(), dtype=delta.dtype, device=delta.device)
    magnitude = delta.abs().reshape(-1)
    if magnitude.device.type == "cpu":
        magnitude = magnitude.float()
    mask[torch.argsort(magnitude, descending=True)[:k]] = 1
    return delta * mask.reshape_as(delta)


def random_drop(delta: Tensor, keep: Tensor, rescale: str, drop_rate: float) -> Tensor:
    """mergekit's `sparsify.bernoulli` given the mask `keep` (featcal's seeded one; mergekit draws its own): in
    bfloat16 for a bfloat16 δ on the CPU, else float32; rescaled so that the tensor keeps its L1 norm ('l1',
    mergekit's; not where either norm is below 1e-7), by 1/(1−p) ('inverse') or not ('none')."""
    work = delta.dtype if delta.dtype == torch.bfloat16 or delta.device.type != "cpu" else torch.float32
    tensor = delta.to(work)
    masked = tensor * keep.to(work)
    if rescale == "l1":
        before, after = tensor.abs().sum(), masked.abs().sum()
        if not (before < L1_EPS or after < L1_EPS):
            masked = masked * (before / after)
    elif rescale == "inverse":
        masked = masked / (1.0 - drop_rate)
    return masked.to(delta.dtype)


def generalized_task_arithmetic(base: Tensor, deltas: Sequence[Tensor], weights: Sequence[float], *,
                                consensus: bool, normalize: bool, scaling: float) -> Tensor:
    """mergekit's GeneralizedTaskArithmeticMerge.merge_group on (sparsified) task vectors δt already in the
    arithmetic dtype of `base`: Σ wt·δt, with consensus only the δt agreeing with the sign of that sum (0 counts
    as +), divided by the summed (agreeing) weights with normalize, times λ = `scaling`, plus θ0."""
    stacked = torch.stack(list(deltas))
    w = torch.tensor(list(weights), dtype=stacked.dtype, device=stacked.device)
    while stacked.dim() > w.dim():
        w.unsqueeze_(-1)
    stacked.mul_(w)
    if consensus:
        majority = (stacked.sum(dim=0) >= 0).to(stacked.dtype) * 2 - 1
        agree = stacked.sign() == majority
        mixed = (stacked * agree).sum(dim=0)
        divisor = (w * agree).sum(dim=0)
        divisor[divisor == 0] = 1
    else:
        mixed = stacked.sum(dim=0)
        divisor = w.sum(dim=0)
        divisor[divisor.abs() < 1e-8] = 1
    if normalize:
        mixed /= divisor
    if scaling != 1:
        mixed *= scaling
    return (base + mixed).to(base.dtype)


def mergekit_linear(tensors: Sequence[Tensor], weights: Sequence[float], normalize: bool) -> Tensor:
    """mergekit's linear merge on inputs already in its dtype: Σ wi·θi accumulated in float32 (float64 for
    float64 inputs) with float32 weights, divided by their float32 sum with normalize, cast back."""
    first = tensors[0]
    dtype = torch.float64 if first.dtype == torch.float64 else torch.float32
    w = torch.tensor(list(weights), dtype=dtype, device=first.device)
    result = torch.zeros_like(first, dtype=dtype)
    for tensor, coefficient in zip(tensors, w.unbind(0), strict=True):
        result.addcmul_(tensor, coefficient)
    if normalize:
        result.div_(w.sum())
    return result.to(first.dtype)
