"""Guarantees from issue 20 about data, names and run files: nothing silent, one-line refusals.

Covers docs/guarantees.md: an ambiguous text column is refused and `text_column` picks one (CLI, YAML,
Python), featcal.json records the column read; duplicate YAML keys are refused; relative image paths
in JSONL / parquet resolve from the data file's folder; 16-bit PNGs are scaled, not clipped; a
test-only saved dataset needs `allow_test_split`; task names that cannot be file names are refused
before any work; non-UTF-8 JSONL / YAML, decompression bombs and a shard index that misplaces a
tensor are one-line errors, and JSONL holding U+2028 loads; YAML booleans are not numbers;
`resume_dir` / `spill_dir` in a run file resolve from the file's folder.
"""

from __future__ import annotations

import json
import re
import shutil
import struct
import zlib
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
import yaml
from PIL import Image
from safetensors.torch import load_file, save_file

import featcal.calibration.front.pipeline as pipeline
from featcal import FeatCalConfig, MergeConfig, merge
from featcal.cli.run_cmd import resolve_paths
from featcal.config import load_run_file, parse
from featcal.data import load_calibration_batches
from featcal.errors import CalibrationDataError, ConfigError
from tests.builders.data_fixtures import sentences, write_jsonl
from tests.builders.guarantees import (
    calibrate_argv,
    cli,
    copy_family,
    leftovers,
    merge_argv,
    one_line_error,
    report,
)

pytestmark = pytest.mark.usefixtures("one_thread")







def _two_column_data(fam: dict, root: Path, first: str = "title") -> dict:
    """Each task's texts under `body`, beside another string column: no conventional name to go by."""
    root.mkdir(parents=True, exist_ok=True)
    data = {}
    for i, t in enumerate(fam["experts"]):
        texts, other = sentences(6, seed=i), sentences(6, seed=30 + i)
        data[t] = write_jsonl(root / f"{t}.jsonl", [{first: o, "body": s} for o, s in zip(other, texts, strict=True)])
    return data


# --- item 3: which text column ----------------------------------------------------------------------------


def test_ambiguous_text_columns_are_refused_naming_them(bert, tmp_path, capsys, no_calibration_work):
    fam = {**bert, "data": _two_column_data(bert, tmp_path / "data")}
    out = tmp_path / "out"
    rc, _, err = cli(calibrate_argv(fam, out), capsys)
    assert rc == 2
    line = one_line_error(err)
    assert re.search(r"task 'task0': .*task0.jsonl: no conventionally named text column .* several string columns "
                     r"could hold the texts: 'title', 'body'; name one with --text-column", line), line
    assert not out.exists() and leftovers(tmp_path) == []


def test_an_id_or_label_column_is_never_taken_as_the_text(bert, tmp_path, capsys, no_calibration_work):
    fam = copy_family(bert, tmp_path / "fam")
    for t in fam["experts"]:
        fam["data"][t] = write_jsonl(tmp_path / f"{t}-ids.jsonl", [{"id": f"row{i}", "label": "yes"} for i in range(6)])
    rc, _, err = cli(calibrate_argv(fam, tmp_path / "out"), capsys)
    assert rc == 2
    line = one_line_error(err)
    assert "holds no image or text column" in line and "string columns: 'id', 'label'" in line
    assert "--text-column" in line


def test_a_text_column_without_strings_is_refused(bert, tmp_path, capsys, no_calibration_work):
    fam = copy_family(bert, tmp_path / "fam")
    rows = [{"text": [3, 4, 5], "body": s} for s in sentences(6)]  # pre-tokenised ids under the usual name
    fam["data"]["task1"] = write_jsonl(tmp_path / "ids.jsonl", rows)
    rc, _, err = cli(calibrate_argv(fam, tmp_path / "out"), capsys)
    assert rc == 2
    line = one_line_error(err)
    assert re.search(r"task 'task1': .*ids.jsonl: column 'text' does not hold strings .*--text-column "
                     r"\(string columns: 'body'\)", line), line


def test_text_column_picks_the_column_and_featcal_json_records_it(bert, tmp_path, capsys):
    plain = tmp_path / "plain"  # the same texts under the conventional name
    rc, _, err = cli(calibrate_argv(bert, plain), capsys)
    assert rc == 0, err
    fam = {**bert, "data": _two_column_data(bert, tmp_path / "data")}
    chosen = tmp_path / "chosen"
    rc, _, err = cli(calibrate_argv(fam, chosen, "--text-column", "body"), capsys)
    assert rc == 0, err
    want, got = report(plain)["inputs"]["calibration"], report(chosen)["inputs"]["calibration"]
    assert want["task0"]["text_column"] == "text" and got["task0"]["text_column"] == "body"
    assert {t: r["tensors_sha256"] for t, r in got.items()} == {t: r["tensors_sha256"] for t, r in want.items()}
    assert report(chosen)["params"]["text_column"] == "body"

    rc, _, err = cli(calibrate_argv(fam, tmp_path / "bad", "--text-column", "bodyy"), capsys)
    assert rc == 2
    assert "text column 'bodyy' does not exist (string columns: 'title', 'body')" in one_line_error(err)


def test_text_column_for_a_vision_model_is_refused(clip, tmp_path, capsys, no_calibration_work):
    rc, _, err = cli(calibrate_argv(clip, tmp_path / "out", "--text-column", "caption"), capsys)
    assert rc == 2
    assert re.search(r"text_column 'caption' is set, but the model in .* \(clip_vision_model\) takes images",
                     one_line_error(err)), err


def test_text_column_in_a_run_file_and_the_python_api(bert, tmp_path, capsys):
    data = _two_column_data(bert, tmp_path / "data", first="summary")
    experts = {t: str(p) for t, p in bert["experts"].items()}
    run = tmp_path / "run.yaml"
    doc = {
        "merge": {"base": str(bert["merged"]), "experts": experts, "method": "regmean",
                  "calibration": {t: str(p) for t, p in data.items()},
                  "params": {"num_calibration_examples": 4, "text_column": "body"}},
        "calibrate": {"calibration": {t: str(p) for t, p in data.items()},
                      "config": {"num_calibration_examples": 4, "calibration_batch_size": 2, "text_column": "body"}},
        "out": str(tmp_path / "out"),
    }
    run.write_text(yaml.safe_dump(doc))
    rc, _, err = cli(["run", run, "--no-progress"], capsys)
    assert rc == 0, err
    assert {r["text_column"] for r in report(tmp_path / "out")["inputs"]["calibration"].values()} == {"body"}

    del doc["calibrate"]["config"]["text_column"]  # the calibration section has its own, refused before merging
    doc["out"] = str(tmp_path / "out2")
    run.write_text(yaml.safe_dump(doc))
    rc, _, err = cli(["run", run, "--no-progress"], capsys)
    assert rc == 2 and "several string columns could hold the texts: 'summary', 'body'" in one_line_error(err)

    with pytest.raises(CalibrationDataError, match="several string columns could hold the texts"):
        merge(bert["merged"], bert["experts"], "regmean", calibration=data, num_calibration_examples=4)
    merge(bert["merged"], bert["experts"], "regmean", calibration=data, num_calibration_examples=4,
          text_column="body", out=tmp_path / "py")
    assert report(tmp_path / "py")["inputs"]["calibration"]["task1"]["text_column"] == "body"
    with pytest.raises(ConfigError, match="text_column: String should have at least 1 character"):
        parse(FeatCalConfig, {"text_column": ""})


# --- item 5: duplicate keys in a run file -------------------------------------------------------------------


@pytest.mark.parametrize(("text", "key", "line"), [
    ("merge:\n  base: {base}\n  experts:\n    a: {e0}\n    b: {e1}\n    a: {e1}\nout: {out}\n", "a", 6),
    ("merge:\n  base: {base}\n  experts: {{a: {e0}, b: {e1}}}\n  method: ties\n  method: average\nout: {out}\n",
     "method", 5),
    ("merge:\n  base: {base}\n  experts: {{a: {e0}, a: {e1}}}\nout: {out}\n", "a", 3),
    ("out: {out}\nmerge:\n  base: {base}\n  experts: {{a: {e0}}}\nout: {out}2\n", "out", 5),
])
def test_duplicate_keys_in_a_run_file_are_refused(bert, tmp_path, capsys, no_merge_work, text, key, line):
    e0, e1 = bert["experts"].values()
    run = tmp_path / "run.yaml"
    run.write_text(text.format(base=bert["base"], e0=e0, e1=e1, out=tmp_path / "out"))
    rc, _, err = cli(["run", run, "--no-progress"], capsys)
    assert rc == 2
    msg = one_line_error(err)
    assert f"run.yaml, line {line}: key {key!r} is given twice in one mapping" in msg, msg
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.yaml"]


def test_yaml_merge_keys_still_override():
    loaded = yaml.load("a: &x {k: 1, j: 2}\nb:\n  <<: *x\n  k: 3\n", Loader=_loader())
    assert loaded["b"] == {"k": 3, "j": 2}


def _loader():
    from featcal.config.files import UniqueKeyLoader

    return UniqueKeyLoader


# --- item 6: relative image paths in data files ---------------------------------------------------------------


def _png(path: Path, seed: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (20, 20, 3), dtype=np.uint8)).save(path)


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "parquet-image-feature"])
def test_relative_image_paths_resolve_from_the_data_file(clip, tmp_path, monkeypatch, fmt):
    data = tmp_path / "data"
    names = [f"imgs/{i}.png" for i in range(4)]
    for i, n in enumerate(names):
        _png(data / n, seed=i)
        _png(tmp_path / "cwd" / n, seed=100 + i)  # decoys of the same names where featcal is run
    rel, absolute = data / f"rel.{fmt}", data / f"abs.{fmt}"
    monkeypatch.chdir(data)  # datasets' writer sizes the images it points to
    for path, rows in ((rel, names), (absolute, [str(data / n) for n in names])):
        if fmt == "jsonl":
            write_jsonl(path.with_suffix(".jsonl"), [{"image": r} for r in rows])
        elif fmt == "parquet":
            datasets.Dataset.from_dict({"image": rows}).to_parquet(str(path.with_suffix(".parquet")))
        else:  # datasets' own Image feature, stored as {bytes: null, path}
            ds = datasets.Dataset.from_dict({"image": rows}).cast_column("image", datasets.Image(decode=False))
            ds.to_parquet(str(path.with_suffix(".parquet")))
    suffix = ".jsonl" if fmt == "jsonl" else ".parquet"
    monkeypatch.chdir(tmp_path / "cwd")
    got = load_calibration_batches(rel.with_suffix(suffix), model_dir=clip["base"], num_examples=4, batch_size=4)
    want = load_calibration_batches(absolute.with_suffix(suffix), model_dir=clip["base"], num_examples=4, batch_size=4)
    assert torch.equal(got[0]["pixel_values"], want[0]["pixel_values"])
    monkeypatch.chdir(tmp_path)  # and from elsewhere, the same images
    again = load_calibration_batches(rel.with_suffix(suffix), model_dir=clip["base"], num_examples=4, batch_size=4)
    assert torch.equal(again[0]["pixel_values"], want[0]["pixel_values"])


# --- item 7: 16-bit PNGs -------------------------------------------------------------------------------------


def _png16(path: Path, samples: np.ndarray) -> None:
    """A 16-bit PNG (greyscale for 2-D `samples`, else 2/3/4 channels), written by hand: PIL cannot write it."""
    arr = samples if samples.ndim == 3 else samples[..., None]
    h, w, c = arr.shape
    colour = {1: 0, 2: 4, 3: 2, 4: 6}[c]
    raw = b"".join(b"\x00" + arr[y].astype(">u2").tobytes() for y in range(h))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", w, h, 16, colour, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))


@pytest.mark.parametrize("processor", ["saved", "fallback"])
def test_16_bit_pngs_are_scaled_not_clipped(clip, tmp_path, processor):
    model_dir = clip["base"]
    if processor == "fallback":
        model_dir = tmp_path / "bare"
        shutil.copytree(clip["base"], model_dir)
        (model_dir / "preprocessor_config.json").unlink()
    grey = np.random.default_rng(0).integers(0, 256, (4, 20, 20), dtype=np.uint16)
    for i, g in enumerate(grey):
        (tmp_path / "wide").mkdir(exist_ok=True)
        (tmp_path / "narrow").mkdir(exist_ok=True)
        _png16(tmp_path / "wide" / f"{i}.png", g * 257)  # the same picture in 16 bits
        Image.fromarray(g.astype(np.uint8)).save(tmp_path / "narrow" / f"{i}.png")
    assert Image.open(tmp_path / "wide" / "0.png").mode.startswith("I")
    wide = load_calibration_batches(tmp_path / "wide", model_dir=model_dir, num_examples=4, batch_size=4)
    narrow = load_calibration_batches(tmp_path / "narrow", model_dir=model_dir, num_examples=4, batch_size=4)
    assert torch.equal(wide[0]["pixel_values"], narrow[0]["pixel_values"])
    write_jsonl(tmp_path / "wide.jsonl", [{"image": f"wide/{i}.png"} for i in range(4)])  # decoded by datasets
    table = load_calibration_batches(tmp_path / "wide.jsonl", model_dir=model_dir, num_examples=4, batch_size=4)
    assert torch.equal(table[0]["pixel_values"], narrow[0]["pixel_values"])


def test_mode_i_images_are_scaled_when_they_hold_16_bit_values():
    from featcal.data.preprocess import to_8bit

    wide = Image.fromarray(np.array([[0, 257 * 100, 65535]], dtype=np.int32))  # mode I, as older PIL opens 16-bit PNGs
    narrow = Image.fromarray(np.array([[0, 100, 255]], dtype=np.int32))
    assert wide.mode == "I" and np.asarray(to_8bit(wide)).tolist() == [[0, 100, 255]]
    assert np.asarray(to_8bit(narrow)).tolist() == [[0, 100, 255]]


# --- item 8: a saved dataset holding only test data ---------------------------------------------------------


def _save_images_as(kind: str, root: Path) -> tuple[Path, str]:
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (20, 20, 3), dtype=np.uint8)) for _ in range(4)]
    features = datasets.Features({"image": datasets.Image()})
    if kind == "DatasetDict":
        datasets.DatasetDict({"test": datasets.Dataset.from_dict({"image": images}, features=features)}).save_to_disk(
            str(root))
        return root, "test"
    split = {"Dataset": "test", "Dataset from train+test": "train+test", "Dataset from test[:4]": "test[:4]"}[kind]
    datasets.Dataset.from_dict({"image": images}, features=features, split=split).save_to_disk(str(root))
    return root, split  # a Dataset saved from a split (as datasets names it) remembers which


@pytest.mark.parametrize("kind", ["DatasetDict", "Dataset", "Dataset from train+test", "Dataset from test[:4]"])
def test_a_test_only_saved_dataset_needs_allow_test_split(clip, tmp_path, capsys, monkeypatch, kind):
    fam = copy_family(clip, tmp_path / "fam")
    fam["data"]["task1"], split = _save_images_as(kind, tmp_path / "test-only")
    out = tmp_path / "out"

    def boom(*a, **k):
        raise AssertionError("a model was loaded before the data was checked")

    with monkeypatch.context() as m:
        m.setattr(pipeline, "load_model", boom)
        rc, _, err = cli(calibrate_argv(fam, out), capsys)
    assert rc == 2
    line = one_line_error(err)
    assert re.search(rf"task 'task1': .*test-only is the {re.escape(repr(split))} split, test data: .* pass "
                     r"--allow-test-split", line), line
    assert not out.exists() and leftovers(tmp_path) == []
    rc, _, err = cli(calibrate_argv(fam, out, "--allow-test-split"), capsys)
    assert rc == 0, err
    assert any(f"calibrating on its {split!r} split" in w for w in report(out)["warnings"])
    assert report(out)["inputs"]["calibration"]["task1"]["split"] == split  # and featcal.json says which


def test_a_train_split_beside_test_is_still_used_silently(clip, tmp_path):
    rng = np.random.default_rng(0)
    features = datasets.Features({"image": datasets.Image()})
    ds = datasets.Dataset.from_dict(
        {"image": [Image.fromarray(rng.integers(0, 256, (20, 20, 3), dtype=np.uint8)) for _ in range(2)]},
        features=features,
    )
    datasets.DatasetDict({"train": ds, "test": ds}).save_to_disk(str(tmp_path / "dd"))
    assert len(load_calibration_batches(tmp_path / "dd", model_dir=clip["base"], num_examples=2, batch_size=2)) == 1


# --- item 13: task names that cannot be file names --------------------------------------------------------


@pytest.mark.parametrize("name", ["glue/sst2", "a\\b", "..", "tab\there"])
def test_a_task_name_that_cannot_be_a_file_name_is_refused_before_work(clip, tmp_path, capsys, no_calibration_work,
                                                                       name):
    fam = copy_family(clip, tmp_path / "fam")
    fam["experts"] = {name: fam["experts"]["task0"], "task1": fam["experts"]["task1"]}
    fam["data"] = {name: fam["data"]["task0"], "task1": fam["data"]["task1"]}
    out = tmp_path / "out"
    rc, _, err = cli(calibrate_argv(fam, out, "--spill-dir", str(tmp_path / "spill")), capsys)
    assert rc == 2
    assert f"expert name {name!r} must not contain '/'" in one_line_error(err), err
    assert not out.exists() and not (tmp_path / "spill").exists() and leftovers(tmp_path) == []


def test_task_names_are_checked_by_merge_run_and_the_python_api(clip, tmp_path, capsys, no_merge_work):
    from featcal import calibrate

    experts = {"glue/sst2": clip["experts"]["task0"], "task1": clip["experts"]["task1"]}
    rc, _, err = cli(merge_argv(clip["base"], experts, tmp_path / "m"), capsys)
    assert rc == 2 and "expert name 'glue/sst2' must not contain '/'" in one_line_error(err)
    assert "use e.g. 'glue-sst2'" in err
    with pytest.raises(ConfigError, match="expert names 'Task1' and 'task1' differ only in case"):
        calibrate(clip["merged"], base=clip["base"], experts={"Task1": clip["experts"]["task0"],
                                                              "task1": clip["experts"]["task1"]},
                  calibration={"Task1": [torch.zeros(1, 3, 16, 16)], "task1": [torch.zeros(1, 3, 16, 16)]})
    run = tmp_path / "run.yaml"
    run.write_text(yaml.safe_dump({
        "merge": {"base": str(clip["base"]), "experts": {t: str(p) for t, p in experts.items()}},
        "calibrate": {"calibration": {"glue/sst2": str(clip["data"]["task0"]), "task1": str(clip["data"]["task1"])}},
        "out": str(tmp_path / "out"),
    }))
    rc, _, err = cli(["run", run, "--no-progress"], capsys)
    assert rc == 2 and "expert name 'glue/sst2'" in one_line_error(err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.yaml"]


def test_names_that_are_fine_as_file_names_calibrate_with_spilled_chains(clip, tmp_path, capsys):
    fam = copy_family(clip, tmp_path / "fam")
    fam["experts"] = {"glue-sst2": fam["experts"]["task0"], "ünï cödé": fam["experts"]["task1"]}
    fam["data"] = {"glue-sst2": fam["data"]["task0"], "ünï cödé": fam["data"]["task1"]}
    rc, _, err = cli(calibrate_argv(fam, tmp_path / "out", "--spill-dir", str(tmp_path / "spill")), capsys)
    assert rc == 0, err
    assert set(report(tmp_path / "out")["inputs"]["calibration"]) == {"glue-sst2", "ünï cödé"}


# --- item 14: tracebacks that became one-line errors ----------------------------------------------------------


def test_a_non_utf8_jsonl_file_is_one_line(bert, tmp_path, capsys, no_calibration_work):
    fam = copy_family(bert, tmp_path / "fam")
    bad = tmp_path / "latin1.jsonl"
    bad.write_bytes('{"text": "w1 w2"}\n{"text": "caf\u00e9 w3"}\n'.encode("latin-1"))
    fam["data"]["task0"] = bad
    rc, _, err = cli(calibrate_argv(fam, tmp_path / "out", "--allow-fewer"), capsys)
    assert rc == 2
    assert re.search(r"task 'task0': .*latin1.jsonl, line 2: not UTF-8 text \(byte 0xe9", one_line_error(err)), err


def test_a_non_utf8_run_file_is_one_line(tmp_path, capsys):
    run = tmp_path / "run.yaml"
    run.write_bytes("out: x\nmerge: {base: b, experts: {caf\u00e9: e}}\n".encode("latin-1"))
    rc, _, err = cli(["run", run], capsys)
    assert rc == 2 and re.search(r"run.yaml, line 2: not UTF-8 text \(byte 0xe9", one_line_error(err))


def test_a_decompression_bomb_is_one_line(clip, tmp_path, capsys, monkeypatch):
    fam = copy_family(clip, tmp_path / "fam")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)  # the 20x24 test images count as bombs (> 2x the limit)
    rc, _, err = cli(calibrate_argv(fam, tmp_path / "out"), capsys)
    assert rc == 2
    line = one_line_error(err)
    assert re.search(r"cannot read image file .*data-task0.*\.png: Image size \(480 pixels\) exceeds limit", line), line
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def _shard(directory: Path, misplace: bool | str | int) -> None:
    """Split a checkpoint into two shards; with `misplace`, the index puts one tensor in the wrong one
    (True) or in the file named by `misplace`."""
    state = load_file(directory / "model.safetensors")
    names = sorted(state)
    halves = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    weight_map = {}
    for file, keys in halves.items():
        save_file({k: state[k] for k in keys}, directory / file, metadata={"format": "pt"})
        weight_map.update({k: file for k in keys})
    if misplace:
        weight_map[names[-1]] = "model-00001-of-00002.safetensors" if misplace is True else misplace
    (directory / "model.safetensors").unlink()
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


SHARD_CASES = {
    "a shard without the tensor": (True, r"expert1/model.safetensors.index.json: the index puts tensor '.*' in "
                                         r"shard model-00001-of-00002.safetensors, which does not hold it"),
    "a file outside the folder": ("../base/model.safetensors",
                                  r"expert1/model.safetensors.index.json: weight_map names "
                                  r"'../base/model.safetensors', not a shard file in .*expert1"),
    "not a file name": (3, r"weight_map names 3, not a shard file"),
}


@pytest.mark.parametrize("case", list(SHARD_CASES))
@pytest.mark.parametrize("command", ["merge", "calibrate"])
def test_a_shard_index_that_misplaces_a_tensor_is_one_line(clip, tmp_path, capsys, command, case):
    misplace, message = SHARD_CASES[case]
    fam = copy_family(clip, tmp_path / "fam")
    _shard(fam["experts"]["task1"], misplace=misplace)
    out = tmp_path / "out"
    argv = merge_argv(fam["base"], fam["experts"], out) if command == "merge" else calibrate_argv(fam, out)
    rc, _, err = cli(argv, capsys)
    assert rc == 2
    line = one_line_error(err)
    assert re.search(message, line), line
    assert not out.exists() and leftovers(tmp_path) == []


def test_a_correct_shard_index_still_reads(clip, tmp_path, capsys):
    fam = copy_family(clip, tmp_path / "fam")
    _shard(fam["experts"]["task1"], misplace=False)
    rc, _, err = cli(merge_argv(fam["base"], fam["experts"], tmp_path / "out"), capsys)
    assert rc == 0, err


def test_jsonl_holding_u2028_inside_a_string_is_valid(bert, tmp_path):
    texts = [s.replace(" ", "\u2028", 1) for s in sentences(4)]  # a line separator inside the JSON string
    raw = tmp_path / "raw.jsonl"
    raw.write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in texts), encoding="utf-8")
    assert "\u2028" in raw.read_text(encoding="utf-8")
    escaped = write_jsonl(tmp_path / "escaped.jsonl", [{"text": t} for t in texts])
    a = load_calibration_batches(raw, model_dir=bert["merged"], num_examples=4, batch_size=4)
    b = load_calibration_batches(escaped, model_dir=bert["merged"], num_examples=4, batch_size=4)
    assert torch.equal(a[0]["input_ids"], b[0]["input_ids"])


# --- item 15: YAML booleans; run-file directories ---------------------------------------------------------


@pytest.mark.parametrize(("section", "field"), [("params", "scaling"), ("params", "seed"),
                                                ("config", "lambda_ratio"), ("config", "checkpoint_every")])
def test_a_boolean_is_not_a_number(clip, tmp_path, capsys, no_merge_work, section, field):
    doc = {
        "merge": {"base": str(clip["base"]), "experts": {t: str(p) for t, p in clip["experts"].items()}},
        "calibrate": {"calibration": {t: str(p) for t, p in clip["data"].items()}},
        "out": str(tmp_path / "out"),
    }
    (doc["merge"] if section == "params" else doc["calibrate"])[section] = {field: True}
    run = tmp_path / "run.yaml"
    run.write_text(yaml.safe_dump(doc))
    rc, _, err = cli(["run", run, "--no-progress"], capsys)
    assert rc == 2 and f"{field}: Value error, Input should be a number, not the boolean true" in one_line_error(err)
    model = MergeConfig if section == "params" else FeatCalConfig
    with pytest.raises(ConfigError, match=f"{field}: .*not the boolean"):
        parse(model, {field: True})
    assert parse(FeatCalConfig, {"calibrate_bias": False}).calibrate_bias is False  # real booleans still are


def test_run_file_directories_resolve_from_its_folder(clip, tmp_path, capsys, monkeypatch):
    folder = tmp_path / "runs"
    folder.mkdir()
    run = folder / "run.yaml"
    run.write_text(yaml.safe_dump({
        "merge": {"base": str(clip["base"]), "experts": {t: str(p) for t, p in clip["experts"].items()}},
        "calibrate": {"calibration": {t: str(p) for t, p in clip["data"].items()},
                      "config": {"num_calibration_examples": 4, "calibration_batch_size": 2,
                                 "spill_dir": "spill", "resume_dir": "state"}},
        "out": "out",
    }))
    resolved = resolve_paths(load_run_file(run), folder).calibrate.featcal_config()
    assert (resolved.spill_dir, resolved.resume_dir) == (folder / "spill", folder / "state")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    rc, _, err = cli(["run", run, "--no-progress"], capsys)
    assert rc == 0, err
    params = report(folder / "out")["params"]
    assert (params["spill_dir"], params["resume_dir"]) == (str(folder / "spill"), str(folder / "state"))
    assert list(elsewhere.iterdir()) == []  # nothing written where the command happened to run
