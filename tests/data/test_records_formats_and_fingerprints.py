"""Issue 49's data defects: a table's format from every record, not the first; texts that tokenise to nothing,
conversations with no text, a tab-separated file named .csv and Alpaca prompts without answers refused or read
right; the leakage guard's fingerprints blind to whitespace the model does not read; folders that only look
like saved datasets, and paths that are neither file nor folder."""

from __future__ import annotations

import json
import os

import datasets
import pytest

from featcal.data import Example, load_calibration_batches, open_source, read_examples
from featcal.data.fingerprint import example_sha256
from featcal.errors import CalibrationDataError, ConfigError
from featcal.evaluation.data import read_eval_set
from featcal.evaluation.leakage import overlaps
from tests.builders.data_fixtures import conversations, save_tokenizer, write_jsonl
from tests.builders.tiny import tiny_config

ALPACA = [{"instruction": f"w{i}", "input": "", "output": f"w{i + 10}"} for i in range(6)]


# ---- 1. a table's columns and format come from every record ------------------------------------------------


def test_an_alpaca_record_without_output_first_is_refused_not_read_as_plain_text(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", [{"instruction": "w1", "input": "w2"}] + ALPACA)
    with pytest.raises(CalibrationDataError) as info:
        read_examples(path)  # was: every record read as the plain text of `input`, every answer dropped
    message = str(info.value)
    assert message.startswith(f"{path}, line 1: a chat record in the instruction/input layout, but {path}, line 2 is "
                              "a chat record in the instruction/input/output layout")
    assert "it has no 'output'" in message and "\n" not in message
    later = write_jsonl(tmp_path / "b.jsonl", ALPACA[:4] + [{"instruction": "w1", "input": "w2"}] + ALPACA[4:])
    with pytest.raises(CalibrationDataError, match=r"b\.jsonl, line 5: a chat record in the instruction/input layout"):
        read_examples(later)  # the same file, the odd record elsewhere: refused the same way, naming it


def test_a_prompt_without_completion_first_is_refused(tmp_path):
    records = [{"prompt": "w1"}] + [{"prompt": f"w{i}", "completion": f"w{i + 1}"} for i in range(5)]
    with pytest.raises(CalibrationDataError, match=r"p\.jsonl, line 1: a plain record, not a chat, but .*p\.jsonl, "
                                                   r"line 2 is a chat record in the prompt/completion layout.*"
                                                   r"it has no 'completion'"):
        read_examples(write_jsonl(tmp_path / "p.jsonl", records))
    with pytest.raises(CalibrationDataError, match=r"records \(in memory\), record 1: a plain record"):
        read_examples(records)  # records in memory are one table by the same rule


@pytest.mark.parametrize(("first_chat", "line"), [(True, 2), (False, 1)])
def test_mixed_text_and_chat_records_name_the_first_record_that_differs(tmp_path, first_chat, line):
    chats = [{"messages": c} for c in conversations(8)]
    records = [chats[0], {"text": "w1 w2"}, *chats[1:]] if first_chat else [{"text": "w1 w2"}, *chats]
    path = write_jsonl(tmp_path / "mixed.jsonl", records)
    with pytest.raises(CalibrationDataError, match=rf"mixed\.jsonl, line {line}: a plain record, not a chat, but "
                                                   r".*mixed\.jsonl, line \d is a chat record in the messages layout"):
        read_examples(path)


def test_plain_records_read_every_column_any_record_holds(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": "w1"}, {"text": "w2", "label": 1}, {"text": "w3", "label": 0}])
    examples = read_examples(path)
    assert [e.fields.get("label") for e in examples] == [None, 1, 0]  # was: no label column at all
    with pytest.raises(CalibrationDataError, match=r"u\.jsonl, line 2: no text in column 'text'"):
        list(read_examples(write_jsonl(tmp_path / "u.jsonl", [{"text": "w1"}, {"label": 1, "other": "w3"}])))
    # naming the text column reads plain text, whatever layout other columns would make
    assert [e.text for e in read_examples(write_jsonl(tmp_path / "a.jsonl", [{"instruction": "w1", "input": "w2"}]
                                                      + ALPACA), text_column="instruction")][:2] == ["w1", "w0"]


# ---- 2. a text that tokenises to nothing -------------------------------------------------------------------


@pytest.fixture
def dropping_model(tmp_path):
    """A BERT config and a tokenizer that drops format characters and adds no special tokens."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, "[UNK]": 1, **{f"w{i}": i + 2 for i in range(40)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(clean_text=True, lowercase=False, strip_accents=False)
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    directory = tmp_path / "model"
    tiny_config("bert").save_pretrained(directory)
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]").save_pretrained(directory)
    return directory


@pytest.mark.parametrize("texts", [["\u200b", "\ufeff"], ["w1 w2", "\u200b"]], ids=["all", "one"])
def test_a_text_that_tokenises_to_nothing_is_refused_not_a_traceback(dropping_model, texts):
    with pytest.raises(CalibrationDataError) as info:  # was: RuntimeError from max() of an empty tensor
        load_calibration_batches(texts, model_dir=dropping_model, num_examples=2, batch_size=2)
    message = str(info.value)
    assert "turns a calibration example into no tokens at all" in message and "'\\u200b'" in message
    assert "\n" not in message
    batches = load_calibration_batches(["w1 w2", "w3"], model_dir=dropping_model, num_examples=2, batch_size=2)
    assert batches[0]["attention_mask"].sum(dim=1).min() > 0  # texts it reads still go through


# ---- 3. conversations without text, delimiters, Alpaca prompts ---------------------------------------------


def test_a_conversation_whose_every_turn_is_empty_is_refused(tmp_path):
    empty = [{"role": "user", "content": ""}, {"role": "assistant", "content": " \n"}]
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": c} for c in conversations(3)] + [{"messages": empty}])
    with pytest.raises(CalibrationDataError, match=r"c\.jsonl, line 4: every turn's content is empty"):
        read_examples(path)
    with pytest.raises(CalibrationDataError, match=r"item 2: every turn's content is empty"):
        read_examples([conversations(1)[0], empty])
    with pytest.raises(CalibrationDataError, match=r"line 1: every turn's content is empty"):
        read_examples(write_jsonl(tmp_path / "p.jsonl", [{"prompt": empty[:1], "completion": empty[1:]}]))
    one_empty = [{"role": "user", "content": "w1"}, {"role": "assistant", "content": ""}]
    assert list(read_examples([one_empty])[0].messages) == one_empty  # a turn may be empty, not all of them


def test_a_tab_separated_file_named_csv_is_refused_and_read_as_tsv(tmp_path):
    rows = "text\tlabel\nw1 w2\tpos\nw3, w4\tneg\n"
    (tmp_path / "d.csv").write_text(rows)
    with pytest.raises(CalibrationDataError, match=r"d\.csv: its header is one column, 'text\\tlabel', holding tabs: "
                                                   r"the file looks tab-separated.*name it \.tsv"):
        read_examples(tmp_path / "d.csv")  # was: one column 'text\tlabel', the labels calibrated on as text
    (tmp_path / "d.tsv").write_text(rows)
    read = read_examples(tmp_path / "d.tsv")
    assert [e.text for e in read] == ["w1 w2", "w3, w4"] and [e.fields["label"] for e in read] == ["pos", "neg"]
    (tmp_path / "e.tsv").write_text("text,label\nw1,pos\n")
    with pytest.raises(CalibrationDataError, match=r"e\.tsv: its header is one column.*holding commas.*name it \.csv"):
        read_examples(tmp_path / "e.tsv")
    (tmp_path / "one.csv").write_text("text\nw1\tw2\n")  # one column whose texts hold tabs: fine
    assert [e.text for e in read_examples(tmp_path / "one.csv")] == ["w1\tw2"]


def test_alpaca_prompts_without_outputs_are_the_instruction_then_its_input(tmp_path):
    path = write_jsonl(tmp_path / "prompts.jsonl", [{"instruction": "w1", "input": "w2 w3"},
                                                    {"instruction": "w4", "input": ""}])
    read = read_examples(path)  # was: the plain text of `input` alone, the instruction dropped
    assert read.content == "chat" and read.describe()["chat_layout"] == "instruction/input"
    assert [list(e.messages) for e in read] == [[{"role": "user", "content": "w1\n\nw2 w3"}],
                                                [{"role": "user", "content": "w4"}]]
    with pytest.raises(CalibrationDataError, match=r"line 1: instruction is empty"):
        read_examples(write_jsonl(tmp_path / "bad.jsonl", [{"instruction": " ", "input": "w2"}]))
    with_id = read_examples(write_jsonl(tmp_path / "id.jsonl", [{"instruction": "w1", "id": "a"}]))
    assert list(with_id[0].messages) == [{"role": "user", "content": "w1"}] and with_id[0].fields == {"id": "a"}
    # answers under another name are never dropped by reading the prompts alone
    answered = write_jsonl(tmp_path / "r.jsonl", [{"instruction": "w1", "input": "", "response": "w2"}])
    with pytest.raises(CalibrationDataError, match=r"r\.jsonl: an 'instruction' column and no 'output'.*'response'"):
        read_examples(answered)


# ---- 4. the leakage guard and whitespace -------------------------------------------------------------------


def test_a_trailing_space_does_not_dodge_the_leakage_guard(tmp_path):
    model = tmp_path / "calibrated"
    tiny_config("bert").save_pretrained(model)
    save_tokenizer(model, "bert")
    record: dict = {}
    calibration = write_jsonl(tmp_path / "calib.jsonl", [{"text": "hello world"}, {"text": "w1 w2"}])
    load_calibration_batches(calibration, model_dir=model, num_examples=2, batch_size=2, record=record)
    assert record["example_fingerprint"] == 2
    (model / "featcal.json").write_text(json.dumps({"inputs": {"calibration": {"t": record}}}))

    held = write_jsonl(tmp_path / "eval.jsonl", [{"text": "hello world "}, {"text": " w1\tw2\n"}, {"text": "w3"}])
    (found,) = overlaps("calibrated", model, [read_eval_set("e", held)])
    assert (found.examples, found.of, found.calibration_tasks) == (2, 3, ("t",))  # was: no overlap found
    assert example_sha256("hello world") == example_sha256(Example(text="hello  world\u200b "))


def test_a_featcal_json_of_exact_fingerprints_is_still_compared_by_them(tmp_path):
    """A featcal.json written before `example_fingerprint` holds scheme-1 (exact text) fingerprints."""
    model = tmp_path / "old"
    model.mkdir()
    old = {"source": "elsewhere.jsonl", "example_sha256": [example_sha256("hello world", scheme=1),
                                                           example_sha256("w1  w2", scheme=1)]}
    (model / "featcal.json").write_text(json.dumps({"inputs": {"calibration": {"t": old}}}))
    held = write_jsonl(tmp_path / "eval.jsonl", [{"text": "hello world"}, {"text": "w1  w2"}, {"text": "w1 w2"}])
    (found,) = overlaps("old", model, [read_eval_set("e", held)])
    assert found.examples == 2  # exactly the texts it recorded, as before
    old["example_fingerprint"] = 7
    (model / "featcal.json").write_text(json.dumps({"inputs": {"calibration": {"t": old}}}))
    with pytest.raises(ConfigError, match=r"example_fingerprint 7, a scheme this featcal does not know"):
        overlaps("old", model, [read_eval_set("e", held)])


# ---- 5. what a path is -------------------------------------------------------------------------------------


def test_a_text_folder_holding_a_state_json_is_no_saved_dataset(tmp_path):
    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "a.txt").write_text("w1 w2")
    (folder / "b.txt").write_text("w3")
    (folder / "state.json").write_text('{"step": 3}')
    with pytest.raises(CalibrationDataError, match=r"notes is ambiguous: it holds 2 text files .* and 1 data file \(state\.json\)"):
        open_source(folder)  # was: "cannot load the saved dataset"
    assert len(open_source(folder, data_format="text")) == 3
    datasets.Dataset.from_dict({"text": ["w1", "w2"]}).save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["w1"]})}).save_to_disk(str(tmp_path / "dict"))
    assert open_source(tmp_path / "saved").kind == open_source(tmp_path / "dict").kind == "saved dataset"


def test_a_fifo_is_not_a_file_or_folder_not_missing(tmp_path):
    fifo = tmp_path / "pipe.jsonl"
    os.mkfifo(fifo)
    with pytest.raises(CalibrationDataError, match=r"pipe\.jsonl is not a regular file or a folder"):
        open_source(fifo)
    with pytest.raises(CalibrationDataError, match=r"does not exist"):
        open_source(tmp_path / "missing.jsonl")
