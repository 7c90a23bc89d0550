"""Issue 49, data files as an attacker writes them: a table with thousands of columns is read in time linear in
them (it took minutes: every column's type check copied the whole schema), an object naming one key twice is
refused (the last value was taken silently), and a .jsonl holding a JSON array says so."""

from __future__ import annotations

import json

import datasets
import pytest

from featcal.data import open_source
from featcal.errors import CalibrationDataError


def test_a_table_with_thousands_of_columns_reads_its_schema_a_bounded_number_of_times(tmp_path, monkeypatch):
    """`Dataset.features` copies every column's feature at each access; read once per column, 5,000 columns took
    about 45 minutes (1,000: 106 s) before a single text was read."""
    path = tmp_path / "wide.jsonl"
    path.write_text("".join(json.dumps({"text": f"w{i} w1", **{f"c{j}": j for j in range(400)}}) + "\n"
                            for i in range(3)))
    real = datasets.Dataset.features
    reads = []

    def counted(self):
        reads.append(1)
        return real.fget(self)

    monkeypatch.setattr(datasets.Dataset, "features", property(counted))
    source = open_source(path, modality="text")
    assert source.describe("text")["text_column"] == "text"
    assert [e.text for e in source.examples([0, 2], "text")] == ["w0 w1", "w2 w1"]
    assert len(reads) < 40, len(reads)  # was over 800: two reads per column


@pytest.mark.parametrize(("name", "text", "error"), [
    ("twice.jsonl", '{"text": "w0 w1", "text": "w2 w3"}\n{"text": "w4"}\n',
     r"twice\.jsonl, line 1: the key 'text' comes twice in one object"),
    ("role.jsonl", '{"messages": [{"role": "user", "role": "system", "content": "w0"}]}\n',
     r"role\.jsonl, line 1: the key 'role' comes twice"),
    ("nested.json", '[{"messages": [{"role": "user", "content": "w0", "content": "w1"}]}]',
     r"nested\.json: the key 'content' comes twice"),
    ("array.jsonl", '[\n{"text": "w0"},\n{"text": "w1"}\n]\n', r"array\.jsonl holds a JSON array, not JSON Lines"),
])
def test_records_whose_meaning_cannot_be_told_are_refused_in_one_line(tmp_path, name, text, error):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(CalibrationDataError, match=error) as e:
        open_source(path, modality="text")
    assert "\n" not in str(e.value)
