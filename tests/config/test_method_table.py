"""One method table (issue #35): every fact about a merge method is in its registry entry, and bench, tuning, the
baselines and the merge read it there; adding a method is one registration; RegMean and WUDI have one parameter
model each, used by the merge and the baselines alike."""

from __future__ import annotations

import json

import pytest
import torch

import featcal.config.method_specs as method_specs
from featcal import merge
from featcal.config import (
    TASK_VECTOR_METHODS,
    MergeConfig,
    MethodParams,
    MethodSpec,
    RegMeanParams,
    WudiParams,
    add_method,
    is_task_vector_merge,
    method_spec,
    registered_methods,
)
from featcal.errors import ConfigError
from featcal.experiments.baselines.api import baselines, run_baseline
from featcal.experiments.bench.run import bench_methods
from featcal.merging import register
from featcal.merging.mergers import TaskArithmetic
from featcal.merging.model_mergers import ModelMerger
from tests.builders.tiny import make_family, sample_inputs

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def registry(monkeypatch):
    """A copy of the registry for this test only (a method registered here is gone afterwards)."""
    monkeypatch.setattr(method_specs, "_METHODS", dict(method_specs._METHODS))


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    return make_family("bert", tmp_path_factory.mktemp("bert"), n_experts=2, scale=0.2)


def test_the_facts_of_the_built_in_methods():
    assert TASK_VECTOR_METHODS == ("task_arithmetic", "ties", "dare_ta", "dare_ties")
    assert [m for m in ("average", "linear", "regmean", "wudi") if is_task_vector_merge(m)] == []
    assert bench_methods()["ties"] == {"density": 0.2, "scaling": 1.0} and "linear" not in bench_methods()
    assert set(bench_methods()) == {s.name for s in registered_methods()} - {"linear"}
    assert all(s.reference for s in registered_methods())
    # RegMean, RegMean++ and WUDI: one parameter model each, the merge's and the baselines'
    assert method_spec("regmean").params is method_spec("regmean++").params is RegMeanParams
    assert method_spec("wudi").params is WudiParams
    assert baselines()["regmean"] == (RegMeanParams, ("base", "calibration"))
    assert baselines()["wudi"] == (WudiParams, ("base",))
    from featcal.merging.method_params import RegMeanParams as old_path

    assert old_path is RegMeanParams


def test_adding_a_method_is_one_registration(registry):
    """A task-vector merge registered with its facts is benched with its paper's settings and searched by --tune;
    a whole-model one is a baseline too."""
    @register("test_scaled", task_vector=True, defaults={"scaling": 0.5}, reference="a test")
    class Scaled(TaskArithmetic):
        pass

    @register("test_whole", defaults={}, reference="a test")
    class Whole(ModelMerger):
        def merge_models(self, base, experts, progress):
            return base

    assert is_task_vector_merge("test_scaled") and not is_task_vector_merge("test_whole")
    assert bench_methods()["test_scaled"] == {"scaling": 0.5}
    assert "test_whole" in baselines() and "test_scaled" not in baselines()
    assert MergeConfig(method="test_scaled").method_params().scaling == 0.3  # MergeConfig's field, one declaration
    assert method_spec("test_whole").implementation is Whole


def test_an_implementation_bound_to_a_declared_method_keeps_the_declared_facts(registry):
    """Built-in methods are declared in the table (config/methods.py) and bound by `register(name)`."""
    add_method(MethodSpec("test_declared", "streaming", method_spec("task_arithmetic").params, task_vector=True,
                          defaults={"scaling": 0.4}, reference="declared"))

    @register("test_declared")
    class Declared(TaskArithmetic):
        pass

    spec = method_spec("test_declared")
    assert (spec.task_vector, spec.defaults, spec.reference, spec.implementation) == (True, {"scaling": 0.4},
                                                                                     "declared", Declared)
    with pytest.raises(ValueError, match="already registered by Declared"):
        register("test_declared")(type("Other", (TaskArithmetic,), {}))


def test_wudi_and_regmean_take_their_own_options_through_merge(bert, tmp_path):
    """exclude (regexes of Linear modules to average instead) reaches the merge through MergeConfig's keywords and
    a report names it only when set: excluding every Linear, WUDI is the experts' average."""
    base, experts = bert
    average = merge(base, experts, "average", progress=False)
    everything = merge(base, experts, "wudi", steps=2, exclude=".*", progress=False, out=tmp_path / "w")
    assert all(torch.allclose(everything[k], average[k], atol=1e-6) for k in average)
    assert json.loads((tmp_path / "w" / "featcal.json").read_text())["params"]["exclude"] == [".*"]
    merge(base, experts, "wudi", steps=2, progress=False, out=tmp_path / "plain")
    assert "exclude" not in json.loads((tmp_path / "plain" / "featcal.json").read_text())["params"]
    with pytest.raises(ConfigError, match="is not a regular expression"):
        merge(base, experts, "wudi", exclude="(", progress=False)
    with pytest.raises(ConfigError, match="device"):
        merge(base, experts, "ties", device="cpu", progress=False)  # not a parameter of ties


def test_the_baselines_run_the_merges_own_implementation(bert):
    """run_baseline("wudi") and featcal.merge(method="wudi") are one implementation: the same weights, bit for bit."""
    base, experts = bert
    merged = merge(base, experts, "wudi", steps=3, progress=False)
    result = run_baseline("wudi", base=base, experts=experts, steps=3, progress=False)
    state = result.model.state_dict()
    assert all(torch.equal(state[k], merged[k]) for k in merged)
    assert result.params == WudiParams(steps=3).model_dump()
    calibration = {t: [sample_inputs("bert", seed=i)] for i, t in enumerate(experts)}
    reg = run_baseline("regmean++", base=base, experts=experts, calibration=calibration, progress=False)
    again = merge(base, experts, "regmean++", calibration=calibration, progress=False)
    assert all(torch.equal(reg.model.state_dict()[k], again[k]) for k in again)
    assert issubclass(RegMeanParams, MethodParams)
