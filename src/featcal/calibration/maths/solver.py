"""Closed-form FeatCal solves (docs/method.md §5): pure functions on statistics, no model knowledge.

Everything here works in float64: the systems are small (in×in at most) next to the forwards that
produced their statistics, and double precision keeps the ridge solves exact to round-off.
"""

from __future__ import annotations

import logging

import torch

from featcal.io.read.validate import all_finite, non_finite_count

log = logging.getLogger("featcal.calibration")

_F64 = torch.float64


def solve_spd(a: torch.Tensor, b: torch.Tensor, *, what: str = "system") -> torch.Tensor:
    """Solve a·x = b for symmetric positive (semi-)definite `a`: Cholesky, else pseudo-inverse.

    The ridge term normally makes `a` positive definite; with λ = ε = 0 and rank-deficient statistics it
    is not, and the minimum-norm least-squares solution (pinv) is the natural answer.
    """
    a = a.to(_F64)
    b = b.to(_F64)
    chol, info = torch.linalg.cholesky_ex(a)
    if int(info) == 0:
        x = torch.cholesky_solve(b, chol)
        if all_finite(x):
            return x
    log.warning("%s: Cholesky failed (matrix not positive definite); using a pseudo-inverse", what)
    return torch.linalg.pinv(a, hermitian=True) @ b


def linear_weight(
    gram_sum: torch.Tensor, target_sum: torch.Tensor, anchor: torch.Tensor, lam: float, eps: float, *, what: str = ""
) -> torch.Tensor:
    """W (out×in) from (Σt Ct/st + (λ+ε)I) Wᵀ = Σt (Xt/st) Wtᵀ + λ Āᵀ.

    gram_sum: Σt Ct/st (in×in); target_sum: Σt (Xt/st) Wtᵀ (in×out); anchor: Ā (out×in).
    """
    a = gram_sum.to(_F64, copy=True)  # + (λ+ε)I on the diagonal alone: no in×in identity and sum temporaries
    a.diagonal().add_(lam + eps)
    b = target_sum.to(_F64) + lam * anchor.to(_F64).T
    return solve_spd(a, b, what=what or "linear weight").T


def linear_weight_bias(
    gram_sum: torch.Tensor, target_sum: torch.Tensor, mean_sum: torch.Tensor, inv_scale_sum: float | torch.Tensor,
    bias_target_sum: torch.Tensor, mean_bias_sum: torch.Tensor, anchor_w: torch.Tensor, anchor_b: torch.Tensor,
    lam: float, eps: float, *, what: str = "",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(W, b) together: argmin Σt (1/st) E‖W xs + b − (Wt x~ + bt)‖² + λ‖W − Ā‖² + λ‖b − b̄‖² + ε‖W‖².

    The exact minimiser of the objective `linear_weight` then `linear_bias` minimise in turn (W first
    without the intercept, then b given W): one ridge solve on the input augmented by a constant 1,
    [Σ Ct/st + (λ+ε)I, Σ μs,t/st; (Σ μs,t/st)ᵀ, Σ 1/st + λ] [Wᵀ; bᵀ] =
    [Σ (Xt Wtᵀ + μs,t btᵀ)/st + λĀᵀ; Σ (bt + Wt μ~t)ᵀ/st + λb̄ᵀ].
    mean_bias_sum: Σt μs,t btᵀ / st (in×out); the other sums as in linear_weight / linear_bias.
    """
    d = gram_sum.shape[0]
    a = torch.empty(d + 1, d + 1, dtype=_F64, device=gram_sum.device)
    a[:d, :d] = gram_sum  # copied in (widened), then + (λ+ε)I on its diagonal alone, as linear_weight does
    a[:d, :d].diagonal().add_(lam + eps)
    a[:d, d] = a[d, :d] = mean_sum.to(_F64)
    a[d, d] = torch.as_tensor(inv_scale_sum, dtype=_F64) + lam
    b = torch.cat([target_sum.to(_F64) + mean_bias_sum.to(_F64) + lam * anchor_w.to(_F64).T,
                   (bias_target_sum.to(_F64) + lam * anchor_b.to(_F64))[None]])
    x = solve_spd(a, b, what=what or "linear weight and bias")
    return x[:d].T, x[d]


def linear_bias(
    weight: torch.Tensor,
    inv_scale_sum: float | torch.Tensor,
    target_sum: torch.Tensor,
    mean_sum: torch.Tensor,
    anchor: torch.Tensor,
    lam: float,
) -> torch.Tensor:
    """b = [Σt (1/st)(bt + Wt μ~t) − W Σt (1/st) μs,t + λ b̄] / [Σt 1/st + λ], after W is solved.

    target_sum: Σt (1/st)(bt + Wt μ~t) (out); mean_sum: Σt (1/st) μs,t (in); inv_scale_sum: Σt 1/st.
    """
    num = target_sum.to(_F64) - weight.to(_F64) @ mean_sum.to(_F64) + lam * anchor.to(_F64)
    return num / (torch.as_tensor(inv_scale_sum, dtype=_F64) + lam)


def layernorm_affine(
    e_sum: torch.Tensor,
    m_sum: torch.Tensor,
    n_tasks: int,
    gamma_target: torch.Tensor,
    beta_target: torch.Tensor,
    gamma_anchor: torch.Tensor,
    beta_anchor: torch.Tensor,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel 2×2 ridge solve for a LayerNorm's (γ, β), NOT normalised per task.

    [Σe+λ, Σm; Σm, T+λ] [γ; β] = [Σt(et γt + mt βt) + λγ̄; Σt(mt γt + βt) + λβ̄], solved in closed form
    (Cramer's rule, vectorised over channels); a singular channel keeps its anchor.
    gamma_target = Σt(et γt + mt βt); beta_target = Σt(mt γt + βt).
    """
    a11 = e_sum.to(_F64) + lam
    a12 = m_sum.to(_F64)
    a22 = torch.full_like(a11, float(n_tasks) + lam)
    r1 = gamma_target.to(_F64) + lam * gamma_anchor.to(_F64)
    r2 = beta_target.to(_F64) + lam * beta_anchor.to(_F64)
    det = a11 * a22 - a12 * a12
    ok = det.abs() > 1e-300
    safe = torch.where(ok, det, torch.ones_like(det))
    gamma = torch.where(ok, (a22 * r1 - a12 * r2) / safe, gamma_anchor.to(_F64))
    beta = torch.where(ok, (a11 * r2 - a12 * r1) / safe, beta_anchor.to(_F64))
    if not bool(ok.all()):
        log.warning("layernorm: %d singular channel(s) keep their anchor", int((~ok).sum()))
    return gamma, beta


def rmsnorm_weight(e_sum: torch.Tensor, gamma_target: torch.Tensor, gamma_anchor: torch.Tensor, lam: float) -> torch.Tensor:
    """γ = (Σt et γt + λ γ̄) / (Σt et + λ) for weight-only RMS norms (T5LayerNorm, LlamaRMSNorm).

    gamma_target = Σt et γt. A channel with zero denominator keeps its anchor.
    """
    den = e_sum.to(_F64) + lam
    num = gamma_target.to(_F64) + lam * gamma_anchor.to(_F64)
    ok = den.abs() > 1e-300
    return torch.where(ok, num / torch.where(ok, den, torch.ones_like(den)), gamma_anchor.to(_F64))


def anchor(merged: torch.Tensor, base: torch.Tensor | None, rho: float) -> torch.Tensor:
    """Ā = ρ·θm + (1−ρ)·θ0 (float64); without a base only ρ = 1 is meaningful."""
    m = merged.to(_F64)
    if base is None:
        return m
    return rho * m + (1.0 - rho) * base.to(_F64)


def check_finite(name: str, tensor: torch.Tensor) -> None:
    """Refuse to load a solved parameter holding NaN/Inf (a degenerate calibration set, or overflow)."""
    if not all_finite(tensor):
        from featcal.errors import CalibrationDataError

        bad = non_finite_count(tensor)
        raise CalibrationDataError(
            f"solved parameter {name} has {bad} non-finite value(s); the calibration statistics are degenerate "
            "(empty or constant inputs, or overflow): check the calibration data and covariance_eps/lambda_ratio"
        )
