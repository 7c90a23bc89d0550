"""Guarantees, results: bit-identical reruns, clean fallbacks on singular statistics, no NaN/Inf written.

Covers docs/guarantees.md "Determinism" and "Numerical guards": the same inputs and seed give the same
model.safetensors bytes for every merge method (DARE included) and for calibrate and run, through
the CLI, twice in a row; a singular Gram falls back to the pseudo-inverse, finitely, and the report
says so; non-finite solved, calibrated or merged weights are refused before anything is written.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
import yaml

import featcal.calibration.front.pipeline as calibration_pipeline
from featcal import FeatCalConfig, calibrate
from featcal.calibration.maths import solver
from featcal.config import CALIBRATED_MERGE_METHODS
from featcal.io.read.models import load_model
from featcal.merging import available_methods
from tests.builders.guarantees import (
    CALIB_FLAGS,
    calibrate_argv,
    cli,
    copy_family,
    leftovers,
    merge_argv,
    one_line_error,
    rewrite,
    weights_sha,
)
from tests.builders.tiny import perturbed, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")



# --- determinism --------------------------------------------------------------------------------------------


# what the whole-model methods need besides the shared flags: RegMean(++) its data, WUDI fewer steps
METHOD_FLAGS = {"wudi": ("--steps", "20", "--lr", "1e-4")}


@pytest.mark.parametrize("method", available_methods())
def test_merge_is_bit_identical_twice_in_a_row(clip, tmp_path, capsys, method):
    flags = ("--method", method, "--seed", "7", "--drop-rate", "0.3", "--density", "0.5")
    extra = METHOD_FLAGS.get(method, ())
    if method in CALIBRATED_MERGE_METHODS:
        extra = (*CALIB_FLAGS, *[a for t, d in clip["data"].items() for a in ("--calib", f"{t}={d}")])
    flags = (*flags, *extra)
    shas = []
    for name in ("a", "b"):
        rc, _, err = cli(merge_argv(clip["base"], clip["experts"], tmp_path / name, *flags), capsys)
        assert rc == 0, err
        shas.append(weights_sha(tmp_path / name))
    assert shas[0] == shas[1]
    if method.startswith("dare"):  # the seed is what fixes the drop masks: another seed, other bytes
        rc, _, err = cli(merge_argv(clip["base"], clip["experts"], tmp_path / "c", "--method", method, "--seed", "8",
                                    "--drop-rate", "0.3"), capsys)
        assert rc == 0, err
        assert weights_sha(tmp_path / "c") != shas[0]


def test_calibrate_is_bit_identical_twice_in_a_row(clip, tmp_path, capsys):
    for name in ("a", "b"):
        rc, _, err = cli(calibrate_argv(clip, tmp_path / name, "--seed", "3"), capsys)
        assert rc == 0, err
    assert weights_sha(tmp_path / "a") == weights_sha(tmp_path / "b")
    reports = [json.loads((tmp_path / n / "featcal.json").read_text()) for n in ("a", "b")]
    assert reports[0]["inputs"]["calibration"] == reports[1]["inputs"]["calibration"]  # the same examples drawn
    assert reports[0]["output"]["sha256"]["model.safetensors"] == weights_sha(tmp_path / "a")


def test_run_is_bit_identical_twice_in_a_row(clip, tmp_path, capsys):
    shas = []
    for name in ("a", "b"):
        run = tmp_path / f"{name}.yaml"
        run.write_text(yaml.safe_dump({
            "merge": {"base": str(clip["base"]), "experts": {t: str(p) for t, p in clip["experts"].items()},
                      "method": "dare_ties", "params": {"seed": 5, "density": 0.5}},
            "calibrate": {"calibration": {t: str(p) for t, p in clip["data"].items()},
                          "config": {"num_calibration_examples": 4, "calibration_batch_size": 2}},
            "out": str(tmp_path / name),
        }))
        rc, _, err = cli(["run", run, "--no-progress"], capsys)
        assert rc == 0, err
        shas.append(weights_sha(tmp_path / name))
    assert shas[0] == shas[1]


# --- singular statistics fall back cleanly and are reported ---------------------------------------------------


SINGULAR = {"lambda_ratio": 0.0, "covariance_eps": 0.0}  # no ridge: a Gram of too few tokens is singular


def test_singular_gram_falls_back_through_the_api(caplog):
    base = tiny_model("clip")
    experts = {"a": perturbed(base, 1), "b": perturbed(base, 2)}
    one_image = torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(0))  # 17 tokens < 32 channels
    with caplog.at_level(logging.WARNING, logger="featcal"):
        out = calibrate(perturbed(base, 3), base=base, experts=experts, calibration={"a": [one_image], "b": [one_image]},
                        config=FeatCalConfig(**SINGULAR), progress=False).model
    fallbacks = [r.getMessage() for r in caplog.records if "pseudo-inverse" in r.getMessage()]
    assert any(m.startswith("encoder.layers.0.self_attn.q_proj: Cholesky failed") for m in fallbacks)
    assert all(torch.isfinite(p).all() for p in out.parameters())


def test_singular_gram_is_reported_in_featcal_json(clip, tmp_path, capsys):
    out = tmp_path / "out"
    rc, _, err = cli(calibrate_argv(clip, out, "--lambda-ratio", "0", "--covariance-eps", "0",
                                    "--num-calibration-examples", "1"), capsys)
    assert rc == 0, err
    warnings = json.loads((out / "featcal.json").read_text())["warnings"]
    assert any("encoder.layers.1.mlp.fc2: Cholesky failed" in w and "pseudo-inverse" in w for w in warnings)
    assert all(torch.isfinite(p).all() for p in load_model(out).parameters())


def test_a_clean_run_reports_no_warnings(clip, tmp_path, capsys):
    rc, _, err = cli(calibrate_argv(clip, tmp_path / "out"), capsys)
    assert rc == 0, err
    assert json.loads((tmp_path / "out" / "featcal.json").read_text())["warnings"] == []


# --- nothing non-finite is written -------------------------------------------------------------------------------


def test_a_non_finite_solve_is_refused_naming_the_parameter(clip, tmp_path, capsys, monkeypatch):
    real = solver.linear_weight

    def poisoned(*args, what="", **kwargs):
        w = real(*args, what=what, **kwargs)
        if what == "encoder.layers.1.mlp.fc1":
            w[0, 0] = float("nan")
        return w

    monkeypatch.setattr(solver, "linear_weight", poisoned)
    out = tmp_path / "out"
    rc, _, err = cli(calibrate_argv(clip, out), capsys)
    assert rc == 2
    assert "solved parameter encoder.layers.1.mlp.fc1.weight has 1 non-finite value(s)" in one_line_error(err)
    assert not out.exists() and leftovers(tmp_path) == []


def test_the_calibrated_model_is_checked_before_writing(clip, tmp_path, capsys, monkeypatch):
    real = calibration_pipeline.calibrate_models

    def overflowing(*args, **kwargs):
        result = real(*args, **kwargs)  # featcal calibrate asks for the CalibrationResult
        with torch.no_grad():
            result.model.embeddings.patch_embedding.weight[0, 0, 0, 0] = float("inf")
        return result

    monkeypatch.setattr(calibration_pipeline, "calibrate_models", overflowing)
    out = tmp_path / "out"
    rc, _, err = cli(calibrate_argv(clip, out), capsys)
    assert rc == 2
    assert one_line_error(err).startswith(
        "featcal: error: the calibrated model: tensor 'embeddings.patch_embedding.weight' has 1 "
        "non-finite value(s) (NaN or Inf); nothing was written"
    )
    assert not out.exists() and leftovers(tmp_path) == []


def test_a_merge_that_overflows_its_dtype_is_refused(clip, tmp_path, capsys):
    fam = copy_family(clip, tmp_path / "fp16")
    key = "post_layernorm.weight"
    for i, d in enumerate([fam["base"], *fam["experts"].values()]):
        def to_fp16(sd, value=60000.0 + 2500.0 * i):
            sd.update({k: v.half() for k, v in sd.items() if v.is_floating_point()})
            sd[key].fill_(value)  # finite in fp16 (max 65504) ...
        rewrite(d, to_fp16)
    out = tmp_path / "out"
    rc, _, err = cli(merge_argv(fam["base"], fam["experts"], out, "--scaling", "1.0"), capsys)  # ... but not their sum
    assert rc == 2
    assert (f"the task_arithmetic merge: tensor '{key}' has 32 non-finite value(s) (NaN or Inf); nothing was written"
            in one_line_error(err))
    assert not out.exists() and leftovers(tmp_path) == []
