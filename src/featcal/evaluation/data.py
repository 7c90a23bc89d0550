"""The one place `featcal eval` reads its data: a task's examples with their inputs, labels and targets.

Reads what calibration reads (featcal.data.sources: JSONL / JSON, parquet, folders written by
datasets' `save_to_disk`, image folders), and also the columns evaluation needs:
- the input: a text column (resolved as calibration resolves it, --text-column when ambiguous), chat
  turns (a `messages` column of {role, content} lists), or an image column / image file;
- `label` (or --label-column): class ids or class names; the class names in id order come from a
  `ClassLabel` feature, or from an image folder's class sub-folders;
- `target` (or --target-column): the text a text-to-text model should produce.
A saved DatasetDict is read at its evaluation split: the one split there is, else `test` or
`validation` (the one of the two present); --split names it when both are, or any other.

Everything else (which metric, whether a label map fits the model) is the runners' business.
When featcal.data gains `read_examples` (issue #37), this module is where evaluation switches to it.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from featcal.data.fingerprint import example_sha256
from featcal.data.sources import ImageFolderSource, TableSource, open_source
from featcal.errors import CalibrationDataError, ConfigError, EvaluationDataError

log = logging.getLogger(__name__)

LABEL_COLUMNS = ("label", "labels")
MESSAGES_COLUMN = "messages"
EVAL_SPLITS = ("test", "validation")


@dataclass(frozen=True)
class EvalExample:
    """One example: its input (a text, chat turns or an image) and what it is scored against."""

    text: str | None = None
    messages: tuple[Mapping[str, str], ...] | None = None
    image: Any = None
    label: int | str | None = None
    target: str | None = None


@dataclass
class EvalSet:
    """A task's evaluation examples, read on demand (images are decoded only when fetched)."""

    task: str
    path: Path
    kind: str  # the source kind ("jsonl", "saved dataset", "image folder", ...)
    rows: list[int]  # the source rows evaluated, in order
    fields: frozenset[str]  # which of text / messages / image / label / target the examples carry
    label_names: tuple[str, ...] | None = None  # class names in label-id order, when the data says
    read_as: dict[str, Any] = field(default_factory=dict)  # split and columns read (for eval.json)
    _source: Any = None
    _columns: dict[str, Any] = field(default_factory=dict)
    _fingerprints: dict[str, list[str]] = field(default_factory=dict)
    _plain: Any = None

    def __len__(self) -> int:
        return len(self.rows)

    def examples(self, positions: Sequence[int] | None = None) -> list[EvalExample]:
        """The examples at `positions` (indices into `rows`), all of them by default."""
        chosen = [self.rows[p] for p in (range(len(self.rows)) if positions is None else positions)]
        return [self._example(r) for r in chosen]

    def labels(self) -> list:
        """Every example's label, reading nothing else (no image is decoded)."""
        if "label" not in self.fields:
            return []
        if isinstance(self._source, ImageFolderSource):
            return [self._columns["folder_labels"][r] for r in self.rows]
        return list(self._source.dataset.select(self.rows)[self._columns["label"]])

    def texts(self) -> list[str]:
        """Every example's input text, read as one column (no row-by-row reads, no image decoded)."""
        if "text" not in self.fields:
            return []
        column = self._columns["text"]
        texts = list(self._without_images().select(self.rows)[column])
        for row, text in zip(self.rows, texts, strict=True):
            if not isinstance(text, str) or not text.strip():
                raise EvaluationDataError(f"task {self.task!r}: {self.path}: row {row} has no text in column {column!r}")
        return texts

    def fingerprints(self, modality: str = "text") -> list[str]:
        """Each example's content fingerprint (data.fingerprint) of what a model of `modality` ("text": the
        chat turns or the text; "image": the image) reads, as calibration fingerprints it; computed once."""
        if modality not in self._fingerprints:
            if modality == "image":
                self._fingerprints[modality] = [example_sha256(e.image) for e in self.examples()]
            else:
                self._fingerprints[modality] = [
                    example_sha256(e.messages if e.messages is not None else e.text) for e in self.examples()
                ]
        return self._fingerprints[modality]

    def require(self, needed: Sequence[str], what: str, hint: str) -> None:
        """Refuse a set that lacks one of `needed` (e.g. "label"), naming what the model is and the fix."""
        missing = [f for f in needed if f not in self.fields]
        if missing:
            raise EvaluationDataError(
                f"task {self.task!r}: {self.path} ({self.kind}) has no {' or '.join(missing)}, which {what} needs; "
                f"{hint}"
            )

    def _example(self, row: int) -> EvalExample:
        if isinstance(self._source, ImageFolderSource):
            label = self._columns.get("folder_labels")
            return EvalExample(image=self._source.examples([row], "image")[0].image,
                               label=label[row] if label is not None else None)  # type: ignore[index]
        src: TableSource = self._source
        record = self._without_images()[row]
        cols = self._columns
        text = record[cols["text"]] if cols.get("text") else None
        if cols.get("text") and (not isinstance(text, str) or not text.strip()):
            raise EvaluationDataError(f"task {self.task!r}: {self.path}: row {row} has no text in column {cols['text']!r}")
        messages = _messages(record[cols["messages"]], self, row) if cols.get("messages") else None
        image = src.examples([row], "image")[0].image if cols.get("image") else None
        label = record[cols["label"]] if cols.get("label") else None
        if cols.get("label") and label is None:
            raise EvaluationDataError(f"task {self.task!r}: {self.path}: row {row} has no label (column {cols['label']!r})")
        target = record[cols["target"]] if cols.get("target") else None
        return EvalExample(text=text, messages=messages, image=image, label=label,
                           target=None if target is None else str(target))

    def _without_images(self):
        """The table less its image column, so reading a row's text or label decodes no image."""
        if self._plain is None:
            image = self._columns.get("image")
            self._plain = self._source.dataset.remove_columns([image]) if image else self._source.dataset
        return self._plain


def _messages(turns: Any, data: EvalSet, row: int) -> tuple[Mapping[str, str], ...]:
    if not isinstance(turns, list) or not turns or not all(
        isinstance(t, Mapping) and isinstance(t.get("role"), str) and isinstance(t.get("content"), str) for t in turns
    ):
        raise EvaluationDataError(
            f"task {data.task!r}: {data.path}: row {row}: `messages` must be a non-empty list of "
            "{role, content} objects with string values"
        )
    return tuple({"role": t["role"], "content": t["content"]} for t in turns)


def read_eval_set(
    task: str,
    source: str | Path,
    *,
    text_column: str | None = None,
    label_column: str | None = None,
    target_column: str | None = None,
    split: str | None = None,
    max_examples: int | None = None,
    seed: int = 0,
) -> EvalSet:
    """Open `source` for task `task` and resolve its columns, reading no image yet.

    `max_examples`: a seeded subset of that many rows (sorted, the same for every model compared), since
    evaluation files are often sorted by label; all rows otherwise.
    """
    if max_examples is not None and max_examples < 1:
        raise ConfigError(f"max_examples must be at least 1, got {max_examples}")
    path = Path(source).expanduser()
    if not path.exists():
        raise EvaluationDataError(f"task {task!r}: evaluation data {path} does not exist")
    try:
        src = _open(path, text_column=text_column, split=split)
        if len(src) == 0:
            raise EvaluationDataError(f"task {task!r}: evaluation data {path} ({src.kind}) holds no examples")
        rows = _rows(len(src), max_examples, seed)
        if isinstance(src, ImageFolderSource):
            return _image_folder_set(task, src, rows, label_column, target_column, text_column)
        return _table_set(task, src, rows, label_column=label_column, target_column=target_column)
    except CalibrationDataError as exc:  # featcal.data's messages speak of calibration data
        raise EvaluationDataError(f"task {task!r}: " + str(exc).replace("calibration data", "evaluation data")) from None


def _rows(n: int, max_examples: int | None, seed: int) -> list[int]:
    if max_examples is None or max_examples >= n:
        return list(range(n))
    return sorted(random.Random(seed).sample(range(n), max_examples))


def _open(path: Path, *, text_column: str | None, split: str | None):
    if path.is_dir() and (path / "dataset_dict.json").exists():
        return _dataset_dict_split(path, text_column, split)
    if split is not None and not (path.is_dir() and (path / "state.json").exists()):
        raise ConfigError(f"--split {split!r} applies to a saved DatasetDict, and {path} is not one")
    return open_source(path, text_column=text_column, allow_test_split=True)  # evaluating on test data is the point


def _dataset_dict_split(path: Path, text_column: str | None, split: str | None) -> TableSource:
    """The evaluation split of a saved DatasetDict: the named one, the only one, or the one of test/validation."""
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as exc:
        raise EvaluationDataError(f"cannot load the saved dataset {path}: {type(exc).__name__}: {exc}") from None
    names = list(loaded)
    if split is not None:
        if split not in loaded:
            raise ConfigError(f"{path} has no split {split!r} (splits: {', '.join(names)}); fix --split")
        chosen = split
    elif len(names) == 1:
        chosen = names[0]
    else:
        candidates = [s for s in EVAL_SPLITS if s in loaded]
        if len(candidates) != 1:
            raise ConfigError(
                f"{path} holds the splits {', '.join(names)}: name the one to evaluate on with --split "
                f"({'both test and validation are there' if candidates else 'none is test or validation'})"
            )
        chosen = candidates[0]
    source = TableSource(loaded[chosen], path, "saved dataset", text_column=text_column)
    source.split = chosen
    return source


def _image_folder_set(task: str, src: ImageFolderSource, rows: list[int], label_column: str | None,
                      target_column: str | None, text_column: str | None) -> EvalSet:
    for flag, value in (("--label-column", label_column), ("--target-column", target_column),
                        ("--text-column", text_column)):
        if value is not None:
            raise ConfigError(f"task {task!r}: {flag} names a table column, and {src.path} is an image folder")
    parts = [f.relative_to(src.path).parts for f in src.files]
    nested = all(len(p) > 1 for p in parts)
    fields = {"image"}
    names: tuple[str, ...] | None = None
    columns: dict[str, Any] = {}
    if nested:  # class sub-folders: the folder is the label, as in torchvision's ImageFolder
        names = tuple(sorted({p[0] for p in parts}))
        columns["folder_labels"] = [p[0] for p in parts]
        fields.add("label")
    elif any(len(p) > 1 for p in parts):
        log.warning("%s: some images sit in sub-folders and some do not; reading no labels from the folders", src.path)
    return EvalSet(task, src.path, src.kind, rows, frozenset(fields), names,
                   {"labels": "class sub-folders"} if nested else {}, src, columns)


def _table_set(task: str, src: TableSource, rows: list[int], *, label_column: str | None,
               target_column: str | None) -> EvalSet:
    dataset = src.dataset
    names_held = ", ".join(repr(c) for c in dataset.column_names)
    columns: dict[str, Any] = {}
    if MESSAGES_COLUMN in dataset.column_names:
        columns["messages"] = MESSAGES_COLUMN
    if "text" in src.modalities and not columns.get("messages"):
        columns["text"] = src.text_column  # refuses an ambiguous text column, naming --text-column
    if src.image_column is not None:
        columns["image"] = src.image_column
    columns["label"] = _chosen_column(task, src, label_column, LABEL_COLUMNS, "--label-column", names_held)
    columns["target"] = _chosen_column(task, src, target_column, (src.target_column,) if src.target_column else (),
                                       "--target-column", names_held)
    if columns["label"] is not None and columns["label"] == columns.get("text"):
        raise ConfigError(f"task {task!r}: {src.path}: column {columns['label']!r} cannot be both the text and the label")
    names = _class_names(dataset, columns["label"])
    fields = frozenset(k for k, v in columns.items() if v is not None)
    read_as = {k + "_column": v for k, v in columns.items() if v is not None}
    if getattr(src, "split", None) is not None:
        read_as["split"] = src.split
    return EvalSet(task, src.path, src.kind, rows, fields, names, read_as, src, columns)


def _chosen_column(task: str, src: TableSource, chosen: str | None, conventional: Sequence[str], flag: str,
                   held: str) -> str | None:
    if chosen is not None:
        if chosen not in src.dataset.column_names:
            raise ConfigError(f"task {task!r}: {src.path} has no column {chosen!r} ({flag}); columns: {held}")
        return chosen
    present = [c for c in conventional if c in src.dataset.column_names]
    if len(present) > 1:
        raise ConfigError(f"task {task!r}: {src.path} has columns {', '.join(map(repr, present))}; name the one to "
                          f"read with {flag}")
    return present[0] if present else None


def _class_names(dataset, column: str | None) -> tuple[str, ...] | None:
    """Class names in id order, from a ClassLabel feature (None for any other column)."""
    if column is None:
        return None
    feature = dataset.features.get(column)
    names = getattr(feature, "names", None)
    return tuple(str(n) for n in names) if names else None
