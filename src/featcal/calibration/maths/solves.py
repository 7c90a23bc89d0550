"""One block's closed-form solves (docs/method.md §5) from its folded statistics, before they are loaded.

The solver (solver.py) knows no model; this joins it to a block's modules: each Linear's weight (and bias),
each norm's scale (and shift), pulled toward the anchor Ā = ρ·θm + (1−ρ)·θ0 read from the base where
ρ ≠ 1, checked for NaN / Inf. Every solve reads merged values first; the caller loads them all afterwards.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from featcal.blocks.discovery import Calibrated
from featcal.blocks.linear import weight_of
from featcal.calibration.maths import solver
from featcal.calibration.maths.statistics import LinearNormalised, NormalisedSums, NormNormalised
from featcal.config import FeatCalConfig

log = logging.getLogger("featcal.calibration")

# a parameter's base value by full name, on the calibration device (None without a base)
BaseParam = Callable[[str], "torch.Tensor | None"]
Solved = dict[nn.Parameter, torch.Tensor]


def solve_modules(cfg: FeatCalConfig, base: BaseParam, prefix: str, mods: list[Calibrated],
                  sums: NormalisedSums) -> Solved:
    """Every module of `mods` (names under `prefix`) that the statistics reached, solved; not loaded."""
    solved: Solved = {}
    for c in mods:
        full = prefix + c.name
        if c.kind == "linear":
            acc = sums.linears.get(c.name)
            if acc is None:
                log.debug("%s was not called: keeps its merged value", full)
                continue
            solved.update(solve_linear(cfg, base, full, c, acc))
        elif cfg.calibrate_layernorm:
            acc = sums.norms.get(c.name)
            if acc is None:
                continue
            solved.update(solve_norm(cfg, base, full, c.kind, c.module, acc))
    return solved


def solve_linear(cfg: FeatCalConfig, base: BaseParam, full: str, c: Calibrated, acc: LinearNormalised) -> Solved:
    """A Linear's weight (stored layout), and its bias where it has one and calibrate_bias: after the weight
    (the paper's) or with it (bias_solve joint)."""
    lam, eps, rho = cfg.lambda_ratio, cfg.covariance_eps, cfg.anchor_blend_rho
    base_w = base(full + ".weight")
    w_anchor = solver.anchor(c.weight, None if base_w is None else weight_of(c.module, base_w), rho)
    bias = c.module.bias if cfg.calibrate_bias else None
    if bias is not None and cfg.bias_solve == "joint":
        bias_anchor = solver.anchor(bias, base(full + ".bias"), rho)
        w, b = solver.linear_weight_bias(acc.gram, acc.target, acc.mean, acc.inv_scale, acc.bias_target,
                                         acc.mean_bias, w_anchor, bias_anchor, lam, eps, what=full)
        solver.check_finite(full + ".weight", w)
        solver.check_finite(full + ".bias", b)
        return {c.module.weight: c.stored(w), bias: b}
    w = solver.linear_weight(acc.gram, acc.target, w_anchor, lam, eps, what=full)
    solver.check_finite(full + ".weight", w)
    solved = {c.module.weight: c.stored(w)}
    if bias is not None:
        bias_anchor = solver.anchor(bias, base(full + ".bias"), rho)
        b = solver.linear_bias(w, acc.inv_scale, acc.bias_target, acc.mean, bias_anchor, lam)
        solver.check_finite(full + ".bias", b)
        solved[bias] = b
    return solved


def solve_norm(cfg: FeatCalConfig, base: BaseParam, full: str, kind: str, module: nn.Module,
               acc: NormNormalised) -> Solved:
    """The per-channel solve of norm `full` (docs/method.md §5): (γ, β) of a LayerNorm, γ of an RMS norm."""
    lam, rho = cfg.lambda_ratio, cfg.anchor_blend_rho
    g_anchor = solver.anchor(module.weight, base(full + ".weight"), rho)
    if kind == "rmsnorm" or getattr(module, "bias", None) is None:
        g = solver.rmsnorm_weight(acc.e, acc.gamma_target, g_anchor, lam)
        solver.check_finite(full + ".weight", g)
        return {module.weight: g}
    b_anchor = solver.anchor(module.bias, base(full + ".bias"), rho)
    g, b = solver.layernorm_affine(acc.e, acc.m, acc.n_tasks, acc.gamma_target, acc.beta_target, g_anchor,
                                   b_anchor, lam)
    solver.check_finite(full + ".weight", g)
    solver.check_finite(full + ".bias", b)
    return {module.weight: g, module.bias: b}
