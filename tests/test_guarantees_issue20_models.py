"""Guarantees from issue 20 about models: output dtype, option bounds and drift warnings, hub layouts.

Covers docs/guarantees.md: a 16-bit merge is calibrated in float32 and written in its own dtype;
`covariance_eps` and `lambda_ratio` have upper bounds; a calibration that makes the end-to-end drift
worse than the merge's is reported; the README's hub pairing (a full CLIPModel base with
transformers-4 CLIPVisionModel experts) merges and calibrates, from local stand-ins laid out like
the hub.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import yaml
from safetensors.torch import load_file

import featcal.calibration.pipeline as pipeline
from featcal.config import FeatCalConfig, parse
from featcal.errors import ConfigError
from test_guarantees_support import (
    calibrate_argv,
    cli,
    copy_family,
    edit_config,
    merge_argv,
    one_line_error,
    rewrite,
)
from test_pipeline_support import clip_family

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    return clip_family(tmp_path_factory.mktemp("clip"))


def _store_as(directory, dtype: torch.dtype) -> None:
    """Rewrite a checkpoint's floating tensors (and its config's dtype) in `dtype`; exact for upcasts."""
    rewrite(directory, lambda sd: sd.update({k: v.to(dtype) for k, v in sd.items() if v.is_floating_point()}))
    edit_config(directory, dtype=str(dtype).removeprefix("torch."))


# --- item 9: the merged model's dtype is kept -----------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_16_bit_merge_is_calibrated_in_float32_and_written_in_its_dtype(clip, tmp_path, capsys, dtype):
    name = str(dtype).removeprefix("torch.")
    half = copy_family({k: v for k, v in clip.items() if k != "merged"}, tmp_path / "half")
    for d in (half["base"], *half["experts"].values()):
        _store_as(d, dtype)
    half["merged"] = tmp_path / "half" / "merged"
    rc, _, err = cli(merge_argv(half["base"], half["experts"], half["merged"]), capsys)
    assert rc == 0, err
    assert {v.dtype for v in load_file(half["merged"] / "model.safetensors").values() if v.is_floating_point()} == {dtype}
    full = copy_family(half, tmp_path / "full")  # the same values stored in float32 (the upcast is exact)
    for d in (full["base"], full["merged"], *full["experts"].values()):
        _store_as(d, torch.float32)

    for fam in (half, full):
        rc, _, err = cli(calibrate_argv(fam, fam["base"].parent / "cal"), capsys)
        assert rc == 0, err
    out16, out32 = tmp_path / "half" / "cal", tmp_path / "full" / "cal"
    got, reference = load_file(out16 / "model.safetensors"), load_file(out32 / "model.safetensors")
    assert {v.dtype for v in got.values() if v.is_floating_point()} == {dtype}
    assert json.loads((out16 / "config.json").read_text())["dtype"] == name
    assert json.loads((out16 / "featcal.json").read_text())["output"]["dtype"] == name
    # computed in float32 and rounded once: exactly the float32 calibration of the same values, cast
    assert got.keys() == reference.keys()
    for k, v in reference.items():
        assert torch.equal(got[k], v.to(dtype) if v.is_floating_point() else v), k
    merged = load_file(half["merged"] / "model.safetensors")
    assert not torch.equal(got["encoder.layers.0.mlp.fc1.weight"], merged["encoder.layers.0.mlp.fc1.weight"])
    assert (out16 / "model.safetensors").stat().st_size < 0.6 * (out32 / "model.safetensors").stat().st_size


# --- item 10: bounded ridge terms; a calibration that makes the end-to-end drift worse is reported -----------


@pytest.fixture
def no_calibration_work(monkeypatch):
    """Fail the test if the pipeline gets as far as loading a model or preprocessing data."""

    def boom(*a, **k):
        raise AssertionError("calibration work started before the input was validated")

    monkeypatch.setattr(pipeline, "load_model", boom)
    monkeypatch.setattr(pipeline, "load_calibration_batches", boom)


@pytest.mark.parametrize(("field", "value"), [
    ("covariance_eps", 1e300), ("covariance_eps", 0.0101), ("lambda_ratio", 1e300), ("lambda_ratio", 100.5),
])
def test_ridge_terms_have_an_upper_bound(field, value):
    with pytest.raises(ConfigError, match=rf"invalid FeatCalConfig: {field}: Input should be less than or equal"):
        parse(FeatCalConfig, {field: value})
    assert parse(FeatCalConfig, {"covariance_eps": 0.01, "lambda_ratio": 100.0}).covariance_eps == 0.01


def test_a_huge_covariance_eps_is_refused_before_any_work(clip, tmp_path, capsys, no_calibration_work):
    rc, _, err = cli(calibrate_argv(clip, tmp_path / "out", "--covariance-eps", "1e300"), capsys)
    assert rc == 2 and "covariance_eps: Input should be less than or equal to 0.01" in one_line_error(err)
    assert not (tmp_path / "out").exists()
    run = tmp_path / "run.yaml"
    run.write_text(yaml.safe_dump({
        "merge": {"base": str(clip["base"]), "experts": {t: str(p) for t, p in clip["experts"].items()}},
        "calibrate": {"calibration": {t: str(p) for t, p in clip["data"].items()}, "config": {"lambda_ratio": 1e300}},
        "out": str(tmp_path / "run-out"),
    }))
    rc, _, err = cli(["run", run, "--no-progress"], capsys)
    assert rc == 2 and "lambda_ratio: Input should be less than or equal to 100" in one_line_error(err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.yaml"]


# ρ = 10 with λ = 100: every weight pinned to θ0 + 10·(θm − θ0), far past the merge: worse end to end
WORSE = ("--anchor-blend-rho", "10", "--lambda-ratio", "100")


def test_a_calibration_that_worsens_the_end_to_end_drift_is_reported(clip, tmp_path, capsys):
    rc, _, err = cli(calibrate_argv(clip, tmp_path / "good"), capsys)
    assert rc == 0, err
    good = json.loads((tmp_path / "good" / "featcal.json").read_text())
    e2e = good["end_to_end_drift"]
    assert e2e["tokens"] == "class token" and 0 <= e2e["calibrated"] < e2e["merged"]
    assert good["warnings"] == []

    rc, _, err = cli(calibrate_argv(clip, tmp_path / "bad", *WORSE), capsys)
    assert rc == 0, err  # a legal configuration: the output is written, and the report says what it did
    bad = json.loads((tmp_path / "bad" / "featcal.json").read_text())
    assert bad["end_to_end_drift"]["calibrated"] > bad["end_to_end_drift"]["merged"]
    assert bad["end_to_end_drift"]["merged"] == pytest.approx(e2e["merged"])  # the merge's drift, not the run's
    assert [w for w in bad["warnings"] if "end-to-end drift worse than the merge's" in w]


def test_the_console_warns_when_the_end_to_end_drift_gets_worse(clip, tmp_path):
    argv = [str(a) for a in calibrate_argv(clip, tmp_path / "bad", *WORSE)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "featcal", *argv], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert "WARNING featcal.calibration: calibration made the end-to-end drift worse than the merge's" in done.stderr
