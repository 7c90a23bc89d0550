"""Tables of records: JSONL / JSON, CSV / TSV, parquet, saved datasets, hub and in-memory datasets.

Every table is a `datasets.Dataset` read through one `TableSource`, so the column rules are the same
whatever the file: images from the first Image feature or a column named image / img; chat
conversations from a chat layout (data/chat.py: messages, prompt / completion, instruction / input /
output); else texts from the column the user names, else a conventionally named one (TEXT_COLUMNS),
else the one string column that is no id, label, target or image. Several candidates are refused
naming them, never picked.
"""

from __future__ import annotations

import csv as csv_module
import io
import json
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from featcal.data.chat import CHAT_LAYOUTS, chat_layout, conversation
from featcal.data.text_files import read_utf8
from featcal.data.types import Content, Example, Modality
from featcal.errors import CalibrationDataError, SplitChoiceError

log = logging.getLogger(__name__)

IMAGE_COLUMNS = ("image", "img")
TEXT_COLUMNS = ("text", "sentence", "content", "prompt", "input", "question", "document", "premise", "sentence1")
TARGET_COLUMNS = ("target", "label_text")
# string columns that name or label an example rather than hold its text: never taken as the text by default
NON_TEXT_COLUMNS = (
    "id", "idx", "uid", "guid", "uuid", "key", "label", "labels", "class", "category", "split", "source", "path",
    "file", "filename", "url",
)
TEST_SPLITS = ("test", "testing")
TABLE_SUFFIXES = (".jsonl", ".ndjson", ".json", ".csv", ".tsv", ".parquet")
# tables this long have their chat records checked when read, not all when opened (time stays bounded)
CHECK_ALL_ROWS_UP_TO = 200_000


class TableSource:
    """A `datasets.Dataset` with its columns resolved: what it holds, and how each example is read."""

    def __init__(self, dataset, path: Path | str, kind: str, *, text_column: str | None = None,
                 image_root: Path | None = None, locate: Callable[[int], str] | None = None) -> None:
        self.path = path
        self.kind = kind
        self.split: str | None = None  # a saved or hub dataset's split, when known
        self._without_images = None  # the table less its image column, made when a text example is read
        self._locate = locate or (lambda i: f"{path}, row {i + 1}")
        self.dataset, self.image_column = _resolve_image_column(dataset, path, image_root)
        columns = self.dataset.column_names
        self.chat_layout = chat_layout(columns) if text_column is None else None
        if self.chat_layout is not None:
            self._text_candidates, self._text_problem = [], None
            self._refuse_unread_answers()
            self._check_conversations()
        else:
            self._text_candidates, self._text_problem = _text_column(
                self.dataset, path, text_column, exclude=(self.image_column,)
            )
        self.target_column = next(
            (c for c in TARGET_COLUMNS if c in columns and _is_string(self.dataset.features, c)), None
        )

    @property
    def text_column(self) -> str | None:
        """The column texts are read from; an ambiguous or unusable choice is refused here, before any read."""
        if self._text_problem is not None:
            raise CalibrationDataError(self._text_problem)
        return self._text_candidates[0] if self._text_candidates else None

    @property
    def modalities(self) -> tuple[Modality, ...]:
        found: list[Modality] = []
        if self.image_column is not None:
            found.append("image")
        if self.chat_layout is not None or self._text_candidates or self._text_problem is not None:
            found.append("text")
        return tuple(found)

    def content(self, modality: Modality) -> Content:
        if modality == "image":
            return "image"
        return "chat" if self.chat_layout is not None else "text"

    def describe(self, modality: Modality) -> dict[str, Any]:
        out: dict[str, Any] = {"format": self.kind, "content": self.content(modality), "unit": "record"}
        if self.split is not None:
            out["split"] = self.split
        if modality == "image":
            out["image_column"] = self.image_column
        elif self.chat_layout is not None:
            out["chat_layout"] = self.chat_layout
        elif self.text_column is not None:
            out["text_column"] = self.text_column
            if self.target_column is not None:
                out["target_column"] = self.target_column
        return out

    def string_columns(self) -> list[str]:
        """Every string column (what a user may pass as the text column)."""
        features = self.dataset.features  # a copy at each access: taken once (a table may have 10,000 columns)
        return [c for c in self.dataset.column_names if _is_string(features, c)]

    def __len__(self) -> int:
        return len(self.dataset)

    def examples(self, indices: Sequence[int], modality: Modality) -> list[Example]:
        return [self._example(int(i), modality) for i in indices]

    def field_names(self, modality: Modality) -> list[str]:
        """The columns an example of `modality` carries as `fields` (all but those its content is read from)."""
        used = set(self.content_columns(modality))
        table = self._text_rows if modality == "text" else self.dataset
        return [c for c in table.column_names if c not in used]

    def field_values(self, name: str, indices: Sequence[int]) -> list[Any]:
        """Column `name` at `indices`, read alone (an image column beside it is never decoded)."""
        if name not in self.dataset.column_names:
            return [None] * len(indices)
        column = self.dataset.select_columns([name])
        return list(column[list(indices)][name]) if indices else []

    def class_names(self, name: str) -> tuple[str, ...] | None:
        """Class names in id order of a ClassLabel column (None for any other column)."""
        names = getattr(self.dataset.features.get(name), "names", None)
        return tuple(str(n) for n in names) if names else None

    def content_columns(self, modality: Modality) -> tuple[str, ...]:
        """The columns an example of `modality` is read from (the image; the chat layout's; the text)."""
        if modality == "image":
            return (self.image_column,) if self.image_column else ()
        if self.chat_layout is not None:
            return CHAT_LAYOUTS[self.chat_layout] + (("input",) if self.chat_layout.startswith("instruction") else ())
        return (self.text_column,) if self.text_column else ()

    @property
    def _text_rows(self):
        """The table less its image column: reading a text or chat example decodes no image (a missing or
        broken image file cannot stop a text model from reading the captions beside it)."""
        if self.image_column is None:
            return self.dataset
        if self._without_images is None:
            self._without_images = self.dataset.remove_columns([self.image_column])
        return self._without_images

    def _example(self, i: int, modality: Modality) -> Example:
        if modality == "image":
            return self._image(i)
        row = self._text_rows[i]
        if self.chat_layout is not None:
            return Example(messages=conversation(row, self.chat_layout, self._locate(i)),
                           fields=_other_fields(row, self.content_columns("text")))
        column = self.text_column
        text = row[column]
        if not isinstance(text, str) or not text.strip():
            raise CalibrationDataError(f"{self._locate(i)}: no text in column {column!r}")
        target = row[self.target_column] if self.target_column else None
        return Example(text=text, target=target if isinstance(target, str) else None,
                       fields=_other_fields(row, (column,)))

    def _image(self, i: int) -> Example:
        try:
            row = self.dataset[i]
            image = row[self.image_column]
        except Exception as exc:  # decoding errors surface here, one row at a time
            raise CalibrationDataError(
                f"{self.path}: cannot decode the image in row {i} (column {self.image_column!r}): {exc}"
            ) from None
        if image is None:
            raise CalibrationDataError(f"{self.path}: row {i} has no image (column {self.image_column!r} is empty)")
        return Example(image=image, fields=_other_fields(row, (self.image_column,)))

    def _refuse_unread_answers(self) -> None:
        """Alpaca prompts (`instruction` without `output`) beside another string column that could hold the
        answers (`response`, `answer`, ...) are refused: read as prompts alone, every answer would be dropped."""
        if self.chat_layout != "instruction/input":
            return
        others = [c for c in self.string_columns() if c not in ("instruction", "input") and c.lower() not in NON_TEXT_COLUMNS]
        if others:
            raise CalibrationDataError(
                f"{self.path}: an 'instruction' column and no 'output', read as Alpaca prompts alone, would leave out "
                f"the string column(s) {', '.join(map(repr, others))}; name the answers' column 'output', or the "
                "column to read as plain text with --text-column"
            )

    def _check_conversations(self) -> None:
        """Every record a conversation with known roles and text turns, refused naming the first that is not
        (all of them for tables up to CHECK_ALL_ROWS_UP_TO rows; longer ones as their records are read)."""
        if len(self.dataset) > CHECK_ALL_ROWS_UP_TO:
            return
        columns = [c for c in self.dataset.column_names if c in ("messages", "prompt", "completion", "instruction",
                                                                 "input", "output")]
        rows = self.dataset.select_columns(columns)
        start = 0
        for batch in rows.iter(batch_size=1000):
            size = len(batch[columns[0]])
            for k in range(size):
                conversation({c: batch[c][k] for c in columns}, self.chat_layout, self._locate(start + k))
            start += size


def _other_fields(row: dict, used: Sequence[str]) -> dict[str, Any]:
    return {k: v for k, v in row.items() if k not in used}


def _is_string(features, column: str) -> bool:
    """Whether `column` of a table with `features` (`dataset.features`, which copies them all at each access: read
    it once, not once per column) holds strings."""
    from datasets import Value

    feature = features.get(column)
    return isinstance(feature, Value) and feature.dtype in ("string", "large_string")


def _resolve_image_column(dataset, path: Path | str, root: Path | None = None):
    """The first Image feature, else a column named image/img cast to Image (paths or bytes).

    With `root` (the folder of a JSONL / parquet file), relative image paths are taken from there, so a
    data file reads the same images from whatever directory featcal is run.
    """
    from datasets import Image

    found = next((name for name, feature in dataset.features.items() if isinstance(feature, Image)), None)
    if found is None:
        found = next((name for name in IMAGE_COLUMNS if name in dataset.column_names), None)
    if found is None:
        return dataset, None
    try:
        if root is not None:
            dataset = _anchor_image_paths(dataset, found, root)
        if not isinstance(dataset.features[found], Image) or not dataset.features[found].decode:
            dataset = dataset.cast_column(found, Image())
    except Exception as exc:
        raise CalibrationDataError(
            f"{path}: column {found!r} cannot be read as images ({type(exc).__name__}: {exc})"
        ) from None
    return dataset, found


def _anchor_image_paths(dataset, column: str, root: Path):
    """`dataset` with the relative paths of image column `column` (no embedded bytes) made relative to `root`.

    Works on the Arrow chunks, so embedded image bytes are never copied into Python objects.
    """
    import os

    import pyarrow as pa
    from datasets import Image
    from datasets.table import InMemoryTable

    def anchored(p: str | None, has_bytes: bool) -> str | None:
        if p is None or has_bytes or "://" in p:
            return p
        q = os.path.expanduser(p)
        return q if os.path.isabs(q) else str(root / q)

    raw = dataset.cast_column(column, Image(decode=False))  # struct<bytes, path>, whatever the column held
    cells = raw.data.column(column)
    chunks, changed = [], False
    for chunk in cells.chunks:
        data, paths = chunk.field("bytes"), chunk.field("path").to_pylist()
        new_paths = [anchored(p, b) for p, b in zip(paths, data.is_valid().to_pylist(), strict=True)]
        changed = changed or new_paths != paths
        chunks.append(pa.StructArray.from_arrays(
            [data, pa.array(new_paths, type=pa.string())], names=["bytes", "path"], mask=chunk.is_null()
        ))
    if not changed:
        return raw
    table = raw.data.table
    table = table.set_column(table.schema.get_field_index(column), column, pa.chunked_array(chunks, type=cells.type))
    return type(dataset)(InMemoryTable(table), info=raw.info)


def _text_column(
    dataset, path: Path | str, chosen: str | None, exclude: Sequence[str | None]
) -> tuple[list[str], str | None]:
    """(candidate text columns, the problem with them or None): the column the user chose, else a
    conventionally named one, else the one string column that is not an image, target, id or label.

    Several candidates are a problem, not a choice to make silently: calibrating on ids or label words
    instead of the texts gives a wrong model with no error, so the user must name the column.
    """
    features = dataset.features
    strings = [c for c in dataset.column_names if _is_string(features, c)]
    held = ", ".join(repr(c) for c in strings) or "none"
    if chosen is not None:
        if chosen not in dataset.column_names:
            return [], f"{path}: text column {chosen!r} does not exist (string columns: {held})"
        if not _is_string(features, chosen):
            return [], f"{path}: text column {chosen!r} does not hold strings (string columns: {held})"
        return [chosen], None
    for name in TEXT_COLUMNS:
        if name in strings:
            return [name], None
    odd = next((n for n in TEXT_COLUMNS if n in dataset.column_names and n not in exclude), None)
    if odd is not None:  # e.g. pre-tokenised ids under `text`: the texts are not where the name says
        return [], (
            f"{path}: column {odd!r} does not hold strings ({features[odd]}); name the column holding "
            f"the texts with --text-column (string columns: {held})"
        )
    candidates = [c for c in strings if c not in exclude and c not in TARGET_COLUMNS and c.lower() not in NON_TEXT_COLUMNS]
    if len(candidates) > 1:
        return candidates, (
            f"{path}: no conventionally named text column ({', '.join(TEXT_COLUMNS[:4])}, ...) and several string "
            f"columns could hold the texts: {', '.join(map(repr, candidates))}; name one with --text-column "
            "(text_column in the config)"
        )
    return candidates, None


def is_test_split(name: object) -> bool:
    """Whether a split name (as datasets records it: 'test', 'test[:100]', 'train+test') holds test data."""
    if name is None:
        return False
    return any(part.split("[", 1)[0].strip().lower() in TEST_SPLITS for part in str(name).split("+"))


def refuse_test_split(path: Path | str, split: object, allowed: bool) -> None:
    """Test data must never become calibration data by accident: only when the user says so."""
    if not is_test_split(split):
        return
    if not allowed:
        raise CalibrationDataError(
            f"{path} is the {str(split)!r} split, test data: calibrating on it would leak it into the model "
            "evaluated on it. Use a training split, or pass --allow-test-split (allow_test_split: true) if you mean it"
        )
    log.warning("%s: calibrating on its %r split, as allowed by allow_test_split", path, str(split))


TRAIN_SPLITS = ("train",)  # calibration reads training data


def choose_split(loaded, path: Path | str, *, split: str | None = None, prefer: Sequence[str] = TRAIN_SPLITS,
                 allow_test_split: bool = False):
    """(the Dataset, its split name) of a DatasetDict: `split` when named; else its only split; else the one
    of `prefer` it holds (calibration: train; evaluation: test or validation). Several or none is refused
    naming the splits, never picked; a test split needs `allow_test_split`."""
    names = list(loaded)
    if split is not None:
        if split not in loaded:
            raise SplitChoiceError(f"{path} has no split {split!r} (splits: {', '.join(names)}); fix --split")
        chosen = split
    elif len(names) == 1:
        chosen = names[0]
        if tuple(prefer) == TRAIN_SPLITS and chosen != "train":
            log.info("%s has no 'train' split; using its only split %r", path, chosen)
    else:
        held = [s for s in prefer if s in loaded]
        if len(held) != 1:
            if tuple(prefer) == TRAIN_SPLITS:
                raise CalibrationDataError(
                    f"{path} is a DatasetDict without a 'train' split (splits: {', '.join(names)}); "
                    "calibration data must come from training data"
                )
            why = f"both {' and '.join(held)} are there" if held else f"none is {' or '.join(prefer)}"
            raise SplitChoiceError(f"{path} holds the splits {', '.join(names)}: name the one to read with --split ({why})")
        chosen = held[0]
    refuse_test_split(path, chosen, allow_test_split)
    return loaded[chosen], chosen


def train_split(loaded, path: Path | str, allow_test_split: bool):
    """(the Dataset, its split name) of a DatasetDict: its 'train' split, else its only split; else refused."""
    return choose_split(loaded, path, allow_test_split=allow_test_split)


def saved_dataset(path: Path, *, text_column: str | None = None, allow_test_split: bool = False,
                  split: str | None = None, prefer_splits: Sequence[str] = TRAIN_SPLITS) -> TableSource:
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as exc:
        raise CalibrationDataError(f"cannot load the saved dataset {path}: {type(exc).__name__}: {exc}") from None
    return dataset_source(loaded, path, "saved dataset", text_column=text_column, allow_test_split=allow_test_split,
                          split=split, prefer_splits=prefer_splits)


def dataset_source(loaded, name: Path | str, kind: str, *, text_column: str | None = None,
                   allow_test_split: bool = False, split: str | None = None,
                   prefer_splits: Sequence[str] = TRAIN_SPLITS) -> TableSource:
    """A Dataset or DatasetDict (saved, from the hub, or in memory) as a source; a dict's split chosen by
    `choose_split`. A Dataset named with another `split` than the one it was loaded from is refused."""
    import datasets

    if isinstance(loaded, datasets.DatasetDict):
        loaded, split = choose_split(loaded, name, split=split, prefer=prefer_splits, allow_test_split=allow_test_split)
    else:  # a Dataset loaded from a split remembers which one
        own = getattr(loaded, "split", None)
        if split is not None and (own is None or str(own) != split):
            held = f"the {str(own)!r} split" if own is not None else "one dataset, not a DatasetDict"
            raise SplitChoiceError(f"{name} holds {held}, so --split {split!r} names nothing there; drop --split")
        split = own
        refuse_test_split(name, split, allow_test_split)
    source = TableSource(loaded, name, kind, text_column=text_column)
    source.split = None if split is None else str(split)  # featcal.json records which split was read
    return source


def records_source(records: list[dict], name: Path | str, kind: str, *, text_column: str | None = None,
                   image_root: Path | None = None, locate: Callable[[int], str] | None = None) -> TableSource:
    """Records (dicts, as JSON objects come) as one table, its columns the union of every record's keys (not
    the first record's, as `Dataset.from_list` takes them); records of different formats (a chat among plain
    texts, an Alpaca record without `output` among ones with it) are refused naming the first that differs."""
    import datasets

    locate = locate or (lambda i: f"{name}, record {i + 1}")
    columns = list(dict.fromkeys(k for r in records for k in r))  # every key, in order of first appearance
    if text_column is None:
        _check_one_format(records, columns, locate)
    try:
        whole = all(len(r) == len(columns) for r in records)  # every record holds every key: used as they are
        dataset = datasets.Dataset.from_list(records if whole else [{c: r.get(c) for c in columns} for r in records])
    except Exception as exc:  # mixed types in one field, nested garbage
        raise CalibrationDataError(f"{name}: records cannot be read as one table: {exc}") from None
    return TableSource(dataset, name, kind, text_column=text_column, image_root=image_root, locate=locate)


def _check_one_format(records: list[dict], columns: list[str], locate: Callable[[int], str]) -> None:
    """Refuse records that disagree on their format: the table's chat layout (data/chat.py) is decided from
    all of its columns, and a record whose own (non-null) keys make another layout, or none, is refused."""
    expected = chat_layout(columns)
    if expected is None:
        return
    layouts = [chat_layout([k for k, v in r.items() if v is not None]) for r in records]
    first = next((i for i, own in enumerate(layouts) if own != expected), None)
    if first is None:
        return
    keys = [k for k, v in records[first].items() if v is not None]
    missing = [c for c in CHAT_LAYOUTS[expected] if c not in keys]
    hint = f"it has no {' or '.join(map(repr, missing))}" if missing else "its keys make another layout"
    like = next((i for i, own in enumerate(layouts) if own == expected), None)
    other = (f"{locate(like)} is {_format_name(expected)}" if like is not None
             else f"the records' keys together make {_format_name(expected)}")
    raise CalibrationDataError(
        f"{locate(first)}: {_format_name(layouts[first])}, but {other}; the records of one table must share one "
        f"format ({hint}: fill it in, or read one column as plain text with --text-column)"
    )


def _format_name(layout: str | None) -> str:
    return "a plain record, not a chat" if layout is None else f"a chat record in the {layout} layout"


class _DuplicateKey(ValueError):
    """A JSON object naming one key twice."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object's pairs as a dict, refused when a key comes twice: `json` would keep the last value silently
    (`{"text": "a", "text": "b"}` is text "b"; a turn's second "role" its role), and which is meant cannot be told."""
    out = dict(pairs)
    if len(out) != len(pairs):
        twice = next(k for i, (k, _) in enumerate(pairs) if any(k == other for other, _ in pairs[:i]))
        raise _DuplicateKey(f"the key {twice!r} comes twice in one object (which value is meant cannot be told)")
    return out


def _loads(text: str, where: str) -> Any:
    """`text` parsed as JSON; invalid JSON, or an object naming a key twice, refused naming `where`."""
    try:
        return json.loads(text, object_pairs_hook=_unique_keys)
    except _DuplicateKey as exc:
        raise CalibrationDataError(f"{where}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise CalibrationDataError(f"{where}: not valid JSON ({exc})") from None


def jsonl_file(path: Path, *, text_column: str | None = None) -> TableSource:
    text = read_utf8(path)
    records: list[dict] = []
    lines: list[int] = []
    array = text.lstrip().startswith("[")
    if array and path.suffix.lower() != ".json":
        raise CalibrationDataError(f"{path} holds a JSON array, not JSON Lines (one object per line) as its suffix "
                                   "says; name it .json, or write one record per line")
    if array:
        records = _loads(text, str(path))
        if not all(isinstance(r, dict) for r in records):
            raise CalibrationDataError(f"{path}: a JSON array of calibration records must hold objects")
    else:
        # JSON Lines ends records at "\n" only: str.splitlines() would also split at U+2028, U+0085, ...,
        # which valid JSON may hold unescaped inside a string
        for lineno, line in enumerate(text.split("\n"), 1):
            if not line.strip():
                continue
            record = _loads(line, f"{path}, line {lineno}")
            if not isinstance(record, dict):
                raise CalibrationDataError(f"{path}, line {lineno}: expected a JSON object, got {type(record).__name__}")
            records.append(record)
            lines.append(lineno)
    locate = (lambda i: f"{path}, line {lines[i]}") if lines else (lambda i: f"{path}, record {i + 1}")
    return records_source(records, path, "jsonl", text_column=text_column, image_root=path.parent, locate=locate)


def csv_file(path: Path, *, text_column: str | None = None) -> TableSource:
    """A CSV (or, by its .tsv suffix, tab-separated) file with a header row; text-like columns stay strings."""
    import datasets
    import pyarrow as pa
    import pyarrow.csv as pcsv
    from datasets.table import InMemoryTable

    tsv = path.suffix.lower() == ".tsv"
    kind = "tsv" if tsv else "csv"
    text = read_utf8(path)  # refuses a non-UTF-8 file naming the line
    if not text.strip():
        return records_source([], path, kind)
    delimiter = "\t" if tsv else ","
    names = next(csv_module.reader(io.StringIO(text), delimiter=delimiter), [])
    _refuse_other_delimiter(path, names, tsv)
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:  # which of the two is the text (or the label) cannot be told
        raise CalibrationDataError(f"{path}: the header names the column(s) {', '.join(map(repr, twice))} more than "
                                   "once; give every column its own name")
    textual = set(TEXT_COLUMNS) | set(TARGET_COLUMNS) | {c for cols in CHAT_LAYOUTS.values() for c in cols}
    textual |= {"input"} | ({text_column} if text_column else set())
    try:
        table = pcsv.read_csv(
            io.BytesIO(text.encode("utf-8")),
            parse_options=pcsv.ParseOptions(delimiter=delimiter, newlines_in_values=True),
            convert_options=pcsv.ConvertOptions(column_types={n: pa.string() for n in names if n in textual}),
        )
    except pa.ArrowInvalid as exc:
        raise CalibrationDataError(f"{path}: not a readable {kind.upper()} file ({' '.join(str(exc).split())})") from None
    return TableSource(datasets.Dataset(InMemoryTable(table)), path, kind, text_column=text_column,
                       image_root=path.parent, locate=lambda i: f"{path}, row {i + 1}")


def _refuse_other_delimiter(path: Path, names: list[str], tsv: bool) -> None:
    """A header read as one column that the other delimiter splits (a tab-separated file named .csv, a
    comma-separated one named .tsv) is refused: read as it is named, every row would become one text column,
    labels and all, and be calibrated on as text."""
    other, right = (",", ".csv") if tsv else ("\t", ".tsv")
    if len(names) != 1 or len([n for n in names[0].split(other) if n.strip()]) < 2:
        return
    what = "commas" if tsv else "tabs"
    raise CalibrationDataError(
        f"{path}: its header is one column, {names[0]!r}, holding {what}: the file looks {'comma' if tsv else 'tab'}-"
        f"separated, not {'tab' if tsv else 'comma'}-separated as its suffix says; name it {right}"
    )


def parquet_file(path: Path, *, text_column: str | None = None) -> TableSource:
    import datasets
    import pyarrow.parquet as pq
    from datasets.table import InMemoryTable

    try:
        table = pq.read_table(path)
    except Exception as exc:
        raise CalibrationDataError(f"cannot read parquet file {path}: {exc}") from None
    return TableSource(
        datasets.Dataset(InMemoryTable(table)), path, "parquet", text_column=text_column, image_root=path.parent
    )


def table_file(path: Path, *, text_column: str | None = None) -> TableSource:
    """A data file read by its suffix (TABLE_SUFFIXES)."""
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".ndjson", ".json"):
        return jsonl_file(path, text_column=text_column)
    if suffix in (".csv", ".tsv"):
        return csv_file(path, text_column=text_column)
    return parquet_file(path, text_column=text_column)
