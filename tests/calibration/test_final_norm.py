"""calibrate_final_norm (issue 17 variant): the norm between the last block and the head, solved as the
in-block norms are, checked against a dense reference built from the calibrated model's own forward."""

from __future__ import annotations

import pytest
import torch

from featcal import FeatCalConfig, calibrate
from featcal.blocks.adapters import adapter_for
from featcal.blocks.structure import get_path
from featcal.config import parse
from featcal.errors import ConfigError
from tests.builders.reference_featcal import Crash, family_data, killed_after, max_abs_diff, noisy_family
from tests.builders.tiny import family_of, padded_ids, pixel_batch, tiny_dinov2, tiny_gemma3

FINAL = {"clip": "post_layernorm", "dinov2": "layernorm", "llama": "model.norm", "t5": "decoder.final_layer_norm",
         "vit": "layernorm", "gemma3": "model.norm"}


def _family_and_data(kind: str):
    if kind == "dinov2":
        base, experts, merged = family_of(tiny_dinov2())
        return base, experts, merged, {t: [pixel_batch(i), pixel_batch(10 + i)] for i, t in enumerate(experts)}
    if kind == "gemma3":  # Gemma3RMSNorm, y = z·(1 + w): the solve on the stored w (test_gemma3.py says why)

        base, experts, merged = family_of(tiny_gemma3())
        return base, experts, merged, {t: [padded_ids(seed=2 * i), padded_ids(seed=2 * i + 1)] for i, t in enumerate(experts)}
    base, experts, merged = noisy_family(kind)
    return base, experts, merged, family_data(kind, experts)


def _norm_input(model, path: str, batch: dict) -> torch.Tensor:
    """What the final norm at `path` is called with in the model's own forward on `batch`."""
    seen = []
    handle = get_path(model, path).register_forward_hook(lambda _m, args, _o: seen.append(args[0].detach()))
    try:
        with torch.no_grad():
            model(**batch)
    finally:
        handle.remove()
    (x,) = seen
    return x


def _dense_reference(kind: str, calibrated, base, experts, merged, data, cfg: FeatCalConfig) -> dict[str, torch.Tensor]:
    """docs/method.md §5's norm solve written out densely: moments of the normalised input on the calibrated chain
    (the calibrated model's own forward), targets from each expert's affine, anchor ρ·θm + (1−ρ)·θ0."""
    path = FINAL[kind]
    norm = get_path(merged, path)
    rms = not isinstance(norm, torch.nn.LayerNorm)
    (stack,) = adapter_for(merged).stacks(merged)[-1:]
    e_sum = m_sum = g_tgt = b_tgt = 0.0
    for t, batches in data.items():
        sw, sz, szz = 0.0, 0.0, 0.0
        for batch in batches:
            x = _norm_input(calibrated, path, batch).double()
            if rms:
                eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
                z = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
            else:
                z = (x - x.mean(-1, keepdim=True)) / torch.sqrt(x.var(-1, unbiased=False, keepdim=True) + norm.eps)
            w = torch.ones(z.shape[:-1], dtype=torch.float64)
            if stack.class_token_head and z.dim() == 3:  # all tokens read: the last block's weights
                w.fill_(cfg.cls_token_weight)
                w[:, 0] = 1.0
            if "attention_mask" in batch and kind in ("llama", "gemma3"):  # T5's is the encoder's
                w = w * batch["attention_mask"].double()
            sw += w.sum()
            sz = sz + (w[..., None] * z).reshape(-1, z.shape[-1]).sum(0)
            szz = szz + (w[..., None] * z * z).reshape(-1, z.shape[-1]).sum(0)
        m, e = sz / sw, szz / sw
        ne = get_path(experts[t], path)
        gamma = ne.weight.double()
        beta = torch.zeros_like(gamma) if rms else ne.bias.double()
        e_sum, m_sum = e_sum + e, m_sum + m
        g_tgt = g_tgt + (e * gamma + (0 if rms else m * beta))
        b_tgt = b_tgt + (m * gamma + beta)
    lam, rho = cfg.lambda_ratio, cfg.anchor_blend_rho
    nb = get_path(base, path)
    g_bar = rho * norm.weight.double() + (1 - rho) * nb.weight.double()
    if rms:
        return {"weight": (g_tgt + lam * g_bar) / (e_sum + lam)}
    b_bar = rho * norm.bias.double() + (1 - rho) * nb.bias.double()
    n = len(data)
    gammas, betas = [], []
    for c in range(g_bar.numel()):  # one 2×2 system per channel
        a = torch.tensor([[e_sum[c] + lam, m_sum[c]], [m_sum[c], n + lam]], dtype=torch.float64)
        r = torch.stack([g_tgt[c] + lam * g_bar[c], b_tgt[c] + lam * b_bar[c]])
        g, b = torch.linalg.solve(a, r)
        gammas.append(g)
        betas.append(b)
    return {"weight": torch.stack(gammas), "bias": torch.stack(betas)}


@pytest.mark.parametrize("kind", ["clip", "dinov2", "llama", "t5", "gemma3"])
def test_final_norm_matches_the_dense_reference_and_leaves_the_blocks_alone(kind):
    base, experts, merged, data = _family_and_data(kind)
    cfg = FeatCalConfig(calibrate_final_norm=True)
    plain = calibrate(merged, base=base, experts=experts, calibration=data, progress=False)
    on = calibrate(merged, base=base, experts=experts, calibration=data, config=cfg, progress=False)
    path = FINAL[kind]
    # the default: the final norm stays merged, bit for bit, and no record is made
    assert plain.final_norm is None
    for n, p in get_path(plain.model, path).named_parameters():
        assert torch.equal(p, dict(get_path(merged, path).named_parameters())[n])
    # with the option: every other parameter as without it (the norm comes after the last block), bit for bit
    sa, sb = plain.model.state_dict(), on.model.state_dict()
    assert {k for k in sa if not torch.equal(sa[k], sb[k])} == {f"{path}.{n}" for n, _ in
                                                                  get_path(merged, path).named_parameters()}
    assert on.drift == plain.drift
    want = _dense_reference(kind, on.model, base, experts, merged, data, cfg)
    got = dict(get_path(on.model, path).named_parameters())
    for n, ref in want.items():
        assert torch.allclose(got[n].double(), ref, rtol=0, atol=1e-5), (n, (got[n].double() - ref).abs().max())
    rec = on.final_norm
    assert rec["calibrated"] and rec["module"] == path and rec["kind"] in ("layernorm", "rmsnorm")
    assert rec["tokens"] == ("class token" if kind == "clip" else
                             "all tokens (class token 1, others 0.01)" if kind == "dinov2" else "all tokens")
    # the drift after the norm, as merged and as solved (not asserted to fall: the solve targets the experts'
    # affine on the merged side's normalised input, and ρ = 2.2 pulls toward an extrapolated anchor)
    assert 0.0 <= rec["before"] < 10 and 0.0 <= rec["after"] < 10


def test_bert_has_no_final_norm_and_the_option_changes_nothing(caplog):
    base, experts, merged = noisy_family("bert")
    data = family_data("bert", experts)
    plain = calibrate(merged, base=base, experts=experts, calibration=data, progress=False).model
    with caplog.at_level("INFO", logger="featcal"):
        on = calibrate(merged, base=base, experts=experts, calibration=data,
                       config=FeatCalConfig(calibrate_final_norm=True), progress=False)
    assert max_abs_diff(on.model, plain)[0] == 0.0
    assert on.final_norm["calibrated"] is False and "no norm between its last encoder block" in on.final_norm["why"]
    assert "calibrate_final_norm" in caplog.text and "nothing is calibrated" in caplog.text


def test_vit_final_norm_is_found():
    base, _, _ = noisy_family("vit")
    adapter = adapter_for(base)
    final = adapter.final_norm(base, adapter.stacks(base)[-1])
    assert final.path == "layernorm" and not final.class_token_only


def test_resumed_and_offloaded_runs_solve_the_same_final_norm(tmp_path, monkeypatch):
    """A run stopped after its last block re-solves the final norm from the restored chains; offloading
    blocks gives the same bits."""
    base, experts, merged, data = _family_and_data("clip")
    cfg = FeatCalConfig(calibrate_final_norm=True)
    straight = calibrate(merged, base=base, experts=experts, calibration=data, config=cfg, progress=False)
    stateful = cfg.model_copy(update={"resume_dir": tmp_path / "state"})
    # killed after the last block: every block and chain is committed, the final norm is not solved
    with killed_after(monkeypatch, 1), pytest.raises(Crash):
        calibrate(merged, base=base, experts=experts, calibration=data, config=stateful, progress=False)
    resumed = calibrate(merged, base=base, experts=experts, calibration=data, config=stateful, progress=False)
    assert max_abs_diff(resumed.model, straight.model)[0] == 0.0
    assert resumed.final_norm == straight.final_norm

    offloaded = calibrate(merged, base=base, experts=experts, calibration=data, progress=False,
                          config=cfg.model_copy(update={"offload_blocks": True}))
    assert max_abs_diff(offloaded.model, straight.model)[0] == 0.0


def test_the_option_is_validated_and_off_by_default():
    assert FeatCalConfig().calibrate_final_norm is False
    with pytest.raises(ConfigError, match="calibrate_final_norm"):
        parse(FeatCalConfig, {"calibrate_final_norm": "maybe"})


def test_cli_flag_records_the_final_norm_in_featcal_json(tmp_path):
    import json

    from featcal.cli.main import main
    from tests.builders.pipeline_family import clip_family

    fam = clip_family(tmp_path / "fam")
    argv = ["calibrate", "--base", str(fam["base"]), "--merged", str(fam["merged"]), "--out", str(tmp_path / "out"),
            "--no-progress", "--num-calibration-examples", "4", "--calibrate-final-norm"]
    for t, d in fam["experts"].items():
        argv += ["--expert", f"{t}={d}"]
    for t, d in fam["data"].items():
        argv += ["--calib", f"{t}={d}"]
    assert main(argv) == 0
    report = json.loads((tmp_path / "out" / "featcal.json").read_text())
    assert report["params"]["calibrate_final_norm"] is True
    assert report["final_norm"]["calibrated"] and report["final_norm"]["module"] == "post_layernorm"


def test_two_gloo_ranks_solve_the_final_norm_of_one_process(tmp_path):
    """The final norm's statistics are all-reduced like a block's: 2 ranks give 1 process's checkpoint."""
    import transformers as T

    from featcal.cli.main import main
    from tests.builders.distributed import max_param_diff, ranked_argv, torchrun
    from tests.builders.pipeline_family import clip_family

    fam = clip_family(tmp_path / "fam", n_images=4)
    for i, d in enumerate(fam["experts"].values()):  # the family's norms are all ones: give the experts their own
        expert = T.CLIPVisionModel.from_pretrained(d)
        g = torch.Generator().manual_seed(i)
        with torch.no_grad():
            for p in expert.post_layernorm.parameters():
                p.add_(0.2 * torch.randn(p.shape, generator=g))
        expert.save_pretrained(d)
    assert main([*ranked_argv(fam, tmp_path / "one", 4), "--calibrate-final-norm"]) == 0
    proc = torchrun([*ranked_argv(fam, tmp_path / "two", 4), "--calibrate-final-norm"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert max_param_diff(T.CLIPVisionModel, tmp_path / "one", tmp_path / "two") < 1e-5
    one = T.CLIPVisionModel.from_pretrained(tmp_path / "one").post_layernorm.weight
    merged = T.CLIPVisionModel.from_pretrained(fam["merged"]).post_layernorm.weight
    assert not torch.equal(one, merged)
