"""The one front door to checkpoints (io/read/family.py, issue #35): every kind of input opens as one TensorSource, and
merge, calibrate (the Python API and the CLI's checks) and the whole-model merges open their inputs through it."""

from __future__ import annotations

import copy

import pytest
import torch

import featcal.io.read.family as front_door
from featcal import FeatCalConfig
from featcal.calibration.front.api import calibrate
from featcal.calibration.front.pipeline import CalibrateRequest, check_calibration_inputs
from featcal.errors import CheckpointError
from featcal.io.read.checkpoint import CheckpointReader
from featcal.io.read.family import open_family, open_input
from featcal.io.read.gguf import GGUFHeader, GGUFSource
from featcal.io.read.layouts import RenamedSource
from featcal.io.read.lora import LoraSource
from featcal.io.read.param_sources import CheckpointSource, ModelSource, ParamSource
from featcal.io.read.sources import ModuleSource, UnmappedReader
from featcal.io.read.tensor_source import TensorSource
from featcal.io.read.vocab import PaddedRows, RowsView
from featcal.merging.api import merge
from tests.builders.pipeline_family import clip_family
from tests.builders.tiny import make_family, perturbed, sample_inputs, save, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

QUERY = "encoder.layer.0.attention.self.query.weight"


def test_every_kind_of_source_is_one_tensor_source(tmp_path):
    """The merge's sources (checkpoint names) and calibration's (parameter names) are one hierarchy: each
    answers keys / meta / get / shape alike, and says None for a tensor it lacks."""
    base = tiny_model("bert")
    folder = save(base, tmp_path / "base")
    opened = {
        "folder": open_input(folder, label="base"),
        "module": open_input(base, label="base"),
        "folder by parameter names": CheckpointSource(None, base, "base", reader=open_input(folder, label="base")),
        "module by parameter names": ModelSource(base, "base"),
        "padded view": PaddedRows(ModelSource(base, "base"), base),
    }
    for kind, src in opened.items():
        assert isinstance(src, TensorSource), kind
        assert QUERY in src and QUERY in src.keys(), kind
        assert src.shape(QUERY) == tuple(src.meta(QUERY)[0]) == (32, 32), kind
        assert torch.equal(src.get(QUERY), base.state_dict()[QUERY]), kind
        assert src.shape("no.such.tensor") is None, kind
    assert ParamSource is TensorSource
    for cls in (CheckpointReader, UnmappedReader, ModuleSource, RenamedSource, RowsView, LoraSource, GGUFSource,
                GGUFHeader):
        assert issubclass(cls, TensorSource), cls.__name__


def test_open_input_names_the_input_and_refuses_what_is_no_model(tmp_path):
    with pytest.raises(CheckpointError, match=r"^expert 'a': .*does not exist"):
        open_input(tmp_path / "missing", label="expert 'a'")
    with pytest.raises(CheckpointError, match=r"^base: expected a checkpoint path, hub id or torch.nn.Module, got int"):
        open_input(3, label="base")
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="is a LoRA/PEFT adapter, not a model"):
        open_input(adapter, label="base")  # an adapter needs a base to be an expert over


def test_a_lazy_family_opens_an_input_only_when_used(tmp_path):
    """featcal.calibrate with models in memory never reads the base as a checkpoint view it does not need."""
    base_dir, experts = make_family("bert", tmp_path, n_experts=1)
    family = open_family(base_dir, experts, eager=False)
    assert family._sources == {}
    assert family.experts["task0"].path == experts["task0"]
    assert set(family._sources) == {"expert 'task0'"}  # a folder expert needs no base
    assert family.path("base") == base_dir and set(family._sources) == {"expert 'task0'", "base"}


@pytest.fixture
def opened(monkeypatch):
    """Every input the front door opens, by label, in order."""
    seen: list[str] = []
    real = front_door.open_input

    def recording(item, *, label, **kw):
        seen.append(label)
        return real(item, label=label, **kw)

    monkeypatch.setattr(front_door, "open_input", recording)
    return seen


def test_merge_calibrate_and_the_whole_model_merges_open_through_the_front_door(tmp_path, opened):
    base = tiny_model("bert")
    base_dir = save(base, tmp_path / "base")
    experts = {t: save(perturbed(base, i), tmp_path / t) for i, t in enumerate(("a", "b"))}
    merge(base_dir, experts, progress=False)
    assert opened == ["base", "expert 'a'", "expert 'b'"]

    opened.clear()
    merge(base_dir, experts, "wudi", steps=1, progress=False)  # a whole-model merge: the same opened sources
    assert opened == ["base", "expert 'a'", "expert 'b'"]

    opened.clear()
    merged = copy.deepcopy(base)
    batches = {t: [sample_inputs("bert", seed=i)] for i, t in enumerate(experts)}
    calibrate(merged, base=base_dir, experts=experts, calibration=batches, config=FeatCalConfig(), progress=False)
    assert sorted(opened) == ["base", "expert 'a'", "expert 'b'"]


def test_the_calibration_checks_open_each_input_once_through_the_front_door(tmp_path, opened):
    fam = clip_family(tmp_path / "clip")
    checked = check_calibration_inputs(CalibrateRequest(fam["merged"], fam["base"], fam["experts"], fam["data"],
                                                        tmp_path / "out", config=FeatCalConfig(), check_finite=True,
                                                        progress=False))
    assert opened == ["merged model", "base model", "expert 'task0'", "expert 'task1'"]  # the scan reuses them
    assert checked.merged == fam["merged"] and checked.experts == fam["experts"]
    assert checked.read_as == {"base": {}, "expert 'task0'": {}, "expert 'task1'": {}}


def test_the_checks_compare_every_input_with_the_merge(tmp_path):
    fam = clip_family(tmp_path / "clip")
    other = save(tiny_model("vit"), tmp_path / "vit")
    with pytest.raises(CheckpointError, match=r"must share the merged model's type \(clip_vision_model\); these "
                                              r"differ: expert 'task1' \(vit\)"):
        open_family(fam["base"], {**fam["experts"], "task1": other}, fam["merged"]).check_model_types("merged")
