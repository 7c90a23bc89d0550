"""calibrate_stem_norm (issue 17 variant): the norm whose output is block 0's input (BERT embeddings.LayerNorm,
CLIP pre_layrnorm), solved as the in-block norms are, checked against a dense solve from the merged model's own
stem forward; the blocks are then the paper's calibration of the model carrying that norm."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from featcal import FeatCalConfig, calibrate
from featcal.blocks.structure import get_path
from featcal.config import parse
from featcal.errors import ConfigError
from tests.builders.reference_featcal import Crash, family_data, killed_after, max_abs_diff, noisy_family

D = torch.float64
STEM = {"bert": "embeddings.LayerNorm", "clip": "pre_layrnorm"}
ON = FeatCalConfig(calibrate_stem_norm=True)


def _dense_stem_solve(kind: str, merged, base, experts, data, cfg: FeatCalConfig):
    """docs/method.md §5's (γ, β) solve, per channel, from the inputs the merged stem norm sees (padding weighs 0)."""
    path = STEM[kind]
    norm = get_path(merged, path)
    lam, rho = cfg.lambda_ratio, cfg.anchor_blend_rho
    rows = []
    for t, e in experts.items():
        xs, ws = [], []
        for batch in data[t]:
            seen = []
            handle = norm.register_forward_hook(lambda _m, a, _o, seen=seen: seen.append(a[0].detach()))
            with torch.no_grad():
                merged(**batch)
            handle.remove()
            x = seen[0]
            mask = batch.get("attention_mask")
            w = torch.ones(x.shape[:-1]) if mask is None else mask.to(torch.float32)
            xs.append(x.reshape(-1, x.shape[-1]).to(D))
            ws.append(w.reshape(-1).to(D))
        x, w = torch.cat(xs), torch.cat(ws)
        z = F.layer_norm(x, norm.normalized_shape, eps=norm.eps)
        p = (w / w.sum())[:, None]
        en = get_path(e, path)
        rows.append(((p * z).sum(0), (p * z * z).sum(0), en.weight.to(D), en.bias.to(D)))
    nb = get_path(base, path)
    ag = rho * norm.weight.to(D) + (1 - rho) * nb.weight.to(D)
    ab = rho * norm.bias.to(D) + (1 - rho) * nb.bias.to(D)
    a11 = lam + sum(e for _, e, _, _ in rows)
    a12 = sum(m for m, _, _, _ in rows)
    a22 = lam + len(rows)
    r1 = lam * ag + sum(e * g + m * b for m, e, g, b in rows)
    r2 = lam * ab + sum(m * g + b for m, _, g, b in rows)
    det = a11 * a22 - a12 * a12
    return (a22 * r1 - a12 * r2) / det, (a11 * r2 - a12 * r1) / det


@pytest.mark.parametrize("kind", ["bert", "clip"])
def test_stem_norm_is_the_dense_solve_and_the_blocks_the_papers_on_top(kind):
    base, experts, merged = noisy_family(kind)
    data = family_data(kind, experts)
    out = calibrate(merged, base=base, experts=experts, calibration=data, config=ON, progress=False)
    gamma, beta = _dense_stem_solve(kind, merged, base, experts, data, ON)
    solved = get_path(out.model, STEM[kind])
    assert (solved.weight.to(D) - gamma).abs().max() < 1e-5
    assert (solved.bias.to(D) - beta).abs().max() < 1e-5
    rec = out.stem_norm
    assert rec["calibrated"] and rec["module"] == STEM[kind] and rec["after"] < rec["before"]
    # the blocks: the paper's calibration of the merge carrying the solved stem norm
    carried = copy.deepcopy(merged)
    with torch.no_grad():
        get_path(carried, STEM[kind]).weight.copy_(solved.weight)
        get_path(carried, STEM[kind]).bias.copy_(solved.bias)
    paper = calibrate(carried, base=base, experts=experts, calibration=data, progress=False).model
    diff, where = max_abs_diff(out.model, paper)
    assert diff < 1e-6, f"{kind}: {where} differs by {diff}"
    default = calibrate(merged, base=base, experts=experts, calibration=data, progress=False).model
    assert max_abs_diff(out.model, default)[0] > 1e-4


def test_llama_has_no_stem_norm_and_the_option_changes_nothing(caplog):
    base, experts, merged = noisy_family("llama")
    data = family_data("llama", experts)
    with caplog.at_level("INFO", logger="featcal.calibration"):
        out = calibrate(merged, base=base, experts=experts, calibration=data, config=ON, progress=False)
    assert out.stem_norm["calibrated"] is False and "no norm between its embeddings" in out.stem_norm["why"]
    assert "calibrate_stem_norm" in caplog.text
    default = calibrate(merged, base=base, experts=experts, calibration=data, progress=False).model
    assert max_abs_diff(out.model, default)[0] == 0.0


def test_a_resumed_run_restores_the_stem_norm_with_block_0(tmp_path, monkeypatch):
    base, experts, merged = noisy_family("bert")
    data = family_data("bert", experts)
    straight = calibrate(merged, base=base, experts=experts, calibration=data, config=ON, progress=False).model
    stateful = ON.model_copy(update={"resume_dir": tmp_path / "state"})
    # killed once block 0 (and with it the stem norm) is committed, block 1 not calibrated
    with killed_after(monkeypatch, 0), pytest.raises(Crash):
        calibrate(merged, base=base, experts=experts, calibration=data, config=stateful, progress=False)
    resumed = calibrate(merged, base=base, experts=experts, calibration=data, config=stateful, progress=False)
    assert max_abs_diff(resumed.model, straight)[0] == 0.0
    assert "restored" in resumed.stem_norm


def test_the_option_is_validated_off_by_default_and_keeps_old_resume_digests():
    from featcal.calibration.resume.store import config_digest

    assert FeatCalConfig().calibrate_stem_norm is False
    with pytest.raises(ConfigError, match="calibrate_stem_norm"):
        parse(FeatCalConfig, {"calibrate_stem_norm": "maybe"})
    plain = FeatCalConfig()
    dumped = plain.model_dump(mode="json")
    for k in ("calibrate_stem_norm", "block_statistics", "calibrate_final_norm"):  # options added later: at their
        assert k in dumped  # default they leave the digest as it was before they existed
    assert config_digest(plain) == config_digest(FeatCalConfig(calibrate_stem_norm=False, block_statistics="as_merged"))
    assert config_digest(plain) != config_digest(ON)
    assert config_digest(plain) != config_digest(FeatCalConfig(block_statistics="sequential"))
