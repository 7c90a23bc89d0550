"""`featcal calibrate`: the round trip, schema-generated flags, and one-line errors."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
import transformers as T

from featcal.cli.calibrate_cmd import add_config_flags, config_from_args, drift_table, parse_pairs
from featcal.cli.main import main
from featcal.config import FeatCalConfig
from featcal.errors import ConfigError
from tests.builders.guarantees import calibrate_argv


def test_round_trip(clip, tmp_path, capsys):
    out = tmp_path / "out"
    code = main(calibrate_argv(clip, out, "--lambda-ratio", "0.1", "--no-calibrate-bias", "--chain-dtype", "bfloat16",
                      "--seed", "3"))
    assert code == 0
    printed = capsys.readouterr().out
    assert "drift before" in printed and "calibrated checkpoint" in printed
    assert [line.split()[0] for line in printed.splitlines() if "%" in line] == ["vision.0", "vision.1"]
    params = json.loads((out / "featcal.json").read_text())["params"]
    assert params["lambda_ratio"] == 0.1 and params["calibrate_bias"] is False
    assert params["chain_dtype"] == "bfloat16" and params["seed"] == 3
    assert params["anchor_blend_rho"] == 2.2  # untouched flags keep the schema's defaults
    calibrated = T.CLIPVisionModel.from_pretrained(out).state_dict()
    merged = T.CLIPVisionModel.from_pretrained(clip["merged"]).state_dict()
    assert any(not torch.equal(merged[k], calibrated[k]) for k in merged if k.endswith("fc2.weight"))
    assert all(torch.equal(merged[k], calibrated[k]) for k in merged if k.endswith("fc2.bias"))  # --no-calibrate-bias


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--lambda-ratio", "-1"], "invalid FeatCalConfig: lambda_ratio"),
        (["--device", "tpu"], "device must be cpu, cuda"),
        (["--expert", "oops"], "--expert expects NAME=VALUE, got 'oops'"),
        (["--expert", "task0=elsewhere"], "--expert 'task0' is given twice"),
        (["--calib", "task9=somewhere"], "'task9' have calibration data but no expert"),
    ],
)
def test_bad_input_is_one_line_exit_2(clip, tmp_path, capsys, extra, message):
    assert main(calibrate_argv(clip, tmp_path / "out", *extra)) == 2
    err = capsys.readouterr().err
    assert err.startswith("featcal: error: ") and message in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_existing_output_needs_overwrite(clip, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "x").write_text("x")
    (out / "featcal.json").write_text("{}")  # an earlier output: --overwrite replaces only those
    assert main(calibrate_argv(clip, out)) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert main(calibrate_argv(clip, out, "--overwrite")) == 0
    assert (out / "featcal.json").is_file() and not (out / "x").exists()


def test_every_schema_field_has_a_flag_and_defaults_round_trip():
    parser = argparse.ArgumentParser()
    add_config_flags(parser, FeatCalConfig)
    text = parser.format_help()
    for name in FeatCalConfig.model_fields:
        assert "--" + name.replace("_", "-") in text
    assert config_from_args(parser.parse_args([]), FeatCalConfig) == FeatCalConfig()
    cfg = config_from_args(parser.parse_args(["--spill-dir", "/tmp/x", "--no-calibrate-layernorm"]), FeatCalConfig)
    assert str(cfg.spill_dir) == "/tmp/x" and cfg.calibrate_layernorm is False
    with pytest.raises(SystemExit):  # argparse rejects a value outside a Literal's choices
        parser.parse_args(["--chain-dtype", "int8"])


def test_parse_pairs_and_drift_table():
    assert parse_pairs(["a=x", "b = y=z"], "--calib") == {"a": "x", "b": "y=z"}
    with pytest.raises(ConfigError, match="NAME=VALUE"):
        parse_pairs(["=x"], "--calib")
    table = drift_table([{"block": 0, "before": 2.0, "after": 0.5}, {"block": 1, "before": 0.0, "after": 0.0}])
    assert "-75.0%" in table and "n/a" in table
    rows = drift_table([{"block": 2, "stack": "decoder", "layer": 0, "before": 1.0, "after": 1.5}]).splitlines()
    assert rows[1].split() == ["decoder.0", "1", "1.5", "+50.0%"]
    assert drift_table(None) == "(no per-block drift recorded)"
