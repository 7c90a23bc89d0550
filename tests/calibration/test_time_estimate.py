"""`featcal plan`'s time: a short measured probe of this machine (calibration/planning/time_estimate.py) or the stated
throughput (calibration/planning/cost.py), and which one the estimate used."""

from __future__ import annotations

import pytest

from featcal.calibration.planning import cost, time_estimate
from featcal.calibration.planning.planner import BlockShape, ModelShape, StackShape
from featcal.config import FeatCalConfig
from tests.builders.guarantees import cli, one_line_error, plan_argv
from tests.builders.pipeline_family import bert_family


def _shape(width_in: int, width_out: int, tokens: int = 8) -> ModelShape:
    block = BlockShape((("mlp.up", width_in, width_out), ("mlp.down", width_out, width_in)), (width_in,), 0)
    return ModelShape(0, (StackShape("encoder", (block,), width_in, 1, tokens, 0),), 0)


def test_the_probe_times_the_runs_largest_linear_and_counts_its_flops(monkeypatch):
    ticks = iter(range(1, 10_000))
    monkeypatch.setattr(time_estimate.time, "perf_counter", lambda: next(ticks) * 0.1)  # 0.1 s per reading
    config = FeatCalConfig(calibration_batch_size=4)
    p = time_estimate.probe(_shape(24, 40), config, seconds=0.5)
    # the wider product per token is 24·40 (= 40·24); 4 examples × 8 tokens a batch; 3 readings reach 0.25 s
    assert (p.rows, p.width_in * p.width_out, p.device, p.threads > 0) == (32, 960, "cpu", True)
    assert p.f32 == pytest.approx(2 * 32 * 24 * 40 * 3 / 0.3)
    i, o = p.width_in, p.width_out
    assert p.f64 == pytest.approx(2 * (2 * i * i * o + i**3 / 6) * 3 / 0.3)
    assert p.seconds == pytest.approx(0.6)


def test_a_wide_model_is_probed_at_the_cap_quickly():
    p = time_estimate.probe(_shape(14336, 4096, tokens=512), FeatCalConfig(), seconds=0.05)
    assert (p.rows, p.width_in, p.width_out) == (time_estimate.PROBE_ROWS_CAP, 2048, 2048)
    assert p.f32 > 1e6 and p.f64 > 1e6


def test_measured_throughput_keeps_the_stated_reads_and_says_so():
    stated = cost.throughput_for("cpu")
    p = time_estimate.Probe(32, 24, 40, "cpu", 2, 0.5, 3e9, 1e9)
    tp = time_estimate.measured_throughput(p, stated)
    assert (tp.f32, tp.f64, tp.read, tp.source, tp.name) == (3e9, 1e9, stated.read, "measured", "this machine")
    assert "(32×24)·(24×40)" in tp.note and "2 thread(s)" in tp.note


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    return bert_family(tmp_path_factory.mktemp("plan-time"))


def test_plan_prints_the_time_and_which_source_it_came_from(family, tmp_path, capsys):
    rc, out, err = cli(plan_argv(family, tmp_path / "a"), capsys)
    assert rc == 0, err
    assert "estimated time at measured throughput 'this machine' (a " in out and "probe here just now" in out
    assert "total ≈" in out
    rc, out, _ = cli(plan_argv(family, tmp_path / "a", "--time-from", "stated"), capsys)
    assert rc == 0 and "estimated time at stated throughput 'cpu'" in out and "probe" not in out
    rc, out, _ = cli(plan_argv(family, tmp_path / "a", "--flops", "1e9"), capsys)  # stated rates: no probe
    assert rc == 0 and "estimated time at stated throughput" in out and "rates overridden" in out


def test_a_probe_that_cannot_be_made_is_refused(family, tmp_path, capsys):
    import torch

    rc, _, err = cli(plan_argv(family, tmp_path / "b", "--time-from", "probe", "--flops", "1e9"), capsys)
    assert rc == 2 and "--time-from probe measures the rates that --flops state" in one_line_error(err)
    rc, out, err = cli(plan_argv(family, tmp_path / "b", "--time-from", "probe", "--device", "cuda"), capsys)
    if torch.cuda.is_available():  # a GPU here: it is what the probe measures
        assert rc == 0 and "measured throughput" in out and "on cuda" in out
    else:
        assert rc == 2 and "device cuda is not on this machine to be measured" in one_line_error(err)
