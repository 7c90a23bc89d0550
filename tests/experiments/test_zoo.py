"""The offline zoo: task generators, splits, heads, and a deterministic, cached, atomic build."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from featcal.blocks.heads import LinearHead
from featcal.errors import CheckpointError, ConfigError, OutputExistsError
from featcal.evaluation.classification import accuracy, fit_linear_probe
from featcal.experiments.zoo.build import build_zoo, few_shot
from featcal.experiments.zoo.presets import PRESETS, get_preset
from featcal.experiments.zoo.pretrain import categories, n_classes, pretraining_set
from featcal.experiments.zoo.store import Zoo
from featcal.experiments.zoo.tasks import TASKS, make_splits
from featcal.experiments.zoo.train import pixel_values
from tests.builders.zoo import micro_preset


@pytest.mark.parametrize("name", list(TASKS))
def test_task_generates_balanced_uint8_images_deterministically(name):
    task = TASKS[name]
    a = make_splits(task, {"train": 40, "test": 20}, seed=3)
    b = make_splits(task, {"train": 40, "test": 20}, seed=3)
    x, y = a["train"]
    assert x.shape == (40, 32, 32, 3) and x.dtype == np.uint8
    assert y.min() >= 0 and y.max() < len(task.classes)
    np.testing.assert_array_equal(x, b["train"][0])
    np.testing.assert_array_equal(a["test"][1], b["test"][1])
    assert not np.array_equal(a["train"][0][:20], a["test"][0])  # splits are different images
    assert x.std() > 5  # not blank


def test_procedural_tasks_are_balanced():
    _, y = make_splits(TASKS["shapes"], {"train": 60}, seed=0)["train"]
    assert np.bincount(y).tolist() == [10] * 6


def test_real_digits_splits_are_disjoint_and_refuse_oversize():
    task = TASKS["handwritten_digits"]
    splits = make_splits(task, {"train": 300, "calibration": 50, "test": 100}, seed=0)
    flat = {k: {v.tobytes() for v in x} for k, (x, _) in splits.items()}
    assert not (flat["train"] & flat["test"]) and not (flat["calibration"] & flat["test"])
    with pytest.raises(ValueError, match="only 1797"):
        make_splits(task, {"train": 2000}, seed=0)


def test_pretraining_categories_are_fixed_by_seed_and_labelled():
    assert categories(5, 0) == categories(5, 0) != categories(5, 1)
    x, y = pretraining_set(300, 10, seed=0)
    assert x.shape == (300, 32, 32, 3) and sorted(set(y.tolist())) == list(range(n_classes(10)))


def test_linear_probe_fits_separable_features_and_round_trips(tmp_path):
    g = torch.Generator().manual_seed(0)
    y = torch.arange(90) % 3
    feats = torch.randn(90, 8, generator=g) * 0.1 + torch.nn.functional.one_hot(y, 8).float() * 3
    head = fit_linear_probe(feats, y.numpy(), 3)
    assert (head(feats).argmax(-1) == y).float().mean() == 1.0
    head.save(tmp_path / "h.safetensors")
    again = LinearHead.load(tmp_path / "h.safetensors")
    torch.testing.assert_close(again(feats), head(feats))
    with pytest.raises(CheckpointError, match="does not exist"):
        LinearHead.load(tmp_path / "missing.safetensors")


def test_few_shot_keeps_the_first_examples_of_each_class_in_order():
    y = np.array([2, 0, 1, 0, 2, 1, 0, 2])
    x = np.arange(8) * 10
    xs, ys = few_shot(x, y, 2)
    np.testing.assert_array_equal(ys, [2, 0, 1, 0, 2, 1])
    np.testing.assert_array_equal(xs, [0, 10, 20, 30, 40, 50])
    xs, ys = few_shot(x, y, None)
    assert xs is x and ys is y
    with pytest.raises(ValueError, match="probe_shots must be at least 1"):
        few_shot(x, y, 0)
    with pytest.raises(ConfigError, match="probe_shots must be at least 1"):  # before any build work
        dataclasses.replace(PRESETS["default"], probe_shots=0)


def test_accuracy_counts_matches():
    class Fixed(torch.nn.Module):
        def forward(self, pixel_values):
            return type("O", (), {"pooler_output": pixel_values[:, :2]})()

    x = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [1.0, 0.0]])
    head = torch.nn.Identity()
    assert accuracy(Fixed(), head, x, torch.tensor([0, 1, 1, 1])) == 0.5


def test_pixel_values_maps_uint8_to_unit_range():
    x = np.zeros((1, 2, 2, 3), np.uint8)
    x[..., 0] = 255
    pv = pixel_values(x)
    assert pv.shape == (1, 3, 2, 2)
    assert pv[0, 0].eq(1.0).all() and pv[0, 1].eq(-1.0).all()


def test_unknown_preset_is_a_config_error():
    with pytest.raises(ConfigError, match="unknown zoo preset 'huge'"):
        get_preset("huge")


MICRO = micro_preset()


def test_build_is_deterministic_cached_and_guarded(tmp_path):
    zoo = build_zoo(tmp_path / "a", MICRO, seed=1, progress=False)
    assert zoo.tasks == ["stripes", "colours"]
    manifest = json.loads((tmp_path / "a" / "zoo.json").read_text())
    assert set(manifest["regime"]) == {"base", "task_arithmetic_0.3", "experts", "ordered"}
    assert (tmp_path / "a" / "build.log").read_text().startswith("pretrain:")
    x, y = zoo.split("colours", "calibration")
    assert x.shape == (16, 3, 32, 32) and len(y) == 16
    assert zoo.split("stripes", "test", limit=5)[0].shape[0] == 5

    weights = (tmp_path / "a" / "experts" / "stripes" / "model.safetensors").read_bytes()
    again = build_zoo(tmp_path / "b", MICRO, seed=1, progress=False)
    assert (again.root / "experts" / "stripes" / "model.safetensors").read_bytes() == weights  # deterministic

    stamp = (tmp_path / "a" / "zoo.json").stat().st_mtime_ns
    build_zoo(tmp_path / "a", MICRO, seed=1, progress=False)  # cached: nothing rewritten
    assert (tmp_path / "a" / "zoo.json").stat().st_mtime_ns == stamp

    with pytest.raises(OutputExistsError, match="another preset, seed"):
        build_zoo(tmp_path / "a", MICRO, seed=2, progress=False)
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "file.txt").write_text("x")
    with pytest.raises(OutputExistsError):
        build_zoo(tmp_path / "junk", MICRO, seed=1, progress=False)


def test_open_reports_missing_pieces(tmp_path):
    with pytest.raises(CheckpointError, match="not a built zoo"):
        Zoo.open(tmp_path)
    build_zoo(tmp_path / "z", MICRO, seed=0, progress=False)
    (tmp_path / "z" / "heads" / "colours.safetensors").unlink()
    with pytest.raises(CheckpointError, match="heads/colours.safetensors is missing for task 'colours'"):
        Zoo.open(tmp_path / "z")


def test_load_returns_the_zoo_models_heads_and_test_splits(tmp_path):
    zoo = build_zoo(tmp_path / "z", MICRO, seed=0, progress=False)
    loaded = zoo.load()
    assert set(loaded.experts) == set(loaded.heads) == set(loaded.tests) == {"stripes", "colours"}
    on_disk = load_file(str(zoo.expert_dir("colours") / "model.safetensors"))
    for name, value in loaded.experts["colours"].state_dict().items():
        if name in on_disk:
            assert torch.equal(value, on_disk[name]), name
    torch.testing.assert_close(loaded.heads["stripes"].weight, zoo.head("stripes").weight)
    x, y = loaded.tests["stripes"]
    torch.testing.assert_close(x, zoo.split("stripes", "test")[0])
    assert len(y) == 32
    assert zoo.load(experts=False).experts == {}
    assert loaded.mean_accuracy(loaded.base, ["stripes"]) == accuracy(loaded.base, loaded.heads["stripes"], x, y)
