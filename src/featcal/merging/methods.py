"""Merging methods as pure functions on tensors (no I/O), with their maths.

Notation: θ0 the base tensor, θ1..θT the experts' tensors of the same name, τt = θt − θ0 the task
vectors. All arithmetic runs in float32 (float64 for a float64 base) and the caller casts back to
the base dtype. The whole-tensor functions (`average`, `task_arithmetic`, `ties`, `dare_ta`,
`dare_ties`) are the reference definitions; the streaming mergers (featcal.merging.mergers) build
the same results from the same pieces (`task_vector`, `dare`, `DisjointMean`) while reading one
expert tensor at a time, and are tested against these functions.

- average:          θ = (1/T) Σt θt
- task_arithmetic:  θ = θ0 + s · Σt τt                                     (Ilharco et al., 2023)
- ties:             TIES-Merging (Yadav et al., 2023), Algorithm 1:
    1. trim:  τ̂t = τt ⊙ [|τt| ≥ κt], κt the k-th largest |τt| with k = round(density · N), N the
              number of entries of the WHOLE task vector (the driver takes κt over all floating
              parameters of expert t together; here over the given tensor);
    2. elect: γ = sgn(Σt τ̂t), entry by entry (sgn 0 = 0);
    3. disjoint merge: τm = Σ_{t: sgn τ̂t = γ} τ̂t / |{t : sgn τ̂t = γ, τ̂t ≠ 0}|  (0 where none agree);
    θ = θ0 + s · τm.
  Entries where γ = 0 merge to 0, as the paper's Algorithm 1 reads; the authors' code instead sends
  them to the global majority sign, which only matters where trimmed masses cancel exactly.
- dare:             DARE (Yu et al., 2024): each entry of τt is dropped with probability p and the
                    survivors are rescaled by 1/(1−p), so E[dare(τ)] = τ; masks come from a seeded
                    generator, so the result is reproducible.
- dare_ta:          θ0 + s · Σt dare(τt)
- dare_ties:        TIES on the task vectors dare(τt) (trim, elect, disjoint merge, as above).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

import torch
from torch import Tensor


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; every other floating dtype (bf16, fp16, fp32, fp8) computes in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def task_vector(expert: Tensor, base: Tensor) -> Tensor:
    """τ = θt − θ0, in the compute dtype of the base (a bf16 expert of an fp32 base is upcast)."""
    dtype = compute_dtype(base.dtype)
    return expert.to(dtype) - base.to(dtype)


def average(base: Tensor, experts: Sequence[Tensor]) -> Tensor:
    """Plain weight averaging (1/T) Σ θt (the base only fixes the dtype)."""
    dtype = compute_dtype(base.dtype)
    total = torch.zeros(base.shape, dtype=dtype)
    for e in experts:
        total += e.to(dtype)
    return total / len(experts)


def task_arithmetic(base: Tensor, experts: Sequence[Tensor], scaling: float = 0.3) -> Tensor:
    """θ0 + s · Σt (θt − θ0)."""
    dtype = compute_dtype(base.dtype)
    total = torch.zeros(base.shape, dtype=dtype)
    for e in experts:
        total += task_vector(e, base)
    return base.to(dtype) + scaling * total


def keep_count(numel: int, density: float) -> int:
    """How many entries TIES keeps of a task vector with `numel` entries: round(density·N), at least 1."""
    if numel == 0:
        return 0
    return min(numel, max(1, math.floor(density * numel + 0.5)))


def kth_largest(values: Tensor, k: int) -> float:
    """The k-th largest entry of `values` (k ≥ 1), by sorting: the in-memory reference."""
    flat = values.reshape(-1)
    return float(torch.topk(flat, k, sorted=True).values[-1])


def trim(tau: Tensor, threshold: float) -> Tensor:
    """Keep the entries with |τ| ≥ threshold (ties at the threshold are all kept), zero the rest."""
    return torch.where(tau.abs() >= threshold, tau, torch.zeros((), dtype=tau.dtype))


class DisjointMean:
    """TIES' elect + disjoint merge, accumulated one trimmed task vector at a time.

    Keeps four tensors of the merged tensor's shape (positive and negative sums of the weighted
    trimmed vectors w_t·τ̂t, and the weights that contributed to each), whatever the number of
    experts: γ = sgn(P + N), and the disjoint mean is P / Σ_{w·τ̂>0} w where γ > 0, N / Σ_{w·τ̂<0} w
    where γ < 0, 0 where γ = 0 (with unit weights: the paper's mean over the agreeing experts; with
    `normalize=False` the sums P and N themselves, mergekit's dare_ties default).
    """

    def __init__(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> None:
        self.pos = torch.zeros(shape, dtype=dtype)
        self.neg = torch.zeros(shape, dtype=dtype)
        self.n_pos = torch.zeros(shape, dtype=dtype)  # summed weights (counts with unit weights: exact)
        self.n_neg = torch.zeros(shape, dtype=dtype)

    def add(self, trimmed: Tensor, weight: float = 1.0) -> None:
        weighted = trimmed if weight == 1.0 else trimmed * weight
        positive, negative = weighted > 0, weighted < 0
        self.pos += torch.where(positive, weighted, 0.0)
        self.neg += torch.where(negative, weighted, 0.0)
        self.n_pos += torch.where(positive, weight, 0.0)
        self.n_neg += torch.where(negative, weight, 0.0)

    def result(self, normalize: bool = True) -> Tensor:
        elected = torch.sign(self.pos + self.neg)
        one = torch.ones((), dtype=self.pos.dtype)
        up = self.pos / torch.where(self.n_pos == 0, one, self.n_pos) if normalize else self.pos
        down = self.neg / torch.where(self.n_neg == 0, one, self.n_neg) if normalize else self.neg
        zero = torch.zeros((), dtype=self.pos.dtype)
        return torch.where(elected > 0, up, torch.where(elected < 0, down, zero))


def disjoint_merge(trimmed: Sequence[Tensor]) -> Tensor:
    """Elect the sign per entry by summed trimmed mass, then average the agreeing non-zero entries."""
    acc = DisjointMean(trimmed[0].shape, trimmed[0].dtype)
    for t in trimmed:
        acc.add(t)
    return acc.result()


def ties_from_task_vectors(base: Tensor, taus: Sequence[Tensor], density: float, scaling: float) -> Tensor:
    """TIES given the task vectors (thresholds taken over each whole given tensor)."""
    trimmed = []
    for tau in taus:
        k = keep_count(tau.numel(), density)
        trimmed.append(trim(tau, kth_largest(tau.abs(), k)) if k else tau)
    return base.to(taus[0].dtype) + scaling * disjoint_merge(trimmed)


def ties(base: Tensor, experts: Sequence[Tensor], density: float = 0.2, scaling: float = 0.3) -> Tensor:
    """TIES-Merging of whole tensors (see the module docstring)."""
    return ties_from_task_vectors(base, [task_vector(e, base) for e in experts], density, scaling)


def derive_seed(seed: int, *parts: str) -> int:
    """A 63-bit seed for one (seed, expert, tensor) triple: masks do not depend on reading order."""
    digest = hashlib.sha256("\x1f".join([str(seed), *parts]).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def dare_mask(shape: torch.Size | tuple[int, ...], drop_rate: float, generator: torch.Generator) -> Tensor:
    """Which entries DARE keeps: each is dropped with probability p, from the seeded generator."""
    return torch.rand(shape, generator=generator) >= drop_rate


def dare(tau: Tensor, drop_rate: float, generator: torch.Generator, rescale: str = "inverse") -> Tensor:
    """Drop each entry with probability p; rescale the survivors by 1/(1−p) ('inverse', the DARE paper), by
    ‖τ‖₁ / ‖kept‖₁ ('l1', mergekit's: left unscaled when either norm is below 1e-7) or not ('none').
    p = 0: τ unchanged."""
    if drop_rate == 0.0:
        return tau
    keep = dare_mask(tau.shape, drop_rate, generator)
    zero = torch.zeros((), dtype=tau.dtype)
    if rescale == "inverse":
        return torch.where(keep, tau / (1.0 - drop_rate), zero)
    kept = torch.where(keep, tau, zero)
    if rescale == "none":
        return kept
    before, after = tau.abs().sum(), kept.abs().sum()
    if before < L1_RESCALE_EPS or after < L1_RESCALE_EPS:
        return kept
    return kept * (before / after)


L1_RESCALE_EPS = 1e-7


def floor_keep_count(numel: int, density: float) -> int:
    """How many entries a per-tensor TIES trim keeps: max(1, floor(density·n)), all of them at density 1
    (mergekit's magnitude sparsification; the global trim rounds instead: keep_count)."""
    if numel == 0:
        return 0
    return numel if density >= 1.0 else min(numel, max(1, int(density * numel)))


def dare_ta(
    base: Tensor, experts: Sequence[Tensor], generators: Sequence[torch.Generator], drop_rate: float = 0.5,
    scaling: float = 0.3,
) -> Tensor:
    """θ0 + s · Σt dare(τt), one generator per expert."""
    dtype = compute_dtype(base.dtype)
    total = torch.zeros(base.shape, dtype=dtype)
    for e, g in zip(experts, generators, strict=True):
        total += dare(task_vector(e, base), drop_rate, g)
    return base.to(dtype) + scaling * total


def dare_ties(
    base: Tensor, experts: Sequence[Tensor], generators: Sequence[torch.Generator], drop_rate: float = 0.5,
    density: float = 0.2, scaling: float = 0.3,
) -> Tensor:
    """TIES (trim at `density`, elect, disjoint merge) of the DARE-sparsified task vectors."""
    taus = [dare(task_vector(e, base), drop_rate, g) for e, g in zip(experts, generators, strict=True)]
    return ties_from_task_vectors(base, taus, density, scaling)
