"""benchmarks/straightforward_featcal.py, the speed benchmark's independent yardstick, does featcal's work:
on a tiny random CLIP vision family its calibrated parameters equal featcal.calibrate()'s within float32
round-off, with the same hyperparameters (defaults and a changed set)."""

from __future__ import annotations

import copy
import importlib.util
import sys
from pathlib import Path

import pytest

from featcal import FeatCalConfig, calibrate
from tests.builders.reference_featcal import family_data, max_abs_diff, noisy_family

REPO = Path(__file__).resolve().parents[2]


def _straightforward():
    name = "straightforward_featcal"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _settings(sf, cfg: FeatCalConfig):
    return sf.Settings(alpha=cfg.teacher_interp_alpha, rho=cfg.anchor_blend_rho, lam=cfg.lambda_ratio,
                       eps=cfg.covariance_eps, cls_weight=cfg.cls_token_weight, calibrate_bias=cfg.calibrate_bias,
                       calibrate_layernorm=cfg.calibrate_layernorm)


@pytest.mark.parametrize("changes", [{}, {"teacher_interp_alpha": 0.5, "anchor_blend_rho": 1.5, "lambda_ratio": 0.2,
                                          "cls_token_weight": 0.1}])
def test_straightforward_equals_featcal_on_tiny_clip(one_thread, changes):
    sf = _straightforward()
    base, experts, merged = noisy_family("clip", n_experts=3)
    data = family_data("clip", experts, n_batches=2)
    cfg = FeatCalConfig(**changes)
    assert sf.Settings() == _settings(sf, FeatCalConfig())  # the yardstick's defaults are featcal's
    ours = calibrate(merged, base=base, experts=experts, calibration=data, config=cfg, progress=False).model
    theirs = sf.calibrate(copy.deepcopy(merged), base, experts, data, _settings(sf, cfg))
    diff, where = max_abs_diff(ours, theirs)
    assert diff < 1e-5, f"{where} differs by {diff}"
    changed, _ = max_abs_diff(theirs, merged)
    assert changed > 1e-3  # the comparison is not vacuous: calibration moved the parameters
    # every block Linear / LayerNorm was solved, the stem and post_layernorm kept merged
    sm, st = merged.state_dict(), theirs.state_dict()
    for k in sm:
        moved = (sm[k] - st[k]).abs().max().item() > 0
        assert moved == (".layers." in k), k
