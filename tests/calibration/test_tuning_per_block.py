"""tune_scope "block" (issue 50): each block's ρ and λ chosen on held-out examples inside one calibration's pass.

It must refit bit for bit as the paper's calibration where only the configured setting is scored, never choose
a setting that scored worse than the configured one, choose alike for a seed, see only calibration data, and
refuse what it cannot do before any work."""

from __future__ import annotations

import pytest
import torch

from featcal import FeatCalConfig, calibrate
from featcal.calibration.core import setting as core
from featcal.calibration.engine.block_tuning import LADDERS, BlockTuning
from featcal.calibration.engine.driver import SearchHooks
from featcal.errors import ConfigError
from tests.builders.reference_featcal import family_data, max_abs_diff, noisy_family, ta_merge

START = {"anchor_blend_rho": 2.2, "lambda_ratio": 0.05, "teacher_interp_alpha": 0.25}


@pytest.fixture(scope="module", params=["clip", "llama"])
def family(request):
    kind = request.param
    base, experts, _ = noisy_family(kind, n_experts=2)
    return kind, base, experts, ta_merge(base, experts, 0.3), family_data(kind, experts, n_batches=4)


def test_scoring_only_the_configured_setting_is_the_papers_calibration_bit_for_bit(family):
    """With one score per block the walk keeps the configured setting, and the block is solved from all the
    examples' statistics: the candidate's solve, load and held-out forward leave no trace."""
    _, base, experts, merged, data = family
    ordered = data
    held = {t: frozenset({len(bs) - 1}) for t, bs in data.items()}  # each task's last batch held out
    cfg = FeatCalConfig(resume=False)
    plain = core.calibrate_setting(merged, base=base, experts=experts, calibration=ordered, config=cfg, progress=False)
    tuning = BlockTuning(held, {"anchor_blend_rho": cfg.anchor_blend_rho, "lambda_ratio": cfg.lambda_ratio},
                         ("anchor_blend_rho", "lambda_ratio"), limit=1)
    tuned = core.calibrate_setting(merged, base=base, experts=experts, calibration=ordered, config=cfg,
                                   progress=False, search=SearchHooks(block_tuning=tuning))
    # the held-out batch is each task's last one folded: the fit sums plus its sums are the plain sums exactly
    assert max_abs_diff(plain.model, tuned.model)[0] == 0.0
    assert [b["chosen"] for b in tuning.blocks] == [{"anchor_blend_rho": 2.2, "lambda_ratio": 0.05}] * len(plain.drift)


def test_alpha_blended_from_the_sums_at_0_and_1_is_the_configured_calibration(family):
    """α chosen per block folds the statistics at α 0 and 1 without the teacher form; at the configured α the
    blend is the paper's calibration to round-off."""
    _, base, experts, merged, data = family
    held = {t: frozenset({len(bs) - 1}) for t, bs in data.items()}
    cfg = FeatCalConfig(resume=False)
    plain = core.calibrate_setting(merged, base=base, experts=experts, calibration=data, config=cfg, progress=False)
    tuning = BlockTuning(held, dict(START), tuple(START), limit=1)
    tuned = core.calibrate_setting(merged, base=base, experts=experts, calibration=data, config=cfg,
                                   progress=False, search=SearchHooks(block_tuning=tuning))
    diff, name = max_abs_diff(plain.model, tuned.model)
    scale = max(p.abs().max().item() for p in plain.model.parameters())
    assert diff <= 1e-5 * scale, name
    assert [b["chosen"] for b in tuning.blocks] == [START] * len(plain.drift)


def test_each_block_chooses_a_ladder_setting_that_scored_no_worse_than_the_configured_one(family):
    _, base, experts, merged, data = family
    cfg = FeatCalConfig(tune=True, tune_scope="block", resume=False)
    result = calibrate(merged, base=base, experts=experts, calibration=data, config=cfg, progress=False)
    rec = result.tuning.as_dict()
    assert rec["scope"] == "block" and rec["searched"] == ["anchor_blend_rho", "lambda_ratio", "teacher_interp_alpha"]
    assert len(rec["blocks"]) == len(result.drift)
    moved = 0
    for block in rec["blocks"]:
        first = block["candidates"][0]
        assert {k: first[k] for k in rec["searched"]} == START
        assert block["start_drift"] == first["drift"]
        assert block["held_out_drift"] <= block["start_drift"]
        assert 1 <= len(block["candidates"]) <= rec["limit_per_block"]
        chosen = block["chosen"]
        scored = [c for c in block["candidates"] if all(c[k] == v for k, v in chosen.items())]
        assert scored and scored[0]["drift"] == min(c["drift"] for c in block["candidates"])
        assert all(v in LADDERS[k] for k, v in chosen.items())
        moved += chosen != START
    assert moved  # on these noisy families the configured setting is not every block's best
    # the same seed chooses alike and gives the same checkpoint; the held-out part is recorded
    again = calibrate(merged, base=base, experts=experts, calibration=data, config=cfg, progress=False)
    assert [b["chosen"] for b in again.tuning["blocks"]] == [b["chosen"] for b in rec["blocks"]]
    assert max_abs_diff(result.model, again.model)[0] == 0.0
    assert all(r["held_out"] >= 1 for r in rec["split"].values())


def test_without_a_base_only_lambda_is_searched():
    base, experts, _ = noisy_family("clip", n_experts=2)
    data = family_data("clip", experts, n_batches=4)
    cfg = FeatCalConfig(tune=True, tune_scope="block", anchor_blend_rho=1.0, resume=False)
    result = calibrate(ta_merge(base, experts, 0.3), base=None, experts=experts, calibration=data, config=cfg,
                       progress=False)
    assert result.tuning["searched"] == ["lambda_ratio", "teacher_interp_alpha"]
    assert all(set(b["chosen"]) == {"lambda_ratio", "teacher_interp_alpha"} for b in result.tuning["blocks"])


@pytest.mark.parametrize(("update", "message"), [
    ({"block_statistics": "sequential"}, "block_statistics"),
    ({"tune_folds": 2}, "tune_folds"),
])
def test_what_the_block_scope_cannot_do_is_refused_before_work(update, message):
    base, experts, _ = noisy_family("clip", n_experts=2)
    data = family_data("clip", experts, n_batches=4)
    cfg = FeatCalConfig(tune=True, tune_scope="block", **update)
    with pytest.raises(ConfigError, match=message):
        calibrate(ta_merge(base, experts, 0.3), base=base, experts=experts, calibration=data, config=cfg,
                  progress=False)


def test_heads_are_refused_with_the_block_scope():
    base, experts, _ = noisy_family("clip", n_experts=2)
    data = family_data("clip", experts, n_batches=4)
    heads = {t: torch.nn.Linear(8, 3) for t in experts}
    with pytest.raises(ConfigError, match="tune_scope 'model'"):
        calibrate(ta_merge(base, experts, 0.3), base=base, experts=experts, calibration=data, heads=heads,
                  config=FeatCalConfig(tune=True, tune_scope="block"), progress=False)


def test_the_command_line_runs_the_block_scope_and_records_it(tmp_path, capsys):
    """`featcal calibrate --tune --tune-scope block` on a saved Llama family: featcal.json holds the per-block
    choices and the command prints its one summary line."""
    import json

    from featcal.cli.main import main
    from tests.builders.data_fixtures import sentences
    from tests.builders.pipeline_family import llama_text_family

    fam = llama_text_family(tmp_path / "fam", {t: sentences(8, seed=i) for i, t in enumerate(("task0", "task1"))})
    argv = ["calibrate", "--base", fam["base"], "--merged", fam["merged"], "--out", tmp_path / "out",
            "--num-calibration-examples", "8", "--calibration-batch-size", "2", "--tune", "--tune-scope", "block",
            "--no-progress"]
    for t, p in fam["experts"].items():
        argv += ["--expert", f"{t}={p}"]
    for t, p in fam["data"].items():
        argv += ["--calib", f"{t}={p}"]
    assert main([str(a) for a in argv]) == 0
    out = capsys.readouterr().out
    assert "tune (per block):" in out
    record = json.loads((tmp_path / "out" / "featcal.json").read_text())["tuning"]
    assert record["scope"] == "block" and len(record["blocks"]) > 0
    assert all(set(b["chosen"]) == set(START) for b in record["blocks"])
