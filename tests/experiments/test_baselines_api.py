"""run_baseline: one predictor interface for post-merge modules and merges, inputs checked first."""

import json

import pytest
import torch

from featcal.errors import CalibrationDataError, ConfigError
from featcal.experiments.baselines import BASELINES, run_baseline
from tests.builders.tiny import perturbed, sample_inputs, tiny_model

FAST = {"surgery": {"steps": 5}, "probsurgery": {"steps": 5}, "wudi": {"steps": 5}}


@pytest.fixture(scope="module")
def clip_family():
    base = tiny_model("clip")
    experts = {f"t{i}": perturbed(base, 100 + i, 0.2) for i in range(2)}
    merged = perturbed(base, 7, 0.1)
    calib = {t: [sample_inputs("clip", batch=4, seed=i)] for i, t in enumerate(experts)}
    return base, experts, merged, calib


@pytest.mark.parametrize("name", list(BASELINES))
def test_every_baseline_gives_task_features_the_same_way(name, clip_family):
    base, experts, merged, calib = clip_family
    res = run_baseline(name, merged=merged, base=base, experts=experts, calibration=calib, **FAST.get(name, {}))
    batch = sample_inputs("clip", batch=3, seed=99)
    f = res.features("t0", batch)
    assert f.shape == (3, 32)
    assert res.wall_time_s > 0
    json.dumps(res.summary())
    if res.needs_task_id:
        assert res.model is merged
        # the surgery correction is applied on the merged model's pooled features
        pooled = merged(**batch).pooler_output
        assert torch.allclose(f, res.surgery.apply("t0", pooled))
    else:
        assert torch.allclose(f, res.model(**batch).pooler_output)


def test_surgery_predictor_is_deterministic(clip_family):
    base, experts, merged, calib = clip_family
    batch = sample_inputs("clip", batch=3, seed=5)
    a = run_baseline("probsurgery", merged=merged, experts=experts, calibration=calib, steps=10, seed=1)
    b = run_baseline("probsurgery", merged=merged, experts=experts, calibration=calib, steps=10, seed=1)
    assert torch.equal(a.features("t1", batch), b.features("t1", batch))


def test_custom_feature_fn_is_used(clip_family):
    base, experts, merged, calib = clip_family

    def cls_token(model, batch):
        return model(**batch).last_hidden_state[:, 0]

    res = run_baseline("surgery", merged=merged, experts=experts, calibration=calib, feature_fn=cls_token, steps=3)
    batch = sample_inputs("clip", batch=2)
    assert torch.allclose(res.features("t0", batch), res.surgery.apply("t0", cls_token(merged, batch)))


def test_bad_requests_fail_before_any_work(clip_family):
    base, experts, merged, calib = clip_family
    with pytest.raises(ConfigError, match="unknown baseline 'surgeon'"):
        run_baseline("surgeon", merged=merged, experts=experts, calibration=calib)
    with pytest.raises(ConfigError, match="needs merged"):
        run_baseline("surgery", base=base, experts=experts, calibration=calib)
    with pytest.raises(ConfigError, match="needs base and calibration"):
        run_baseline("regmean", merged=merged, experts=experts)
    with pytest.raises(ConfigError, match="rnak"):
        run_baseline("surgery", merged=merged, experts=experts, calibration=calib, rnak=4)
    with pytest.raises(ConfigError, match="regmean\\+\\+"):
        run_baseline("regmean", base=base, experts=experts, calibration=calib, plus_plus=True)
    with pytest.raises(CalibrationDataError, match="'t1'"):
        run_baseline("surgery", merged=merged, experts=experts, calibration={"t0": calib["t0"]})
    with pytest.raises(CalibrationDataError, match="pooler_output"):
        llama = tiny_model("llama")
        run_baseline("surgery", merged=llama, experts={"a": llama}, calibration={"a": sample_inputs("llama")})


def test_task_accuracy_scores_both_kinds_like_the_benchmark(clip_family):
    from featcal.blocks.heads import LinearHead
    from featcal.evaluation.classification import accuracy
    from featcal.experiments.baselines.evaluate import task_accuracy

    base, experts, merged, calib = clip_family
    torch.manual_seed(0)
    head = LinearHead(32, 3).eval()
    x = sample_inputs("clip", batch=10, seed=3)["pixel_values"]
    rm = run_baseline("regmean", base=base, experts=experts, calibration=calib)
    y = head(rm.model(pixel_values=x).pooler_output).argmax(-1)
    y[:3] = (y[:3] + 1) % 3  # three wrong labels: accuracy 0.7 for the model that made the rest
    assert task_accuracy(rm, "t0", head, x, y, batch_size=4) == pytest.approx(accuracy(rm.model, head, x, y)) == pytest.approx(0.7)
    sg = run_baseline("surgery", merged=merged, experts=experts, calibration=calib, steps=3)
    expected = (head(sg.surgery.apply("t1", merged(pixel_values=x).pooler_output)).argmax(-1) == y).float().mean()
    assert task_accuracy(sg, "t1", head, x, y, batch_size=4) == pytest.approx(float(expected))


def test_missing_expert_checkpoint_is_refused_before_features(clip_family, tmp_path):
    from featcal.errors import CheckpointError

    base, experts, merged, calib = clip_family
    paths = {"t0": experts["t0"], "t1": tmp_path / "absent"}
    with pytest.raises(CheckpointError, match="expert 't1'"):
        run_baseline("surgery", merged=merged, experts=paths, calibration=calib, steps=2)


@pytest.mark.parametrize("name", ["surgery", "probsurgery"])
def test_recomputed_features_train_the_same_modules_as_cached_ones(name, clip_family):
    base, experts, merged, calib = clip_family
    calib2 = {t: [b, sample_inputs("clip", batch=3, seed=50 + i)] for i, (t, (b,)) in enumerate(calib.items())}
    cached = run_baseline(name, merged=merged, experts=experts, calibration=calib2, steps=6, batch_size=3)
    live = run_baseline(name, merged=merged, experts=experts, calibration=calib2, steps=6, batch_size=3,
                        recompute_features=True)
    a, b = cached.surgery.state_dict(), live.surgery.state_dict()
    assert all(torch.allclose(a[k], b[k], atol=1e-5) for k in a)
    assert live.summary()["params"]["recompute_features"] is True
    with pytest.raises(ConfigError, match="recompute_features"):
        run_baseline("regmean", base=base, experts=experts, calibration=calib, recompute_features=True)
