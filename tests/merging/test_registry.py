"""One registry of merge methods: a method added with the public `register` is selectable everywhere a method is
(MergeConfig, featcal.merge, `featcal merge --method`, run files), with its own parameter model; an unknown name
is refused with the list of registered ones. And merging/ has no import circle (issue #18)."""

import ast
import json
import re
from pathlib import Path

import pytest
import torch
import yaml
from pydantic import BaseModel, ConfigDict, Field
from safetensors.torch import load_file

import featcal
import featcal.config.method_specs as method_specs
from featcal import MergeConfig, merge
from featcal.cli.main import main
from featcal.config import MERGE_METHODS, method_names, method_spec, parse
from featcal.errors import ConfigError
from featcal.merging import available_methods, register
from featcal.merging.method import Merger
from tests.builders.tiny import make_family

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    return make_family("bert", tmp_path_factory.mktemp("bert"), n_experts=2)


@pytest.fixture
def registry(monkeypatch):
    """A copy of the registry for this test only (a method registered here is gone afterwards)."""
    monkeypatch.setattr(method_specs, "_METHODS", dict(method_specs._METHODS))


class BlendParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    toward: float = Field(0.5, ge=0.0, le=1.0, description="0: the base, 1: the mean of the experts")
    scaling: float = 1.0  # a MergeConfig field: takes MergeConfig's value


def _register_blend():
    @register("test_blend", params=BlendParams)
    class Blend(Merger):
        """θ0 + toward · (mean θt − θ0) · scaling."""

        def merge_tensor(self, name, base, experts):
            p = self.method_params
            mean = sum(t.to(base.dtype) for _, t in experts) / len(self.family_experts)
            return base + p.toward * p.scaling * (mean - base)

        def prepare(self, family, *, progress=False):
            self.family_experts = list(family.experts)

    return Blend


def test_builtin_methods_are_the_registry(registry):
    assert available_methods() == method_names() == sorted(MERGE_METHODS)
    assert {m: method_spec(m).implementation.__name__ for m in MERGE_METHODS} == {
        "average": "Average", "linear": "Linear", "task_arithmetic": "TaskArithmetic", "ties": "Ties", "dare_ta": "DareTaskArithmetic",
        "dare_ties": "DareTies", "regmean": "RegMean", "regmean++": "RegMeanPlusPlus", "wudi": "Wudi"}
    assert list(method_spec("dare_ties").params.model_fields) == [
        "scaling", "density", "drop_rate", "seed", "weights", "densities", "normalize", "ties_threshold", "drop_rates",
        "dare_rescale", "mergekit_arithmetic"]
    assert method_spec("regmean").needs_calibration and method_spec("wudi").kind == "whole_model"
    # each built-in method's parameters are MergeConfig's: the same bounds, one declaration
    with pytest.raises(ConfigError, match="density: Input should be greater than 0"):
        parse(method_spec("ties").params, {"density": 0.0})


def test_a_registered_method_is_selected_and_runs(bert, registry, tmp_path):
    base, experts = bert
    _register_blend()
    assert "test_blend" in available_methods()
    cfg = MergeConfig(method="test_blend", toward=0.25, scaling=2.0)
    assert cfg.method_options == {"toward": 0.25}
    assert cfg.method_params() == BlendParams(toward=0.25, scaling=2.0)

    merged = merge(base, experts, "test_blend", toward=0.25, scaling=2.0, progress=False, out=tmp_path / "m")
    b = load_file(base / "model.safetensors")
    es = [load_file(d / "model.safetensors") for d in experts.values()]
    for k in b:
        expected = b[k] + 0.5 * ((es[0][k] + es[1][k]) / 2 - b[k])
        assert torch.allclose(merged[k], expected, atol=1e-6), k
    report = json.loads((tmp_path / "m" / "featcal.json").read_text())
    assert report["params"] == {"method": "test_blend", "toward": 0.25, "scaling": 2.0}
    again = merge(base, experts, config=cfg, progress=False)  # the same through a config object
    assert all(torch.equal(again[k], merged[k]) for k in merged)

    # its own parameter model validates its own parameters
    with pytest.raises(ConfigError, match=r"method_options: Value error, toward: Input should be less than or equal to 1"):
        merge(base, experts, "test_blend", toward=1.5, progress=False)
    with pytest.raises(ConfigError, match="towrd: Extra inputs are not permitted"):
        merge(base, experts, "test_blend", towrd=0.5, progress=False)
    with pytest.raises(ConfigError, match="toward: Extra inputs are not permitted"):  # not a parameter of ties
        merge(base, experts, "ties", toward=0.5, progress=False)


def test_a_registered_method_from_the_cli_and_a_run_file(bert, registry, tmp_path, capsys):
    base, experts = bert
    _register_blend()
    argv = ["merge", "--base", str(base), *[a for n, p in experts.items() for a in ("--expert", f"{n}={p}")],
            "--method", "test_blend", "--scaling", "2", "--no-progress", "--out", str(tmp_path / "cli")]
    assert main(argv) == 0
    run = tmp_path / "run.yaml"
    run.write_text(yaml.safe_dump({
        "merge": {"base": str(base), "experts": {n: str(p) for n, p in experts.items()}, "method": "test_blend",
                  "params": {"toward": 0.25, "scaling": 2.0}},
        "out": str(tmp_path / "yaml"),
    }))
    assert main(["run", str(run), "--no-progress"]) == 0
    assert json.loads((tmp_path / "yaml" / "featcal.json").read_text())["params"]["toward"] == 0.25


def test_an_unknown_method_is_refused_with_the_registered_ones(bert, registry, tmp_path, capsys):
    _register_blend()
    listing = "valid methods: average, dare_ta, dare_ties, linear, regmean, regmean++, task_arithmetic, test_blend, ties, wudi"
    message = re.escape(f"unknown merge method 'blend'; {listing}")
    with pytest.raises(ConfigError, match=f"invalid MergeConfig: method: Value error, {message}"):
        parse(MergeConfig, {"method": "blend"})
    with pytest.raises(ConfigError, match=message):
        merge(*bert, "blend", progress=False)
    with pytest.raises(SystemExit):
        main(["merge", "--base", "b", "--expert", "a=b", "--out", str(tmp_path / "o"), "--method", "blend"])
    assert "invalid choice: 'blend'" in capsys.readouterr().err


def test_a_name_is_registered_once(registry):
    _register_blend()
    with pytest.raises(ValueError, match="already registered"):
        _register_blend()


def test_a_merger_with_uses_gets_a_parameter_model_of_mergeconfig_fields(bert, registry):
    @register("test_scaled_base")
    class ScaledBase(Merger):
        uses = ("scaling",)

        def merge_tensor(self, name, base, experts):
            return base * self.config.scaling

    assert list(method_spec("test_scaled_base").params.model_fields) == ["scaling"]
    merged = merge(*bert, "test_scaled_base", scaling=2.0, progress=False)
    b = load_file(bert[0] / "model.safetensors")
    assert all(torch.equal(merged[k], b[k] * 2.0) for k in b)


def test_no_import_circle_in_merging():
    """Every featcal import in merging/, those inside functions included: no circle among its modules."""
    root = Path(featcal.__file__).parent / "merging"
    modules = {f"featcal.merging.{p.stem}": p for p in root.glob("*.py") if p.stem != "__init__"}
    graph = {m: set() for m in modules}
    for m, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            graph[m] |= {n for n in names if n in modules and n != m}

    def reaches(start, goal, seen):
        return any(n == goal or (n not in seen and not seen.add(n) and reaches(n, goal, seen)) for n in graph[start])

    circles = [m for m in graph if reaches(m, m, set())]
    assert not circles, circles
