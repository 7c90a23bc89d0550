"""Streaming statistics: batch/rank mergeability, and the exactness of the no-cross-Gram identity."""

from __future__ import annotations

import pytest
import torch

from featcal.calibration.maths.statistics import NormalisedSums, TaskSums
from featcal.errors import CalibrationDataError

F64 = torch.float64


def _data(n=64, d_in=6, d_out=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    xs = torch.randn(2, n // 2, d_in, generator=g)
    xe = xs + 0.2 * torch.randn(xs.shape, generator=g)
    wt = torch.randn(d_out, d_in, generator=g)
    bt = torch.randn(d_out, generator=g)
    w = torch.rand(2, n // 2, generator=g)
    w[0, -3:] = 0.0  # padding
    return xs, xe, wt, bt, w


def _fill(sums: TaskSums, xs, xe, wt, bt, w, sl=slice(None)):
    sums.add_gram("q", xs[sl], w[sl])
    sums.add_linear("q", "q", xs[sl], xe[sl] @ wt.T + bt, w[sl])
    sums.add_linear("k", "q", xs[sl], xe[sl] @ wt.T + bt, w[sl])  # shares q's Gram
    sums.add_norm("ln", xs[sl], w[sl])


def test_batches_merged_equal_one_pass():
    xs, xe, wt, bt, w = _data()
    whole, a, b = TaskSums(), TaskSums(), TaskSums()
    _fill(whole, xs, xe, wt, bt, w)
    _fill(a, xs, xe, wt, bt, w, slice(0, 1))
    _fill(b, xs, xe, wt, bt, w, slice(1, 2))
    a.merge_(b)
    assert set(a.grams) == {"q"} and set(a.linears) == {"q", "k"}
    for kind in ("grams", "linears", "norms"):
        for name, s in getattr(whole, kind).items():
            other = getattr(a, kind)[name]
            for field in s.__dataclass_fields__:
                v = getattr(s, field)
                if isinstance(v, torch.Tensor):
                    torch.testing.assert_close(getattr(other, field), v, rtol=1e-5, atol=1e-5)


def test_normalised_sums_equal_explicit_teacher_formulas():
    alpha = 0.25
    xs, xe, wt, bt, w = _data()
    sums = TaskSums()
    _fill(sums, xs, xe, wt, bt, w)
    norm = NormalisedSums(alpha)
    gamma, beta = torch.randn(6), torch.randn(6)
    params = {"q": {"weight": wt, "bias": bt}, "k": {"weight": wt, "bias": bt}, "ln": {"weight": gamma, "bias": beta}}
    norm.add_task("t", sums, params, rms=set())

    # dense: x~ formed explicitly, weighted means, float64
    x, xe_, wd = xs.reshape(-1, 6).to(F64), xe.reshape(-1, 6).to(F64), w.reshape(-1).to(F64)
    p = wd / wd.sum()
    xt = alpha * xe_ + (1 - alpha) * x
    c = (x * p[:, None]).T @ x
    cross = (x * p[:, None]).T @ xt
    s = torch.linalg.matrix_norm(c)
    mu_t = (p[:, None] * xt).sum(0)
    got = norm.linears["q"]
    torch.testing.assert_close(got.gram, c / s, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.target, cross @ wt.T.to(F64) / s, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.bias_target, (bt.to(F64) + wt.to(F64) @ mu_t) / s, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.mean, (p[:, None] * x).sum(0) / s, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.inv_scale, 1 / s)
    ln = norm.norms["ln"]
    e, m = (p[:, None] * x * x).sum(0), (p[:, None] * x).sum(0)
    torch.testing.assert_close(ln.e, e, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ln.gamma_target, e * gamma.to(F64) + m * beta.to(F64), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ln.beta_target, m * gamma.to(F64) + beta.to(F64), rtol=1e-5, atol=1e-5)


def test_tasks_add_up_with_their_own_scale():
    xs, xe, wt, bt, w = _data()
    one, two = TaskSums(), TaskSums()
    _fill(one, xs, xe, wt, bt, w)
    _fill(two, 3 * xs, 3 * xe, wt, bt, w)  # ‖C‖ nine times larger: normalised, it weighs the same
    params = {"q": {"weight": wt, "bias": bt}, "k": {"weight": wt, "bias": bt}, "ln": {"weight": wt[0], "bias": wt[1]}}
    norm = NormalisedSums(0.25)
    norm.add_task("a", one, params, rms=set())
    single = norm.linears["q"].gram.clone()
    norm.add_task("b", two, params, rms=set())
    torch.testing.assert_close(norm.linears["q"].gram, 2 * single, rtol=1e-5, atol=1e-6)
    assert norm.norms["ln"].n_tasks == 2


def test_a_task_with_no_weighted_token_is_refused():
    xs, xe, wt, bt, w = _data()
    sums = TaskSums()
    _fill(sums, xs, xe, wt, bt, torch.zeros_like(w))
    with pytest.raises(CalibrationDataError, match="task 'empty'"):
        NormalisedSums(0.25).add_task("empty", sums, {"q": {"weight": wt, "bias": bt}, "k": {"weight": wt}}, rms=set())


def test_cross_form_equals_output_form():
    """E[xs xeᵀ] Wtᵀ (one in×in moment per group) and Σ xs yeᵀ (per module) give the same sums."""
    xs, xe, wt, bt, w = _data()
    params = {"q": {"weight": wt, "bias": bt}, "k": {"weight": 2 * wt, "bias": bt}}
    by_output, by_cross = TaskSums(), TaskSums()
    by_output.add_gram("q", xs, w)
    by_cross.add_gram("q", xs, w)
    for name in ("q", "k"):
        by_output.add_linear(name, "q", xs, xe @ params[name]["weight"].T + bt, w)
        by_cross.add_cross_linear(name, "q")
    by_cross.add_cross("q", xs, xe, w)
    a, b = NormalisedSums(0.3), NormalisedSums(0.3)
    a.add_task("t", by_output, params, rms=set())
    b.add_task("t", by_cross, params, rms=set())
    for name in ("q", "k"):
        torch.testing.assert_close(a.linears[name].target, b.linears[name].target, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(a.linears[name].bias_target, b.linears[name].bias_target, rtol=1e-5, atol=1e-5)


def test_block_plan_groups_shared_inputs_and_picks_the_cheaper_form():
    from featcal.blocks.adapters import adapter_for
    from featcal.blocks.discovery import calibrated_modules
    from featcal.calibration.engine.hooks import ExpertRecorder, plan_block
    from tests.builders import tiny

    model = tiny.tiny_model("clip")
    block = model.encoder.layers[0]
    linears = {c.name: c.module for c in calibrated_modules(block, adapter_for(model)) if c.kind == "linear"}
    with torch.no_grad(), ExpertRecorder(linears, None) as rec:
        block(torch.randn(2, 17, 32), None)
    plan = plan_block(linears, rec.calls, kind=lambda name: ())
    assert {plan[n].group for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")} == {"self_attn.q_proj"}
    assert plan["self_attn.q_proj"].mode == "cross"  # 32 in < 96 out
    assert plan["self_attn.out_proj"].mode == "output"  # 32 in, 32 out
    assert plan["mlp.fc1"].mode == "cross" and plan["mlp.fc2"].mode == "output"  # 32 < 64; 64 > 32
    # class-token-weighted last block: q weighs tokens differently from k/v, so it has its own group
    kv = {"self_attn.k_proj", "self_attn.v_proj"}
    split = plan_block(linears, rec.calls, kind=lambda name: name in kv)
    assert split["self_attn.q_proj"].group == "self_attn.q_proj" and split["self_attn.q_proj"].mode == "output"
    assert split["self_attn.v_proj"].group == split["self_attn.k_proj"].group != "self_attn.q_proj"


def test_engine_keeps_one_task_of_raw_sums_alive_at_a_time(monkeypatch):
    """Why per-task statistics are not spilled to disk (docs/scaling.md): with 4 experts, at most one
    TaskSums exists at any moment, so there is nothing per task to spill beyond the one being filled."""
    import weakref

    from featcal import FeatCalConfig, calibrate
    from featcal.calibration.engine import gather
    from tests.builders.reference_featcal import family_data, noisy_family

    live: set[int] = set()
    made: list[int] = []
    peak = [0]

    class Tracked(TaskSums):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            key = len(made)
            made.append(key)
            live.add(key)
            weakref.finalize(self, live.discard, key)
            peak[0] = max(peak[0], len(live))

    monkeypatch.setattr(gather, "TaskSums", Tracked)
    base, experts, merged = noisy_family("llama", n_experts=4)
    calibrate(merged, base=base, experts=experts, calibration=family_data("llama", experts), config=FeatCalConfig(),
              progress=False)
    assert len(made) == 4 * 2  # one per task per block (2 blocks)
    assert peak[0] == 1 and not live
