"""Small pieces of `featcal reproduce`: where ids are looked up, run-dir rules, seeded draws, options."""

from __future__ import annotations

import datasets
import pytest
import torch

from featcal.config import parse
from featcal.errors import CalibrationDataError, ConfigError, OutputExistsError
from featcal.experiments.reproduce.options import ReproduceOptions
from featcal.experiments.reproduce.pipeline import calibration_indices, eval_indices
from featcal.experiments.reproduce.resolve import Sources, local_dataset, local_model
from featcal.experiments.reproduce.rundir import RunDir
from featcal.experiments.reproduce.settings import DatasetRef


def _save(path):
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"x": [1]})}).save_to_disk(str(path))


def test_dataset_config_subfolder_first_then_the_id_folder(tmp_path):
    ref = DatasetRef("svhn", "cropped_digits")
    assert local_dataset(ref, Sources(data_dir=tmp_path)) is None
    _save(tmp_path / "svhn")
    assert local_dataset(ref, Sources(data_dir=tmp_path)) == tmp_path / "svhn"
    _save(tmp_path / "svhn" / "cropped_digits")
    assert local_dataset(ref, Sources(data_dir=tmp_path)) == tmp_path / "svhn" / "cropped_digits"
    assert local_dataset(DatasetRef("tanganke/eurosat"), Sources()) is None


def test_a_model_folder_needs_its_config(tmp_path):
    (tmp_path / "openai" / "clip").mkdir(parents=True)
    assert local_model("openai/clip", Sources(model_dir=tmp_path)) is None
    (tmp_path / "openai" / "clip" / "config.json").write_text("{}")
    assert local_model("openai/clip", Sources(model_dir=tmp_path)) == tmp_path / "openai" / "clip"


def test_run_dir_refuses_foreign_content_and_other_parameters(tmp_path):
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(OutputExistsError, match="not a featcal reproduce run"):
        RunDir(tmp_path / "other").check({"seed": 1})
    run = RunDir(tmp_path / "run")
    assert run.claim({"seed": 1}, {}) is False
    assert run.claim({"seed": 1}, {"note": "again"}) is True
    with pytest.raises(ConfigError, match="seed: 1 there, 2 now"):
        run.check({"seed": 2})


def test_stage_is_built_once_and_atomically(tmp_path):
    run = RunDir(tmp_path / "run")
    calls = []

    def build(tmp):
        calls.append(tmp)
        (tmp / "config.json").write_text("{}")

    path, reused = run.stage("merged", build)
    assert not reused and (path / "config.json").is_file()
    assert run.stage("merged", build) == (path, True) and len(calls) == 1

    def broken(tmp):
        (tmp / "config.json").write_text("{}")
        raise RuntimeError("crash mid-write")

    with pytest.raises(RuntimeError):
        run.stage("featcal", broken)
    assert not (tmp_path / "run" / "featcal").exists()


def test_eval_cache_is_keyed_by_the_options_it_depends_on(tmp_path):
    run = RunDir(tmp_path)
    run.store_eval("merged", "mnist", {"max_eval_samples": 5}, {"accuracy": 50.0})
    assert run.cached_eval("merged", "mnist", {"max_eval_samples": 5}) == {"accuracy": 50.0}
    assert run.cached_eval("merged", "mnist", {"max_eval_samples": None}) is None


def test_seeded_draws():
    subset = eval_indices(100, 10, seed=3)
    assert subset == sorted(subset) and len(set(subset)) == 10 and subset == eval_indices(100, 10, seed=3)
    assert subset != eval_indices(100, 10, seed=4)
    assert eval_indices(7, None, seed=0) == list(range(7)) and eval_indices(7, 70, seed=0) == list(range(7))
    assert calibration_indices(50, 8, 42, "x") == calibration_indices(50, 8, 42, "x")
    with pytest.raises(CalibrationDataError, match="task t has 3 rows"):
        calibration_indices(3, 8, 42, "task t")


def test_options_are_validated():
    with pytest.raises(ConfigError, match="device"):
        parse(ReproduceOptions, {"setting": "s", "out": "o", "device": "tpu"})
    with pytest.raises(ConfigError, match="num_calibration_examples"):
        parse(ReproduceOptions, {"setting": "s", "out": "o", "num_calibration_examples": 0})
    opts = parse(ReproduceOptions, {"setting": "s", "out": "o", "device": "cuda"})
    if torch.cuda.is_available():
        assert opts.torch_device() == "cuda"
    else:
        with pytest.raises(ConfigError, match="CUDA is not available"):
            opts.torch_device()
    auto = parse(ReproduceOptions, {"setting": "s", "out": "o"})
    assert auto.torch_device() == ("cuda" if torch.cuda.is_available() else "cpu")
    assert auto.featcal_config().seed == 42 and auto.featcal_config().num_calibration_examples == 256
