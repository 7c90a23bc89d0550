"""bias_solve="joint" (issue 17 variant): W and b of each Linear in one solve, checked against a dense
least-squares solve of the same objective with an intercept, built from explicitly captured activations."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from featcal import FeatCalConfig, calibrate
from featcal.calibration.maths import solver
from tests.builders.reference_featcal import family_data, max_abs_diff, noisy_family

D = torch.float64


def _dense(tasks: list[dict], anchor_w: torch.Tensor, anchor_b: torch.Tensor, lam: float, eps: float):
    """argmin Σt (1/st) mean_i ‖W xs_i + b − y_i‖² + λ‖W − Ā‖² + λ‖b − b̄‖² + ε‖W‖², by stacked rows and lstsq.

    tasks: [{"xs": (N, d), "y": (N, out)}], st = ‖E[xs xsᵀ]‖_F.
    """
    rows, targets = [], []
    d = anchor_w.shape[1]
    for t in tasks:
        xs, y = t["xs"].to(D), t["y"].to(D)
        n = xs.shape[0]
        s_t = torch.linalg.matrix_norm(xs.T @ xs / n)
        scale = (1.0 / (s_t * n)).sqrt()
        rows.append(scale * torch.cat([xs, torch.ones(n, 1, dtype=D)], 1))
        targets.append(scale * y)
    ridge_w = torch.cat([torch.eye(d, dtype=D), torch.zeros(d, 1, dtype=D)], 1) * (lam + eps) ** 0.5
    rows.append(ridge_w)
    targets.append(lam / (lam + eps) ** 0.5 * anchor_w.to(D).T)
    rows.append(torch.cat([torch.zeros(1, d, dtype=D), torch.ones(1, 1, dtype=D)], 1) * lam ** 0.5)
    targets.append(lam ** 0.5 * anchor_b.to(D)[None])
    sol = torch.linalg.lstsq(torch.cat(rows), torch.cat(targets), driver="gelsd").solution
    return sol[:d].T, sol[d]


def _objective(tasks, w, b, anchor_w, anchor_b, lam, eps) -> float:
    total = lam * (w - anchor_w).pow(2).sum() + lam * (b - anchor_b).pow(2).sum() + eps * w.pow(2).sum()
    for t in tasks:
        xs, y = t["xs"].to(D), t["y"].to(D)
        s_t = torch.linalg.matrix_norm(xs.T @ xs / xs.shape[0])
        total = total + (xs @ w.T + b - y).pow(2).sum(-1).mean() / s_t
    return float(total)


def _sums(tasks):
    """The normalised sums statistics.py would hold, from explicit tokens."""
    gram = target = mean = bias_target = mean_bias = None
    inv_scale = 0.0
    for t in tasks:
        xs, y = t["xs"].to(D), t["y"].to(D)
        n = xs.shape[0]
        c = xs.T @ xs / n
        inv = 1.0 / torch.linalg.matrix_norm(c)
        mu = xs.mean(0)
        parts = (c * inv, xs.T @ (y - t["bt"].to(D)) / n * inv, mu * inv, y.mean(0) * inv, torch.outer(mu, t["bt"].to(D)) * inv)
        if gram is None:
            gram, target, mean, bias_target, mean_bias = parts
        else:
            gram, target, mean, bias_target, mean_bias = (a + p for a, p in zip(
                (gram, target, mean, bias_target, mean_bias), parts, strict=True))
        inv_scale += float(inv)
    return gram, target, mean, inv_scale, bias_target, mean_bias


def test_solver_joint_solve_is_the_dense_least_squares_minimiser():
    g = torch.Generator().manual_seed(0)
    d, out, lam, eps = 5, 3, 0.05, 1e-8
    tasks = []
    for k in range(3):
        xs = torch.randn(40 + 7 * k, d, generator=g, dtype=D) + torch.randn(d, generator=g, dtype=D)  # uncentred
        bt = torch.randn(out, generator=g, dtype=D)
        y = xs @ torch.randn(out, d, generator=g, dtype=D).T + bt + 0.1 * torch.randn(len(xs), out, generator=g, dtype=D)
        tasks.append({"xs": xs, "y": y, "bt": bt})
    aw, ab = torch.randn(out, d, generator=g, dtype=D), torch.randn(out, generator=g, dtype=D)
    gram, target, mean, inv_scale, bias_target, mean_bias = _sums(tasks)
    w, b = solver.linear_weight_bias(gram, target, mean, inv_scale, bias_target, mean_bias, aw, ab, lam, eps)
    w_ref, b_ref = _dense(tasks, aw, ab, lam, eps)
    assert torch.allclose(w, w_ref, atol=1e-9) and torch.allclose(b, b_ref, atol=1e-9)
    # the paper's sequential solve minimises the same objective in two steps: never below the joint minimum
    w_seq = solver.linear_weight(gram, target, aw, lam, eps)
    b_seq = solver.linear_bias(w_seq, inv_scale, bias_target, mean, ab, lam)
    joint, seq = _objective(tasks, w, b, aw, ab, lam, eps), _objective(tasks, w_seq, b_seq, aw, ab, lam, eps)
    assert joint <= seq and seq - joint > 1e-6


def _block0_inputs(model: nn.Module, names: list[str], batches) -> dict[str, torch.Tensor]:
    """Each named Linear's input tokens over all batches, from a whole forward of `model`."""
    seen: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    mods = dict(model.named_modules())
    hooks = [mods[n].register_forward_hook(lambda m, a, o, n=n: seen[n].append(a[0].reshape(-1, a[0].shape[-1])))
             for n in names]
    with torch.no_grad():
        for batch in batches:
            model(**batch)
    for h in hooks:
        h.remove()
    return {n: torch.cat(v) for n, v in seen.items()}


def test_engine_joint_solve_matches_dense_least_squares_on_a_tiny_clip():
    base, experts, merged = noisy_family("clip")
    data = family_data("clip", experts)
    cfg = FeatCalConfig(bias_solve="joint")
    out = calibrate(merged, base=base, experts=experts, calibration=data, config=cfg, progress=False).model
    prefix = "encoder.layers.0."
    names = [prefix + n for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj",
                                  "mlp.fc1", "mlp.fc2")]
    # block 0's statistics are taken with block 0 as merged: the merged model's own forward gives its inputs
    xs = _block0_inputs(merged, names, [b for t in experts for b in data[t]])
    offsets, per_task = 0, {}
    for t in experts:
        n_tok = sum(b["pixel_values"].shape[0] for b in data[t]) * 17  # 16 patches + the class token
        per_task[t] = slice(offsets, offsets + n_tok)
        offsets += n_tok
    xe = {t: _block0_inputs(e, names, data[t]) for t, e in experts.items()}
    mp, bp, op = (dict(m.named_parameters()) for m in (merged, base, out))
    rho, alpha, lam, eps = cfg.anchor_blend_rho, cfg.teacher_interp_alpha, cfg.lambda_ratio, cfg.covariance_eps
    for name in names:
        tasks = []
        for t, e in experts.items():
            ep = dict(e.named_parameters())
            x_s = xs[name][per_task[t]].to(D)
            x_t = alpha * xe[t][name].to(D) + (1 - alpha) * x_s
            tasks.append({"xs": x_s, "y": x_t @ ep[name + ".weight"].to(D).T + ep[name + ".bias"].to(D)})
        aw = rho * mp[name + ".weight"].to(D) + (1 - rho) * bp[name + ".weight"].to(D)
        ab = rho * mp[name + ".bias"].to(D) + (1 - rho) * bp[name + ".bias"].to(D)
        w_ref, b_ref = _dense(tasks, aw, ab, lam, eps)
        assert (op[name + ".weight"].to(D) - w_ref).abs().max() < 1e-6, name
        assert (op[name + ".bias"].to(D) - b_ref).abs().max() < 1e-6, name
    default = calibrate(merged, base=base, experts=experts, calibration=data, progress=False).model
    assert max_abs_diff(out, default)[0] > 1e-4  # the variant is not the paper's solve


@pytest.mark.parametrize("value", ["both", "Joint"])
def test_bias_solve_is_validated(value):
    from featcal.config import parse
    from featcal.errors import ConfigError

    with pytest.raises(ConfigError, match="bias_solve"):
        parse(FeatCalConfig, {"bias_solve": value})
