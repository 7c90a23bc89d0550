"""Calibration data loading: every format, determinism, preprocessing, and every refusal."""

from __future__ import annotations

import logging

import datasets
import numpy as np
import pytest
import torch
from PIL import Image

from featcal.data import load_calibration_batches, open_source, sample_indices
from featcal.data.preprocess import accepted_inputs, model_modality
from featcal.errors import CalibrationDataError, ConfigError
from tests.builders.data_fixtures import (
    save_image_processor,
    save_tokenizer,
    sentences,
    write_jsonl,
    write_png_folder,
)
from tests.builders.tiny import tiny_config, tiny_model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Tiny checkpoints with their processors: clip (with), clip_bare (without), bert, t5, bert_bare."""
    root = tmp_path_factory.mktemp("models")
    dirs = {}
    for name, kind in (("clip", "clip"), ("clip_bare", "clip"), ("bert", "bert"), ("t5", "t5"), ("bert_bare", "bert")):
        dirs[name] = root / name
        tiny_model(kind).save_pretrained(dirs[name])
    save_image_processor(dirs["clip"])
    save_tokenizer(dirs["bert"], "bert")
    save_tokenizer(dirs["t5"], "t5")
    return dirs


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    return write_png_folder(tmp_path_factory.mktemp("imgs") / "set", n_per_class=5)


def _load(source, model_dir, n=4, bs=3, **kw):
    return load_calibration_batches(source, model_dir=model_dir, num_examples=n, batch_size=bs, **kw)


def _same(a, b) -> bool:
    return len(a) == len(b) and all(x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x) for x, y in zip(a, b, strict=True))


# ---- formats ---------------------------------------------------------------------------------------------


def test_image_folder_batches_match_the_model(images, models):
    batches = _load(images, models["clip"], n=7, bs=3)
    assert [b["pixel_values"].shape for b in batches] == [(3, 3, 16, 16), (3, 3, 16, 16), (1, 3, 16, 16)]
    out = tiny_model("clip")(**batches[0])  # the batch runs through the model it was made for
    assert out.last_hidden_state.shape == (3, 17, 32)


def test_image_folder_is_recursive_case_insensitive_and_skips_hidden(tmp_path):
    rng = np.random.default_rng(1)
    (tmp_path / "a" / "deep").mkdir(parents=True)
    (tmp_path / ".cache").mkdir()
    for rel in ("a/x.JPG", "a/deep/y.bmp", "z.webp", "b.jpeg", ".cache/hidden.png"):
        Image.fromarray(rng.integers(0, 256, (9, 9, 3), dtype=np.uint8)).save(tmp_path / rel)
    (tmp_path / "notes.txt").write_text("not an image")
    src = open_source(tmp_path, modality="image")  # read for an image model: its images, nothing else
    assert [p.relative_to(tmp_path).as_posix() for p in src.files] == ["a/deep/y.bmp", "a/x.JPG", "b.jpeg", "z.webp"]


def test_saved_dataset_and_datasetdict_train_split(tmp_path, models):
    rng = np.random.default_rng(0)
    imgs = [Image.fromarray(rng.integers(0, 256, (12, 12, 3), dtype=np.uint8)) for _ in range(6)]
    ds = datasets.Dataset.from_dict(
        {"picture": imgs, "label": list(range(6))},
        features=datasets.Features({"picture": datasets.Image(), "label": datasets.Value("int64")}),
    )
    ds.save_to_disk(str(tmp_path / "plain"))
    other = datasets.Dataset.from_dict({"picture": imgs[:2]}, features=datasets.Features({"picture": datasets.Image()}))
    datasets.DatasetDict({"train": ds, "test": other}).save_to_disk(str(tmp_path / "dict"))
    plain = _load(tmp_path / "plain", models["clip"], n=6, bs=6)
    from_dict = _load(tmp_path / "dict", models["clip"], n=6, bs=6)
    assert plain[0]["pixel_values"].shape == (6, 3, 16, 16)
    assert _same(plain, from_dict)  # the DatasetDict's train split, not its test split


def test_datasetdict_without_train_is_refused(tmp_path, models):
    a = datasets.Dataset.from_dict({"text": ["w1 w2"]})
    datasets.DatasetDict({"validation": a, "test": a}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(CalibrationDataError, match="without a 'train' split.*validation, test"):
        _load(tmp_path / "dd", models["bert"], n=1)


def test_saved_text_dataset_uses_the_text_column(tmp_path, models):
    texts = sentences(5)
    datasets.Dataset.from_dict({"idx": list(range(5)), "sentence": texts}).save_to_disk(str(tmp_path / "t"))
    jsonl = write_jsonl(tmp_path / "t.jsonl", [{"sentence": t} for t in texts])
    assert _same(_load(tmp_path / "t", models["bert"], n=5), _load(jsonl, models["bert"], n=5))


def test_jsonl_text_batches_pad_and_mask(tmp_path, models):
    path = write_jsonl(tmp_path / "d.jsonl", [{"id": i, "text": t} for i, t in enumerate(sentences(6))])
    batches = _load(path, models["bert"], n=6, bs=6)
    (b,) = batches
    assert set(b) >= {"input_ids", "attention_mask"}
    lengths = b["attention_mask"].sum(1)
    assert lengths.min() < b["input_ids"].shape[1]  # texts of different lengths: padding happened
    assert torch.all(b["input_ids"][b["attention_mask"] == 0] == 0)  # padded positions hold [PAD]
    assert torch.all(b["input_ids"][:, 0] == 2)  # the tokenizer's own template ([CLS] first)
    assert tiny_model("bert")(**b).last_hidden_state.shape[:2] == b["input_ids"].shape


def test_first_string_field_when_no_text_field(tmp_path, models):
    texts = sentences(4)
    a = write_jsonl(tmp_path / "a.jsonl", [{"n": 1, "body": t} for t in texts])
    b = write_jsonl(tmp_path / "b.jsonl", [{"text": t} for t in texts])
    assert _same(_load(a, models["bert"]), _load(b, models["bert"]))


def test_parquet_texts_equal_jsonl(tmp_path, models):
    texts = sentences(8)
    datasets.Dataset.from_dict({"text": texts}).to_parquet(str(tmp_path / "d.parquet"))
    jsonl = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in texts])
    assert _same(_load(tmp_path / "d.parquet", models["bert"], n=8), _load(jsonl, models["bert"], n=8))


def test_truncation_to_max_length(tmp_path, models):
    path = write_jsonl(tmp_path / "long.jsonl", [{"text": t} for t in sentences(3, lo=30, hi=31)])
    (b,) = _load(path, models["bert"], n=3, max_length=10)
    assert b["input_ids"].shape == (3, 10)
    (c,) = _load(path, models["bert"], n=3, max_length=1000)  # clamped to max_position_embeddings (64)
    assert c["input_ids"].shape[1] <= 64


def test_encoder_decoder_gets_teacher_forced_decoder_inputs(tmp_path, models):
    texts, targets = sentences(4), sentences(4, seed=7)
    path = write_jsonl(tmp_path / "s2s.jsonl", [{"text": t, "target": g} for t, g in zip(texts, targets, strict=True)])
    (b,) = _load(path, models["t5"], n=4, bs=4)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(models["t5"])
    assert torch.all(b["decoder_input_ids"][:, 0] == 0)  # decoder_start_token_id
    order = [texts.index(tok.decode(row[m.bool()], skip_special_tokens=True)) for row, m in
             zip(b["input_ids"], b["attention_mask"], strict=True)]
    for row, mask, i in zip(b["decoder_input_ids"], b["decoder_attention_mask"], order, strict=True):
        target_ids = tok(targets[i])["input_ids"]  # words + </s>
        assert row[mask.bool()].tolist() == [0] + target_ids[:-1]  # shifted right by one
    assert tiny_model("t5")(**b).logits.shape[:2] == b["decoder_input_ids"].shape


def test_encoder_decoder_without_target_starts_from_the_start_token(tmp_path, models):
    path = write_jsonl(tmp_path / "plain.jsonl", [{"text": t} for t in sentences(3)])
    (b,) = _load(path, models["t5"], n=3)
    assert b["decoder_input_ids"].tolist() == [[0], [0], [0]]


def test_label_text_is_a_target_too(tmp_path, models):
    path = write_jsonl(tmp_path / "lt.jsonl", [{"text": "w1 w2", "label_text": "w3 w4 w5"}])
    (b,) = _load(path, models["t5"], n=1)
    assert b["decoder_input_ids"].tolist() == [[0, 6, 7, 8]]


def test_only_inputs_the_forward_names_are_kept():
    assert "token_type_ids" in accepted_inputs(tiny_config("bert"))
    assert "token_type_ids" not in accepted_inputs(tiny_config("llama"))
    assert model_modality(tiny_config("vit")) == "image" and model_modality(tiny_config("t5")) == "text"


def test_missing_image_processor_falls_back_with_a_warning(images, models, caplog):
    with caplog.at_level(logging.WARNING, logger="featcal.data.preprocess"):
        (b,) = _load(images, models["clip_bare"], n=2)
    assert b["pixel_values"].shape == (2, 3, 16, 16)
    assert "no image processor" in caplog.text and "CLIP" in caplog.text


def test_processor_size_mismatch_is_refused(images, models, tmp_path):
    import shutil

    wrong = tmp_path / "wrong"
    shutil.copytree(models["clip_bare"], wrong)
    save_image_processor(wrong, size=24)
    with pytest.raises(CalibrationDataError, match=r"\(3, 24, 24\).*expects \(3, 16, 16\)"):
        _load(images, wrong, n=2)


# ---- determinism -----------------------------------------------------------------------------------------


def test_same_seed_same_examples_other_seed_other_examples(images, models):
    a = _load(images, models["clip"], n=4, seed=3)
    b = _load(images, models["clip"], n=4, seed=3)
    c = _load(images, models["clip"], n=4, seed=4)
    assert _same(a, b)
    assert not _same(a, c)


def test_sample_indices_are_distinct_and_prefix_stable():
    small, large = sample_indices(100, 8, seed=5), sample_indices(100, 32, seed=5)
    assert len(set(large)) == 32 and large[:8] == small
    assert sorted(sample_indices(5, 5, seed=1)) == [0, 1, 2, 3, 4]


# ---- refusals --------------------------------------------------------------------------------------------


def test_missing_path(models, tmp_path):
    with pytest.raises(CalibrationDataError, match="nowhere.*does not exist"):
        _load(tmp_path / "nowhere", models["clip"])


def test_empty_folder_and_empty_jsonl(models, tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "readme.txt").write_text("x")
    with pytest.raises(CalibrationDataError, match="empty.*holds no examples"):
        _load(tmp_path / "empty", models["clip"])
    (tmp_path / "e.jsonl").write_text("\n")
    with pytest.raises(CalibrationDataError, match="e.jsonl.*holds no examples"):
        _load(tmp_path / "e.jsonl", models["bert"])


def test_fewer_examples_than_asked(images, models, caplog):
    with pytest.raises(CalibrationDataError, match="holds 10 examples, fewer than the 50"):
        _load(images, models["clip"], n=50)
    with caplog.at_level(logging.WARNING, logger="featcal.data.calibration"):
        batches = _load(images, models["clip"], n=50, bs=4, allow_fewer=True)
    assert sum(len(b["pixel_values"]) for b in batches) == 10
    assert "fewer than the 50" in caplog.text


def test_wrong_modality_both_ways(images, models, tmp_path):
    texts = write_jsonl(tmp_path / "t.jsonl", [{"text": "w1"}])
    with pytest.raises(CalibrationDataError, match="t.jsonl.*holds texts.*clip.*takes images"):
        _load(texts, models["clip"], n=1)
    with pytest.raises(CalibrationDataError, match="holds images.*bert.*takes texts"):
        _load(images, models["bert"], n=1)


def test_unreadable_image_is_named(tmp_path, models):
    write_png_folder(tmp_path / "set", n_per_class=2, classes=("a",))
    (tmp_path / "set" / "a" / "broken.png").write_bytes(b"\x89PNG not really")
    with pytest.raises(CalibrationDataError, match=r"cannot read image file .*broken\.png"):
        _load(tmp_path / "set", models["clip"], n=3)


def test_text_model_without_tokenizer(tmp_path, models):
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": "w1"}])
    with pytest.raises(CalibrationDataError, match="bert_bare has no tokenizer files"):
        _load(path, models["bert_bare"], n=1)


def test_bad_inputs_are_named(tmp_path, models):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "w1"}\n{"text": oops}\n')
    with pytest.raises(CalibrationDataError, match="bad.jsonl, line 2: not valid JSON"):
        _load(bad, models["bert"], n=1)
    blank = write_jsonl(tmp_path / "blank.jsonl", [{"text": "w1"}, {"text": "  "}])
    with pytest.raises(CalibrationDataError, match="blank.jsonl, line 2: no text in column"):
        _load(blank, models["bert"], n=2)
    (tmp_path / "data.xlsx").write_bytes(b"PK\x03\x04")  # CSV is read since issue 37; a spreadsheet is not
    with pytest.raises(CalibrationDataError, match="unsupported format .xlsx"):
        _load(tmp_path / "data.xlsx", models["bert"], n=1)
    with pytest.raises(CalibrationDataError, match="has no config.json"):
        _load(bad, tmp_path, n=1)
    with pytest.raises(ConfigError, match="must be >= 1"):
        _load(bad, models["bert"], n=0)


def test_tokenizer_vocabulary_larger_than_the_model_is_refused(tmp_path, models):
    import shutil

    small = tmp_path / "small_vocab"
    shutil.copytree(models["bert"], small)
    cfg = small / "config.json"
    cfg.write_text(cfg.read_text().replace('"vocab_size": 100', '"vocab_size": 10'))
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": "w30 w31"}])
    with pytest.raises(CalibrationDataError, match="vocabulary has 10 entries"):
        _load(path, small, n=1)
