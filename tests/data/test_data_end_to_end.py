"""Calibration data as users have it, end to end on tiny models (issue 37), through the CLI, YAML and Python.

Each format runs a real calibration, and the token ids handed to the calibrator are compared with what
`tokenizer(...)` / `tokenizer.apply_chat_template(...)` make of the same examples, drawn in the same
seeded order: a wrong unit, template, packing or column fails here. featcal.json records how each task's
data was read. Bad input (an empty file, a non-UTF-8 file, an unknown chat role, a CSV without a text
column, a folder of mixed files, a hub id offline, chat data without a chat template) is one line on
the command line, before any model is loaded. The default example count is a ceiling; a count given
is a requirement.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import datasets
import pytest
import torch
import yaml
from transformers import AutoTokenizer, CLIPImageProcessor

import featcal
import featcal.calibration.core.setting as core
import featcal.calibration.front.pipeline as pipeline
from featcal import FeatCalConfig, MergeConfig
from featcal.data import read_examples, sample_indices
from featcal.errors import CalibrationDataError
from featcal.io.read.models import load_model
from tests.builders.data_fixtures import conversations, sentences, write_jsonl, write_png_folder
from tests.builders.guarantees import calibrate_argv, cli, one_line_error, report
from tests.builders.pipeline_family import llama_family
from tests.builders.tiny import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")





@pytest.fixture
def fed(monkeypatch):
    """The calibration batches each calibration was handed, task -> list of batches (in call order)."""
    seen: list[dict] = []
    real = core.calibrate_setting

    def spy(merged, **kwargs):
        kwargs["calibration"] = {t: list(bs) for t, bs in kwargs["calibration"].items()}  # an iterator read once
        seen.append({t: [dict(b) for b in bs] for t, bs in kwargs["calibration"].items()})
        return real(merged, **kwargs)

    monkeypatch.setattr(core, "calibrate_setting", spy)
    return seen


@pytest.fixture
def no_model_loaded(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("a model was loaded before the calibration data was checked")

    monkeypatch.setattr(pipeline, "load_model", boom)
    monkeypatch.setattr(core, "as_model", boom)



def _with(fam: dict, data: dict) -> dict:
    return {**fam, "data": data}


def _order(n: int, count: int | None = None, seed: int = 0) -> list[int]:
    return sample_indices(n, n if count is None else count, seed)


def _chunks(items: list, size: int) -> list[list]:
    return [items[i:i + size] for i in range(0, len(items), size)]


def _same_batches(got: list[dict], want: list[dict]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert sorted(g) == sorted(w)
        for key in w:
            assert torch.equal(g[key], w[key]), key


def _text_batches(tokenizer, texts: list[str], size: int, max_length: int, keep=None) -> list[dict]:
    out = []
    for chunk in _chunks(texts, size):
        enc = tokenizer(chunk, padding=True, truncation=True, max_length=max_length, return_tensors="pt")
        out.append({k: v for k, v in enc.items() if keep is None or k in keep})
    return out


def _chat_batches(tokenizer, convs: list, size: int, max_length: int, template: str | None = None) -> list[dict]:
    return [dict(tokenizer.apply_chat_template(chunk, chat_template=template, tokenize=True, return_dict=True,
                                               padding=True, truncation=True, max_length=max_length,
                                               return_tensors="pt"))
            for chunk in _chunks(convs, size)]


def _packed_batches(tokenizer, documents: list[str], window: int, count: int, size: int) -> list[dict]:
    stream: list[int] = []
    for i in _order(len(documents)):
        stream += tokenizer(documents[i])["input_ids"] + [tokenizer.eos_token_id]
    windows = [stream[i:i + window] for i in range(0, len(stream), window)][:count]
    out = []
    for chunk in _chunks(windows, size):
        width = max(map(len, chunk))
        ids = torch.tensor([w + [tokenizer.pad_token_id] * (width - len(w)) for w in chunk])
        mask = torch.tensor([[1] * len(w) + [0] * (width - len(w)) for w in chunk])
        out.append({"input_ids": ids, "attention_mask": mask})
    return out


# ---- chat / SFT on a decoder ---------------------------------------------------------------------------------


def test_chat_records_are_rendered_with_the_chat_template(llama, tmp_path, capsys, fed):
    convs = conversations(5)
    alpaca = [{"instruction": s, "input": "w9" if i % 2 else "", "output": t}
              for i, (s, t) in enumerate(zip(sentences(6, seed=4), sentences(6, seed=5), strict=True))]
    data = {"task0": write_jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in convs]),
            "task1": write_jsonl(tmp_path / "alpaca.jsonl", alpaca)}
    out = tmp_path / "out"
    rc, _, err = cli(calibrate_argv(_with(llama, data), out, calib_flags=("--calibration-batch-size", "2")), capsys)
    assert rc == 0, err

    tok = AutoTokenizer.from_pretrained(llama["merged"])
    want0 = [convs[i] for i in _order(5)]
    rendered1 = [list(e.messages) for e in read_examples(data["task1"])]
    assert rendered1[1][0]["content"].endswith("\n\nw9")  # the input follows the instruction
    want1 = [rendered1[i] for i in _order(6)]
    (batches,) = fed
    _same_batches(batches["task0"], _chat_batches(tok, want0, 2, 64))
    _same_batches(batches["task1"], _chat_batches(tok, want1, 2, 64))

    record = report(out)["inputs"]["calibration"]
    assert record["task0"]["content"] == "chat" and record["task0"]["chat_layout"] == "messages"
    assert record["task1"]["chat_layout"] == "instruction/input/output"
    assert record["task0"]["chat_template"]["from"] == f"the tokenizer in {llama['merged']}"
    assert record["task0"]["examples"] == 5 and record["task0"]["requested"] == 256
    assert record["task0"]["tokens"] == sum(int(b["attention_mask"].sum()) for b in batches["task0"])
    assert "fewer than the 256 used by default" in record["task0"]["warning"]
    assert sum("fewer than the 256 used by default" in w for w in report(out)["warnings"]) == 2  # once per task


def test_a_template_found_beside_the_experts_is_used_and_named(tmp_path, capsys, fed):
    fam = llama_family(tmp_path / "fam", template_with="experts")
    convs = conversations(4, seed=7)
    data = {t: write_jsonl(tmp_path / f"{t}.jsonl", [{"messages": c} for c in convs]) for t in fam["experts"]}
    out = tmp_path / "out"
    rc, _, err = cli(calibrate_argv(_with(fam, data), out, calib_flags=("--calibration-batch-size", "4")), capsys)
    assert rc == 0, err
    record = report(out)["inputs"]["calibration"]
    assert record["task1"]["chat_template"]["from"] == f"expert 'task1' ({fam['experts']['task1']})"
    template = AutoTokenizer.from_pretrained(fam["experts"]["task1"]).chat_template
    tok = AutoTokenizer.from_pretrained(fam["merged"])
    assert tok.chat_template is None
    _same_batches(fed[0]["task1"], _chat_batches(tok, [convs[i] for i in _order(4)], 4, 64, template))


def test_chat_data_without_any_chat_template_is_one_line(bert, tmp_path, capsys, no_model_loaded):
    data = {t: write_jsonl(tmp_path / f"{t}.jsonl", [{"messages": c} for c in conversations(3)])
            for t in bert["experts"]}
    rc, _, err = cli(calibrate_argv(_with(bert, data), tmp_path / "out"), capsys)
    assert rc == 2
    line = one_line_error(err)
    assert "task 'task0': chat data needs a chat template" in line and f"the tokenizer in {bert['merged']} has none" in line
    assert "nor do expert 'task0', expert 'task1'" in line and "--text-column" in line


# ---- plain text ---------------------------------------------------------------------------------------------


def test_text_files_are_packed_into_windows_for_a_decoder(llama, tmp_path, capsys, fed):
    paragraphs = sentences(9, seed=11, lo=3, hi=12)
    (tmp_path / "notes.txt").write_text("\n\n".join(paragraphs) + "\n")
    folder = tmp_path / "docs"
    folder.mkdir()
    documents = [" ".join(sentences(4, seed=20 + i)) for i in range(5)]
    for i, d in enumerate(documents):
        (folder / f"doc{i}.md").write_text(d)
    data = {"task0": tmp_path / "notes.txt", "task1": folder}
    out = tmp_path / "out"
    argv = calibrate_argv(_with(llama, data), out, "--max-length", "16", calib_flags=("--calibration-batch-size", "3"))
    rc, _, err = cli(argv, capsys)
    assert rc == 0, err
    tok = AutoTokenizer.from_pretrained(llama["merged"])
    (batches,) = fed
    want0 = _packed_batches(tok, paragraphs, 16, 256, 3)
    want1 = _packed_batches(tok, [(folder / f"doc{i}.md").read_text() for i in range(5)], 16, 256, 3)
    _same_batches(batches["task0"], want0)
    _same_batches(batches["task1"], want1)
    assert sum(len(b["input_ids"]) for b in want0) > 1  # several windows: the unit and the cut both matter
    record = report(out)["inputs"]["calibration"]
    assert record["task0"]["unit"] == "paragraph" and record["task1"]["unit"] == "file"
    assert record["task0"]["packed"] == {"window": 16, "documents": 9}
    assert record["task1"]["format"] == "text folder" and record["task1"]["files"] == 5

    out2 = tmp_path / "unpacked"  # --no-pack-texts: one example per unit, truncated
    rc, _, err = cli(calibrate_argv(_with(llama, data), out2, "--max-length", "16", "--no-pack-texts",
                                    "--text-unit", "line", calib_flags=("--calibration-batch-size", "4")), capsys)
    assert rc == 0, err
    _same_batches(fed[1]["task0"], _text_batches(tok, [paragraphs[i] for i in _order(9)], 4, 16))


def test_text_and_csv_for_an_encoder_one_example_per_unit(bert, tmp_path, capsys, fed):
    lines = sentences(7, seed=3)
    (tmp_path / "lines.txt").write_text("\n".join(lines) + "\n")
    texts = sentences(6, seed=5)
    (tmp_path / "t.tsv").write_text("id\ttext\tlabel\n" + "".join(f"{i}\t{t}\t{i % 2}\n" for i, t in enumerate(texts)))
    data = {"task0": tmp_path / "lines.txt", "task1": tmp_path / "t.tsv"}
    out = tmp_path / "out"
    rc, _, err = cli(calibrate_argv(_with(bert, data), out, "--text-unit", "line",
                                    calib_flags=("--calibration-batch-size", "4")), capsys)
    assert rc == 0, err
    tok = AutoTokenizer.from_pretrained(bert["merged"])
    keep = {"input_ids", "attention_mask", "token_type_ids"}
    _same_batches(fed[0]["task0"], _text_batches(tok, [lines[i] for i in _order(7)], 4, 128, keep))
    _same_batches(fed[0]["task1"], _text_batches(tok, [texts[i] for i in _order(6)], 4, 128, keep))
    record = report(out)["inputs"]["calibration"]
    assert (record["task0"]["format"], record["task0"]["unit"]) == ("text file", "line")
    assert "packed" not in record["task0"]  # an encoder reads one example per unit
    assert (record["task1"]["format"], record["task1"]["text_column"]) == ("tsv", "text")


def test_a_cached_hub_dataset_by_id(bert, tmp_path, capsys, fed, monkeypatch):
    from tests.builders.data_fixtures import cache_as_hub_dataset

    texts = sentences(5, seed=8)
    cache = cache_as_hub_dataset(tmp_path, "acme/reviews", "main", {"train": [{"text": t} for t in texts]})
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(cache))
    data = {"task0": "acme/reviews:main@train", "task1": "acme/reviews:main"}
    out = tmp_path / "out"
    rc, _, err = cli(calibrate_argv(_with(bert, data), out, calib_flags=("--calibration-batch-size", "5")), capsys)
    assert rc == 0, err
    tok = AutoTokenizer.from_pretrained(bert["merged"])
    keep = {"input_ids", "attention_mask", "token_type_ids"}
    _same_batches(fed[0]["task0"], _text_batches(tok, [texts[i] for i in _order(5)], 5, 128, keep))
    record = report(out)["inputs"]["calibration"]["task0"]
    assert (record["source"], record["format"], record["split"]) == ("acme/reviews:main@train", "hub dataset", "train")


# ---- images, through the Python API ---------------------------------------------------------------------------


def test_an_image_folder_through_the_python_api(clip, tmp_path, fed):
    result = featcal.calibrate(
        clip["merged"], base=clip["base"], experts=clip["experts"], calibration=clip["data"],
        config=FeatCalConfig(calibration_batch_size=3), progress=False,
    )
    processor = CLIPImageProcessor.from_pretrained(clip["base"])  # the merge has none: the base's is used
    for t, folder in clip["data"].items():
        images = read_examples(folder)
        order = _order(len(images))
        want = [{"pixel_values": processor(images=[images[i].image.convert("RGB") for i in chunk],
                                           return_tensors="pt")["pixel_values"]}
                for chunk in _chunks(order, 3)]
        _same_batches(fed[0][t], want)
        assert result.calibration_data[t]["format"] == "image folder"
        assert result.calibration_data[t]["source"] == str(folder)


# ---- the Python API takes what the CLI takes ---------------------------------------------------------------------


def test_the_python_api_reads_paths_lists_and_datasets(llama, tmp_path, fed):
    convs = conversations(4, seed=2)
    chat = write_jsonl(tmp_path / "chat.jsonl", [{"prompt": c[-2]["content"], "completion": c[-1]["content"]}
                                                for c in convs])
    texts = sentences(5, seed=6)
    merged = load_model(llama["merged"])  # a model object: its tokenizer is found from its name_or_path
    config = FeatCalConfig(calibration_batch_size=2, num_calibration_examples=4)
    with pytest.raises(CalibrationDataError, match=r"holds 4 examples, fewer than the 5 asked for"):
        featcal.calibrate(merged, base=llama["base"], experts=llama["experts"], progress=False,
                          config=config.model_copy(update={"num_calibration_examples": 5}),
                          calibration={"task0": chat, "task1": datasets.Dataset.from_dict({"text": texts[:4]})})
    result = featcal.calibrate(merged, base=llama["base"], experts=llama["experts"], progress=False,
                               calibration={"task0": str(chat), "task1": texts}, config=config)
    tok = AutoTokenizer.from_pretrained(llama["merged"])
    pairs = [[{"role": "user", "content": c[-2]["content"]}, {"role": "assistant", "content": c[-1]["content"]}]
             for c in convs]
    batches = fed[-1]
    _same_batches(batches["task0"], _chat_batches(tok, [pairs[i] for i in _order(4)], 2, 64))
    _same_batches(batches["task1"], _text_batches(tok, [texts[i] for i in _order(5, 4)], 2, 64))
    assert result.calibration_data["task0"]["chat_layout"] == "prompt/completion"
    assert result.calibration_data["task1"]["format"] == "texts (in memory)"

    # a list of conversations and a datasets.Dataset, as a user holds them in a notebook
    featcal.calibrate(merged, base=llama["base"], experts=llama["experts"], progress=False, config=config,
                      calibration={"task0": convs, "task1": datasets.Dataset.from_dict({"text": texts})})
    _same_batches(fed[-1]["task0"], _chat_batches(tok, [convs[i] for i in _order(4)], 2, 64))
    _same_batches(fed[-1]["task1"], _text_batches(tok, [texts[i] for i in _order(5, 4)], 2, 64))

    # hand-made batches keep working beside a source, untouched
    handmade = [{"input_ids": torch.tensor([[1, 9, 10, 11]]), "attention_mask": torch.ones(1, 4, dtype=torch.long)}]
    featcal.calibrate(merged, base=llama["base"], experts=llama["experts"], progress=False,
                      calibration={"task0": (b for b in handmade), "task1": texts}, config=config)  # any iterable
    _same_batches(fed[-1]["task0"], handmade)


def test_the_python_api_needs_a_tokenizer_for_texts(llama, tmp_path, fed):
    bare = tiny_model("llama")  # built in memory: no folder behind it, so no tokenizer to find
    experts = {t: load_model(p) for t, p in llama["experts"].items()}
    texts = sentences(3)
    with pytest.raises(CalibrationDataError, match=r"task\(s\) 'task0', 'task1': reading calibration texts needs the "
                                                   r"model's tokenizer.*pass tokenizer="):
        featcal.calibrate(bare, experts=experts, calibration={"task0": texts, "task1": texts}, progress=False,
                          config=FeatCalConfig(anchor_blend_rho=1.0))
    tok = AutoTokenizer.from_pretrained(llama["merged"])
    before = tok.pad_token
    featcal.calibrate(bare, experts=experts, calibration={"task0": texts, "task1": texts}, progress=False,
                      config=FeatCalConfig(anchor_blend_rho=1.0, calibration_batch_size=3), tokenizer=tok)
    _same_batches(fed[-1]["task0"], _text_batches(tok, [texts[i] for i in _order(3)], 3, 64))
    assert tok.pad_token == before  # the caller's tokenizer is not changed
    featcal.calibrate(bare, experts=experts, calibration={"task0": texts, "task1": texts}, progress=False,
                      config=FeatCalConfig(anchor_blend_rho=1.0), tokenizer=str(llama["merged"]))


def test_a_regmean_merge_reads_a_text_file(bert, tmp_path):
    (tmp_path / "t.txt").write_text("\n".join(sentences(6, seed=1)))
    data = {t: tmp_path / "t.txt" for t in bert["experts"]}
    featcal.merge(bert["merged"], bert["experts"], "regmean", calibration=data, text_unit="line",
                  out=tmp_path / "merged", progress=False)
    record = report(tmp_path / "merged")
    rows = json.dumps(record)
    assert '"unit": "line"' in rows and '"format": "text file"' in rows and "used by default" in rows


# ---- how many examples --------------------------------------------------------------------------------------------


def test_the_default_count_is_a_ceiling_and_a_given_count_a_requirement(bert, tmp_path, capsys):
    plain = {t: write_jsonl(tmp_path / f"{t}.jsonl", [{"text": s} for s in sentences(6, seed=i)])
             for i, t in enumerate(bert["experts"])}
    fam = _with(bert, plain)
    rc, _, err = cli(calibrate_argv(fam, tmp_path / "default", calib_flags=()), capsys)
    assert rc == 0, err
    assert report(tmp_path / "default")["inputs"]["calibration"]["task0"]["examples"] == 6
    rc, _, err = cli(calibrate_argv(fam, tmp_path / "given", calib_flags=("--num-calibration-examples", "256")), capsys)
    assert rc == 2 and "holds 6 examples, fewer than the 256 asked for (pass --allow-fewer" in one_line_error(err)
    rc, _, err = cli(calibrate_argv(fam, tmp_path / "allowed", "--allow-fewer",
                                    calib_flags=("--num-calibration-examples", "256")), capsys)
    assert rc == 0, err

    run = tmp_path / "run.yaml"  # a run file: the same rule, from its config section
    doc = {"merge": {"base": str(bert["merged"]), "experts": {t: str(p) for t, p in bert["experts"].items()}},
           "calibrate": {"calibration": {t: str(p) for t, p in plain.items()}, "config": {}},
           "out": str(tmp_path / "run-default")}
    run.write_text(yaml.safe_dump(doc))
    rc, _, err = cli(["run", run, "--no-progress"], capsys)
    assert rc == 0, err
    doc["calibrate"]["config"] = {"num_calibration_examples": 256}
    doc["out"] = str(tmp_path / "run-given")
    run.write_text(yaml.safe_dump(doc))
    rc, _, err = cli(["run", run, "--no-progress"], capsys)
    assert rc == 2 and "fewer than the 256 asked for" in one_line_error(err)

    with pytest.raises(CalibrationDataError, match="fewer than the 256 asked for"):  # and in Python
        featcal.calibrate(bert["merged"], base=bert["base"], experts=bert["experts"], calibration=plain,
                          config=FeatCalConfig(num_calibration_examples=256), progress=False)
    with pytest.raises(CalibrationDataError, match="fewer than the 256 asked for"):
        featcal.merge(bert["merged"], bert["experts"], "regmean", calibration=plain,
                      config=MergeConfig(method="regmean", num_calibration_examples=256))


# ---- bad input: one line, before any model is loaded ---------------------------------------------------------------


def _bad_sources(root: Path) -> dict[str, tuple[object, str]]:
    root.mkdir(parents=True, exist_ok=True)
    (root / "empty.txt").write_text("")
    (root / "latin1.txt").write_bytes("w1\ncaf\xe9\n".encode("latin-1"))
    write_jsonl(root / "roles.jsonl", [{"messages": [{"role": "user", "content": "w1"}, {"role": "bot", "content": "w2"}]}])
    (root / "ids.csv").write_text("id,label\n1,0\n2,1\n")
    mixed = write_png_folder(root / "mixed", n_per_class=1)
    (mixed / "notes.txt").write_text("w1 w2")
    return {
        "empty file": (root / "empty.txt", r"empty\.txt \(text file\) holds no examples"),
        "non-UTF-8 file": (root / "latin1.txt", r"latin1\.txt, line 2: not UTF-8 text"),
        "unknown role": (root / "roles.jsonl", r"roles\.jsonl, line 1: turn 2 has role 'bot'"),
        "no text column": (root / "ids.csv", r"ids\.csv \(csv\) holds no image or text column"),
        "mixed folder": (mixed, r"mixed is ambiguous: it holds 2 image files .* and 1 text file \(notes\.txt\); "
                                r"say which to read with --data-format image or --data-format text"),
        "hub id offline": ("acme/nowhere@train", r"'acme/nowhere@train' is no local file or folder, and as a Hugging "
                                                 r"Face dataset id it is not in the local datasets cache while offline "
                                                 r"\(HF_HUB_OFFLINE / HF_DATASETS_OFFLINE is set\)"),
    }


@pytest.mark.parametrize("case", ["empty file", "non-UTF-8 file", "unknown role", "no text column", "mixed folder",
                                  "hub id offline"])
def test_bad_calibration_data_is_one_line_before_any_model(bert, tmp_path, capsys, no_model_loaded, monkeypatch, case):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "no-cache"))
    source, message = _bad_sources(tmp_path / "data")[case]
    data = {"task0": bert["data"]["task0"], "task1": source}
    rc, _, err = cli(calibrate_argv(_with(bert, data), tmp_path / "out"), capsys)
    assert rc == 2
    line = one_line_error(err)
    assert "task 'task1': " in line
    assert re.search(message, line), line
    assert not (tmp_path / "out").exists()
    with pytest.raises(CalibrationDataError, match=message):  # the Python API: the same refusal, as early
        featcal.calibrate(bert["merged"], base=bert["base"], experts=bert["experts"], calibration=data, progress=False)
