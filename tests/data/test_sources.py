"""Layer 1 of the data seam (issue 37): every source read into examples by `read_examples`, with its fields.

Text files by unit, chat / SFT records in their three layouts, CSV / TSV by the JSONL column rules,
folders recognised by content (mixed ones refused), Hugging Face dataset ids (offline: refused fast in
one line; cached: read), in-memory lists and datasets; and every bad input as one error naming it.
"""

from __future__ import annotations

import time

import datasets
import numpy as np
import pytest
from PIL import Image

from featcal.data import Example, read_examples
from featcal.data.sources import is_source
from featcal.errors import CalibrationDataError
from tests.builders.data_fixtures import (
    cache_as_hub_dataset,
    conversations,
    sentences,
    write_jsonl,
    write_png_folder,
)


def _texts(examples) -> list[str]:
    return [e.text for e in examples]


# ---- plain text -------------------------------------------------------------------------------------------


def test_a_text_file_by_line_paragraph_and_file(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("w1 w2\nw3\n\n  \nw4 w5\r\nw6\n\n\n\nw7\n")
    assert _texts(read_examples(path, text_unit="line")) == ["w1 w2", "w3", "w4 w5", "w6", "w7"]
    by_paragraph = read_examples(path)  # a single file's default unit: its paragraphs
    assert _texts(by_paragraph) == ["w1 w2\nw3", "w4 w5\nw6", "w7"]
    assert by_paragraph.describe() == {"source": str(path), "format": "text file", "content": "text",
                                       "unit": "paragraph"}
    assert _texts(read_examples(path, text_unit="file")) == [path.read_text().replace("\r\n", "\n")]
    assert read_examples(path)[1].fields == {"file": "notes.txt"}


def test_a_folder_of_text_files_is_text_one_example_per_file(tmp_path):
    root = tmp_path / "docs"
    (root / "sub").mkdir(parents=True)
    (root / "b.md").write_text("w3 w4\n\nw5\n")
    (root / "a.txt").write_text("w1 w2\n")
    (root / "sub" / "code.py").write_text("def f():\n    return 1\n")  # any suffix: text by its content
    (root / ".hidden.txt").write_text("never read")
    examples = read_examples(root)
    assert examples.describe()["format"] == "text folder" and examples.describe()["unit"] == "file"
    assert [e.fields["file"] for e in examples] == ["a.txt", "b.md", "sub/code.py"]
    assert _texts(examples) == ["w1 w2\n", "w3 w4\n\nw5\n", "def f():\n    return 1\n"]
    assert _texts(read_examples(root, text_unit="paragraph"))[:3] == ["w1 w2", "w3 w4", "w5"]


# ---- chat / SFT -------------------------------------------------------------------------------------------


def test_the_three_chat_layouts_become_conversations(tmp_path):
    convs = conversations(4)
    messages = read_examples(write_jsonl(tmp_path / "m.jsonl", [{"messages": c, "id": i} for i, c in enumerate(convs)]))
    assert messages.content == "chat" and messages.describe()["chat_layout"] == "messages"
    assert [list(e.messages) for e in messages] == convs
    assert messages[2].fields == {"id": 2}

    pc = read_examples(write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "w1 w2", "completion": "w3"}]))
    assert list(pc[0].messages) == [{"role": "user", "content": "w1 w2"}, {"role": "assistant", "content": "w3"}]

    alpaca = read_examples(write_jsonl(tmp_path / "a.jsonl", [
        {"instruction": "w1", "input": "w2 w3", "output": "w4"}, {"instruction": "w5", "input": "", "output": "w6"},
    ]))
    assert [list(e.messages) for e in alpaca] == [
        [{"role": "user", "content": "w1\n\nw2 w3"}, {"role": "assistant", "content": "w4"}],
        [{"role": "user", "content": "w5"}, {"role": "assistant", "content": "w6"}],
    ]
    # a text column named by the user reads plain text instead, the prompts alone
    assert _texts(read_examples(tmp_path / "pc.jsonl", text_column="prompt")) == ["w1 w2"]


def test_turn_fields_other_turns_have_are_not_invented(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": [
        {"role": "user", "content": "w1", "name": "ann"}, {"role": "assistant", "content": "w2"},
    ]}])
    (example,) = read_examples(path)
    assert list(example.messages) == [{"role": "user", "content": "w1", "name": "ann"},
                                      {"role": "assistant", "content": "w2"}]  # no name: None on the second


@pytest.mark.parametrize(("records", "message"), [
    ([{"messages": [{"role": "user", "content": "w1"}]}, {"messages": [{"role": "robot", "content": "w2"}]}],
     r"c\.jsonl, line 2: turn 1 has role 'robot'; chat roles are system, user, assistant, tool, developer"),
    ([{"messages": [{"role": "user", "content": 3}]}], r"line 1: turn 1 \(user\) has no text content"),
    ([{"messages": []}], r"line 1: a chat conversation must be a non-empty list of turns"),
    ([{"prompt": "w1", "completion": ["w2"]}], r"prompt and completion must both be strings or both be lists"),
])
def test_a_bad_chat_record_is_named(tmp_path, records, message):
    with pytest.raises(CalibrationDataError, match=message):
        read_examples(write_jsonl(tmp_path / "c.jsonl", records))


# ---- CSV / TSV --------------------------------------------------------------------------------------------


def test_csv_and_tsv_read_like_jsonl(tmp_path):
    texts = sentences(5) + ['w1, "w2"\nw3']  # a comma, quotes and a line break inside one value
    rows = [{"id": i, "text": t, "label": i % 2} for i, t in enumerate(texts)]
    import csv

    for name, delimiter in (("d.csv", ","), ("d.tsv", "\t")):
        with (tmp_path / name).open("w", newline="") as f:
            writer = csv.DictWriter(f, ["id", "text", "label"], delimiter=delimiter)
            writer.writeheader()
            writer.writerows(rows)
    jsonl = read_examples(write_jsonl(tmp_path / "d.jsonl", rows))
    for name in ("d.csv", "d.tsv"):
        table = read_examples(tmp_path / name)
        assert _texts(table) == _texts(jsonl) == texts
        assert [e.fields for e in table] == [e.fields for e in jsonl]  # the label is kept (an int, as in JSONL)
        assert table.describe()["format"] == name[2:]
    (tmp_path / "n.csv").write_text("id,text\n1,123\n2,456\n")  # digits under a text column stay text
    assert _texts(read_examples(tmp_path / "n.csv")) == ["123", "456"]


def test_csv_column_rules(tmp_path):
    (tmp_path / "two.csv").write_text("title,body\nw1,w2 w3\nw4,w5\n")
    with pytest.raises(CalibrationDataError, match="several string columns could hold the texts: 'title', 'body'"):
        read_examples(tmp_path / "two.csv")
    assert _texts(read_examples(tmp_path / "two.csv", text_column="body")) == ["w2 w3", "w5"]
    (tmp_path / "none.csv").write_text("id,label\n1,0\n2,1\n")
    with pytest.raises(CalibrationDataError, match=r"none\.csv \(csv\) holds no image, text or chat column"):
        read_examples(tmp_path / "none.csv")
    (tmp_path / "chat.csv").write_text("prompt,completion\nw1,w2\n")
    assert list(read_examples(tmp_path / "chat.csv")[0].messages)[1] == {"role": "assistant", "content": "w2"}


# ---- folders ----------------------------------------------------------------------------------------------


def test_folders_are_known_by_what_they_hold(tmp_path):
    images = write_png_folder(tmp_path / "images", n_per_class=2)
    read = read_examples(images)
    assert read.content == "image" and read[0].fields == {"file": "cat/000.png", "label": "cat"}
    assert isinstance(read[0].image, Image.Image)

    (images / "notes.txt").write_text("w1 w2")
    with pytest.raises(CalibrationDataError, match=(
        r"images is ambiguous: it holds 4 image files \(cat/000.png, cat/001.png, dog/000.png, \.\.\.\) and 1 text "
        r"file \(notes.txt\); say which to read with --data-format image or --data-format text")):
        read_examples(images)
    assert len(read_examples(images, data_format="image")) == 4
    assert _texts(read_examples(images, data_format="text")) == ["w1 w2"]
    assert len(read_examples(images, modality="image")) == 4  # an image model reads the images only

    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "README.md").write_text("w1")
    write_jsonl(mixed / "train.jsonl", [{"text": "w2"}])
    with pytest.raises(CalibrationDataError, match=r"mixed is ambiguous: .*1 text file \(README.md\) and 1 data file "
                                                   r"\(train.jsonl\); say which to read with --data-format text"):
        read_examples(mixed)


# ---- Hugging Face datasets by id ----------------------------------------------------------------------------


def test_a_hub_id_offline_fails_fast_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "empty-cache"))
    for variable in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
        monkeypatch.setenv(variable, "1")
        start = time.monotonic()
        with pytest.raises(CalibrationDataError) as caught:
            read_examples("acme/instructions:main@train")
        assert time.monotonic() - start < 10  # no network retries
        message = str(caught.value)
        assert "\n" not in message
        assert message.startswith("calibration data 'acme/instructions:main@train' is no local file or folder")
        assert "HF_HUB_OFFLINE / HF_DATASETS_OFFLINE" in message and "save_to_disk" in message and ".jsonl" in message
    with pytest.raises(CalibrationDataError, match=r"calibration data .*missing\.jsonl does not exist"):
        read_examples("data/missing.jsonl")  # a path, not an id: never sent to the hub


def test_a_cached_hub_dataset_is_read_by_id_config_and_split(tmp_path, monkeypatch):
    train = [{"text": t, "label": i % 2} for i, t in enumerate(sentences(5))]
    cache = cache_as_hub_dataset(tmp_path, "acme/reviews", "main", {"train": train, "test": train[:2]})
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(cache))
    default = read_examples("acme/reviews:main")  # no split: its train split
    assert _texts(default) == [r["text"] for r in train] and default.describe()["split"] == "train"
    assert default.describe()["format"] == "hub dataset" and default.describe()["source"] == "acme/reviews:main"
    assert _texts(read_examples("acme/reviews:main@train[:2]")) == [r["text"] for r in train[:2]]
    with pytest.raises(CalibrationDataError, match=r"'test' split, test data.*--allow-test-split"):
        read_examples("acme/reviews:main@test")
    assert len(read_examples("acme/reviews:main@test", allow_test_split=True)) == 2
    with pytest.raises(CalibrationDataError, match=r"'acme/reviews:other' .* cannot be read: .*config"):
        read_examples("acme/reviews:other")


# ---- in memory --------------------------------------------------------------------------------------------


def test_in_memory_sources(tmp_path):
    assert _texts(read_examples(["w1 w2", "w3"])) == ["w1 w2", "w3"]
    convs = conversations(2)
    assert [list(e.messages) for e in read_examples(convs)] == convs
    assert read_examples([{"messages": c} for c in convs]).content == "chat"  # records, as JSONL lines
    dataset = datasets.Dataset.from_dict({"sentence": ["w1", "w2"], "label": [0, 1]})
    assert [e.fields["label"] for e in read_examples(dataset)] == [0, 1]
    assert read_examples(datasets.DatasetDict({"train": dataset, "test": dataset})).describe()["split"] == "train"
    pixels = [Image.fromarray(np.zeros((4, 4, 3), dtype=np.uint8)) for _ in range(3)]
    assert read_examples(pixels).content == "image"
    with pytest.raises(CalibrationDataError, match=r"item 2: the text is empty"):
        read_examples(["w1", " "])
    with pytest.raises(CalibrationDataError, match=r"mixes or holds unreadable items \(int, str\)"):
        read_examples(["w1", 2])
    with pytest.raises(CalibrationDataError, match="the list is empty"):
        read_examples([])
    import torch

    batch = {"input_ids": torch.ones(2, 3, dtype=torch.long)}
    assert not any(is_source(x) for x in (batch, [batch], (b for b in [batch]), torch.ones(2, 3), [torch.ones(2, 3)]))
    assert all(is_source(x) for x in ("d.jsonl", tmp_path, ["w1"], convs, [{"text": "w1"}], dataset, pixels))


# ---- bad files ----------------------------------------------------------------------------------------------


def test_empty_and_non_utf8_files_are_one_line_errors(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    assert len(read_examples(tmp_path / "empty.txt")) == 0  # calibration refuses it: "holds no examples"
    (tmp_path / "latin1.txt").write_bytes("w1\nw2 caf\xe9\n".encode("latin-1"))
    with pytest.raises(CalibrationDataError, match=r"latin1\.txt, line 2: not UTF-8 text \(byte 0xe9"):
        read_examples(tmp_path / "latin1.txt")
    (tmp_path / "latin1.csv").write_bytes("text\ncaf\xe9\n".encode("latin-1"))
    with pytest.raises(CalibrationDataError, match=r"latin1\.csv, line 2: not UTF-8 text"):
        read_examples(tmp_path / "latin1.csv")
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "ok.txt").write_text("w1")
    (folder / "bad.txt").write_bytes(b"\xff\xfe w2")
    with pytest.raises(CalibrationDataError, match=r"bad\.txt, line 1: not UTF-8 text"):
        read_examples(folder)
    (tmp_path / "data.bin").write_bytes(b"\0\1")
    with pytest.raises(CalibrationDataError, match=r"unsupported format \.bin.*--data-format text reads any file"):
        read_examples(tmp_path / "data.bin")


def test_examples_are_read_lazily_and_by_index(tmp_path):
    images = write_png_folder(tmp_path / "images", n_per_class=3)
    examples = read_examples(images)
    first = images / "cat" / "000.png"
    first.write_bytes(b"not a png any more")  # opened only when read
    assert len(examples) == 6 and isinstance(examples[-1], Example)
    with pytest.raises(CalibrationDataError, match=r"cannot read image file .*cat/000\.png"):
        examples[0]
    assert [e.fields["file"] for e in examples.take([5, 1])] == ["dog/002.png", "cat/001.png"]
