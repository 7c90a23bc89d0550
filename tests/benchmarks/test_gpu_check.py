"""benchmarks/gpu_check.sh (issue 19) without a GPU: its equality check as a CPU dry run on a tiny CLIP, its
report's refusal of a ratio below the floor, and its fail-fast preflight when CUDA is asked for and absent.

The GPU run itself is a command (docs/scaling.md, "GPU check"), not a test.
"""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[2]


def _gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "benchmarks" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_equality_dry_run_on_tiny_clip_goes_through_a_gloo_group(monkeypatch):
    from featcal.calibration.maths.distributed import RankGroup

    gc = _gpu_check()
    calls = []
    all_reduce = dist.all_reduce
    monkeypatch.setattr(dist, "all_reduce", lambda t, *a, **k: calls.append(t.numel()) or all_reduce(t, *a, **k))
    active = RankGroup.active
    r = gc.equality("cpu", "gloo", size="tiny", tasks=2, examples=8, batch_size=4)
    assert r["backend"] == "gloo" and r["offload_blocks"] and r["collectives_forced"]
    assert r["max_abs_diff"] == 0.0 and r["max_rel_diff"] == 0.0  # on the CPU the two paths are bit-identical
    assert r["changed_by_calibration"] > 100 * r["rel_bound"] and r["equal"]  # the check is not vacuous
    assert calls and max(calls) > 1  # featcal's statistics went through the one-rank group's all-reduce
    assert not dist.is_initialized() and RankGroup.active is active  # the group is torn down, the patch undone


def test_a_ratio_below_the_floor_is_a_measurement_error_not_a_result():
    gc = _gpu_check()
    run = lambda s: {"seconds_median": s, "peak_rss_mb_median": 600.0, "peak_device_mb_median": None}  # noqa: E731
    speed = {"model": {"model_type": "clip_vision_model", "parameters": 3e6, "blocks": 4}, "tasks": 8,
             "examples_per_task": 256, "batch_size": 32, "device": "cpu", "repeats": 1,
             "floor": run(2.0), "calibrate": run(1.0)}
    figures, table = gc.report_table(speed, None, None)
    assert figures["ratio"] is None and "measurement error" in figures["ratio_error"]
    assert "MEASUREMENT ERROR" in table and "0.50x" not in table
    figures, table = gc.report_table({**speed, "calibrate": run(5.0)}, None, None)
    assert figures["ratio"] == 2.5 and figures["ratio_error"] is None and "2.50x" in table


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the failure without CUDA")
def test_script_fails_fast_when_cuda_is_asked_for_and_absent(tmp_path):
    env = {**os.environ, "GPU_CHECK_DEVICE": "cuda", "GPU_CHECK_OUT": str(tmp_path), "GPU_CHECK_THREADS": "1",
           "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_check.sh")], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "--device cuda asked for, but torch.cuda.is_available() is False" in proc.stderr
    assert "== equality" not in proc.stdout  # nothing after the preflight ran
