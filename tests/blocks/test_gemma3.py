"""Gemma 3 (issue 15): its adapter on tiny random Gemma3ForCausalLM models with sliding and global layers.

The exactness check is a dense FeatCal written here from the model's OWN forwards: block l's module
inputs are recorded while the whole (partly calibrated) merged model and each expert run, so every
block gets the mask and rotary table the model itself gives it. An engine that replayed block 0's
sliding-window context in a global block would disagree with it.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
import transformers as T
from safetensors.torch import load_file
from torch import nn

from featcal import FeatCalConfig, calibrate
from featcal.blocks.adapters import StructuralAdapter, adapter_for
from featcal.blocks.capture import capture_block_input
from featcal.blocks.discovery import calibrated_modules
from featcal.calibration.engine.replay import check_context_replay
from featcal.calibration.maths import solver
from featcal.errors import FeatCalError
from tests.builders.gguf_files import write_gemma3_gguf
from tests.builders.reference_featcal import max_abs_diff, padding_change_effect
from tests.builders.tiny import GLOBAL, SLIDING, family_of, padded_ids, tiny_gemma3

pytestmark = pytest.mark.usefixtures("one_thread")
D = torch.float64


def _module_inputs(model, layer: int, names: list[str], batch: dict) -> dict[str, torch.Tensor]:
    """Each named module of block `layer`: its input in the model's own full forward."""
    block = model.model.layers[layer]
    seen: dict[str, torch.Tensor] = {}
    hooks = [block.get_submodule(n).register_forward_hook(lambda _m, i, _o, n=n: seen.__setitem__(n, i[0].detach()))
             for n in names]
    try:
        model.model(**batch, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return seen


def dense_featcal(merged, base, experts, data, cfg: FeatCalConfig):
    """docs/method.md §3-§5 literally, float64, module inputs from full-model forwards; RMS norms solved on γ = 1 + w."""
    model = copy.deepcopy(merged)
    alpha, lam, eps, rho = cfg.teacher_interp_alpha, cfg.lambda_ratio, cfg.covariance_eps, cfg.anchor_blend_rho
    base_p = dict(base.named_parameters())
    with torch.no_grad():
        for layer in range(len(model.model.layers)):
            block = model.model.layers[layer]
            mods = {n: m for n, m in block.named_modules() if isinstance(m, nn.Linear) or type(m).__name__ == "Gemma3RMSNorm"}
            per_task = {}
            for t, expert in experts.items():
                rows = {n: ([], [], []) for n in mods}
                for batch in data[t]:
                    xs_all = _module_inputs(model, layer, list(mods), batch)
                    xe_all = _module_inputs(expert, layer, list(mods), batch)
                    for n in mods:
                        xs, xe = xs_all[n], xe_all[n]
                        mask = batch["attention_mask"].to(D)
                        w = mask[:, None, :].expand(xs.shape[:3]) if xs.dim() == 4 else mask  # q/k norms: per head
                        rows[n][0].append(xs.reshape(-1, xs.shape[-1]).to(D))
                        rows[n][1].append(xe.reshape(-1, xe.shape[-1]).to(D))
                        rows[n][2].append(w.reshape(-1))
                per_task[t] = {n: tuple(torch.cat(r) for r in rows[n]) for n in mods}
            new = {}
            for n, m in mods.items():
                full = f"model.layers.{layer}.{n}.weight"
                anchor = rho * m.weight.to(D) + (1 - rho) * base_p[full].to(D)
                if isinstance(m, nn.Linear):
                    a = (lam + eps) * torch.eye(m.in_features, dtype=D)
                    rhs = lam * anchor.T
                    for t, expert in experts.items():
                        xs, xe, w = per_task[t][n]
                        p = w / w.sum()
                        c = (xs * p[:, None]).T @ xs
                        x = (xs * p[:, None]).T @ (alpha * xe + (1 - alpha) * xs)
                        s = torch.linalg.matrix_norm(c)
                        a, rhs = a + c / s, rhs + (x / s) @ expert.get_parameter(full).to(D).T
                    new[m.weight] = torch.linalg.solve(a, rhs).T
                else:  # Gemma3RMSNorm: y = z·(1 + w); solve for γ = 1 + w, store γ − 1
                    num, den = lam * (1 + anchor), torch.full_like(anchor, lam)
                    for t, expert in experts.items():
                        xs, _, w = per_task[t][n]
                        z = xs * torch.rsqrt(xs.pow(2).mean(-1, keepdim=True) + m.eps)
                        e = ((w / w.sum())[:, None] * z * z).sum(0)
                        num = num + e * (1 + expert.get_parameter(full).to(D))
                        den = den + e
                    new[m.weight] = num / den - 1
            for p, v in new.items():
                p.copy_(v.to(p.dtype))
    return model


# --- the adapter ----------------------------------------------------------------------------------

def test_adapter_finds_blocks_types_and_calibrated_modules():
    model = tiny_gemma3()
    adapter = adapter_for(model)
    assert isinstance(adapter, StructuralAdapter)
    (stack,) = adapter.stacks(model)
    assert (stack.blocks_path, stack.entry_path, stack.layer_types) == ("model.layers", "model", (SLIDING, GLOBAL, SLIDING))
    kinds = {c.name: c.kind for c in calibrated_modules(model.model.layers[0], adapter)}
    assert kinds == {
        **{f"self_attn.{p}_proj": "linear" for p in "qkvo"}, **{f"mlp.{p}_proj": "linear" for p in ("gate", "up", "down")},
        "self_attn.q_norm": "rmsnorm", "self_attn.k_norm": "rmsnorm", "input_layernorm": "rmsnorm",
        "post_attention_layernorm": "rmsnorm", "pre_feedforward_layernorm": "rmsnorm", "post_feedforward_layernorm": "rmsnorm",
    }
    # the planner's context per example: a rotary cos and sin per type, (S, head_dim) float32, and a second mask
    assert adapter.context_bytes(stack, 8, 32, 4) == 2 * 2 * 8 * 8 * 4 + 8 * 8
    wide = tiny_gemma3(head_dim=16)  # Gemma's head_dim is its own (270M: 256, not 640 / 4)
    a2 = adapter_for(wide)
    assert a2.context_bytes(a2.stacks(wide)[0], 8, 32, 4) == 2 * 2 * 8 * 16 * 4 + 8 * 8


def test_rms_solve_on_the_stored_weight_is_the_solve_on_one_plus_weight():
    """Gemma's norms compute z·(1 + w): calibrating w as stored equals solving for γ = 1 + w (weights sum to 1)."""
    g = torch.Generator().manual_seed(0)
    w_m, w_0 = torch.randn(16, generator=g, dtype=D), torch.randn(16, generator=g, dtype=D)
    w_t = [torch.randn(16, generator=g, dtype=D) for _ in range(3)]
    e_t = [torch.rand(16, generator=g, dtype=D) + 0.1 for _ in range(3)]
    e_sum = sum(e_t)
    for lam, rho in ((0.05, 2.2), (3.0, 1.0), (0.0, 0.5)):
        on_w = solver.rmsnorm_weight(e_sum, sum(e * w for e, w in zip(e_t, w_t, strict=True)),
                                     solver.anchor(w_m, w_0, rho), lam)
        on_gamma = solver.rmsnorm_weight(e_sum, sum(e * (1 + w) for e, w in zip(e_t, w_t, strict=True)),
                                         solver.anchor(1 + w_m, 1 + w_0, rho), lam)
        torch.testing.assert_close(on_w + 1, on_gamma, rtol=0, atol=1e-12)


def test_each_layer_type_gets_its_own_context():
    """Block 1 (global) gets the global mask and rotary table, not block 0's (sliding): the model's own call."""
    model = tiny_gemma3()
    adapter = adapter_for(model)
    (stack,) = adapter.stacks(model)
    mod, kw = adapter.stack_call(model, stack, padded_ids(), None)
    with torch.no_grad():
        hidden, ctx = adapter.capture(mod, stack, model, kw)
        h0, actual0 = capture_block_input(mod, stack.blocks(model)[0], kw)
        _, actual1 = capture_block_input(mod, stack.blocks(model)[1], kw)
    assert torch.equal(hidden, h0)
    assert set(ctx["by_type"]) == {SLIDING, GLOBAL}
    for layer, actual in ((0, actual0), (1, actual1), (2, actual0)):
        got = adapter.block_kwargs(stack, layer, ctx)
        assert got.keys() == actual.keys()
        assert torch.equal(got["attention_mask"], actual["attention_mask"])
        assert all(torch.equal(a, b) for a, b in zip(got["position_embeddings"], actual["position_embeddings"], strict=True))
    # the two types truly differ: window 3 < 8 tokens, and rotary bases 10^4 vs 10^6
    assert not torch.equal(actual0["attention_mask"], actual1["attention_mask"])
    assert not torch.equal(actual0["position_embeddings"][0], actual1["position_embeddings"][0])
    with torch.no_grad():
        check_context_replay(adapter, stack, model, mod, kw, hidden, ctx)  # the engine's own guard agrees

        class Replaying(StructuralAdapter):  # what the engine did before: block 0's arguments everywhere
            def block_kwargs(self, stack, layer, ctx):
                return super().block_kwargs(stack, 0, ctx)

        with pytest.raises(FeatCalError, match="block 1 is called with another 'attention_mask'"):
            check_context_replay(Replaying(), stack, model, mod, kw, hidden, ctx)


def test_blocks_of_one_type_called_differently_are_refused():
    model = tiny_gemma3()
    adapter = adapter_for(model)
    (stack,) = adapter.stacks(model)
    lying = type(stack)(stack.name, stack.blocks_path, stack.entry_path, layer_types=(SLIDING, SLIDING, SLIDING))
    mod, kw = adapter.stack_call(model, lying, padded_ids(), None)
    with torch.no_grad(), pytest.raises(FeatCalError, match=r"block 1 \(sliding_attention\) is called with other arguments"):
        adapter.capture(mod, lying, model, kw)


# --- calibration ----------------------------------------------------------------------------------

def test_calibration_equals_the_dense_reference():
    base, experts, merged = family_of(tiny_gemma3())
    data = {t: [padded_ids(seed=2 * i), padded_ids(seed=2 * i + 1)] for i, t in enumerate(experts)}
    cfg = FeatCalConfig()
    out = calibrate(merged, base=base, experts=experts, calibration=data, progress=False).model
    changed = {k for k, v in out.state_dict().items() if not torch.equal(v, merged.state_dict()[k])}
    for layer in range(3):
        for n in ("self_attn.q_norm", "self_attn.k_norm", "post_feedforward_layernorm", "self_attn.q_proj", "mlp.down_proj"):
            assert f"model.layers.{layer}.{n}.weight" in changed
    assert not {k for k in changed if not k.startswith("model.layers.")}  # embeddings, final norm, tied head: merged
    diff, where = max_abs_diff(out, dense_featcal(merged, base, experts, data, cfg))
    assert diff < 1e-5, where


def test_replaying_block_0_context_would_be_caught(monkeypatch):
    """The same calibration with block 0's (sliding) arguments in every block is far from the reference."""
    base, experts, merged = family_of(tiny_gemma3(layer_types=(SLIDING, GLOBAL)))
    data = {t: [padded_ids(seed=i)] for i, t in enumerate(experts)}
    want = dense_featcal(merged, base, experts, data, FeatCalConfig())
    monkeypatch.setattr(StructuralAdapter, "block_kwargs", lambda self, stack, layer, ctx: {**ctx["shared"], **ctx["by_type"][SLIDING]})
    monkeypatch.setattr("featcal.calibration.engine.driver.check_context_replay", lambda *a, **k: None)  # past the guard
    wrong = calibrate(merged, base=base, experts=experts, calibration=data, progress=False).model
    diff, where = max_abs_diff(wrong, want)
    assert diff > 1e-3 and where.startswith("model.layers.1."), (diff, where)


def test_padding_tokens_do_not_count():
    """What sits under attention_mask == 0 changes nothing, the per-head q/k norms included."""
    base, experts, merged = family_of(tiny_gemma3())
    data = {t: [padded_ids(seed=i)] for i, t in enumerate(experts)}
    assert padding_change_effect(merged, base, experts, data) < 1e-6


def test_spilled_checkpointed_and_offloaded_chains_give_the_same_calibration(tmp_path):
    """Per-type contexts survive the chain store's disk spill, the resume checkpoints and the offload placement
    (on the CPU here)."""
    base, experts, merged = family_of(tiny_gemma3(layer_types=(SLIDING, GLOBAL)))
    data = {t: [padded_ids(seed=i)] for i, t in enumerate(experts)}
    a = calibrate(merged, base=base, experts=experts, calibration=data, progress=False).model
    cfg = FeatCalConfig(spill_dir=str(tmp_path / "spill"), offload_blocks=True, resume_dir=str(tmp_path / "resume"))
    b = calibrate(merged, base=base, experts=experts, calibration=data, config=cfg, progress=False).model
    assert max_abs_diff(a, b)[0] < 1e-6


def test_regmean_plus_plus_runs_each_block_with_its_own_context(monkeypatch):
    """RegMean++ advances its chains through the adapter too: replaying block 0's arguments changes the global block."""
    from featcal.merging.regmean import regmean

    base, experts, _ = family_of(tiny_gemma3())
    data = {t: [padded_ids(seed=i)] for i, t in enumerate(experts)}
    right = regmean(base, experts, data, plus_plus=True, progress=False)
    monkeypatch.setattr(StructuralAdapter, "block_kwargs", lambda self, stack, layer, ctx: {**ctx["shared"], **ctx["by_type"][SLIDING]})
    wrong = regmean(base, experts, data, plus_plus=True, progress=False)
    sr, sw = right.state_dict(), wrong.state_dict()
    assert all(torch.equal(sr[k], sw[k]) for k in sr if k.startswith("model.layers.0."))  # block 0 is sliding anyway
    assert not torch.equal(sr["model.layers.1.self_attn.o_proj.weight"], sw["model.layers.1.self_attn.o_proj.weight"])


# --- GGUF and the command line --------------------------------------------------------------------


def test_gguf_round_trip_then_merge_and_calibrate_through_the_cli(tmp_path, capsys):
    """A tiny gemma3 GGUF base (GGUF carries no layer pattern: 6 blocks give transformers' default 5 sliding +
    1 global) and safetensors experts: featcal merge (TA, TIES) and featcal calibrate write checkpoints that
    load as Gemma3ForCausalLM."""
    from featcal.cli.main import main
    from featcal.io.read.gguf import load_gguf_model

    model = tiny_gemma3(layer_types=(SLIDING,) * 5 + (GLOBAL,))
    base, experts, _ = family_of(model, scale=0.1)
    gguf_path = write_gemma3_gguf(base, tmp_path / "base.gguf")
    back = load_gguf_model(gguf_path, "base")
    assert type(back) is T.Gemma3ForCausalLM and back.config.layer_types == base.config.layer_types
    assert max_abs_diff(back, base)[0] < 1e-6  # the norms' 1 + w round trip in float32
    ids = padded_ids(seq=10)
    with torch.no_grad():
        torch.testing.assert_close(back(**ids).logits, base(**ids).logits, rtol=0, atol=1e-5)

    expert_args = []
    for t, e in experts.items():
        e.save_pretrained(tmp_path / t)
        expert_args += ["--expert", f"{t}={tmp_path / t}"]
    for method, extra in (("task_arithmetic", ["--scaling", "0.3"]), ("ties", ["--density", "0.5"])):
        rc = main(["merge", "--base", str(gguf_path), *expert_args, "--method", method, *extra,
                   "--out", str(tmp_path / method), "--no-progress"])
        assert rc == 0, capsys.readouterr().err
    calib = []
    for i, t in enumerate(experts):
        f = tmp_path / f"{t}.jsonl"
        f.write_text("".join(json.dumps({"text": " ".join(f"w{(7 * i + 3 * k + j) % 96}" for j in range(5 + k % 4))}) + "\n"
                             for k in range(8)))
        calib += ["--calib", f"{t}={f}"]
    out = tmp_path / "cal"
    rc = main(["calibrate", "--merged", str(tmp_path / "task_arithmetic"), "--base", str(gguf_path), *expert_args,
               *calib, "--num-calibration-examples", "8", "--calibration-batch-size", "4", "--max-length", "12",
               "--no-progress", "--no-resume", "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    report = json.loads((out / "featcal.json").read_text())
    assert report["inputs"]["base"]["dequantised_from_gguf"] is True
    assert len(report["drift"]) == 6
    for d in ("ties", "task_arithmetic", "cal"):
        m = T.AutoModelForCausalLM.from_pretrained(tmp_path / d, dtype=torch.float32).eval()
        assert type(m) is T.Gemma3ForCausalLM and m.config.layer_types == base.config.layer_types
        with torch.no_grad():
            assert torch.isfinite(m(**ids).logits).all()
    before, after = load_file(tmp_path / "task_arithmetic" / "model.safetensors"), load_file(out / "model.safetensors")
    assert not torch.equal(before["model.layers.5.self_attn.q_norm.weight"], after["model.layers.5.self_attn.q_norm.weight"])
    assert torch.equal(before["model.norm.weight"], after["model.norm.weight"])
