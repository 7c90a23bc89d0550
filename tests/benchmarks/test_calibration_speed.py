"""benchmarks/calibration_speed.py without timing anything: a tiny --quick run goes through its three measured
paths (floor, featcal, the straightforward yardstick), each in its own process, and finds featcal's and the
straightforward implementation's parameters equal; a ratio below the floor is printed as a measurement error."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TINY = ["--hidden-size", "32", "--intermediate-size", "64", "--num-hidden-layers", "2", "--num-attention-heads", "4",
        "--image-size", "16", "--patch-size", "4"]


def _speed():
    if "calibration_speed" not in sys.modules:
        spec = importlib.util.spec_from_file_location("calibration_speed", REPO / "benchmarks" / "calibration_speed.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["calibration_speed"] = module
        spec.loader.exec_module(module)
    return sys.modules["calibration_speed"]


def test_quick_run_measures_three_paths_and_they_agree(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    cs = _speed()
    out = tmp_path / "speed.json"
    rc = cs.main(["--preset", "small", *TINY, "--tasks", "2", "--examples", "4", "--batch-size", "2", "--quick",
                  "--threads", "1", "--workdir", str(tmp_path / "work"), "--out", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["quick"] and r["repeats"] == 1 and r["examples_per_task"] == 4
    for key in ("floor", "calibrate", "straightforward"):
        assert len(r[key]["seconds_all"]) == 1 and r[key]["peak_rss_mb_median"] > 0
    assert r["ratio_to_straightforward"] > 0 and r["straightforward_ratio"] > 0
    sf = r["straightforward"]  # its models' loading is timed apart and added back for the like-for-like ratio
    assert sf["with_loading_seconds_median"] > sf["seconds_median"]
    assert r["ratio_to_straightforward_with_loading"] < r["ratio_to_straightforward"]
    eq = r["equality"]
    assert eq["equal"] and eq["max_abs_change"] > 1e-3 and eq["max_abs_diff"] < 1e-5
    table = capsys.readouterr().out
    assert "straightforward FeatCal" in table and "calibrate / straightforward" in table and "EQUAL" in table
    assert "calibrate / straightforward with its loading" in table
    assert "quick check" in table


def test_quick_defaults_and_skip():
    cs = _speed()
    a = cs.parse_args(["--quick"])
    assert (a.examples, a.repeats) == (8, 1)
    a = cs.parse_args(["--quick", "--examples", "32"])
    assert (a.examples, a.repeats) == (32, 1)
    a = cs.parse_args([])
    assert (a.examples, a.repeats, a.skip_straightforward) == (64, 3, False)


def test_ratios_below_the_floor_are_measurement_errors_not_results():
    cs = _speed()
    ratio, error = cs.ratio_to_floor(1.0, 2.0, "the straightforward FeatCal")
    assert ratio == 0.5 and "measurement error" in error and "straightforward" in error
    assert cs.ratio_to_floor(3.0, 2.0) == (1.5, None)
    run = {"seconds_median": 1.0, "seconds_all": [1.0], "peak_rss_mb_median": 500.0, "rss_after_load_mb_median": 400.0,
           "peak_device_mb_median": None}
    _, err = cs.ratio_to_floor(1.0, 2.0)
    result = {"command": "x", "model": {"model_type": "clip_vision_model", "parameters": 1e6, "blocks": 2},
              "tasks": 2, "examples_per_task": 4, "batch_size": 2, "threads": 1, "device": "cpu",
              "expert_source": "path", "repeats": 1, "floor": {**run, "seconds_median": 2.0}, "calibrate": run,
              "ratio": 0.5, "ratio_error": err, "straightforward": run, "straightforward_ratio": 0.5,
              "straightforward_ratio_error": error, "ratio_to_straightforward": 1.0}
    table = cs.markdown(result)
    assert table.count("MEASUREMENT ERROR") == 2 and "| 0.50 |" not in table


def test_device_warm_up_calls_run():
    """warm_device runs its calls only on CUDA; they are checked here on the CPU so that a GPU session does not
    find a typo first."""
    cs = _speed()
    cs.start_libraries("cpu")
    cs.warm_device("cpu")  # nothing to start on the CPU
