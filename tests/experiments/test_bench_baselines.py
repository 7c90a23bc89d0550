"""`featcal bench --baselines all` on the tiny zoo: one row per baseline, in the bench row interface."""

from __future__ import annotations

import json

import pytest

from featcal.cli.main import main
from featcal.errors import ConfigError
from featcal.experiments.bench.baselines import ALL_BASELINES, parse_baselines
from featcal.experiments.bench.run import BenchSettings, validate

ROW_KEYS = {"method", "calibrated", "baseline", "average_accuracy", "per_task", "seconds", "peak_rss_mb",
            "normalised_accuracy"}


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench_baselines")
    code = main(["bench", "--preset", "tiny", "--seed", "0", "--calib-sizes", "8,32", "--methods", "task_arithmetic",
                 "--baselines", "all", "--surgery-steps", "40", "--wudi-steps", "20", "--zoo-dir", str(root / "zoo"),
                 "--out", str(root / "out"), "--no-progress", "--threads", "1"])
    assert code == 0
    return json.loads((root / "out" / "bench.json").read_text()), (root / "out" / "table.md").read_text(), root


def test_one_row_per_baseline_with_the_row_interface(bench):
    data, *_ = bench
    rows = [r for r in data["rows"] if r.get("baseline")]
    assert [r["method"] for r in rows] == list(ALL_BASELINES)
    tasks = set(data["tasks"])
    for r in rows:
        assert ROW_KEYS <= set(r), r
        assert r["calibrated"] is False and r["baseline"] is True
        assert set(r["per_task"]) == tasks
        assert all(0.0 <= v <= 1.0 for v in r["per_task"].values())
        assert r["average_accuracy"] == pytest.approx(sum(r["per_task"].values()) / len(tasks))
        assert r["seconds"] > 0 and r["peak_rss_mb"] > 0
    by = {r["method"]: r for r in rows}
    for name in ("surgery", "probsurgery"):
        assert by[name]["merge"] == "task_arithmetic"
        assert by[name]["calibration_examples"] == 32  # the largest FeatCal size
        assert by[name]["params"]["recompute_features"] is True and "authors" in by[name]["note"]
        assert by[name]["params"]["steps"] == 40
        assert "gap_closed" in by[name]
    assert by["regmean"]["calibration_examples"] == 32 and "calibration_examples" not in by["wudi"]
    assert by["wudi"]["params"]["steps"] == 20
    assert data["params"]["baselines"] == list(ALL_BASELINES)


def test_surgery_changes_its_merge(bench):
    data, *_ = bench
    merge = next(r for r in data["rows"] if r["method"] == "task_arithmetic" and not r["calibrated"])
    surgery = next(r for r in data["rows"] if r["method"] == "surgery")
    assert surgery["per_task"] != merge["per_task"]
    assert surgery["average_accuracy"] != merge["average_accuracy"]


def test_table_shows_baselines(bench):
    _, table, _ = bench
    assert "| task_arithmetic + surgery (32/task, recomputed) |" in table
    assert "| task_arithmetic + probsurgery (32/task, recomputed) |" in table
    for name in ("regmean", "regmean++", "wudi"):
        assert f"| {name} (baseline) |" in table


def test_cached_surgery_features_give_the_recomputed_rows_accuracy(bench, capsys):
    """--surgery-features cached trains the same modules (to round-off), so the same predictions; labelled as such."""
    data, _, root = bench
    code = main(["bench", "--preset", "tiny", "--seed", "0", "--calib-sizes", "32", "--methods", "task_arithmetic",
                 "--baselines", "surgery,probsurgery", "--surgery-steps", "40", "--surgery-features", "cached",
                 "--zoo-dir", str(root / "zoo"), "--out", str(root / "cached"), "--no-progress", "--threads", "1"])
    assert code == 0
    assert "features cached: not the authors' cost" in capsys.readouterr().out
    cached = json.loads((root / "cached" / "bench.json").read_text())
    assert cached["params"]["surgery_features"] == "cached" and data["params"]["surgery_features"] == "recomputed"
    table = (root / "cached" / "table.md").read_text()
    for name in ("surgery", "probsurgery"):
        live = next(r for r in data["rows"] if r["method"] == name)
        once = next(r for r in cached["rows"] if r["method"] == name)
        assert "recompute_features" not in once["params"] and "computed once" in once["note"]
        assert once["per_task"] == live["per_task"]
        assert f"| task_arithmetic + {name} (32/task, cached features) |" in table


def test_bad_surgery_features_refused_before_work(tmp_path):
    with pytest.raises(ConfigError, match="--surgery-features"):
        validate(BenchSettings(preset="tiny", calib_sizes=(32,), baselines=("surgery",), surgery_features="live"))


def test_bad_baselines_refused_before_work(tmp_path):
    with pytest.raises(ConfigError, match="unknown baselines"):
        parse_baselines("surgery,magic")
    assert parse_baselines("") == () and parse_baselines("wudi,surgery") == ("surgery", "wudi")
    with pytest.raises(ConfigError, match="not in --baselines"):
        validate(BenchSettings(preset="tiny", calib_sizes=(8,), baselines=("wudi",),
                               baseline_params={"surgery": {"steps": 5}}))
    with pytest.raises(ConfigError):
        validate(BenchSettings(preset="tiny", calib_sizes=(8,), baselines=("surgery",),
                               baseline_params={"surgery": {"steps": 0}}))
    assert main(["bench", "--preset", "tiny", "--baselines", "magic", "--out", str(tmp_path / "o"),
                 "--zoo-dir", str(tmp_path / "zoo")]) == 2
    assert not (tmp_path / "zoo").exists()
