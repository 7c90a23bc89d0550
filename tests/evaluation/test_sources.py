"""`featcal eval` reads every source calibration reads, through the data seam's read_examples (issue #34):
text files by unit, CSV, the chat layouts, hub ids; and the leakage guard matches across formats, packed
text files included."""

from __future__ import annotations

import csv
import json

import datasets
import pytest

import featcal
from featcal.errors import CalibrationOverlapError, ConfigError, EvaluationDataError
from featcal.evaluation.data import read_eval_set
from tests.builders.data_fixtures import sentences, write_jsonl
from tests.builders.eval_models import save_bert_classifier, save_llama, save_t5


def _values(report: dict, task: str) -> dict[str, float]:
    return {r["metric"]: r["value"] for r in report["results"] if r["task"] == task}


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return save_llama(tmp_path_factory.mktemp("eval-sources") / "llama")


def test_a_text_file_is_scored_by_paragraph_or_line_as_its_records_would_be(llama, tmp_path):
    paragraphs = ["\n".join(sentences(2, seed=i)) for i in range(4)]  # two lines each
    text = tmp_path / "held.txt"
    text.write_bytes(("\ufeff" + "\r\n\r\n".join(p.replace("\n", "\r\n") for p in paragraphs) + "\r\n").encode())
    by_paragraph = write_jsonl(tmp_path / "paragraphs.jsonl", [{"text": p} for p in paragraphs])
    lines = [line for p in paragraphs for line in p.split("\n")]
    by_line = write_jsonl(tmp_path / "lines.jsonl", [{"text": line} for line in lines])
    report = featcal.evaluate({"txt": text, "jsonl": by_paragraph}, {"llama": llama}, progress=False, batch_size=3)
    assert _values(report, "txt") == _values(report, "jsonl")  # the same examples, whatever the file
    assert report["tasks"]["txt"]["examples"] == 4 and report["tasks"]["txt"]["unit"] == "paragraph"
    lined = featcal.evaluate({"txt": text, "jsonl": by_line}, {"llama": llama}, progress=False, text_unit="line")
    assert _values(lined, "txt") == _values(lined, "jsonl") != _values(report, "txt")
    assert lined["tasks"]["txt"]["examples"] == 8


def test_a_csv_with_quoted_commas_and_line_breaks_scores_as_its_jsonl(tmp_path):
    bert = save_bert_classifier(tmp_path / "bert")
    rows = [{"sentence": s, "label": ("neg", "neu", "pos")[i % 3]} for i, s in enumerate(sentences(9, seed=4))]
    rows[2]["sentence"] = 'w1, "w2"\nw3'  # a comma, quotes and a line break inside one quoted value
    with (tmp_path / "d.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["sentence", "label"])
        writer.writeheader()
        writer.writerows(rows)
    write_jsonl(tmp_path / "d.jsonl", rows)
    report = featcal.evaluate({"csv": tmp_path / "d.csv", "jsonl": tmp_path / "d.jsonl"}, {"bert": bert},
                              progress=False, batch_size=4)
    assert _values(report, "csv") == _values(report, "jsonl") and report["tasks"]["csv"]["examples"] == 9
    assert read_eval_set("t", tmp_path / "d.csv").texts()[2] == 'w1, "w2"\nw3'


def test_prompt_completion_and_alpaca_records_score_as_the_same_messages(llama, tmp_path):
    prompts, answers = sentences(5, seed=7), sentences(5, seed=8)
    messages = write_jsonl(tmp_path / "messages.jsonl", [
        {"messages": [{"role": "user", "content": p}, {"role": "assistant", "content": a}]}
        for p, a in zip(prompts, answers, strict=True)])
    pairs = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": p, "completion": a}
                                                   for p, a in zip(prompts, answers, strict=True)])
    alpaca = write_jsonl(tmp_path / "alpaca.jsonl", [{"instruction": p, "input": "", "output": a}
                                                     for p, a in zip(prompts, answers, strict=True)])
    report = featcal.evaluate({"messages": messages, "pairs": pairs, "alpaca": alpaca}, {"llama": llama},
                              progress=False, batch_size=2)
    assert _values(report, "messages") == _values(report, "pairs") == _values(report, "alpaca")
    assert report["tasks"]["pairs"]["chat_layout"] == "prompt/completion"
    # the prompts alone, as plain text: --text-column turns a chat layout into a text column
    assert read_eval_set("t", pairs, text_column="prompt").texts() == prompts


def test_the_guard_finds_the_documents_of_a_packed_text_file_in_any_format(llama, tmp_path):
    from featcal.data.calibration import load_calibration_batches

    documents = [" ".join(sentences(3, seed=30 + i)) for i in range(8)]
    text = tmp_path / "corpus.txt"
    text.write_text("\n\n".join(documents) + "\n")
    calibrated = tmp_path / "calibrated"
    save_llama(calibrated)
    record: dict = {}
    load_calibration_batches(text, model_dir=calibrated, num_examples=2, batch_size=2, max_length=8, record=record)
    assert "packed" in record and 0 < len(record["example_sha256"]) < len(documents)  # some documents, not all
    (calibrated / "featcal.json").write_text(json.dumps({"inputs": {"calibration": {"corpus": record}}}))
    used = len(record["example_sha256"])

    with pytest.raises(CalibrationOverlapError, match=rf"calibrated on {used} of the 8 examples of task 'lm'"):
        featcal.evaluate({"lm": text}, {"model": calibrated}, progress=False)
    as_records = write_jsonl(tmp_path / "corpus.jsonl", [{"text": d, "label": 0} for d in reversed(documents)])
    with pytest.raises(CalibrationOverlapError, match=rf"calibrated on {used} of the 8 examples"):
        featcal.evaluate({"lm": as_records}, {"model": calibrated}, progress=False)
    held_out = tmp_path / "held.txt"
    held_out.write_text("\n\n".join(" ".join(sentences(3, seed=90 + i)) for i in range(4)))
    report = featcal.evaluate({"lm": held_out}, {"model": calibrated}, progress=False)
    assert report["calibration_overlap"] == [] and _values(report, "lm")["loss"] > 0


def test_a_cached_hub_dataset_is_read_at_its_evaluation_split(tmp_path, monkeypatch):
    from tests.builders.data_fixtures import cache_as_hub_dataset as _cache_as_hub_dataset

    rows = [{"text": s, "label": i % 2} for i, s in enumerate(sentences(6, seed=2))]
    cache = _cache_as_hub_dataset(tmp_path, "acme/reviews", "main", {"train": rows, "test": rows[:3]})
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(cache))
    data = read_eval_set("t", "acme/reviews:main")
    assert data.read_as["split"] == "test" and data.texts() == [r["text"] for r in rows[:3]]
    assert data.labels() == [0, 1, 0] and data.kind == "hub dataset"
    assert len(read_eval_set("t", "acme/reviews:main", split="train")) == 6
    with pytest.raises(ConfigError, match=r"names the split 'test' and --split names 'train'"):
        read_eval_set("t", "acme/reviews:main@test", split="train")


def test_split_is_refused_where_there_is_no_split_to_choose(tmp_path):
    write_jsonl(tmp_path / "d.jsonl", [{"text": "w1"}])
    with pytest.raises(ConfigError, match=r"task 't': .*d\.jsonl is a file of examples with no splits"):
        read_eval_set("t", tmp_path / "d.jsonl", split="test")
    datasets.Dataset.from_dict({"text": ["w1", "w2"]}).save_to_disk(str(tmp_path / "one"))
    with pytest.raises(ConfigError, match=r"one dataset, not a DatasetDict, so --split 'test' names nothing"):
        read_eval_set("t", tmp_path / "one", split="test")  # was ignored: the set was read whatever --split said


def test_targets_must_be_there_for_text_to_text_and_labels_for_classifiers(tmp_path):
    t5 = save_t5(tmp_path / "t5")
    write_jsonl(tmp_path / "qa.jsonl", [{"text": "w1 w2", "target": "w3"}, {"text": "w4", "target": None},
                                        {"text": "w5", "target": "w6"}])
    with pytest.raises(EvaluationDataError, match=r"example 2 has no target text in 'target' \(got None\)"):
        featcal.evaluate({"qa": tmp_path / "qa.jsonl"}, {"t5": t5}, progress=False)  # was scored against ""
    write_jsonl(tmp_path / "qa2.jsonl", [{"text": "w1", "answer": "w3"}, {"text": "w4", "answer": " "}])
    with pytest.raises(EvaluationDataError, match=r"example 2 has no target text in 'answer'"):
        featcal.evaluate({"qa": tmp_path / "qa2.jsonl"}, {"t5": t5}, progress=False, target_column="answer")
    bert = save_bert_classifier(tmp_path / "bert")
    write_jsonl(tmp_path / "c.jsonl", [{"text": "w1", "label": 0}, {"text": "w2", "label": None}])
    with pytest.raises(EvaluationDataError, match=r"example 2 has no label \('label' is empty\)"):
        featcal.evaluate({"c": tmp_path / "c.jsonl"}, {"bert": bert}, progress=False)
    with pytest.raises(ConfigError, match=r"'text' \(--label-column\) is the text the models read"):
        read_eval_set("t", tmp_path / "c.jsonl", label_column="text")
