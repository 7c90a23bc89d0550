"""The closed-form solves: known identities and stationarity of the objectives they minimise."""

from __future__ import annotations

import torch

from featcal.calibration.maths import solver

F64 = torch.float64


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def test_linear_weight_one_task_identity_returns_expert():
    wt = _rand(5, 4)
    eye = torch.eye(4, dtype=F64)
    w = solver.linear_weight(eye, eye @ wt.T, anchor=_rand(5, 4, seed=1), lam=0.0, eps=0.0)
    torch.testing.assert_close(w, wt, rtol=1e-12, atol=1e-12)


def test_linear_bias_zero_means_returns_expert_bias():
    bt, s = _rand(5), 3.0
    w = _rand(5, 4, seed=2)
    b = solver.linear_bias(w, 1 / s, bt / s, torch.zeros(4, dtype=F64), anchor=_rand(5, seed=3), lam=0.0)
    torch.testing.assert_close(b, bt, rtol=1e-12, atol=1e-12)


def test_layernorm_unit_moments_returns_expert_affine():
    gt, bt = _rand(6), _rand(6, seed=1)
    e, m = torch.ones(6, dtype=F64), torch.zeros(6, dtype=F64)
    g, b = solver.layernorm_affine(e, m, 1, e * gt + m * bt, m * gt + bt, _rand(6, seed=2), _rand(6, seed=3), lam=0.0)
    torch.testing.assert_close(g, gt, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(b, bt, rtol=1e-12, atol=1e-12)


def test_rmsnorm_without_ridge_is_weighted_mean_of_experts():
    g1, g2 = _rand(3), _rand(3, seed=1)
    e1, e2 = torch.tensor([1.0, 2.0, 3.0], dtype=F64), torch.tensor([3.0, 2.0, 1.0], dtype=F64)
    g = solver.rmsnorm_weight(e1 + e2, e1 * g1 + e2 * g2, torch.zeros(3, dtype=F64), lam=0.0)
    torch.testing.assert_close(g, (e1 * g1 + e2 * g2) / (e1 + e2))


def _tasks(n_tasks=3, n=50, d_in=4, d_out=3, alpha=0.25):
    """Random per-task token sets (xs, xe), expert weights, and the explicit teacher x~."""
    out = []
    for t in range(n_tasks):
        xs = _rand(n, d_in, seed=10 + t)
        xe = xs + 0.3 * _rand(n, d_in, seed=20 + t)
        out.append(dict(xs=xs, xt=alpha * xe + (1 - alpha) * xs, wt=_rand(d_out, d_in, seed=30 + t),
                        bt=_rand(d_out, seed=40 + t), w=torch.rand(n, generator=torch.Generator().manual_seed(t), dtype=F64)))
    return out


def _moments(task):
    w = task["w"] / task["w"].sum()
    xs, xt = task["xs"], task["xt"]
    c = (xs * w[:, None]).T @ xs
    x = (xs * w[:, None]).T @ xt
    return c, x, (w[:, None] * xs).sum(0), (w[:, None] * xt).sum(0)


def test_linear_solution_is_stationary_point_of_objective():
    lam, eps = 0.05, 1e-3
    tasks = _tasks()
    anchor = _rand(3, 4, seed=99)
    gram = sum(_moments(t)[0] / torch.linalg.matrix_norm(_moments(t)[0]) for t in tasks)
    target = sum((_moments(t)[1] @ t["wt"].T) / torch.linalg.matrix_norm(_moments(t)[0]) for t in tasks)
    w_star = solver.linear_weight(gram, target, anchor, lam, eps).requires_grad_(True)

    def objective(w):
        total = lam * ((w - anchor) ** 2).sum() + eps * (w**2).sum()
        for t in tasks:
            c = _moments(t)[0]
            r = t["xs"] @ w.T - t["xt"] @ t["wt"].T
            total = total + ((t["w"] / t["w"].sum()) * (r**2).sum(1)).sum() / torch.linalg.matrix_norm(c)
        return total

    (grad,) = torch.autograd.grad(objective(w_star), w_star)
    assert grad.abs().max() < 1e-10
    # and it is a minimum: any perturbation increases the objective
    with torch.no_grad():
        assert objective(w_star + 1e-3 * _rand(3, 4, seed=5)) > objective(w_star)


def test_bias_solution_is_stationary_point_of_objective():
    lam = 0.05
    tasks = _tasks()
    w = _rand(3, 4, seed=7)
    b_anchor = _rand(3, seed=8)
    inv = sum(1 / torch.linalg.matrix_norm(_moments(t)[0]) for t in tasks)
    tgt = sum((t["bt"] + t["wt"] @ _moments(t)[3]) / torch.linalg.matrix_norm(_moments(t)[0]) for t in tasks)
    mean = sum(_moments(t)[2] / torch.linalg.matrix_norm(_moments(t)[0]) for t in tasks)
    b_star = solver.linear_bias(w, inv, tgt, mean, b_anchor, lam).requires_grad_(True)

    def objective(b):
        total = lam * ((b - b_anchor) ** 2).sum()
        for t in tasks:
            s = torch.linalg.matrix_norm(_moments(t)[0])
            r = t["xs"] @ w.T + b - (t["xt"] @ t["wt"].T + t["bt"])
            total = total + ((t["w"] / t["w"].sum()) * (r**2).sum(1)).sum() / s
        return total

    (grad,) = torch.autograd.grad(objective(b_star), b_star)
    assert grad.abs().max() < 1e-10


def test_layernorm_solution_is_stationary_point_of_objective():
    lam = 0.05
    zs = [_rand(40, 5, seed=s) * (1 + s) for s in range(3)]
    gts = [_rand(5, seed=10 + s) for s in range(3)]
    bts = [_rand(5, seed=20 + s) for s in range(3)]
    ga, ba = _rand(5, seed=30), _rand(5, seed=31)
    e = sum((z**2).mean(0) for z in zs)
    m = sum(z.mean(0) for z in zs)
    gtar = sum((z**2).mean(0) * g + z.mean(0) * b for z, g, b in zip(zs, gts, bts, strict=True))
    btar = sum(z.mean(0) * g + b for z, g, b in zip(zs, gts, bts, strict=True))
    g_star, b_star = solver.layernorm_affine(e, m, 3, gtar, btar, ga, ba, lam)
    g_star.requires_grad_(True)
    b_star.requires_grad_(True)
    total = lam * (((g_star - ga) ** 2).sum() + ((b_star - ba) ** 2).sum())
    for z, g, b in zip(zs, gts, bts, strict=True):
        total = total + ((z * g_star + b_star - (z * g + b)) ** 2).mean(0).sum()
    gg, gb = torch.autograd.grad(total, (g_star, b_star))
    assert gg.abs().max() < 1e-10 and gb.abs().max() < 1e-10


def test_cholesky_failure_falls_back_to_pinv(caplog):
    a = torch.zeros(3, 3, dtype=F64)
    a[0, 0] = 1.0  # singular, PSD
    b = torch.tensor([[2.0], [0.0], [0.0]], dtype=F64)
    with caplog.at_level("WARNING", logger="featcal.calibration"):
        x = solver.solve_spd(a, b, what="q_proj")
    torch.testing.assert_close(x, torch.tensor([[2.0], [0.0], [0.0]], dtype=F64))
    assert "q_proj" in caplog.text and "pseudo-inverse" in caplog.text


def test_non_finite_solution_is_refused():
    import pytest

    from featcal.errors import CalibrationDataError

    with pytest.raises(CalibrationDataError, match="layers.0.fc1.weight"):
        solver.check_finite("layers.0.fc1.weight", torch.tensor([1.0, float("nan")]))


def test_anchor_extrapolates_task_vector():
    m, b = torch.tensor([2.0]), torch.tensor([1.0])
    torch.testing.assert_close(solver.anchor(m, b, 2.2), torch.tensor([2.2 * 2 - 1.2 * 1], dtype=F64))


def test_linear_weight_adds_the_ridge_on_the_diagonal_exactly_as_the_identity_sum():
    # the ridge goes onto the diagonal of a copy (no in×in identity and sum temporaries): the same system, so the
    # same solution bit for bit, and the caller's Gram is left as it was
    x = _rand(50, 12, seed=3)
    gram, target, anchor = x.T @ x / 50, _rand(12, 5, seed=4), _rand(5, 12, seed=5)
    held = gram.clone()
    lam, eps = 0.05, 1e-6
    a = gram + (lam + eps) * torch.eye(12, dtype=torch.float64)
    expected = torch.cholesky_solve(target + lam * anchor.T, torch.linalg.cholesky(a)).T
    assert torch.equal(solver.linear_weight(gram, target, anchor, lam, eps), expected)
    assert torch.equal(gram, held)


def test_linear_weight_bias_adds_the_ridge_on_the_diagonal_exactly_as_the_identity_sum():
    x = _rand(50, 12, seed=6)
    gram, target, mean = x.T @ x / 50, _rand(12, 5, seed=7), x.mean(0)
    bias_target, mean_bias, anchor_w, anchor_b = _rand(5, seed=9), _rand(12, 5, seed=10), _rand(5, 12, seed=11), \
        _rand(5, seed=12)
    lam, eps, inv = 0.05, 1e-6, 1.7
    a = torch.empty(13, 13, dtype=F64)
    a[:12, :12] = gram + (lam + eps) * torch.eye(12, dtype=F64)
    a[:12, 12] = a[12, :12] = mean
    a[12, 12] = inv + lam
    b = torch.cat([target + mean_bias + lam * anchor_w.T, (bias_target + lam * anchor_b)[None]])
    expected = torch.cholesky_solve(b, torch.linalg.cholesky(a))
    w, bias = solver.linear_weight_bias(gram, target, mean, inv, bias_target, mean_bias, anchor_w, anchor_b, lam, eps)
    assert torch.equal(w, expected[:12].T) and torch.equal(bias, expected[12])
