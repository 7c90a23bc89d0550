"""One line per task saying what its calibration data gave: examples, tokens, and how they were read.

An "example" is not the same thing in every format: a decoder reads a plain-text file as packed windows of
`max_length` tokens cut from the concatenated documents, and the same texts as CSV / JSONL / parquet as one
(short) example per record, so sixteen examples may hold 2,040 tokens in one task and 167 in another. `featcal
plan` (and `calibrate --dry-run`) print these lines before any work, `featcal calibrate` and `featcal run` after
it, from what featcal.json records of each task (`inputs.calibration`): the counts the calibration saw.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from featcal.data.calibration_set import CalibrationSet


def read_task_data(data: CalibrationSet) -> dict[str, dict[str, Any]]:
    """Each task's data (checked, as `check_calibration_inputs` leaves it) read as the run reads it (the same
    options, the same draw), its batches dropped: what featcal.json will record of each (examples, tokens, format,
    packing). No model is loaded, and nothing the check opened is opened again."""
    return data.load().records


def _how_read(record: Mapping[str, Any], max_length: int | None) -> str:
    unit = record.get("unit") or "example"
    packed = record.get("packed")
    if packed:
        documents = packed.get("documents")
        return (f"windows of {packed['window']} tokens cut from its {documents} {unit}{'' if documents == 1 else 's'} "
                "run together")
    if "tokens" in record and max_length is not None:
        return f"one example per {unit}, at most {max_length} tokens each"
    return f"one example per {unit}"


def task_data_line(task: str, record: Mapping[str, Any], max_length: int | None = None) -> str:
    """`calibration data 'code': 16 examples, 2040 tokens (code.txt, text file: windows of 128 tokens cut from its
    40 paragraphs run together)`: the counts the calibration saw, and how the source was read."""
    examples = record.get("examples", 0)
    counts = f"{examples} example{'' if examples == 1 else 's'}"
    if "tokens" in record:
        counts += f", {record['tokens']} tokens"
    where = [Path(str(record["source"])).name] if record.get("source") else []
    where += [str(record["format"])] if record.get("format") else []
    return f"calibration data {task!r}: {counts} ({', '.join(where)}{': ' if where else ''}{_how_read(record, max_length)})"


def task_data_lines(records: Mapping[str, Mapping[str, Any]], max_length: int | None = None) -> list[str]:
    """task_data_line for each task, and a note when some tasks are packed windows and others one example per
    record: their examples then differ in size, and the counts above say by how much."""
    lines = [task_data_line(t, r, max_length) for t, r in records.items()]
    text = {t: r for t, r in records.items() if "tokens" in r}
    packed = [t for t, r in text.items() if r.get("packed")]
    single = [t for t in text if t not in packed]
    if packed and single:
        lines.append(
            f"note: an example is not the same unit in every task: {', '.join(map(repr, packed))} packed windows, "
            f"{', '.join(map(repr, single))} one example per record; --pack-texts packs every format, "
            "--no-pack-texts reads a text file one example per document"
        )
    return lines
