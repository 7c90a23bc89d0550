"""The one door to calibration data (featcal.data.open_calibration, issue 52): sources and in-memory batches of one
task map read through it, refused at check() before any load, opened and preprocessed once; its options one frozen,
validated value."""

from __future__ import annotations

import logging

import pytest
import torch
from pydantic import ValidationError

import featcal.data.calibration as calibration_module
from featcal.config import (
    CalibrationOptions,
    DataOptions,
    FeatCalConfig,
    MergeConfig,
    calibration_options,
    parse,
)
from featcal.data import DataReader, load_calibration_batches, open_calibration
from featcal.data.preprocess import TextPreprocessor
from featcal.errors import CalibrationDataError, ConfigError
from tests.builders.data_fixtures import save_image_processor, save_tokenizer, sentences, write_jsonl
from tests.builders.tiny import sample_inputs, tiny_model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("door")
    dirs = {"bert": root / "bert", "clip": root / "clip"}
    tiny_model("bert").save_pretrained(dirs["bert"])
    save_tokenizer(dirs["bert"], "bert")
    tiny_model("clip").save_pretrained(dirs["clip"])
    save_image_processor(dirs["clip"])
    return dirs


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("texts") / "d.jsonl", [{"text": t} for t in sentences(6)])


def _options(**values) -> CalibrationOptions:
    return calibration_options(FeatCalConfig(**values))


def _same(a, b) -> bool:
    return len(a) == len(b) and all(x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
                                    for x, y in zip(a, b, strict=True))


def test_a_path_source_and_in_memory_batches_go_through_one_door(models, texts):
    batch = sample_inputs("bert")
    lone = sample_inputs("bert", seed=1)
    data = open_calibration({"a": texts, "b": [batch], "c": lone}, reader=DataReader(models["bert"]),
                            options=_options(num_calibration_examples=5, calibration_batch_size=2))
    assert data.sources == ("a",) and data.in_memory == ("b", "c")
    loaded = data.check().load()
    want = load_calibration_batches(texts, model_dir=models["bert"], num_examples=5, batch_size=2)
    assert _same(loaded.batches["a"], want)  # read as the one-source function reads it
    assert loaded.batches["b"][0] is batch and loaded.batches["c"] == [lone]  # untouched; a lone batch: a list of one
    assert list(loaded.records) == ["a"]  # featcal.json's records of the tasks read from a source
    assert loaded.records["a"]["source"] == str(texts) and loaded.records["a"]["examples"] == 5
    report = loaded.report()
    assert list(report) == ["a", "b", "c"] and report["b"]["source"] == "<in-memory batches>"
    assert report["b"]["examples"] == 2


def test_check_refuses_bad_data_before_any_load(models, texts, monkeypatch):
    def boom(*a, **k):
        raise AssertionError("the data was loaded before it was checked")

    monkeypatch.setattr(calibration_module, "read_plan", boom)
    too_few = open_calibration({"a": texts}, reader=DataReader(models["bert"]),
                               options=_options(num_calibration_examples=50))  # asked for: a requirement
    with pytest.raises(CalibrationDataError, match="task 'a': .*holds 6 examples, fewer than the 50 asked for"):
        too_few.check()
    images_model = open_calibration({"a": texts}, reader=DataReader(models["clip"]), options=_options())
    with pytest.raises(CalibrationDataError, match="task 'a': .*holds texts, but the model .* takes images"):
        images_model.check()
    empty = open_calibration({"a": texts, "b": []}, reader=DataReader(models["bert"]), options=_options())
    with pytest.raises(CalibrationDataError, match="task 'b' is empty"):
        empty.check()
    no_model = open_calibration({"a": texts}, options=_options())
    with pytest.raises(ConfigError, match="the model's config is needed"):
        no_model.check()


def test_default_count_is_a_ceiling_with_a_warning_at_load(models, texts, caplog):
    data = open_calibration({"a": texts}, reader=DataReader(models["bert"]), options=_options()).check()
    with caplog.at_level(logging.WARNING, logger="featcal"):
        loaded = data.load()
    assert loaded.records["a"]["examples"] == 6 and "fewer than the 256 used by default" in loaded.records["a"]["warning"]
    assert "fewer than the 256" in caplog.text


def test_load_after_check_opens_and_preprocesses_nothing_again(models, texts, monkeypatch):
    opened, preprocessed = [], []
    real_open, real_call = calibration_module.open_source, TextPreprocessor.__call__

    def counting_open(*a, **k):
        opened.append(a[0])
        return real_open(*a, **k)

    def counting_call(self, examples):
        preprocessed.append(len(examples))
        return real_call(self, examples)

    monkeypatch.setattr(calibration_module, "open_source", counting_open)
    monkeypatch.setattr(TextPreprocessor, "__call__", counting_call)
    data = open_calibration({"a": texts, "b": sentences(4, seed=3)}, reader=DataReader(models["bert"]),
                            options=_options(num_calibration_examples=4, calibration_batch_size=3))
    data.check()
    assert len(opened) == 2 and preprocessed == [3, 1, 3, 1]  # each source opened, its draw preprocessed: once
    first = data.load()
    again = data.check().load()
    assert len(opened) == 2 and preprocessed == [3, 1, 3, 1]  # neither opened nor preprocessed again
    assert _same(first.batches["a"], again.batches["a"])
    other = data.load(batch_size=4)  # other batches: preprocessed again from the plan, not opened again
    assert len(opened) == 2 and preprocessed[4:] == [4, 4]
    assert [b["input_ids"].shape[0] for b in other.batches["a"]] == [4]


def test_options_are_one_frozen_validated_value():
    options = calibration_options(MergeConfig(num_calibration_examples=8), max_length=64, allow_fewer=True)
    assert (options.num_calibration_examples, options.max_length, options.allow_fewer) == (8, 64, True)
    assert options.num_examples_explicit  # given, so a requirement
    assert not calibration_options(FeatCalConfig()).num_examples_explicit  # the default: a ceiling
    assert CalibrationOptions(num_calibration_examples=4).num_examples_explicit
    assert not CalibrationOptions().num_examples_explicit
    with pytest.raises(ValidationError, match="frozen"):
        options.max_length = 32
    assert list(options.report()) == [*DataOptions.model_fields, "max_length", "allow_fewer"]  # a merge's record
    with pytest.raises(ConfigError, match="max_length must be at least 1, got 0"):
        calibration_options(FeatCalConfig(), max_length=0)
    with pytest.raises(ConfigError, match="max_length: .*not the boolean true"):
        calibration_options(FeatCalConfig(), max_length=True)
    with pytest.raises(ConfigError, match="Extra inputs are not permitted"):
        parse(CalibrationOptions, {"max_len": 8})
    with pytest.raises(ConfigError, match="text_unit"):
        parse(CalibrationOptions, {"text_unit": "sentence"})
    with pytest.raises(ConfigError, match="options must be CalibrationOptions"):
        open_calibration({"a": "x"}, options={"max_length": 8})
    with pytest.raises(ConfigError, match="must map task names"):
        open_calibration(["x"], options=options)
