"""`featcal bench --featcal-variants` (issue 17): a calibrated row per variant beside the reference's, the
reference rows as they were, and an unknown variant refused before any work."""

from __future__ import annotations

import json

import pytest

from featcal.cli.main import main
from featcal.errors import ConfigError
from featcal.experiments.bench.run import FEATCAL_VARIANTS, BenchSettings, run_bench, validate, write_bench

ALL = ("reference", "joint_bias", "final_norm", "sequential", "tuned", "blockwise")
TIMING = {"seconds", "peak_rss_mb", "calibration_seconds", "forward_floor_seconds", "cost_ratio"}


def _stable(row: dict) -> dict:
    """A row without what the clock and the allocator decide."""
    return {k: v for k, v in row.items() if k not in TIMING}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench-variants")
    common = dict(preset="tiny", seed=0, calib_sizes=(16,), methods=("task_arithmetic",), zoo_dir=root / "zoo")
    plain = run_bench(BenchSettings(**common), progress=False)
    every = run_bench(BenchSettings(**common, featcal_variants=ALL), progress=False)
    return plain, every, write_bench(every, root / "out"), root


def test_every_variant_has_a_row_beside_the_reference(runs):
    _, every, out, _ = runs
    data = json.loads((out / "bench.json").read_text())
    cal = [r for r in data["rows"] if r["calibrated"]]
    assert [r["variant"] for r in cal] == list(ALL)
    assert all("variant" not in r for r in data["rows"] if not r["calibrated"])
    by = {r["variant"]: r for r in cal}
    assert by["final_norm"]["final_norm"]["calibrated"] and by["final_norm"]["final_norm"]["module"] == "post_layernorm"
    assert {"anchor_blend_rho", "lambda_ratio", "teacher_interp_alpha", "merge_scaling"} <= set(
        by["tuned"]["tuning_chosen"])
    tuned = by["tuned"]  # the whole search is kept, so a choice can be studied without rerunning it
    assert tuned["tuning_min_evidence"] == 0.0 and tuned["tuning_candidates"][0]["index"] == 0
    assert tuned["tuning_chosen"]["index"] < len(tuned["tuning_candidates"])
    compared = {c["candidate"] for c in tuned["tuning_comparisons"]}  # every candidate after the start was compared
    assert compared == set(range(1, len(tuned["tuning_candidates"])))
    assert by["joint_bias"]["per_task"] != by["reference"]["per_task"] or \
        by["joint_bias"]["engine_drift"] != by["reference"]["engine_drift"]  # the variant did change something
    assert by["sequential"]["engine_drift"] != by["reference"]["engine_drift"]
    blocks = by["blockwise"]["tuning_blocks"]  # each block's choice, scored on held-out examples
    assert len(blocks) == len(by["blockwise"]["engine_drift"])
    assert all(b["held_out_drift"] <= b["start_drift"] for b in blocks)
    assert data["params"]["featcal_variants"] == list(ALL)
    summary = data["summary"]["task_arithmetic"]
    assert set(summary["variants"]) == set(ALL)
    assert summary["gap_closed"] == summary["variants"]["reference"]["gap_closed"]  # the first variant's
    table = (out / "table.md").read_text()
    assert "| task_arithmetic + FeatCal (16/task) |" in table
    for v in ALL[1:]:
        assert f"| task_arithmetic + FeatCal [{v}] (16/task) |" in table


def test_reference_rows_are_todays(runs):
    plain, every, _, _ = runs
    assert [r["variant"] for r in plain["rows"] if r["calibrated"]] == ["reference"]
    want = [_stable(r) for r in plain["rows"]]
    got = [_stable(r) for r in every["rows"] if not r["calibrated"] or r["variant"] == "reference"]
    assert got == want
    assert every["drift"] == plain["drift"]  # the first variant's curve: the reference's
    strip = {"cost_ratio", "variants"}
    assert {k: v for k, v in every["summary"]["task_arithmetic"].items() if k not in strip} == \
        {k: v for k, v in plain["summary"]["task_arithmetic"].items() if k not in strip}


def test_cli_prints_each_variants_gap(runs, capsys):
    *_, root = runs
    argv = ["bench", "--preset", "tiny", "--zoo-dir", str(root / "zoo"), "--calib-sizes", "8", "--methods",
            "task_arithmetic", "--featcal-variants", "reference,joint_bias", "--out", str(root / "cli"),
            "--no-progress", "--base-cache", ""]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "task_arithmetic: gap to experts closed by FeatCal (8/task): " in text
    assert "task_arithmetic: gap to experts closed by FeatCal [joint_bias] (8/task): " in text


@pytest.mark.parametrize(("variants", "message"), [
    (("reference", "magic"), r"unknown FeatCal variants \['magic'\]; choose from reference, joint_bias"),
    ((), "no FeatCal variant given"),
    (("tuned", "tuned"), "FeatCal variants given twice: tuned"),
    (("reference", "tuned+magic"), r"unknown FeatCal variants \['magic'\] in 'tuned\+magic'"),
    (("sequential+sequential_one_pass",), "two of its parts set block_statistics"),
    (("tuned+tuned_soft",), "two of its parts set tune"),
    (("reference+joint_bias",), "'reference' is the configured method and cannot be combined"),
    (("joint_bias+joint_bias",), "names one variant twice"),
    (("fixed_lambda",), "fixed_lambda or scaling_only changes how a tuned variant searches; combine it with one"),
    (("cross_fit",), "cross_fit or one_split changes how a tuned variant searches; combine it with one"),
    (("one_split+joint_bias",), "cross_fit or one_split changes how a tuned variant searches; combine it with one"),
    (("tuned+cross_fit+one_split",), "two of its parts set tune_folds"),
    (("screened",), "screened or screened16 changes how a tuned variant searches; combine it with one"),
])
def test_bad_variants_are_refused_before_any_work(variants, message, tmp_path, capsys):
    with pytest.raises(ConfigError, match=message):
        validate(BenchSettings(preset="tiny", calib_sizes=(8,), zoo_dir=tmp_path / "zoo", featcal_variants=variants))
    if variants:
        argv = ["bench", "--preset", "tiny", "--zoo-dir", str(tmp_path / "zoo"), "--out", str(tmp_path / "out"),
                "--featcal-variants", ",".join(variants), "--no-progress", "--base-cache", ""]
        assert main(argv) == 2
        assert "FeatCal variant" in capsys.readouterr().err
        assert not (tmp_path / "out").exists() and not (tmp_path / "zoo").exists()


def test_variants_are_valid_configs():
    from featcal.config import FeatCalConfig, parse

    for changes in FEATCAL_VARIANTS.values():
        parse(FeatCalConfig, changes)


def test_a_combination_takes_every_parts_options():
    from featcal.experiments.bench.run import variant_options

    assert variant_options("tuned+sequential_one_pass") == {"tune": True, "block_statistics": "sequential_one_pass"}
    assert variant_options(" joint_bias + final_norm ") == {"bias_solve": "joint", "calibrate_final_norm": True}
    assert variant_options("reference") == {}
    assert variant_options("tuned_soft+fixed_lambda") == {"tune": True, "tune_tiebreak": "soft",
                                                          "tune_fixed": ("lambda_ratio",)}


def test_a_combined_row_is_both_variants(runs):
    """joint_bias+final_norm: the final norm's record, and parameters neither part gives alone."""
    *_, root = runs
    got = run_bench(BenchSettings(preset="tiny", seed=0, calib_sizes=(8,), methods=("task_arithmetic",),
                                  zoo_dir=root / "zoo", featcal_variants=("final_norm", "joint_bias",
                                                                         "joint_bias+final_norm")), progress=False)
    by = {r["variant"]: r for r in got["rows"] if r["calibrated"]}
    both = by["joint_bias+final_norm"]
    assert both["final_norm"]["calibrated"] and both["final_norm"]["module"] == "post_layernorm"
    assert both["final_norm"] != by["final_norm"]["final_norm"]  # solved on the joint solve's chains
    assert both["engine_drift"] == by["joint_bias"]["engine_drift"]  # the blocks are the joint solve's
    assert "joint_bias+final_norm" in got["summary"]["task_arithmetic"]["variants"]
