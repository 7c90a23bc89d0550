"""`featcal plan` and `featcal calibrate` say, per task, how many examples and tokens its data gave and how it was
read (issue 53): a decoder reads a .txt as packed windows of --max-length tokens and the same texts as JSONL as
one short example per record, so "8 examples" held 128 tokens in one task and about 50 in the other, silently."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from featcal.calibration.front.data_summary import task_data_line, task_data_lines
from featcal.data import sample_indices
from tests.builders.data_fixtures import sentences
from tests.builders.guarantees import calibrate_argv, cli, plan_argv
from tests.builders.pipeline_family import llama_text_family

pytestmark = pytest.mark.usefixtures("one_thread")
TEXTS = sentences(64, seed=3)  # 2 to 8 words each
FLAGS = ("--num-calibration-examples", "8", "--calibration-batch-size", "4", "--max-length", "16")


@pytest.fixture(scope="module")
def same_texts(tmp_path_factory):
    """A Llama family; task 'txt' reads TEXTS as a plain-text file (a paragraph each), task 'jsonl' the same
    texts as JSONL records."""
    root = tmp_path_factory.mktemp("same-texts")
    fam = llama_text_family(root, {"txt": TEXTS, "jsonl": TEXTS})
    (root / "texts.txt").write_text("\n\n".join(TEXTS) + "\n")
    experts = dict(zip(("txt", "jsonl"), fam["experts"].values(), strict=True))
    return {**fam, "experts": experts, "data": {"txt": root / "texts.txt", "jsonl": fam["data"]["jsonl"]}}


def _expected_jsonl_tokens(fam) -> int:
    """The 8 records the run draws (seed 0), tokenised by the model's own tokenizer, each cut at 16 tokens."""
    tokenizer = AutoTokenizer.from_pretrained(fam["merged"])
    drawn = [TEXTS[i] for i in sample_indices(len(TEXTS), 8, 0)]
    return sum(min(16, len(tokenizer(t)["input_ids"])) for t in drawn)


def _lines(printed: str) -> dict[str, str]:
    return {t: next(line for line in printed.splitlines() if line.startswith(f"calibration data {t!r}:"))
            for t in ("txt", "jsonl")}


def test_plan_and_calibrate_print_examples_tokens_and_how_each_task_was_read(same_texts, tmp_path, capsys):
    jsonl_tokens = _expected_jsonl_tokens(same_texts)
    assert jsonl_tokens < 8 * 16  # the point: the same count of examples, far fewer tokens
    expected = {
        "txt": "calibration data 'txt': 8 examples, 128 tokens (texts.txt, text file: windows of 16 tokens cut "
               "from its 64 paragraphs run together)",
        "jsonl": f"calibration data 'jsonl': 8 examples, {jsonl_tokens} tokens (calib-jsonl.jsonl, jsonl: one "
                 "example per record, at most 16 tokens each)",
    }
    rc, printed, err = cli(plan_argv(same_texts, tmp_path / "out", calib_flags=FLAGS), capsys)
    assert rc == 0, err
    assert _lines(printed) == expected
    assert "note: an example is not the same unit in every task: 'txt' packed windows, 'jsonl' one example" in printed
    assert not (tmp_path / "out").exists()

    rc, printed, err = cli(calibrate_argv(same_texts, tmp_path / "out", calib_flags=FLAGS), capsys)
    assert rc == 0, err
    assert _lines(printed) == expected
    recorded = json.loads((tmp_path / "out" / "featcal.json").read_text())["inputs"]["calibration"]
    assert {t: (r["examples"], r["tokens"]) for t, r in recorded.items()} == {"txt": (8, 128),
                                                                                "jsonl": (8, jsonl_tokens)}


def test_lines_for_images_and_a_run_read_alike():
    image = {"source": "/d/cats", "format": "image folder", "content": "image", "unit": "file", "examples": 1}
    assert task_data_line("cats", image) == "calibration data 'cats': 1 example (cats, image folder: one example per file)"
    text = {"source": "a.jsonl", "format": "jsonl", "unit": "record", "examples": 4, "tokens": 20}
    assert task_data_lines({"a": text, "b": text}, 16)[-1].startswith("calibration data 'b': 4 examples, 20 tokens")
