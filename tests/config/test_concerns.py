"""featcal.config cut by concern (issue #35): FeatCalConfig is five concern models, its options are taken flat (as
every release took them) or by section, and stored flat; one strictness base for every option model; one
max_length default; every command's option flags generated from the schemas and grouped by concern."""

from __future__ import annotations

import argparse
import inspect
import math

import pytest
import yaml

from featcal.cli.calibrate_args import add_arguments, config_from_args
from featcal.cli.main import build_parser
from featcal.config import (
    DEFAULT_MAX_LENGTH,
    SECTIONS,
    DataOptions,
    ExecutionOptions,
    FeatCalConfig,
    MergeConfig,
    ResumeOptions,
    RunOptions,
    SolveOptions,
    StrictModel,
    TuneOptions,
    load_run_file,
    parse,
)
from featcal.errors import ConfigError

# FeatCalConfig's keywords before the cut (featcal 0.1 to #34): each must still be one, with its old default
OLD_DEFAULTS = {
    "lambda_ratio": 0.05, "anchor_blend_rho": 2.2, "teacher_interp_alpha": 0.25, "covariance_eps": 1e-8,
    "calibrate_bias": True, "calibrate_layernorm": True, "num_calibration_examples": 256, "calibration_batch_size": 16,
    "cls_token_weight": 0.01, "seed": 0, "chain_dtype": "float32", "spill_dir": None, "device": "cpu",
    "offload_blocks": False, "resume": True, "checkpoint_every": 1, "resume_dir": None, "text_column": None,
    "allow_test_split": False, "text_unit": None, "data_format": None, "pack_texts": None, "bias_solve": "sequential",
    "block_statistics": "as_merged", "calibrate_final_norm": False, "calibrate_stem_norm": False, "tune": False,
    "tune_budget": 10.0, "tune_holdout": 0.25, "tune_folds": "auto", "tune_min_evidence": 0.0, "tune_tiebreak": "drift",
    "tune_fixed": (), "tune_head_pooling": "auto",
}
# keywords added since the cut, with their defaults
NEW_DEFAULTS = {"tune_next_token": True, "tune_screen": "off", "tune_confirm": 2, "tune_scope": "model",
                "tune_cache_gb": 2.0}


def test_every_old_keyword_is_still_an_option_with_its_old_default():
    everything = {**OLD_DEFAULTS, **NEW_DEFAULTS}
    assert FeatCalConfig().model_dump() == everything  # stored and written flat, as before: reports unchanged
    sections = [set(model.model_fields) for model in SECTIONS.values()]
    assert set().union(*sections) == set(everything) and sum(map(len, sections)) == len(everything)


def test_flat_keywords_and_sections_give_the_same_config():
    flat = FeatCalConfig(lambda_ratio=0.1, num_calibration_examples=8, device="cpu", resume=False, tune=True,
                         tune_budget=5.0)
    nested = FeatCalConfig(solve={"lambda_ratio": 0.1}, data=DataOptions(num_calibration_examples=8),
                           execution={"device": "cpu"}, resume={"resume": False},
                           tune={"tune": True, "tune_budget": 5.0})
    assert nested == flat and nested.model_fields_set == flat.model_fields_set
    assert flat.tune_options == TuneOptions(tune=True, tune_budget=5.0)
    assert flat.solve_options.lambda_ratio == 0.1 and isinstance(flat.solve_options, SolveOptions)
    assert flat.resume_options == ResumeOptions(resume=False)
    assert flat.execution_options == ExecutionOptions()
    assert flat.data_options.num_calibration_examples == 8
    with pytest.raises(ConfigError, match="lambda_ratio is given both in the solve section and on its own"):
        parse(FeatCalConfig, {"lambda_ratio": 0.1, "solve": {"lambda_ratio": 0.2}})
    with pytest.raises(ConfigError, match=r"tune.lambda_ratio: not an option of the tune section"):
        parse(FeatCalConfig, {"tune": {"lambda_ratio": 0.1}})
    with pytest.raises(ConfigError, match="tune_holdout 0.3 and tune_folds 2 are alternatives"):
        parse(FeatCalConfig, {"tune": {"tune_holdout": 0.3, "tune_folds": 2}})  # a section's own validator


def test_an_old_run_file_parses_to_the_same_values(tmp_path):
    """A run file written for the flat schema (calibrate.config's flat keys, run options at the top) reads the
    same values as one written by section."""
    old = {"merge": {"base": "b", "experts": {"a": "x", "b": {"path": "y", "weight": 0.5}}, "method": "ties",
                     "params": {"density": 0.3, "num_calibration_examples": 64}},
           "calibrate": {"calibration": {"a": "d1", "b": "d2"},
                         "config": {"lambda_ratio": 0.1, "tune": True, "tune_folds": 2, "spill_dir": "s"}},
           "out": "o", "overwrite": True, "max_length": 64, "allow_fewer": True, "dtype": "bfloat16"}
    new = {**old, "calibrate": {**old["calibrate"], "config": {
        "solve": {"lambda_ratio": 0.1}, "tune": {"tune": True, "tune_folds": 2}, "execution": {"spill_dir": "s"}}}}
    runs = []
    for name, data in (("old", old), ("new", new)):
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(data))
        runs.append(load_run_file(tmp_path / f"{name}.yaml"))
    assert runs[0].calibrate.featcal_config() == runs[1].calibrate.featcal_config()
    config = runs[0].calibrate.featcal_config()
    assert (config.lambda_ratio, config.tune, config.tune_folds, str(config.spill_dir)) == (0.1, True, 2, "s")
    merge = runs[0].merge.merge_config()
    assert (merge.method, merge.density, merge.num_calibration_examples, merge.weights) == ("ties", 0.3, 64, {"b": 0.5})
    assert runs[0].run_options() == RunOptions(overwrite=True, max_length=64, allow_fewer=True)
    assert runs[0].output_options().dtype == "bfloat16"


def _models_with_numbers():
    from featcal.config import method_spec
    from featcal.evaluation.options import EvalOptions
    from featcal.experiments.baselines.params import ProbSurgeryParams, SurgeryParams
    from featcal.experiments.reproduce.options import ReproduceOptions

    return [(FeatCalConfig, {}, "lambda_ratio"), (MergeConfig, {}, "scaling"), (RunOptions, {}, "max_length"),
            (method_spec("wudi").params, {}, "lr"), (method_spec("regmean").params, {}, "alpha"),
            (SurgeryParams, {}, "lr"), (ProbSurgeryParams, {}, "kl_weight"), (EvalOptions, {}, "batch_size"),
            (ReproduceOptions, {"setting": "s", "out": "o"}, "scaling")]


@pytest.mark.parametrize(("model", "required", "field"), _models_with_numbers())
def test_one_strictness_rule_for_every_option_model(model, required, field):
    """No inf / NaN, no boolean for a number, no unknown key: the same for every option model (there were three
    bases, the parameter models of the baselines and of RegMean / WUDI accepting inf)."""
    assert issubclass(model, StrictModel)
    for bad in (math.inf, math.nan, True):
        with pytest.raises(ConfigError):
            parse(model, {**required, field: bad})
    with pytest.raises(ConfigError, match="Extra inputs are not permitted"):
        parse(model, {**required, "no_such_option": 1})


def test_one_max_length_default():
    from featcal.calibration.front.api import calibrate
    from featcal.calibration.front.pipeline import CalibrateRequest
    from featcal.merging.api import MergeRequest, merge

    assert RunOptions().max_length == DEFAULT_MAX_LENGTH
    for fn in (merge, calibrate):
        assert inspect.signature(fn).parameters["max_length"].default == DEFAULT_MAX_LENGTH, fn.__name__
    for request in (CalibrateRequest(None, "b", {}, {}, "o"), MergeRequest("b", {}, MergeConfig())):  # RunOptions' default
        assert request.options.max_length == DEFAULT_MAX_LENGTH, type(request).__name__
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--base", "b", "--merged", "m", "--expert", "a=x", "--calib", "a=d", "--out", "o"])
    from featcal.cli.calibrate_args import run_options_from_args

    assert run_options_from_args(args).max_length == DEFAULT_MAX_LENGTH


def _groups(command: str) -> dict[str, list[str]]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    return {g.title: [o for a in g._group_actions for o in a.option_strings] for g in sub._action_groups}


def test_every_commands_flags_come_from_the_schemas_grouped_by_concern():
    calibrate = _groups("calibrate")
    for name, model in SECTIONS.items():
        title = model.concern
        assert title in calibrate, name
        for field in model.model_fields:
            assert "--" + field.replace("_", "-") in calibrate[title], (name, field)
    assert {"--overwrite", "--allow-pickle", "--max-length", "--allow-fewer", "--expert-kind"} <= set(
        calibrate[RunOptions.concern])
    merge = _groups("merge")
    assert {"--method", "--scaling", "--weight", "--expert-density", "--expert-drop-rate"} <= set(
        merge[MergeConfig.concern])
    assert "--num-calibration-examples" in merge["calibration data of regmean, regmean++ (docs/data.md)"]
    assert {"--dtype", "--tokenizer-source"} <= set(merge["the written checkpoint"])
    assert "--num-calibration-examples" in _groups("reproduce")["reproduce options"]


def test_flags_round_trip_through_the_schema():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    base = ["--base", "b", "--merged", "m", "--expert", "a=x", "--calib", "a=d", "--out", "o"]
    config = config_from_args(parser.parse_args([*base, "--lambda-ratio", "0.1", "--tune", "--tune-folds", "2"]),
                              FeatCalConfig)
    assert config == FeatCalConfig(lambda_ratio=0.1, tune=True, tune_folds=2)
    with pytest.raises(ConfigError, match="tune_budget given without tune"):
        config_from_args(parser.parse_args([*base, "--tune-budget", "5"]), FeatCalConfig)
