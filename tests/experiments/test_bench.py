"""`featcal bench` end to end on the tiny zoo: schema of bench.json, files, and that FeatCal helps."""

from __future__ import annotations

import json

import pytest

from featcal.cli.main import main
from featcal.errors import ConfigError
from featcal.experiments.bench.metrics import gap_closed, mean, normalised_accuracy
from featcal.experiments.bench.regime import regime
from featcal.experiments.bench.run import BenchSettings, run_bench, validate, write_bench
from featcal.experiments.bench.table import bench_table

ROW_KEYS = {"method", "calibrated", "average_accuracy", "per_task", "seconds", "peak_rss_mb"}


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    settings = BenchSettings(preset="tiny", seed=0, calib_sizes=(8, 64), methods=("task_arithmetic", "average"),
                             zoo_dir=root / "zoo")
    report = run_bench(settings, progress=False)
    out = write_bench(report, root / "out")
    return report, out


def test_bench_json_schema(bench):
    report, out = bench
    data = json.loads((out / "bench.json").read_text())
    assert 0.0 <= data["experts_average"] <= 1.0
    tasks = data["tasks"]
    assert len(tasks) == 4
    for row in data["rows"]:
        assert ROW_KEYS <= set(row), row
        assert isinstance(row["calibrated"], bool)
        assert 0.0 <= row["average_accuracy"] <= 1.0
        assert all(0.0 <= v <= 1.0 for v in row["per_task"].values())
        assert row["seconds"] >= 0 and row["peak_rss_mb"] > 0
    methods = [(r["method"], r["calibrated"], r.get("calibration_examples")) for r in data["rows"]]
    assert methods.count(("expert", False, None)) == 4
    assert ("base", False, None) in methods
    for m in ("task_arithmetic", "average"):
        assert (m, False, None) in methods and (m, True, 8) in methods and (m, True, 64) in methods
    experts = [r for r in data["rows"] if r["method"] == "expert"]
    assert data["experts_average"] == pytest.approx(sum(r["average_accuracy"] for r in experts) / 4)
    assert data["seed"] == 0 and "bench" in data["command"] and data["command_line"]
    assert (out / "drift.png").stat().st_size > 1000 and (out / "calib_sizes.png").stat().st_size > 1000
    assert "task_arithmetic + FeatCal (64/task)" in (out / "table.md").read_text()


def test_calibrated_rows_carry_drift_and_cost(bench):
    report, _ = bench
    cal = [r for r in report["rows"] if r["calibrated"]]
    for r in cal:
        assert r["cost_ratio"] == pytest.approx(r["calibration_seconds"] / r["forward_floor_seconds"], rel=0.05)
        assert len(r["engine_drift"]) == 2 and len(r["feature_drift"]) == 2  # the tiny encoder's two blocks
        assert r["engine_drift"][0]["after"] < r["engine_drift"][0]["before"]  # first block: drift reduced
    assert set(report["drift"]) == {"task_arithmetic", "average"}
    ta = report["drift"]["task_arithmetic"]
    assert [d["block"] for d in ta] == [0, 1] and ta[0]["after"] < ta[0]["before"]


def test_featcal_improves_the_tiny_merge(bench):
    report, _ = bench
    summary = report["summary"]["task_arithmetic"]
    # seeds 0, 1, 2 gain 1.4, 1.9 and 1.9 points at 64 examples per task (25–37 % of the gap)
    assert summary["calibrated_average"][64] >= summary["merge_average"] + 0.005, summary
    assert summary["gap_closed"][64] > 0.1
    assert 2.0 < report["summary"]["cost_ratio_arithmetic"] < 3.5  # the exact method vs the floor, counted


def test_regime_line_is_stored_for_a_vision_preset(bench):
    report, out = bench
    regime = json.loads((out / "bench.json").read_text())["regime"]
    ta = next(r for r in report["rows"] if r["method"] == "task_arithmetic" and not r["calibrated"])
    assert regime["task_arithmetic"] == pytest.approx(ta["average_accuracy"])
    assert regime["experts"] == pytest.approx(report["experts_average"])
    assert set(regime["merged_for_the_regime_only"]) == {"regmean", "wudi"}  # not benched, merged for the line
    assert regime["regmean_minus_ta"] == pytest.approx(regime["regmean"] - regime["task_arithmetic"])
    assert regime["line"].startswith("regime: base ") and "points vs TA" in regime["line"]
    assert regime["regmean_examples"] == 64 and "(64/task)" in regime["line"]  # RegMean on the largest size


def test_regime_verdict():
    real = regime(0.48, 0.68, 0.90, 0.82, 0.85, 0.3)
    assert real["real_fine_tune_regime"] and "NOT" not in real["line"]
    assert "RegMean +14.0, WUDI +17.0 points vs TA" in real["line"]
    synthetic = regime(0.483, 0.667, 0.929, 0.637, 0.52, 0.3)  # the default vision zoo's figures
    assert not synthetic["real_fine_tune_regime"] and synthetic["ordered"]
    assert "NOT in the regime of real fine-tunes: RegMean is not above TA; WUDI is not above TA" in synthetic["line"]
    assert "base < TA < experts does not hold" in regime(0.7, 0.6, 0.9, 0.8, 0.8, 0.3)["line"]
    named = regime(0.48, 0.68, 0.90, 0.82, 0.85, 0.3, regmean_examples=256)
    assert "RegMean +14.0 (256/task), WUDI +17.0 points vs TA" in named["line"] and named["regmean_examples"] == 256


def test_validate_rejects_bad_settings_before_work():
    with pytest.raises(ConfigError, match="calibration size 10000 is out of range"):
        validate(BenchSettings(preset="tiny", calib_sizes=(10000,)))
    with pytest.raises(ConfigError, match="unknown merge methods"):
        validate(BenchSettings(preset="tiny", calib_sizes=(8,), methods=("magic",)))
    with pytest.raises(ConfigError, match="--wudi-steps must be at least 0"):
        validate(BenchSettings(preset="tiny", calib_sizes=(8,), wudi_steps=-1))
    assert BenchSettings(preset="text").merge_params("wudi") == {"steps": 100}  # the preset's, unless overridden
    assert BenchSettings(preset="text", wudi_steps=7).merge_params("wudi") == {"steps": 7}


def test_cli_refuses_existing_output_before_work(tmp_path, capsys):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "x").write_text("keep me")
    code = main(["bench", "--preset", "tiny", "--out", str(tmp_path / "out"), "--zoo-dir", str(tmp_path / "zoo")])
    assert code == 2
    assert "not empty" in capsys.readouterr().err
    assert not (tmp_path / "zoo").exists()  # nothing was built
    assert main(["bench", "--preset", "tiny", "--calib-sizes", "4,x", "--out", str(tmp_path / "o2")]) == 2


def test_metrics():
    assert mean({"a": 0.5, "b": 1.0}) == 0.75
    assert normalised_accuracy({"a": 0.45, "b": 0.9}, {"a": 0.9, "b": 0.9}) == pytest.approx(0.75)
    assert gap_closed(0.8, 0.6, 1.0) == pytest.approx(0.5)
    assert gap_closed(0.8, 0.9, 0.9) is None
    assert gap_closed(0.95, 0.9, 0.85) is None  # experts below the merge: no gap, no share


def test_table_lists_every_model():
    report = {
        "tasks": ["a", "b"], "experts_average": 0.9,
        "rows": [
            {"method": "expert", "task": "a", "calibrated": False, "average_accuracy": 0.9, "per_task": {"a": 0.9},
             "seconds": 1.0, "peak_rss_mb": 10.0},
            {"method": "expert", "task": "b", "calibrated": False, "average_accuracy": 0.9, "per_task": {"b": 0.9},
             "seconds": 1.0, "peak_rss_mb": 10.0},
            {"method": "task_arithmetic", "calibrated": True, "calibration_examples": 8, "average_accuracy": 0.7,
             "per_task": {"a": 0.6, "b": 0.8}, "seconds": 2.0, "peak_rss_mb": 11.0, "gap_closed": 0.5,
             "normalised_accuracy": 0.78, "cost_ratio": 1.2},
        ],
    }
    text = bench_table(report)
    assert "| experts (each on its task) | 90.0 | 90.0 | 90.0 |" in text
    assert "| task_arithmetic + FeatCal (8/task) | 60.0 | 80.0 | 70.0 | 78.0 | 50.0 | 2.0 | 1.20 | 11 |" in text


def test_stale_zoo_cache_is_refused_with_the_bench_flag_and_rebuilt_on_request(tmp_path, capsys, monkeypatch):
    zoo = tmp_path / "zoo"
    zoo.mkdir()
    (zoo / "zoo.json").write_text(json.dumps({"fingerprint": "from-an-older-featcal"}))
    argv = ["bench", "--preset", "tiny", "--out", str(tmp_path / "out"), "--zoo-dir", str(zoo), "--no-progress"]
    assert main(argv) != 0
    err = capsys.readouterr().err
    assert "--rebuild-zoo" in err and "--overwrite to rebuild" not in err
    assert json.loads((zoo / "zoo.json").read_text())["fingerprint"] == "from-an-older-featcal"  # untouched

    import featcal.experiments.zoo.build as build

    seen = {}

    def fake_build(out, preset, seed, *, overwrite=False, **_):
        seen["overwrite"] = overwrite
        raise RuntimeError("stop after the call")

    monkeypatch.setattr(build, "build_zoo", fake_build)
    with pytest.raises(RuntimeError, match="stop after the call"):
        run_bench(BenchSettings(preset="tiny", calib_sizes=(8,), zoo_dir=zoo, rebuild_zoo=True), progress=False)
    assert seen == {"overwrite": True}
    other = tmp_path / "not-a-zoo"  # --rebuild-zoo never licenses replacing a directory that is no zoo
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    with pytest.raises(RuntimeError, match="stop after the call"):
        run_bench(BenchSettings(preset="tiny", calib_sizes=(8,), zoo_dir=other, rebuild_zoo=True), progress=False)
    assert seen == {"overwrite": False}


def test_a_cost_below_the_floor_is_printed_as_a_measurement_error():
    from featcal.experiments.bench.metrics import cost_ratio_text

    assert cost_ratio_text(2.56) == "2.56x"
    assert "MEASUREMENT ERROR" in cost_ratio_text(0.52) and cost_ratio_text(0.52).startswith("0.52x")
