"""Guarantees from issue 20 about models: output dtype, option bounds and drift warnings, hub layouts.

Covers docs/guarantees.md: a 16-bit merge is calibrated in float32 and written in its own dtype;
`covariance_eps` and `lambda_ratio` have upper bounds; a calibration that makes the end-to-end drift
worse than the merge's is reported; the README's hub pairing (a full CLIPModel base with
transformers-4 CLIPVisionModel experts) merges and calibrates, from local stand-ins laid out like
the hub.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from test_guarantees_support import (
    calibrate_argv,
    cli,
    copy_family,
    edit_config,
    merge_argv,
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
