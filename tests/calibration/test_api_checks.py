"""The Python API refuses unusable in-memory inputs before any forward runs."""

import pytest
import torch

from featcal import FeatCalConfig, calibrate
from featcal.calibration.engine import driver as engine
from featcal.errors import CalibrationDataError, CheckpointError
from tests.builders.tiny import perturbed, sample_inputs, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


def _family(kind):
    base = tiny_model(kind)
    return base, {"a": perturbed(base, 1), "b": perturbed(base, 2)}


def _no_forward(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("work started before the inputs were checked")

    monkeypatch.setattr(engine.FeatCalEngine, "run", boom)


@pytest.mark.parametrize("who", ["merged", "expert", "base"])
def test_nan_in_an_in_memory_model_is_named_before_work(monkeypatch, who):
    base, experts = _family("clip")
    merged = perturbed(base, 3)
    target = {"merged": merged, "expert": experts["b"], "base": base}[who]
    with torch.no_grad():
        target.encoder.layers[1].mlp.fc1.weight[0, 0] = float("nan")
    _no_forward(monkeypatch)
    data = {t: [sample_inputs("clip")] for t in experts}
    label = {"merged": "merged model", "expert": "expert 'b'", "base": "base"}[who]
    with pytest.raises(CheckpointError, match=rf"{label}.*fc1.weight.*NaN"):
        calibrate(merged, base=base, experts=experts, calibration=data, config=FeatCalConfig(), progress=False)


@pytest.mark.parametrize(
    "pixels,message",
    [(torch.randn(2, 1, 16, 16), "1 channels"), (torch.randn(2, 3, 24, 24), r"\(24, 24\) pixels")],
)
def test_images_the_model_cannot_take_are_refused(monkeypatch, pixels, message):
    base, experts = _family("clip")
    _no_forward(monkeypatch)
    data = {"a": [sample_inputs("clip")], "b": [{"pixel_values": pixels}]}
    with pytest.raises(CalibrationDataError, match=rf"task 'b', batch 0.*{message}"):
        calibrate(base, base=base, experts=experts, calibration=data, progress=False)


def test_texts_longer_than_the_positions_are_refused(monkeypatch):
    base, experts = _family("bert")
    _no_forward(monkeypatch)
    long = {"input_ids": torch.randint(2, 100, (1, 65)), "attention_mask": torch.ones(1, 65, dtype=torch.long)}
    data = {"a": [sample_inputs("bert")], "b": [long]}
    with pytest.raises(CalibrationDataError, match="65 tokens, the model takes at most 64"):
        calibrate(base, base=base, experts=experts, calibration=data, progress=False)


def test_calibrate_returns_a_typed_result_and_return_result_only_warns_once(monkeypatch):
    """calibrate always hands back a CalibrationResult; its drift rows are typed and still read as the mappings
    featcal.json holds; return_result is a deprecated no-op that warns once per process."""
    import json
    import warnings

    from featcal.calibration.core.result import CalibrationResult, DriftRow
    from featcal.calibration.front import api

    base, experts = _family("clip")
    merged = perturbed(base, 3)
    data = {t: [sample_inputs("clip")] for t in experts}
    monkeypatch.setattr(api, "_warned", [])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = [calibrate(merged, base=base, experts=experts, calibration=data, progress=False, return_result=flag)
                   for flag in (True, False, True)]
    deprecations = [w for w in caught if issubclass(w.category, DeprecationWarning)]
    assert len(deprecations) == 1 and "return_result" in str(deprecations[0].message)
    assert deprecations[0].filename == __file__  # it points at the caller
    plain = calibrate(merged, base=base, experts=experts, calibration=data, progress=False)
    for result in (*results, plain):
        assert isinstance(result, CalibrationResult) and isinstance(result.model, torch.nn.Module)
        assert result.model.state_dict().keys() == merged.state_dict().keys()
    rows = plain.drift
    assert all(isinstance(r, DriftRow) for r in rows) and [r.block for r in rows] == list(range(len(rows)))
    assert rows[0]["before"] == rows[0].before and dict(rows[0]) == rows[0].as_dict()
    assert set(rows[0]) == {"block", "stack", "layer", "before", "after"}  # no before_batches where all were run
    assert json.loads(json.dumps(plain.drift_records())) == [r.as_dict() for r in rows]
    assert all(torch.equal(v, results[0].model.state_dict()[k]) for k, v in plain.model.state_dict().items())
