"""Guarantees, bad input: every refusal is one line naming the culprit, before any work, with no output.

The matrix of docs/guarantees.md ("Refused before any work"): mismatched families for merge and for
calibrate, NaN/Inf inputs, calibration data that cannot feed the model, task names that do not pair
up, unknown methods and options, out-of-range hyperparameters; and bf16 experts of an fp32 base,
which must work.
"""

from __future__ import annotations

import json
import math
import re
import shutil

import pytest
import torch
import yaml
from safetensors.torch import load_file

import featcal.calibration.front.pipeline as pipeline
from featcal import FeatCalConfig, MergeConfig, merge
from featcal.config import MAX_SEED, parse
from featcal.errors import ConfigError
from tests.builders.data_fixtures import save_image_processor, sentences, write_jsonl
from tests.builders.guarantees import (
    calibrate_argv,
    cli,
    copy_family,
    edit_config,
    first_key,
    leftovers,
    merge_argv,
    one_line_error,
    rewrite,
    weights_sha,
)
from tests.builders.tiny import make_family, save, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    base, experts = make_family("bert", tmp_path_factory.mktemp("bert"), n_experts=2)
    return {"base": base, "experts": experts}





def _replace_with(directory, kind):
    shutil.rmtree(directory)
    save(tiny_model(kind), directory)


def _nan(key_part):
    return lambda d: rewrite(d, lambda sd: sd[first_key(d, key_part)].fill_(float("nan")))


def _inf(key_part):
    return lambda d: rewrite(d, lambda sd: sd[first_key(d, key_part)].__setitem__(0, float("inf")))


# --- merge: the family ------------------------------------------------------------------------------

MERGE_CASES = {
    "other architecture": ("task1", lambda d: _replace_with(d, "vit"),
                           r"expert 'task1' \(.*expert1\): config model_type is 'vit' but the base has 'bert'"),
    "other config class": ("task1", lambda d: edit_config(d, architectures=["BertForMaskedLM"]),
                           r"expert 'task1'.*config architectures is \['BertForMaskedLM'\] but the base has \['BertModel'\]"),
    "missing tensor": ("task1", lambda d: rewrite(d, lambda sd: sd.pop("pooler.dense.bias")),
                       r"expert 'task1' .* is missing tensor 'pooler.dense.bias' that the base has"),
    "extra tensor": ("task0", lambda d: rewrite(d, lambda sd: sd.update({"head.extra": torch.zeros(2)})),
                     r"expert 'task0' .* has tensor 'head.extra' that the base does not have"),
    "shape": ("task1", lambda d: rewrite(d, lambda sd: sd.update({"pooler.dense.bias": torch.zeros(3)})),
              r"expert 'task1': tensor 'pooler.dense.bias' has shape \(3,\) but the base has \(32,\)"),
    "NaN in an expert": ("task0", _nan("pooler.dense.weight"),
                         r"expert 'task0' \(.*\): tensor 'pooler.dense.weight' contains 1024 NaN and 0 Inf values"),
    "Inf in the base": ("base", _inf("pooler.dense.bias"),
                        r"base \(.*base\): tensor 'pooler.dense.bias' contains 0 NaN and 1 Inf values"),
}


@pytest.mark.parametrize("case", list(MERGE_CASES))
def test_merge_refuses_a_broken_family(bert, tmp_path, capsys, no_merge_work, case):
    target, damage, message = MERGE_CASES[case]
    fam = copy_family(bert, tmp_path / "fam")
    damage(fam["base"] if target == "base" else fam["experts"][target])
    out = tmp_path / "out"
    rc, _, err = cli(merge_argv(fam["base"], fam["experts"], out), capsys)
    assert rc == 2
    assert re.search(message, one_line_error(err)), err
    assert not out.exists() and leftovers(tmp_path) == []


# --- calibrate: the family, the merged input included -------------------------------------------------

CALIBRATE_CASES = {
    "other architecture": ("task1", lambda d: _replace_with(d, "bert"),
                           r"all checkpoints must share the merged model's type \(clip_vision_model\); "
                           r"these differ: expert 'task1' \(bert\)"),
    "other config class": ("task1", lambda d: edit_config(d, architectures=["CLIPVisionModelWithProjection"]),
                           r"expert 'task1' .*config architectures is \['CLIPVisionModelWithProjection'\] but the "
                           r"merged model has \['CLIPVisionModel'\]"),
    "missing tensor": ("task1", lambda d: rewrite(d, lambda sd: sd.pop("post_layernorm.bias")),
                       r"expert 'task1' .* is missing tensor 'post_layernorm.bias' that the merged model has"),
    "extra tensor": ("base", lambda d: rewrite(d, lambda sd: sd.update({"head.extra": torch.zeros(2)})),
                     r"base .* has tensor 'head.extra' that the merged model does not have"),
    "shape": ("task0", lambda d: rewrite(d, lambda sd: sd.update({"post_layernorm.bias": torch.zeros(5)})),
              r"expert 'task0': tensor 'post_layernorm.bias' has shape \(5,\) but the merged model has \(32,\)"),
    "NaN in the merged model": ("merged", _nan("encoder.layers.1.mlp.fc2.weight"),
                                r"merged model \(.*merged\): tensor 'encoder.layers.1.mlp.fc2.weight' contains 2048 NaN"),
    "Inf in the base": ("base", _inf("post_layernorm.weight"),
                        r"base model \(.*base\): tensor 'post_layernorm.weight' contains 0 NaN and 1 Inf"),
}


@pytest.mark.parametrize("case", list(CALIBRATE_CASES))
def test_calibrate_refuses_a_broken_family(clip, tmp_path, capsys, no_calibration_work, case):
    target, damage, message = CALIBRATE_CASES[case]
    fam = copy_family(clip, tmp_path / "fam")
    damage(fam[target] if target in ("base", "merged") else fam["experts"][target])
    out = tmp_path / "out"
    rc, _, err = cli(calibrate_argv(fam, out), capsys)
    assert rc == 2
    assert re.search(message, one_line_error(err)), err
    assert not out.exists() and leftovers(tmp_path) == []


def test_calibrate_refuses_nan_in_an_expert_as_it_reads_it(clip, tmp_path, capsys):
    """Streamed experts are checked as each block is read (calibration/engine/prefetch.py), not scanned before any
    work (issue #40): the run stops with the one-line error naming the expert, its folder and the parameter,
    and writes nothing."""
    fam = copy_family(clip, tmp_path / "fam")
    _nan("encoder.layers.1.mlp.fc1.weight")(fam["experts"]["task1"])
    out = tmp_path / "out"
    rc, _, err = cli(calibrate_argv(fam, out), capsys)
    assert rc == 2
    assert re.search(r"expert 'task1' \(.*expert1\): parameter 'encoder.layers.1.mlp.fc1.weight' contains NaN or Inf "
                     r"\(2048 value\(s\)\)", one_line_error(err.strip().splitlines()[-1])), err  # after block 0's log
    assert not out.exists() and leftovers(tmp_path) == []


# --- calibration data ---------------------------------------------------------------------------------


def _empty_folder(fam, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    fam["data"]["task0"] = empty
    return ()


def _texts_for_an_image_model(fam, tmp_path):
    fam["data"]["task1"] = write_jsonl(tmp_path / "texts.jsonl", [{"text": s} for s in sentences(6)])
    return ()


def _too_few(fam, tmp_path):
    return ("--num-calibration-examples", "50")


def _wrong_image_size(fam, tmp_path):
    save_image_processor(fam["base"], size=24)  # the processor the data goes through makes 24x24 images
    return ()


def _data_without_expert(fam, tmp_path):
    fam["data"]["task9"] = fam["data"]["task0"]
    return ()


def _expert_without_data(fam, tmp_path):
    del fam["data"]["task1"]
    return ()


DATA_CASES = {
    "empty": (_empty_folder, r"task 'task0': calibration data .*empty \(image folder\) holds no examples"),
    "wrong modality": (_texts_for_an_image_model,
                       r"task 'task1': calibration data .*texts.jsonl \(jsonl\) holds texts, but the model in .* "
                       r"\(clip_vision_model\) takes images"),
    "smaller than asked": (_too_few, r"task 'task0': calibration data .* holds 4 examples, fewer than the 50 asked "
                                     r"for \(pass --allow-fewer"),
    "inputs the model cannot take": (_wrong_image_size, r"task 'task0': the image processor in .*base produces images "
                                                        r"of shape \(3, 24, 24\), but the model expects \(3, 16, 16\)"),
    "task in the data without an expert": (_data_without_expert,
                                           r"task\(s\) 'task9' have calibration data but no expert"),
    "expert without data": (_expert_without_data, r"task\(s\) 'task1' have an expert but no calibration data"),
}


@pytest.mark.parametrize("case", list(DATA_CASES))
def test_calibrate_refuses_unusable_data(clip, tmp_path, capsys, monkeypatch, case):
    make, message = DATA_CASES[case]
    fam = copy_family(clip, tmp_path / "fam")
    extra = make(fam, tmp_path)

    def boom(*a, **k):
        raise AssertionError("a model was loaded before the data was checked")

    monkeypatch.setattr(pipeline, "load_model", boom)
    out = tmp_path / "out"
    rc, _, err = cli(calibrate_argv(fam, out, *extra), capsys)
    assert rc == 2
    assert re.search(message, one_line_error(err)), err
    assert not out.exists() and leftovers(tmp_path) == []


def test_allow_fewer_uses_what_there_is_and_says_so(clip, tmp_path, capsys):
    out = tmp_path / "out"
    rc, _, err = cli(calibrate_argv(clip, out, "--num-calibration-examples", "50", "--allow-fewer"), capsys)
    assert rc == 0, err
    report = json.loads((out / "featcal.json").read_text())
    assert report["inputs"]["calibration"]["task0"]["examples"] == 4
    assert any("fewer than the 50 asked for" in w for w in report["warnings"])


def test_run_checks_the_calibration_before_merging(clip, tmp_path, capsys, no_merge_work):
    run = tmp_path / "run.yaml"
    run.write_text(yaml.safe_dump({
        "merge": {"base": str(clip["base"]), "experts": {t: str(p) for t, p in clip["experts"].items()}},
        "calibrate": {"calibration": {t: str(p) for t, p in clip["data"].items()},
                      "config": {"num_calibration_examples": 50}},
        "out": str(tmp_path / "out"),
    }))
    rc, _, err = cli(["run", run, "--no-progress"], capsys)
    assert rc == 2 and "fewer than the 50 asked for" in one_line_error(err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.yaml"]


# --- methods, options, hyperparameter ranges ----------------------------------------------------------

# every field of both schemas -> values that must be refused (the test below checks none is forgotten)
BAD_FEATCAL = {
    "lambda_ratio": [-0.01, math.inf, math.nan],
    "anchor_blend_rho": [-0.5, 10.5, math.nan, math.inf],
    "teacher_interp_alpha": [-0.1, 1.1, math.nan],
    "covariance_eps": [-1e-9, math.inf],
    "calibrate_bias": ["maybe"],
    "calibrate_layernorm": ["sometimes"],
    "num_calibration_examples": [0, -4, 2.5],
    "calibration_batch_size": [0, -1],
    "cls_token_weight": [-0.01, 1.5],
    "seed": [-1, MAX_SEED + 1],
    "chain_dtype": ["int8", "float64"],
    "spill_dir": [3.5],
    "device": ["tpu", "cuda0"],
    "resume": ["perhaps"],  # fields being added to the schema: cases ready before they land
    "resume_dir": [3.5],
    "offload_blocks": ["partly"],
    "checkpoint_every": [0, -2, 1.5, True],
    "text_column": ["", 3],
    "allow_test_split": ["sometimes"],
    "bias_solve": ["both", "Joint", 1],
    "block_statistics": ["forward", "Sequential", 1],
    "calibrate_final_norm": ["maybe"],
    "calibrate_stem_norm": ["maybe"],
    "tune": ["maybe"],
    "tune_budget": [2.9, 100.5, math.nan, math.inf, True],
    "tune_holdout": [0.0, 0.04, 0.51, math.nan],
    "tune_folds": [0, 11, 1.5, True, "two"],
    "tune_min_evidence": [-0.1, 10.5, math.nan, math.inf],
    "tune_screen": [0, 1, 1.5, True, "some", -4],
    "tune_scope": ["layer", "Block", 1],
    "tune_confirm": [-1, 11, 1.5, math.nan],
    "tune_cache_gb": [-0.5, 2000, math.nan, "big"],
    "tune_tiebreak": ["kl", 1],
    "tune_fixed": ["lambda", ["rho"], "auto,lambda_ratio", 3],
    "tune_head_pooling": ["cls", 1],
    "tune_next_token": ["sometimes"],
    "text_unit": ["sentence", "Line", 1],
    "data_format": ["csv", "images", 1],
    "pack_texts": ["sometimes", 2],
}
BAD_MERGE = {
    "method": ["nope", "TIES"],
    "scaling": [0.0, -0.3, 10.5, math.nan, math.inf, True],
    "density": [0.0, 1.01, math.nan],
    "drop_rate": [-0.1, 1.0, math.nan],
    "seed": [-1, MAX_SEED + 1, 0.5],
    "alpha": [-0.1, 1.1, math.nan],
    "steps": [-1, 2.5],
    "lr": [0.0, -1e-5, math.inf],
    "num_calibration_examples": [0, -4, 2.5],
    "calibration_batch_size": [0, -1],
    "text_column": ["", 3],
    "allow_test_split": ["sometimes"],
    "text_unit": ["sentence", "Line", 1],
    "data_format": ["csv", "images", 1],
    "pack_texts": ["sometimes", 2],
    "method_options": ["x", {"scaling_typo": 1}],  # the built-in methods take none
    "weights": [{"a": 100.5}, {"a": math.nan}, {"a": math.inf}, {"a": True}, [0.5]],
    "densities": [{"a": 0.0}, {"a": 1.01}, {"a": math.nan}],
    "drop_rates": [{"a": 1.0}, {"a": -0.1}],
    "normalize": ["maybe"],
    "ties_threshold": ["per_layer", 1],
    "dare_rescale": ["l2", True],
}


def test_every_field_has_range_cases():
    """A new schema field must come with the values it refuses."""
    assert set(FeatCalConfig.model_fields) <= set(BAD_FEATCAL)
    assert set(MergeConfig.model_fields) <= set(BAD_MERGE)


@pytest.mark.parametrize(("model", "field", "value"), [
    *[(FeatCalConfig, f, v) for f, vs in BAD_FEATCAL.items() if f in FeatCalConfig.model_fields for v in vs],
    *[(MergeConfig, f, v) for f, vs in BAD_MERGE.items() for v in vs],
])
def test_out_of_range_values_are_refused_naming_the_field(model, field, value):
    with pytest.raises(ConfigError, match=rf"invalid {model.__name__}: {field}: "):
        parse(model, {field: value})


@pytest.mark.parametrize(("model", "values"), [
    (FeatCalConfig, {"lambda_ratio": 0.0, "anchor_blend_rho": 0.0, "teacher_interp_alpha": 1.0, "covariance_eps": 0.0,
                     "cls_token_weight": 0.0, "seed": MAX_SEED, "num_calibration_examples": 1}),
    (FeatCalConfig, {"anchor_blend_rho": 10.0, "teacher_interp_alpha": 0.0, "cls_token_weight": 1.0}),
    (FeatCalConfig, {"tune": True, "tune_budget": 3.0, "tune_holdout": 0.05, "tune_min_evidence": 0.0, "tune_folds": 1}),
    (FeatCalConfig, {"tune_budget": 100.0, "tune_holdout": 0.5, "tune_min_evidence": 10.0}),
    (FeatCalConfig, {"tune": True, "tune_folds": 10}),
    (MergeConfig, {"scaling": 10.0, "density": 1.0, "drop_rate": 0.0, "seed": MAX_SEED}),
    (MergeConfig, {"alpha": 0.0, "steps": 0, "num_calibration_examples": 1, "calibration_batch_size": 1}),
    (MergeConfig, {"alpha": 1.0}),
])
def test_range_boundaries_are_accepted(model, values):
    assert parse(model, values).model_dump(include=set(values)) == values


def test_largest_seed_really_seeds():
    torch.Generator().manual_seed(MAX_SEED)  # what sample_indices and DARE call


@pytest.mark.parametrize(("flags", "message"), [
    (("--lambda-ratio", "inf"), "lambda_ratio: Input should be a finite number"),
    (("--anchor-blend-rho", "-1"), "anchor_blend_rho: Input should be greater than or equal to 0"),
    (("--teacher-interp-alpha", "nan"), "teacher_interp_alpha: Input should be a finite number"),
    (("--max-length", "0"), "max_length must be at least 1"),
])
def test_calibrate_cli_refuses_bad_values(clip, tmp_path, capsys, no_calibration_work, flags, message):
    rc, _, err = cli(calibrate_argv(clip, tmp_path / "out", *flags), capsys)
    assert rc == 2 and message in one_line_error(err)
    assert not (tmp_path / "out").exists()


def test_unusable_device_and_spill_dir_are_refused_before_work(clip, tmp_path, capsys, no_calibration_work,
                                                               monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    rc, _, err = cli(calibrate_argv(clip, tmp_path / "out", "--device", "cuda"), capsys)
    assert rc == 2 and "device 'cuda' requested but CUDA is not available" in one_line_error(err)
    (tmp_path / "afile").write_text("x")
    rc, _, err = cli(calibrate_argv(clip, tmp_path / "out", "--spill-dir", str(tmp_path / "afile")), capsys)
    assert rc == 2 and "spill_dir" in one_line_error(err) and "is not a directory" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("section", "mutate", "message"), [
    ("merge", {"method": "nope"}, "merge.method: Value error, unknown merge method 'nope'; valid methods: average, dare_ta"),
    ("merge", {"params": {"densty": 0.2}}, "invalid MergeConfig: densty: Extra inputs are not permitted"),
    ("merge", {"params": {"scaling": -1}}, "invalid MergeConfig: scaling: Input should be greater than 0"),
    ("calibrate", {"config": {"lamda_ratio": 0.1}}, "invalid FeatCalConfig: lamda_ratio: Extra inputs are not permitted"),
    ("calibrate", {"config": {"anchor_blend_rho": 11}}, "anchor_blend_rho: Input should be less than or equal to 10"),
    ("top", {"overwrite_all": True}, "overwrite_all: Extra inputs are not permitted"),
])
def test_run_file_refuses_unknown_methods_options_and_ranges(clip, tmp_path, capsys, no_merge_work, section, mutate,
                                                             message):
    doc = {
        "merge": {"base": str(clip["base"]), "experts": {t: str(p) for t, p in clip["experts"].items()}},
        "calibrate": {"calibration": {t: str(p) for t, p in clip["data"].items()}},
        "out": str(tmp_path / "out"),
    }
    (doc if section == "top" else doc[section]).update(mutate)
    run = tmp_path / "run.yaml"
    run.write_text(yaml.safe_dump(doc))
    rc, _, err = cli(["run", run, "--no-progress"], capsys)
    assert rc == 2 and message in one_line_error(err), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.yaml"]


def test_python_api_refuses_unknown_methods_and_options(bert, no_merge_work):
    with pytest.raises(ConfigError, match="unknown merge method 'nope'; valid methods: average, dare_ta"):
        merge(bert["base"], bert["experts"], "nope")
    with pytest.raises(ConfigError, match="densty: Extra inputs are not permitted"):
        merge(bert["base"], bert["experts"], "ties", densty=0.2)
    with pytest.raises(ConfigError, match="config must be a FeatCalConfig"):
        pipeline.check_options({"lambda_ratio": 0.1}, 128)


# --- mixed dtypes: bf16 experts of an fp32 base are handled ------------------------------------------


def _to_dtype(directory, dtype):
    rewrite(directory, lambda sd: sd.update({k: v.to(dtype) for k, v in sd.items() if v.is_floating_point()}))


def test_bf16_experts_of_an_fp32_base_merge_and_calibrate(clip, tmp_path, capsys):
    half = copy_family(clip, tmp_path / "bf16")
    for d in half["experts"].values():
        _to_dtype(d, torch.bfloat16)
    full = copy_family(half, tmp_path / "upcast")  # the same values, stored as fp32 (bf16 -> fp32 is exact)
    for d in full["experts"].values():
        _to_dtype(d, torch.float32)

    for fam in (half, full):
        rc, _, err = cli(merge_argv(fam["base"], fam["experts"], fam["base"].parent / "ta"), capsys)
        assert rc == 0, err
        fam["merged"] = fam["base"].parent / "ta"
    merged = load_file(half["merged"] / "model.safetensors")
    assert {v.dtype for v in merged.values() if v.is_floating_point()} == {torch.float32}  # the base's dtype
    assert weights_sha(half["merged"]) == weights_sha(full["merged"])

    for fam in (half, full):
        rc, _, err = cli(calibrate_argv(fam, fam["base"].parent / "cal"), capsys)
        assert rc == 0, err
    calibrated = load_file(half["base"].parent / "cal" / "model.safetensors")
    assert all(torch.isfinite(v).all() for v in calibrated.values())
    assert not torch.equal(calibrated["encoder.layers.0.mlp.fc1.weight"], merged["encoder.layers.0.mlp.fc1.weight"])
    assert weights_sha(half["base"].parent / "cal") == weights_sha(full["base"].parent / "cal")
