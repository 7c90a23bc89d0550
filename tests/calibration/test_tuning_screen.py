"""`tune_screen` (issue 50): the search's candidates fitted on part of the fit data, the best few confirmed on all
of it. It must choose what the full search chooses, see only calibration data, refit bit for bit as a plain
calibration, and reuse nothing computed for another starting merge."""

from __future__ import annotations

import copy

import pytest
import torch

from featcal import FeatCalConfig, calibrate
from featcal.calibration import tuning
from featcal.calibration.core import setting as core
from featcal.calibration.tuning.split import resolve_screen, screen_split, split_calibration
from tests.builders.reference_featcal import family_data, max_abs_diff, noisy_family, ta_merge

KNOBS = ("anchor_blend_rho", "lambda_ratio", "teacher_interp_alpha", "merge_scaling")


def _family(kind: str, n_batches: int = 8, scaling: float = 0.05):
    base, experts, _ = noisy_family(kind, n_experts=2)
    return base, experts, ta_merge(base, experts, scaling), family_data(kind, experts, n_batches=n_batches)


def _setting(candidate) -> dict:
    return {k: candidate[k] for k in KNOBS}


@pytest.fixture(scope="module")
def clip():
    return _family("clip")


def test_screen_split_takes_whole_fit_batches_and_keeps_the_held_out_part(clip):
    _, _, _, data = clip
    split = split_calibration(data, 0.25, seed=0)
    screened = screen_split(split, 4, seed=0)
    for t in data:
        assert screened.held[t] is split.held[t]
        fit_ids = [id(b) for b in split.fit[t]]
        assert all(id(b) in fit_ids for b in screened.fit[t])  # whole batches of the fit part, nothing else
        held = sum(len(b["pixel_values"]) for b in screened.fit[t])
        assert 4 <= held < sum(len(b["pixel_values"]) for b in split.fit[t])
        assert screened.record[t]["screen_fit"] == held
    again = screen_split(split, 4, seed=0)
    assert all(a["screen_batches"] == b["screen_batches"] for a, b in zip(screened.record.values(),
                                                                           again.record.values(), strict=True))


def test_auto_screens_large_fit_parts_only(clip):
    _, _, _, data = clip
    small = [split_calibration(data, 0.25, seed=0)]  # 12 fit examples per task
    assert resolve_screen("auto", small)[0] is None
    assert resolve_screen("off", small)[0] is None
    assert resolve_screen(4, small)[0] == 4
    assert resolve_screen(64, small)[0] is None  # not smaller than the fit part: nothing to screen
    big = {t: b * 6 for t, b in data.items()}  # 96 examples per task, 72 to fit
    assert resolve_screen("auto", [split_calibration(big, 0.25, seed=0)])[0] == tuning.split.AUTO_SCREEN_EXAMPLES
    with pytest.raises(ValueError, match="at least 2"):
        FeatCalConfig(tune=True, tune_screen=1)


def test_screened_candidates_see_screen_batches_confirmed_ones_the_fit_part_and_the_refit_all(clip, monkeypatch):
    base, experts, merged, data = clip
    one_setting = core.calibrate_setting
    calls: list[dict] = []

    def recording(*args, **kwargs):
        calls.append({"data": kwargs["calibration"], "config": kwargs["config"]})
        return one_setting(*args, **kwargs)

    monkeypatch.setattr(core, "calibrate_setting", recording)
    cfg = FeatCalConfig(tune=True, tune_budget=6.0, tune_folds=1, tune_screen=4, tune_confirm=2)
    result = calibrate(merged, base=base, experts=experts, calibration=data, config=cfg, progress=False,
                       merge_scaling=0.05)
    rec = result.tuning.as_dict()
    *search, refit = calls
    stages = [c["stage"] for c in rec["candidates"]]
    assert len(search) == len(stages) and stages.index("full") == rec["screen"]["screened"] >= 2
    assert set(stages[stages.index("full"):]) == {"full"} and 2 <= len(rec["screen"]["confirmed"]) <= 3
    first_full = rec["candidates"][stages.index("full")]
    assert _setting(first_full) == _setting(rec["candidates"][0])  # the configured setting is always confirmed
    for t in data:
        n_fit = rec["split"][t]["fit"]
        for call, stage in zip(search, stages, strict=True):
            rows = sum(len(b["pixel_values"]) for b in call["data"][t])
            assert rows == (rec["screen"]["fit"][t] if stage == "screen" else n_fit)
        assert sum(len(b["pixel_values"]) for b in refit["data"][t]) == sum(len(b["pixel_values"]) for b in data[t])
    chosen = rec["chosen"]
    assert chosen["stage"] == "full" and chosen["index"] in rec["screen"]["confirmed"]
    # the choice never scores worse than the configured setting on the held-out part, at the same size
    assert chosen["drift"] <= first_full["drift"]
    # the refit is a plain calibration of the chosen setting on all data, bit for bit
    start = ta_merge(base, experts, chosen["merge_scaling"])
    plain = calibrate(start, base=base, experts=experts, calibration=data, progress=False, config=FeatCalConfig(
        **{k: chosen[k] for k in KNOBS if k != "merge_scaling"})).model
    assert max_abs_diff(result.model, plain)[0] < 1e-5  # the rescaled merge equals TA at that scaling to round-off
    assert "screened on 4 examples per task" in tuning.summary_line(rec)


@pytest.mark.parametrize("kind", ["clip", "llama", "bert"])
def test_the_screened_search_chooses_what_the_full_search_chooses(kind):
    """On each tiny family, at a size where the screen fits a third of the fit part, the two searches end on the
    same setting."""
    base, experts, merged, data = _family(kind, n_batches=12)
    common = dict(tune=True, tune_budget=6.0, tune_folds=1, **({"tune_next_token": False} if kind == "llama" else {}))
    full = calibrate(merged, base=base, experts=experts, calibration=data, progress=False, merge_scaling=0.05,
                     config=FeatCalConfig(**common, tune_screen="off")).tuning.as_dict()
    fast = calibrate(merged, base=base, experts=experts, calibration=data, progress=False, merge_scaling=0.05,
                     config=FeatCalConfig(**common, tune_screen=6)).tuning.as_dict()
    assert "screen" in fast and fast["screen"]["screened"] >= 2
    assert _setting(fast["chosen"]) == _setting(full["chosen"])


def test_nothing_computed_for_one_starting_merge_is_reused_for_another(clip, monkeypatch):
    """Each candidate calibrates the merge rebuilt at its own scaling from the merge as given; the given merge is
    never changed, and a candidate at another scaling starts from exactly TA at that scaling."""
    base, experts, merged, data = clip
    before = copy.deepcopy(merged)
    one_setting = core.calibrate_setting
    starts: list[tuple[float | None, torch.nn.Module]] = []

    def recording(model, **kwargs):
        starts.append(copy.deepcopy(model))
        return one_setting(model, **kwargs)

    monkeypatch.setattr(core, "calibrate_setting", recording)
    cfg = FeatCalConfig(tune=True, tune_budget=6.0, tune_folds=1, tune_screen=4, tune_fixed=(
        "anchor_blend_rho", "lambda_ratio", "teacher_interp_alpha"))
    rec = calibrate(merged, base=base, experts=experts, calibration=data, config=cfg, progress=False,
                    merge_scaling=0.05).tuning.as_dict()
    assert max_abs_diff(merged, before)[0] == 0.0
    scalings = [c["merge_scaling"] for c in rec["candidates"]]
    assert len(set(scalings)) > 1
    for s, model in zip(scalings, starts, strict=False):
        assert max_abs_diff(model, ta_merge(base, experts, s))[0] < 1e-5


def test_the_plan_prices_a_tuned_run_with_and_without_the_screen():
    from featcal.calibration.planning.time_estimate import tune_line

    at256 = FeatCalConfig(tune=True, num_calibration_examples=256, tune_screen="auto")
    assert FeatCalConfig(tune=True).tune_screen == "off"  # the default until the real-weights benches compare them
    screened, how = tuning.planned_calibrations(at256, 256)
    unscreened, _ = tuning.planned_calibrations(at256.model_copy(update={"tune_screen": "off"}), 256)
    # 10 candidates: each a calibration on the fit part (0.75) plus a held-out forward (0.25/3), the experts'
    # held-out forward and the refit; screened, each on 32 of 192 fit examples, then 3 confirmed on all 192
    assert unscreened == pytest.approx(1 + 0.25 / 3 + 10 * (0.75 + 0.25 / 3))
    assert screened == pytest.approx(1 + 0.25 / 3 + 10 * (0.75 * 32 / 192 + 0.25 / 3) + 3 * (0.75 + 0.25 / 3))
    assert "screened on 32 of 192 fit examples per task, 3 confirmed" in how
    assert tuning.planned_calibrations(at256, 32)[0] == pytest.approx(unscreened)
    line = tune_line(at256, 60.0)
    assert f"at most {screened:.1f} calibrations' work" in line and "min" in line
    assert tune_line(FeatCalConfig(), 60.0) == ""


@pytest.mark.parametrize("report", [[1, 2], "merge", {"command": "merge", "params": [1]},
                                    {"command": "merge", "params": {"method": ["ties"], "scaling": 0.3}}])
def test_a_merged_report_that_is_not_a_featcal_record_only_stops_the_scaling_search(tmp_path, report):
    """A hand-edited featcal.json (a list, a string, params not an object) is a reason not to search the merge's
    scaling, never a traceback."""
    import json

    from featcal.calibration.tuning import merge_scaling_from_report

    (tmp_path / "merged").mkdir()
    (tmp_path / "merged" / "featcal.json").write_text(json.dumps(report))
    scaling, why = merge_scaling_from_report(tmp_path / "merged", tmp_path / "base", {"a": tmp_path / "a"})
    assert scaling is None and why


def test_confirm_zero_takes_the_screens_best_and_refits_it_on_all_data(clip, monkeypatch):
    """tune_confirm 0: no candidate is fitted on the whole fit part; the screen's best-scoring setting is the
    choice, and the refit on all data is the one calibration at full size."""
    base, experts, merged, data = clip
    one_setting = core.calibrate_setting
    calls: list[dict] = []

    def recording(*args, **kwargs):
        calls.append(kwargs["calibration"])
        return one_setting(*args, **kwargs)

    monkeypatch.setattr(core, "calibrate_setting", recording)
    cfg = FeatCalConfig(tune=True, tune_budget=6.0, tune_folds=1, tune_screen=4, tune_confirm=0)
    rec = calibrate(merged, base=base, experts=experts, calibration=data, config=cfg, progress=False,
                    merge_scaling=0.05).tuning.as_dict()
    assert {c["stage"] for c in rec["candidates"]} == {"screen"} and rec["screen"]["confirmed"] == []
    assert len(calls) == len(rec["candidates"]) + 1  # the screened candidates, then the refit
    best = min(rec["candidates"], key=lambda c: (c["drift"], c["index"]))
    assert rec["chosen"]["index"] == best["index"]
    for t in data:
        assert sum(len(b["pixel_values"]) for b in calls[-1][t]) == sum(len(b["pixel_values"]) for b in data[t])
    assert "screened on 4 examples per task" in tuning.summary_line(rec)
    planned, how = tuning.planned_calibrations(cfg, 16)
    assert "none confirmed" in how and planned < tuning.planned_calibrations(
        cfg.model_copy(update={"tune_confirm": 2}), 16)[0]
