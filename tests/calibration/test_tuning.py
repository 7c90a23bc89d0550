"""`tune` (issue 17): label-free selection of ρ, λ, α and the starting merge's scaling on held-out
calibration examples, then a refit on all of them; CLI / YAML / API."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
import transformers as T
import yaml

from featcal import FeatCalConfig, calibrate
from featcal.blocks.adapters import adapter_for
from featcal.calibration import tuning
from featcal.calibration.core import setting as core
from featcal.cli.main import main
from featcal.config import parse
from featcal.errors import CalibrationDataError, ConfigError
from featcal.io.read.param_sources import ModelSource
from tests.builders.reference_featcal import family_data, max_abs_diff, noisy_family, ta_merge


@pytest.fixture(scope="module")
def family():
    """A CLIP family whose merge is TA at 0.05, far below where FeatCal does well: defaults are poor here."""
    base, experts, _ = noisy_family("clip", n_experts=2)
    merged = ta_merge(base, experts, 0.05)
    data = family_data("clip", experts, n_batches=3)  # 6 examples per task
    return base, experts, merged, data


def _rows(batches, key="pixel_values"):
    return [row for b in batches for row in b[key]]


def _same_rows(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _strip(records):
    return [{k: v for k, v in r.items() if k != "seconds"} for r in records]


# --- the split -----------------------------------------------------------------------------------------
def test_split_is_seeded_disjoint_and_covers_each_task(family):
    _, _, _, data = family
    one = tuning.split_calibration(data, 0.34, seed=0)
    again = tuning.split_calibration(data, 0.34, seed=0)
    other = tuning.split_calibration(data, 0.34, seed=1)
    for t, batches in data.items():
        rows = _rows(batches)
        rec = one.record[t]
        assert rec["examples"] == 6 and rec["held_out"] == 2 and rec["fit"] == 4
        held = [rows[i] for i in rec["held_out_indices"]]
        fit = [rows[i] for i in range(6) if i not in rec["held_out_indices"]]
        assert _same_rows(_rows(one.held[t]), held) and _same_rows(_rows(one.fit[t]), fit)
        assert _same_rows(_rows(again.held[t]), held)
    assert one.record == again.record
    assert [one.record[t]["held_out_indices"] for t in data] != [other.record[t]["held_out_indices"] for t in data]


def test_split_refuses_a_task_it_cannot_split():
    with pytest.raises(CalibrationDataError, match="task 'a' has 1 calibration example"):
        tuning.split_calibration({"a": [{"pixel_values": torch.zeros(1, 3, 16, 16)}]}, 0.25, 0)
    with pytest.raises(CalibrationDataError, match="first sizes"):
        tuning.split_calibration({"a": [{"input_ids": torch.zeros(2, 4), "attention_mask": torch.zeros(3, 4)}]}, 0.25, 0)


def test_folds_hold_every_example_out_exactly_once(family):
    _, _, _, data = family
    splits = tuning.split_folds(data, 3, seed=0)
    again = tuning.split_folds(data, 3, seed=0)
    other = tuning.split_folds(data, 3, seed=1)
    assert len(splits) == 3
    for t, batches in data.items():
        rows = _rows(batches)
        held = [s.record[t]["held_out_indices"] for s in splits]
        assert sorted(i for fold in held for i in fold) == list(range(6))  # every example once, no fold empty
        assert all(len(fold) == 2 for fold in held)
        for s, fold in zip(splits, held, strict=True):
            assert _same_rows(_rows(s.held[t]), [rows[i] for i in fold])
            assert _same_rows(_rows(s.fit[t]), [rows[i] for i in range(6) if i not in fold])
        assert [s.record[t] for s in again] == [s.record[t] for s in splits]
    assert [s.record for s in other] != [s.record for s in splits]
    record = tuning.folds_record(splits)
    assert record["task0"]["folds"] == 3 and record["task0"]["held_out"] == 6 and record["task0"]["fit"] == [4, 4, 4]
    with pytest.raises(CalibrationDataError, match=r"task 'task0' has 6 calibration example\(s\); tune needs at least 7 "
                                                   r"\(one per fold of tune_folds 7\)"):
        tuning.split_folds(data, 7, seed=0)


def test_folds_pool_the_held_out_examples_of_every_fold():
    def sc(drift, agree, soft):
        samples = {"a": {"drift": torch.tensor(drift, dtype=torch.float64),
                         "agreement": torch.tensor(agree, dtype=torch.float64),
                         "soft": torch.tensor(soft, dtype=torch.float64)}}
        per_task = {"a": {k: float(v.mean()) for k, v in samples["a"].items()}}
        return tuning.Score(per_task["a"]["drift"], 1 - per_task["a"]["agreement"], per_task, samples,
                            per_task["a"]["soft"])

    one, two = sc([1.0, 3.0], [1.0, 0.0], [0.5, 0.5]), sc([2.0], [1.0], [0.2])
    both = tuning.combine_folds([one, two])
    assert both.drift == pytest.approx(2.0) and both.disagreement == pytest.approx(1 / 3)
    assert both.soft == pytest.approx(0.4)
    assert both.samples["a"]["agreement"].tolist() == [1.0, 0.0, 1.0]
    assert tuning.combine_folds([one]) is one
    no_head = tuning.Score(2.0, None, {"a": {"drift": 2.0}}, {"a": {"drift": torch.tensor([2.0])}})
    assert tuning.combine_folds([one, no_head]).disagreement is None


# --- selection sees calibration data only, and the refit sees all of it ---------------------------------
def test_selection_sees_only_calibration_data_and_refit_uses_all(family, monkeypatch):
    base, experts, merged, data = family
    original = calibrate
    one_setting = core.calibrate_setting  # what the search calls for each candidate and for the refit
    calls: list[dict] = []

    def recording(*args, **kwargs):
        calls.append({"data": kwargs["calibration"], "config": kwargs["config"]})
        return one_setting(*args, **kwargs)

    seen_by_head: list[torch.Tensor] = []

    def head(model, batch):  # a callable head: records every example it is shown
        seen_by_head.extend(batch["pixel_values"])
        return model(**batch).pooler_output[:, :3]

    monkeypatch.setattr(core, "calibrate_setting", recording)
    cfg = FeatCalConfig(tune=True, tune_budget=5.0, tune_holdout=0.34)
    result = original(merged, base=base, experts=experts, calibration=data, config=cfg, progress=False,
                      heads={"task0": head, "task1": head})
    out, rec = result.model, result.tuning
    *search, refit = calls
    assert len(search) == len(rec["candidates"]) >= 2 and not refit["config"].tune
    for t, batches in data.items():
        rows = _rows(batches)
        held = [rows[i] for i in rec["split"][t]["held_out_indices"]]
        fit = [rows[i] for i in range(len(rows)) if i not in rec["split"][t]["held_out_indices"]]
        for call in search:  # every candidate is fitted on the fit part only
            assert _same_rows(_rows(call["data"][t]), fit)
        assert all(any(torch.equal(x, r) for x in seen_by_head) for r in held)  # and scored on the held-out one
        assert _same_rows(_rows(refit["data"][t]), rows)  # the refit on every calibration example
    calib_rows = [r for b in data.values() for r in _rows(b)]
    held_rows = [r for t, b in data.items() for i, r in enumerate(_rows(b)) if i in rec["split"][t]["held_out_indices"]]
    assert seen_by_head and all(any(torch.equal(x, r) for r in held_rows) for x in seen_by_head)
    assert all(any(torch.equal(x, r) for r in calib_rows) for x in seen_by_head)
    # the returned model is exactly a plain calibration, on all data, of the chosen setting
    chosen = rec["chosen"]
    start = merged if chosen["merge_scaling"] is None else None
    assert start is merged  # no merge_scaling given: the merge itself
    plain = original(merged, base=base, experts=experts, calibration=data, progress=False, config=FeatCalConfig(
        anchor_blend_rho=chosen["anchor_blend_rho"], lambda_ratio=chosen["lambda_ratio"],
        teacher_interp_alpha=chosen["teacher_interp_alpha"], tune_budget=5.0, tune_holdout=0.34)).model
    assert max_abs_diff(out, plain)[0] == 0.0
    assert rec["chosen"]["disagreement"] is not None and rec["heads"] == ["task0", "task1"]
    assert all(0.0 <= c["per_task"][t]["agreement"] <= 1.0 for c in rec["candidates"] for t in data)


def test_cross_fitted_candidates_are_scored_only_on_the_fold_they_were_not_fitted_on(family, monkeypatch):
    base, experts, merged, data = family
    one_setting = core.calibrate_setting
    calls: list[dict] = []

    def recording(*args, **kwargs):
        calls.append(kwargs["calibration"])
        return one_setting(*args, **kwargs)

    shown: list[torch.Tensor] = []

    def head(model, batch):  # records every example it is shown, in order
        shown.extend(batch["pixel_values"])
        return model(**batch).pooler_output[:, :3]

    monkeypatch.setattr(core, "calibrate_setting", recording)
    cfg = FeatCalConfig(tune=True, tune_budget=6.0, tune_folds=2)
    result = calibrate(merged, base=base, experts=experts, calibration=data, config=cfg, progress=False,
                       heads={"task0": head, "task1": head}, merge_scaling=0.05)
    rec = result.tuning
    *search, refit = calls
    assert rec["folds"] == 2 and rec["holdout"] is None
    assert rec["budget"]["max_candidates"] == tuning.max_candidates(6.0, 0.25, 2) == 3
    assert len(search) == 2 * len(rec["candidates"]) == 6  # two calibrations per candidate
    for t, batches in data.items():
        rows = _rows(batches)
        folds = rec["split"][t]["fold_indices"]
        assert sorted(i for f in folds for i in f) == list(range(6))
        for n, call in enumerate(search):  # the k-th calibration of each candidate leaves fold k out
            fold = folds[n % 2]
            assert _same_rows(_rows(call[t]), [rows[i] for i in range(6) if i not in fold])
        assert _same_rows(_rows(refit[t]), rows)
    # what the heads were shown, in order: the experts' references (each task's folds), then for each candidate
    # and fold k, fold k's examples of every task: each scored by the calibration that left fold k out
    folds_of = {t: [[_rows(data[t])[i] for i in f] for f in rec["split"][t]["fold_indices"]] for t in data}
    expected = [r for t in data for fold in folds_of[t] for r in fold]
    for _ in rec["candidates"]:
        expected += [r for k in range(2) for t in data for r in folds_of[t][k]]
    assert _same_rows(shown, expected)
    for c in rec["candidates"]:  # the pooled score: mean over tasks of each task's mean over its 6 examples
        assert c["disagreement"] == pytest.approx(sum(1 - c["per_task"][t]["agreement"] for t in data) / 2)
        assert all(c["per_task"][t]["agreement"] * 6 == pytest.approx(round(c["per_task"][t]["agreement"] * 6))
                   for t in data)
    chosen = rec["chosen"]
    again = calibrate(merged, base=base, experts=experts, calibration=data, progress=False, merge_scaling=0.05,
                      heads={"task0": head, "task1": head}, config=FeatCalConfig(tune=True, tune_budget=6.0, tune_folds=2))
    assert _strip(again.tuning["candidates"]) == _strip(rec["candidates"])  # deterministic
    assert max_abs_diff(again.model, result.model)[0] == 0.0
    assert again.tuning["chosen"] == chosen


def test_auto_folds_cross_fit_only_where_one_split_holds_out_a_few_examples(family):
    assert tuning.resolve_folds("auto", 8, 0.25)[0] == 2  # one split: 2 held out per task
    assert tuning.resolve_folds("auto", 16, 0.25)[0] == 2  # 4
    assert tuning.resolve_folds("auto", 20, 0.25)[0] == 1  # 5
    assert tuning.resolve_folds("auto", 256, 0.25) == (1, "auto: one split holds out 64 example(s) per task")
    assert tuning.resolve_folds(3, 8, 0.25) == (3, "as configured")
    assert tuning.resolve_folds("auto", 8, 0.3) == (1, "auto: tune_holdout 0.3 asks for one split")
    base, experts, merged, data = family
    rec = calibrate(merged, base=base, experts=experts, calibration=data, progress=False,
                    config=FeatCalConfig(tune=True, tune_budget=4.0, tune_folds="auto")).tuning
    assert rec["folds"] == 2 and rec["folds_setting"] == "auto" and "2 folds score every example" in rec["folds_why"]
    assert all(s["held_out"] == 6 for s in rec["split"].values())


def test_tune_folds_and_tune_holdout_are_alternatives(family):
    base, experts, merged, data = family
    with pytest.raises(ConfigError, match="tune_holdout 0.3 and tune_folds 2 are alternatives"):
        parse(FeatCalConfig, {"tune": True, "tune_folds": 2, "tune_holdout": 0.3})
    assert parse(FeatCalConfig, {"tune": True, "tune_folds": 2, "tune_holdout": 0.25}).tune_folds == 2  # the default
    with pytest.raises(CalibrationDataError, match="tune needs at least 7"):
        calibrate(merged, base=base, experts=experts, calibration=data, progress=False,
                  config=FeatCalConfig(tune=True, tune_folds=7))


# --- determinism, budget, and a family where the defaults are poor ---------------------------------------
def test_candidates_and_choice_are_deterministic_for_a_seed(family):
    base, experts, merged, data = family
    cfg = FeatCalConfig(tune=True, tune_budget=4.0)
    a = calibrate(merged, base=base, experts=experts, calibration=data, config=cfg, progress=False, merge_scaling=0.05)
    b = calibrate(merged, base=base, experts=experts, calibration=data, config=cfg, progress=False, merge_scaling=0.05)
    assert _strip(a.tuning["candidates"]) == _strip(b.tuning["candidates"])
    assert a.tuning["chosen"] == b.tuning["chosen"]
    assert max_abs_diff(a.model, b.model)[0] == 0.0
    c = calibrate(merged, base=base, experts=experts, calibration=data, config=cfg.model_copy(update={"seed": 7}),
                  progress=False, merge_scaling=0.05)
    assert c.tuning["split"] != a.tuning["split"]


def test_tune_beats_the_defaults_where_they_are_poor_and_respects_the_budget(family):
    base, experts, merged, data = family
    cfg = FeatCalConfig(tune=True, tune_folds=1)  # one split: 10 candidates in the default budget
    result = calibrate(merged, base=base, experts=experts, calibration=data, config=cfg, progress=False,
                       merge_scaling=0.05)
    out, rec = result.model, result.tuning
    first, chosen = rec["candidates"][0], rec["chosen"]
    assert {k: first[k] for k in ("anchor_blend_rho", "lambda_ratio", "teacher_interp_alpha", "merge_scaling")} == {
        "anchor_blend_rho": 2.2, "lambda_ratio": 0.05, "teacher_interp_alpha": 0.25, "merge_scaling": 0.05}
    assert rec["min_evidence"] == 0.0  # the plain search: the best held-out score wins
    assert chosen["drift"] == min(c["drift"] for c in rec["candidates"])
    assert chosen["drift"] < 0.9 * first["drift"]  # the search moved somewhere clearly better
    assert chosen["merge_scaling"] > 0.05  # ... by starting from a larger merge
    assert len(rec["candidates"]) <= tuning.max_candidates(10.0, 0.25) == rec["budget"]["max_candidates"] == 10
    # on examples no candidate was scored on (same distribution), the choice also beats the defaults
    fresh = family_data("clip", experts, n_batches=3, seed=1000)
    default = calibrate(merged, base=base, experts=experts, calibration=data, progress=False).model
    ref = {t: tuning.expert_reference(t, experts[t], adapter_for(out), fresh[t], None) for t in experts}
    assert tuning.score(out, adapter_for(out), fresh, ref, {}).drift < tuning.score(
        default, adapter_for(out), fresh, ref, {}).drift
    small = calibrate(merged, base=base, experts=experts, calibration=data, progress=False, merge_scaling=0.05,
                      config=cfg.model_copy(update={"tune_budget": 3.0}))
    assert len(small.tuning["candidates"]) == tuning.max_candidates(3.0, 0.25) == 2


def test_fixed_knobs_keep_their_configured_values_in_every_candidate(family):
    base, experts, merged, data = family
    cfg = FeatCalConfig(tune=True, tune_budget=5.0, lambda_ratio=0.1, tune_fixed=("lambda_ratio", "merge_scaling"))
    rec = calibrate(merged, base=base, experts=experts, calibration=data, config=cfg, progress=False,
                    merge_scaling=0.05).tuning
    assert rec["searched"] == ["anchor_blend_rho", "teacher_interp_alpha"]
    assert len(rec["candidates"]) > 1
    assert {c["lambda_ratio"] for c in rec["candidates"]} == {0.1}
    assert {c["merge_scaling"] for c in rec["candidates"]} == {0.05}
    free = calibrate(merged, base=base, experts=experts, calibration=data, progress=False, merge_scaling=0.05,
                     config=cfg.model_copy(update={"tune_fixed": ()})).tuning
    assert free["searched"][0] == "merge_scaling"  # the control: without the option the same search moves them
    assert len({c["merge_scaling"] for c in free["candidates"]}) > 1


def test_budget_arithmetic():
    assert tuning.max_candidates(10.0, 0.25) == 10
    assert tuning.max_candidates(3.0, 0.25) == 2
    assert tuning.max_candidates(100.0, 0.5) > tuning.max_candidates(100.0, 0.05)  # smaller fit part, cheaper
    for budget in (3.0, 10.0, 37.5):  # search and refit stay within the budget's cost model
        for holdout in (0.05, 0.25, 0.5):
            n = tuning.max_candidates(budget, holdout)
            assert 1 + holdout / 3 + n * tuning.candidate_cost(holdout) <= budget + 1e-9
        for folds in (2, 3, 5):  # cross-fitting: folds calibrations on (folds - 1) / folds, every example scored
            n, cost = tuning.max_candidates(budget, 0.25, folds), tuning.candidate_cost(0.25, folds)
            assert 1 + 1 / 3 + (n + 1) * cost > budget  # as many as fit ...
            assert n == 1 or 1 + 1 / 3 + n * cost <= budget + 1e-9  # ... and never fewer than the start itself
    assert tuning.max_candidates(10.0, 0.25, 2) == 6 and tuning.candidate_cost(0.25, 2) == pytest.approx(4 / 3)


# --- the evidence a step needs --------------------------------------------------------------------------
def _samples(**per_task):
    return {t: {"drift": torch.tensor(v, dtype=torch.float64)} for t, v in per_task.items()}


def test_evidence_is_the_paired_z_with_the_within_task_variance_pooled():
    old = _samples(a=[1.0, 1.0, 1.0], b=[2.0, 2.0])
    new = _samples(a=[0.5, 0.9, 0.7], b=[1.0, 2.0])  # improvements a: 0.5, 0.1, 0.3; b: 1.0, 0.0
    delta = (0.3 + 0.5) / 2
    pooled = ((0.2**2 + 0.2**2 + 0.0) + (0.5**2 + 0.5**2)) / (2 + 1)
    se = math.sqrt(pooled * (1 / 3 + 1 / 2) / 4)
    assert tuning.evidence(new, old, "drift", higher_is_better=False) == pytest.approx(delta / se)
    assert tuning.evidence(old, new, "drift", higher_is_better=False) == pytest.approx(-delta / se)
    assert math.isnan(tuning.evidence(_samples(a=[0.5]), _samples(a=[1.0]), "drift", False))  # no estimate
    assert tuning.evidence(_samples(a=[0.5, 0.5]), _samples(a=[1.0, 1.0]), "drift", False) == math.inf


def _score(drift, agreement, soft=None):
    """A Score over one task from per-example drift shares, agreements and (optionally) KLs."""
    d, a = torch.tensor(drift, dtype=torch.float64), torch.tensor(agreement, dtype=torch.float64)
    samples = {"drift": d, "agreement": a}
    if soft is not None:
        samples["soft"] = torch.tensor(soft, dtype=torch.float64)
    return tuning.Score(float(d.mean()), 1.0 - float(a.mean()), {}, {"t": samples},
                        None if soft is None else float(samples["soft"].mean()))


def test_a_step_without_evidence_is_not_taken_and_the_drift_decides_instead():
    best = _score([1.0] * 16, [1.0] * 15 + [0.0])
    one_more = _score([1.0] * 16, [1.0] * 16)  # one example more agrees with its expert, drift unchanged
    assert one_more.verdict(best, 0.0)[0]  # the plain comparison takes it
    taken, z = one_more.verdict(best, 2.0)
    assert not taken and z["disagreement"] == pytest.approx(1.0)  # one example of 16: one standard error
    clearly = _score([0.8 + 0.01 * (i % 3) for i in range(16)], [1.0] * 16)  # ... and a clearly lower drift
    taken, z = clearly.verdict(best, 2.0)
    assert taken and z["drift"] > 2.0
    worse = _score([0.1] * 16, [1.0] * 14 + [0.0] * 2)  # more disagreements lose whatever the drift
    assert not worse.verdict(best, 0.0)[0] and not worse.verdict(best, 2.0)[0]


def test_min_evidence_zero_takes_every_improvement_and_a_high_bar_takes_fewer(family):
    base, experts, merged, data = family
    runs = {z: calibrate(merged, base=base, experts=experts, calibration=data, progress=False, merge_scaling=0.05,
                         config=FeatCalConfig(tune=True, tune_min_evidence=z, tune_folds=1)).tuning for z in (0.0, 2.0)}
    plain = runs[0.0]
    assert plain["chosen"]["drift"] == min(c["drift"] for c in plain["candidates"])
    assert all(c["accepted"] == c["scored_better"] == (
        plain["candidates"][c["candidate"]]["drift"] < plain["candidates"][c["against"]]["drift"])
        for c in plain["comparisons"])
    strict = runs[2.0]
    for c in strict["comparisons"]:  # every step taken was backed by 2 standard errors
        z = c["z_disagreement"] if c["z_drift"] is None else c["z_drift"]
        assert c["accepted"] == (c["scored_better"] and (z == "inf" or (isinstance(z, float) and z >= 2.0))), c
    refused = [c for c in strict["comparisons"] if not c["accepted"]
               and strict["candidates"][c["candidate"]]["drift"] < strict["candidates"][c["against"]]["drift"]]
    assert refused and all(isinstance(c["z_drift"], float) and c["z_drift"] < 2.0 for c in refused)
    assert len({(c["candidate"], c["against"]) for c in strict["comparisons"]}) == len(strict["comparisons"])
    assert strict["chosen"]["drift"] > plain["chosen"]["drift"]  # here the plain search took a step within noise
    assert all(c["scored_better"] for c in refused)
    assert f"{len(refused)} step(s) that scored better were not taken" in tuning.summary_line(strict)


def test_rescaled_merge_is_task_arithmetic_at_the_new_scaling(family):
    base, experts, _, _ = family
    rebuilt = ta_merge(base, experts, 0.3)
    tuning.rescale_merge(rebuilt, ModelSource(base, "base"), 0.7 / 0.3)
    assert max_abs_diff(rebuilt, ta_merge(base, experts, 0.7))[0] < 1e-6


# --- refused before any work ---------------------------------------------------------------------------
@pytest.mark.parametrize(("kwargs", "message"), [
    ({"heads": {"nope": lambda m, b: None}}, r"heads given for unknown task\(s\) \['nope'\]"),
    ({"heads": {"task0": 3}}, "neither an nn.Module nor a callable"),
    ({"merge_scaling": 0.0}, r"merge_scaling must be a number in \(0, 10\]"),
    ({"merge_scaling": True}, "merge_scaling must be a number"),
    ({"merge_scaling": 0.3, "base": None}, "merge_scaling needs the base model"),
    ({"config": FeatCalConfig(), "heads": {"task0": lambda m, b: None}}, "heads are used only .* tune=True"),
    ({"config": FeatCalConfig(), "merge_scaling": 0.3}, "merge_scaling is used only .* tune=True"),
    ({"config": FeatCalConfig(tune=True, tune_tiebreak="soft")}, r"needs a head for every task \(none for \['task0', 'task1'\]\)"),
    ({"config": FeatCalConfig(tune=True, tune_tiebreak="soft"), "heads": {"task0": lambda m, b: None}},
     r"none for \['task1'\]"),
])
def test_bad_tune_requests_are_refused(family, kwargs, message):
    base, experts, merged, data = family
    args = {"base": base, "config": FeatCalConfig(tune=True, anchor_blend_rho=1.0), **kwargs}
    with pytest.raises(ConfigError, match=message):
        calibrate(merged, experts=experts, calibration=data, progress=False, **args)


def test_module_head_scores_agreement_on_the_pooled_output(family):
    base, experts, merged, data = family
    torch.manual_seed(0)
    heads = {t: torch.nn.Linear(32, 4) for t in experts}  # a linear head on CLIP's pooler_output
    out = calibrate(merged, base=base, experts=experts, calibration=data, progress=False, heads=heads,
                    config=FeatCalConfig(tune=True, tune_budget=4.0))
    rec = out.tuning
    for c in rec["candidates"]:
        agreement = [c["per_task"][t]["agreement"] for t in experts]
        assert c["disagreement"] == pytest.approx(1.0 - sum(agreement) / len(agreement))
    best = min((c["disagreement"], c["drift"]) for c in rec["candidates"])
    assert (rec["chosen"]["disagreement"], rec["chosen"]["drift"]) == best


def test_soft_tiebreak_is_the_kl_from_the_experts_head_softmax(family):
    base, experts, merged, data = family
    torch.manual_seed(0)
    heads = {t: torch.nn.Linear(32, 4) for t in experts}
    adapter = adapter_for(merged)
    refs = {t: tuning.expert_reference(t, experts[t], adapter, data[t], heads[t], keep_log_probs=True) for t in experts}
    # an expert scored against its own outputs: no disagreement, no divergence
    own = tuning.score(experts["task0"], adapter, {"task0": data["task0"]}, refs, {"task0": heads["task0"]})
    assert own.disagreement == 0.0 and own.soft == pytest.approx(0.0, abs=1e-6)
    # the merge: the KL computed here by hand from the heads on the pooled outputs
    sc = tuning.score(merged, adapter, data, refs, heads)
    for t in experts:
        rows = torch.cat([b["pixel_values"] for b in data[t]])
        with torch.no_grad():
            pe = torch.log_softmax(heads[t](experts[t](pixel_values=rows).pooler_output), -1)
            pm = torch.log_softmax(heads[t](merged(pixel_values=rows).pooler_output), -1)
        assert sc.per_task[t]["soft"] == pytest.approx(float((pe.exp() * (pe - pm)).sum(-1).mean()), rel=1e-4)
    assert sc.soft == pytest.approx(sum(sc.per_task[t]["soft"] for t in experts) / 2)
    # the search: agreement ties go to the lower KL, and the record says which tie-break ran
    out = calibrate(merged, base=base, experts=experts, calibration=data, progress=False, heads=heads,
                    config=FeatCalConfig(tune=True, tune_budget=4.0, tune_tiebreak="soft"))
    rec = out.tuning
    assert rec["tiebreak"] == "soft" and all("soft" in c for c in rec["candidates"])
    assert (rec["chosen"]["disagreement"], rec["chosen"]["soft"]) == min(
        (c["disagreement"], c["soft"]) for c in rec["candidates"])
    assert all("z_soft" in c and "z_drift" not in c for c in rec["comparisons"])


def test_verdict_breaks_ties_by_the_chosen_score():
    best = _score([1.0, 1.0], [1.0, 1.0], soft=[0.1, 0.1])
    cand = _score([0.5, 0.6], [1.0, 1.0], soft=[0.2, 0.3])  # lower drift, higher KL
    assert cand.verdict(best)[0] and not cand.verdict(best, tiebreak="soft")[0]
    assert best.verdict(cand, tiebreak="soft")[0]


# --- CLI and YAML --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def on_disk(tmp_path_factory):
    from tests.builders import pipeline_family as support

    root = tmp_path_factory.mktemp("tune")
    fam = support.clip_family(root, n_images=6)
    merged = root / "merged-ta"  # a featcal merge: its featcal.json says how to rebuild it
    assert main(["merge", "--base", str(fam["base"]), *[f"--expert={t}={d}" for t, d in fam["experts"].items()],
                 "--method", "task_arithmetic", "--scaling", "0.3", "--out", str(merged), "--no-progress"]) == 0
    return {**fam, "featcal_merge": merged}


def test_cli_calibrate_tune_records_every_candidate_and_the_choice(on_disk, tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["calibrate", "--base", str(on_disk["base"]), "--merged", str(on_disk["featcal_merge"]), "--out", str(out),
            "--no-progress", "--num-calibration-examples", "6", "--calibration-batch-size", "3",
            "--tune", "--tune-budget", "4", "--tune-holdout", "0.34"]
    for t, d in on_disk["experts"].items():
        argv += ["--expert", f"{t}={d}"]
    for t, d in on_disk["data"].items():
        argv += ["--calib", f"{t}={d}"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "tune: 3 candidate(s) scored on held-out calibration examples; chose" in printed
    report = json.loads((out / "featcal.json").read_text())
    rec = report["tuning"]
    assert report["params"]["tune"] is True and report["params"]["tune_budget"] == 4.0
    assert rec["budget"]["max_candidates"] == 3 and len(rec["candidates"]) == 3
    assert rec["searched"][0] == "merge_scaling" and rec["start"]["merge_scaling"] == 0.3
    assert "task_arithmetic, scaling 0.3" in rec["merge_scaling_from"]
    assert all({"drift", "anchor_blend_rho", "lambda_ratio", "teacher_interp_alpha", "merge_scaling"} <= set(c)
               for c in rec["candidates"])
    assert rec["chosen"]["drift"] == min(c["drift"] for c in rec["candidates"])
    assert all(s["fit"] + s["held_out"] == s["examples"] == 6 for s in rec["split"].values())


def test_cli_tune_without_a_featcal_merge_searches_the_three_knobs(on_disk, tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["calibrate", "--base", str(on_disk["base"]), "--merged", str(on_disk["merged"]), "--out", str(out),
            "--no-progress", "--num-calibration-examples", "6", "--calibration-batch-size", "3", "--tune",
            "--tune-budget", "3"]
    for t, d in on_disk["experts"].items():
        argv += ["--expert", f"{t}={d}", "--calib", f"{t}={on_disk['data'][t]}"]
    assert main(argv) == 0
    rec = json.loads((out / "featcal.json").read_text())["tuning"]
    assert rec["searched"] == ["anchor_blend_rho", "lambda_ratio", "teacher_interp_alpha"]
    assert "no featcal.json" in rec["merge_scaling_from"] and rec["start"]["merge_scaling"] is None
    fixed = tmp_path / "fixed"
    argv[argv.index(str(out))] = str(fixed)
    assert main([*argv, "--tune-fixed", "lambda_ratio,teacher_interp_alpha"]) == 0
    assert json.loads((fixed / "featcal.json").read_text())["tuning"]["searched"] == ["anchor_blend_rho"]
    folded = tmp_path / "folded"
    argv[argv.index(str(fixed))] = str(folded)
    assert main([*argv, "--tune-folds", "2"]) == 0
    rec = json.loads((folded / "featcal.json").read_text())["tuning"]
    assert rec["folds"] == 2 and all(s["held_out"] == 6 and len(s["fold_indices"]) == 2 for s in rec["split"].values())


@pytest.mark.parametrize(("flags", "message"), [
    (("--tune-budget", "2"), "tune_budget: Input should be greater than or equal to 3"),
    (("--tune-holdout", "0.6"), "tune_holdout: Input should be less than or equal to 0.5"),
    (("--tune-folds", "0"), "tune_folds: Value error, a number of folds from 1 to 10, or 'auto', not 0"),
    (("--tune-folds", "2", "--tune-holdout", "0.3"), "tune_holdout 0.3 and tune_folds 2 are alternatives"),
    (("--tune-budget", "nan"), "tune_budget: Input should be a finite number"),
    (("--tune-fixed", "lambda"), "tune_fixed: Value error, unknown knob(s) lambda; choose from merge_scaling, "
                                 "anchor_blend_rho, lambda_ratio, teacher_interp_alpha, or 'auto'"),
])
def test_cli_refuses_bad_tune_values_in_one_line(on_disk, tmp_path, capsys, flags, message):
    argv = ["calibrate", "--base", str(on_disk["base"]), "--merged", str(on_disk["merged"]), "--out",
            str(tmp_path / "out"), "--no-progress", "--tune", *flags]
    for t, d in on_disk["experts"].items():
        argv += ["--expert", f"{t}={d}", "--calib", f"{t}={on_disk['data'][t]}"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and not (tmp_path / "out").exists()


def test_yaml_run_tunes_the_task_arithmetic_scaling(on_disk, tmp_path, capsys):
    out = tmp_path / "calibrated"
    run = tmp_path / "run.yaml"
    run.write_text(yaml.safe_dump({
        "merge": {"base": str(on_disk["base"]), "experts": {n: str(p) for n, p in on_disk["experts"].items()},
                  "method": "task_arithmetic", "params": {"scaling": 0.2}},
        "calibrate": {"calibration": {t: str(p) for t, p in on_disk["data"].items()},
                      "config": {"num_calibration_examples": 6, "calibration_batch_size": 3, "tune": True,
                                 "tune_budget": 4}},
        "out": str(out),
    }))
    assert main(["run", str(run), "--no-progress"]) == 0
    rec = json.loads((out / "featcal.json").read_text())["tuning"]
    assert rec["start"]["merge_scaling"] == 0.2 and rec["merge_scaling_from"] == "given by the caller"
    assert rec["candidates"][1]["merge_scaling"] == 0.3  # the first step up the scaling ladder: 1.5 × 0.2
    assert T.CLIPVisionModel.from_pretrained(out) is not None
    bad = tmp_path / "bad.yaml"
    bad.write_text(run.read_text().replace("tune_budget: 4", "tune_budget: 1000").replace(str(out), str(tmp_path / "o2")))
    assert main(["run", str(bad), "--no-progress"]) == 2
    assert "tune_budget: Input should be less than or equal to 100" in capsys.readouterr().err


def test_pooled_follows_tune_head_pooling():
    from types import SimpleNamespace

    h = torch.arange(24, dtype=torch.float32).reshape(1, 3, 8)
    batch = {"attention_mask": torch.tensor([[1, 1, 0]])}
    both = SimpleNamespace(pooler_output=torch.ones(1, 8), last_hidden_state=h)
    assert torch.equal(tuning.pooled_output("a", both, batch, "auto"), torch.ones(1, 8))
    assert torch.equal(tuning.pooled_output("a", both, batch, "mean"), h[:, :2].mean(1))
    only_states = SimpleNamespace(pooler_output=None, last_hidden_state=h)
    assert torch.equal(tuning.pooled_output("a", only_states, batch, "auto"), h[:, :2].mean(1))
    with pytest.raises(ConfigError, match="tune_head_pooling is 'pooler' but the model's output has no pooler_output"):
        tuning.pooled_output("a", only_states, batch, "pooler")


@pytest.fixture(scope="module")
def saved_heads(on_disk, tmp_path_factory):
    from featcal.blocks.heads import LinearHead

    root = tmp_path_factory.mktemp("heads")
    torch.manual_seed(0)
    paths = {}
    for t in on_disk["experts"]:
        head = LinearHead(32, 3)
        head.save(root / f"{t}.safetensors")
        paths[t] = root / f"{t}.safetensors"
    (root / "junk.safetensors").write_text("not a head")
    return {**paths, "junk": root / "junk.safetensors"}


def _calibrate_argv(on_disk, out, *extra):
    argv = ["calibrate", "--base", str(on_disk["base"]), "--merged", str(on_disk["featcal_merge"]), "--out", str(out),
            "--no-progress", "--num-calibration-examples", "6", "--calibration-batch-size", "3", *extra]
    for t, d in on_disk["experts"].items():
        argv += ["--expert", f"{t}={d}", "--calib", f"{t}={on_disk['data'][t]}"]
    return argv


def test_cli_tune_heads_score_agreement(on_disk, saved_heads, tmp_path, capsys):
    out = tmp_path / "out"
    heads = [f"--tune-head={t}={saved_heads[t]}" for t in on_disk["experts"]]
    assert main(_calibrate_argv(on_disk, out, "--tune", "--tune-budget", "3", *heads)) == 0
    assert "disagreement with the experts" in capsys.readouterr().out
    rec = json.loads((out / "featcal.json").read_text())["tuning"]
    assert rec["heads"] == sorted(on_disk["experts"]) and set(rec["head_files"]) == set(on_disk["experts"])
    assert all(c["disagreement"] is not None for c in rec["candidates"])


@pytest.mark.parametrize(("extra", "message"), [
    (lambda h: [f"--tune-head=task0={h['task0']}"], "heads are used only to score candidates with --tune"),
    (lambda h: ["--tune", f"--tune-head=nope={h['task0']}"], r"head\(s\) given for unknown task\(s\) \['nope'\]"),
    (lambda h: ["--tune", f"--tune-head=task0={h['junk']}"], "head of task 'task0'"),
    (lambda h: ["--tune", "--tune-head=task0=/no/such/head.safetensors"], "head of task 'task0'"),
])
def test_cli_bad_tune_heads_are_one_line_errors(on_disk, saved_heads, tmp_path, capsys, extra, message):
    out = tmp_path / "out"
    assert main(_calibrate_argv(on_disk, out, *extra(saved_heads))) == 2
    err = capsys.readouterr().err
    assert err.startswith("featcal: error: ") and "Traceback" not in err and not out.exists()
    assert len(err.strip().splitlines()) == 1 and __import__("re").search(message, err), err


def test_yaml_run_takes_heads(on_disk, saved_heads, tmp_path):
    out = tmp_path / "calibrated"
    run = tmp_path / "run.yaml"
    run.write_text(yaml.safe_dump({
        "merge": {"base": str(on_disk["base"]), "experts": {n: str(p) for n, p in on_disk["experts"].items()},
                  "method": "task_arithmetic"},
        "calibrate": {"calibration": {t: str(p) for t, p in on_disk["data"].items()},
                      "heads": {t: str(saved_heads[t]) for t in on_disk["experts"]},
                      "config": {"num_calibration_examples": 6, "calibration_batch_size": 3, "tune": True,
                                 "tune_budget": 3, "tune_head_pooling": "pooler"}},
        "out": str(out),
    }))
    assert main(["run", str(run), "--no-progress"]) == 0
    rec = json.loads((out / "featcal.json").read_text())["tuning"]
    assert rec["chosen"]["disagreement"] is not None and rec["heads"] == sorted(on_disk["experts"])


def test_tune_reads_lora_experts_as_calibrate_does(tmp_path, tmp_path_factory):
    """A LoRA adapter expert is scored as base + ΔW: the same search and choice as from full checkpoints."""
    from featcal.merging.api import merge
    from tests.builders.lora import full_checkpoints, lora_family, token_batches

    _, base, experts, by_hand = lora_family(tmp_path_factory.mktemp("lora"))
    merged_dir = tmp_path / "merged"
    merge(base, experts, "task_arithmetic", scaling=0.3, out=merged_dir, progress=False)
    data = token_batches(experts)
    full_dirs = full_checkpoints(by_hand, base, tmp_path)
    cfg = FeatCalConfig(tune=True, tune_budget=4.0)
    model = T.LlamaForCausalLM.from_pretrained(merged_dir)
    a = calibrate(model, base=str(base), experts={t: str(d) for t, d in experts.items()}, calibration=data,
                  config=cfg, progress=False, merge_scaling=0.3)
    b = calibrate(model, base=str(base), experts=full_dirs, calibration=data, config=cfg, progress=False,
                  merge_scaling=0.3)
    ra, rb = a.tuning, b.tuning
    assert [c["merge_scaling"] for c in ra["candidates"]] == [c["merge_scaling"] for c in rb["candidates"]]
    assert all(c["drift"] == pytest.approx(d["drift"], rel=1e-4) for c, d in zip(ra["candidates"], rb["candidates"],
                                                                                 strict=True))
    assert max_abs_diff(a.model, b.model)[0] < 1e-4


def test_the_callers_merge_is_left_as_given_unless_inplace(family):
    base, experts, merged, data = family
    before = {k: v.clone() for k, v in merged.state_dict().items()}
    cfg = FeatCalConfig(tune=True, tune_budget=3.0, tune_folds=1)
    result = calibrate(merged, base=base, experts=experts, calibration=data, config=cfg, progress=False,
                       merge_scaling=0.05)
    out = result.model
    assert out is not merged and all(torch.equal(before[k], v) for k, v in merged.state_dict().items())
    assert result.tuning["chosen"]["merge_scaling"] != 0.05  # a rebuilt merge was calibrated, on a copy
    own = copy.deepcopy(merged)
    again = calibrate(own, base=base, experts=experts, calibration=data, config=cfg, progress=False,
                      merge_scaling=0.05, inplace=True).model
    assert again is own and max_abs_diff(again, out)[0] == 0.0


def test_auto_tiebreak_is_soft_on_tiny_held_out_parts_only():
    heads = {"a": object(), "b": object()}
    small = tuning.AUTO_SOFT_MAX_HELD
    assert tuning.resolve_tiebreak("auto", heads, ["a", "b"], 2)[0] == "soft"
    assert tuning.resolve_tiebreak("auto", heads, ["a", "b"], small)[0] == "soft"
    assert tuning.resolve_tiebreak("auto", heads, ["a", "b"], small + 1)[0] == "drift"
    assert tuning.resolve_tiebreak("auto", {"a": object()}, ["a", "b"], 2) == ("drift", "auto: not every task has a head")
    assert tuning.resolve_tiebreak("drift", heads, ["a", "b"], 2) == ("drift", "as configured")
    assert tuning.resolve_tiebreak("soft", heads, ["a", "b"], 50)[0] == "soft"


@pytest.mark.parametrize("n_batches, expected", [(3, "soft"), (12, "drift")])
def test_auto_tiebreak_runs_and_is_recorded(n_batches, expected):
    """6 examples per task hold out 2 (soft); 24 hold out 6 (drift). Without heads auto is drift, no error."""
    base, experts, _ = noisy_family("clip", n_experts=2)
    merged = ta_merge(base, experts, 0.05)
    data = family_data("clip", experts, n_batches=n_batches)
    torch.manual_seed(0)
    heads = {t: torch.nn.Linear(32, 4) for t in experts}
    cfg = FeatCalConfig(tune=True, tune_budget=3.0, tune_tiebreak="auto", tune_folds=1)  # one split: 2 held out
    rec = calibrate(merged, base=base, experts=experts, calibration=data, progress=False, heads=heads,
                    config=cfg).tuning
    assert (rec["tiebreak"], rec["tiebreak_setting"]) == (expected, "auto")
    assert all(f"z_{expected}" in c for c in rec["comparisons"])
    assert all(("soft" in c) == (expected == "soft") for c in rec["candidates"])
    bare = calibrate(merged, base=base, experts=experts, calibration=data, progress=False, config=cfg).tuning
    assert bare["tiebreak"] == "drift" and bare["tiebreak_why"] == "auto: not every task has a head"


def test_auto_fixed_holds_lambda_on_tiny_held_out_parts_only():
    small = tuning.AUTO_SOFT_MAX_HELD
    assert tuning.resolve_fixed("auto", 2)[0] == ("lambda_ratio",)
    assert tuning.resolve_fixed("auto", small)[0] == ("lambda_ratio",)
    assert tuning.resolve_fixed("auto", small + 1)[0] == ()
    assert tuning.resolve_fixed(("teacher_interp_alpha",), 2) == (("teacher_interp_alpha",), "as configured")


@pytest.mark.parametrize("n_batches, held", [(3, True), (12, False)])
def test_auto_fixed_runs_and_is_recorded(n_batches, held, caplog):
    """6 examples per task hold out 2: λ is held, and a warning says the held-out part is tiny; 24 hold out 6: λ is
    searched like the rest, no warning."""
    base, experts, _ = noisy_family("clip", n_experts=2)
    merged = ta_merge(base, experts, 0.05)
    data = family_data("clip", experts, n_batches=n_batches)
    cfg = FeatCalConfig(tune=True, tune_budget=4.0, tune_fixed="auto", tune_folds=1)  # one split: 2 held out
    with caplog.at_level("WARNING", logger="featcal"):
        rec = calibrate(merged, base=base, experts=experts, calibration=data, progress=False, config=cfg,
                        merge_scaling=0.05).tuning
    assert any("held-out example(s) per task score the candidates" in r.message for r in caplog.records) is held
    assert rec["fixed_setting"] == "auto" and rec["fixed"] == (["lambda_ratio"] if held else [])
    assert ("lambda_ratio" in rec["searched"]) is not held
    assert rec["fixed_why"].startswith("auto: ")
