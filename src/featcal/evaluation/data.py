"""The one place `featcal eval` reads its data: a task's examples with their inputs, labels and targets.

Reads through the data seam (`featcal.data.read_examples_by_modality`), so a task takes every source
calibration takes (docs/data.md): text files and folders cut by --text-unit, chat JSONL / CSV in its three
layouts, JSONL / JSON, CSV / TSV, parquet, saved datasets, hub dataset ids, image folders. On top of the
examples, evaluation reads:
- the label: the `label` (or `labels`) field, or --label-column; class ids or class names. Class names in id
  order come from a `ClassLabel` feature, or from an image folder's class sub-folders;
- the target: a `target` / `label_text` column (what calibration teacher-forces), or --target-column: the
  text a text-to-text model should produce.
A DatasetDict (saved or from the hub) is read at its evaluation split: the one split there is, else `test`
or `validation` (the one of the two present); --split names it when both are, or any other. Each example's
fingerprint is `example_sha256` over the very `Example` calibration would read from the same source, so
the leakage guard matches whatever file, format or order the examples come in.

Everything else (which metric, whether a label map fits the model) is the runners' business.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from featcal.data.examples import Examples, read_examples_by_modality
from featcal.data.fingerprint import FINGERPRINT_SCHEME, example_sha256
from featcal.errors import CalibrationDataError, ConfigError, EvaluationDataError

LABEL_FIELDS = ("label", "labels")
EVAL_SPLITS = ("test", "validation")


@dataclass(frozen=True)
class EvalExample:
    """One example: its input (a text, chat turns or an image) and what it is scored against."""

    text: str | None = None
    messages: tuple[Mapping[str, Any], ...] | None = None
    image: Any = None
    label: int | str | None = None
    target: str | None = None


@dataclass
class EvalSet:
    """A task's evaluation examples, read on demand through the data seam (images decoded only when fetched)."""

    task: str
    path: Path | str  # the source as featcal.data names it (a path, or a hub id)
    kind: str  # the source's format ("jsonl", "csv", "text file", "saved dataset", "image folder", ...)
    rows: list[int]  # the source's examples evaluated, in order
    fields: frozenset[str]  # which of text / messages / image / label / target the examples carry
    label_names: tuple[str, ...] | None = None  # class names in label-id order, when the data says
    read_as: dict[str, Any] = field(default_factory=dict)  # split, unit and columns read (for eval.json)
    _read: dict[str, Examples] = field(default_factory=dict)  # modality -> the source's examples
    _label: str | None = None  # the field labels are read from
    _target: str | None = None  # the field targets are read from
    _cache: dict[str, list] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def primary(self) -> str:
        """The modality examples are read for by default: text (or chat) when the source serves it, else image."""
        return "text" if "text" in self._read else "image"

    def examples(self, positions: Sequence[int] | None = None, modality: str | None = None) -> list[EvalExample]:
        """The examples at `positions` (indices into `rows`, all by default), read for `modality`."""
        positions = range(len(self.rows)) if positions is None else positions
        read = self._read[modality or self.primary]
        labels = self.labels() if self._label else None
        targets = self._raw_targets()
        out = []
        for p, e in zip(positions, read.take([self.rows[p] for p in positions]), strict=True):
            target = targets[p] if targets is not None else None
            out.append(EvalExample(text=e.text, messages=e.messages, image=e.image,
                                   label=labels[p] if labels is not None else None,
                                   target=None if target is None else str(target)))
        return out

    def labels(self) -> list:
        """Every example's label, read alone (no image decoded); a missing label is refused naming the row."""
        if self._label is None:
            return []
        if "labels" not in self._cache:
            values = self._read[self.primary].field_values(self._label, self.rows)
            missing = next((r for r, v in zip(self.rows, values, strict=True) if v is None), None)
            if missing is not None:
                raise EvaluationDataError(f"task {self.task!r}: {self.path}: example {missing + 1} has no label "
                                          f"({self._label!r} is empty)")
            self._cache["labels"] = values
        return self._cache["labels"]

    def targets(self) -> list[str]:
        """Every example's target text; a missing or blank one is refused naming the row (scoring a generation
        against an empty target would give a number, and a wrong one)."""
        if self._target is None:
            return []
        if "targets" not in self._cache:
            values = self._raw_targets() or []
            for row, value in zip(self.rows, values, strict=True):
                if isinstance(value, bool) or not isinstance(value, (str, int)) or not str(value).strip():
                    raise EvaluationDataError(
                        f"task {self.task!r}: {self.path}: example {row + 1} has no target text in {self._target!r} "
                        f"(got {value!r}); every example needs the answer it is scored against"
                    )
            self._cache["targets"] = [str(v) for v in values]
        return self._cache["targets"]

    def _raw_targets(self) -> list | None:
        if self._target is None:
            return None
        if "raw_targets" not in self._cache:
            self._cache["raw_targets"] = self._read[self.primary].field_values(self._target, self.rows)
        return self._cache["raw_targets"]

    def texts(self) -> list[str]:
        """Every example's input text (read once; the data seam refuses an empty one naming the row)."""
        if "text" not in self.fields:
            return []
        if "texts" not in self._cache:
            self._cache["texts"] = [e.text for e in self._read["text"].take(self.rows)]
        return self._cache["texts"]

    def fingerprints(self, modality: str = "text", scheme: int = FINGERPRINT_SCHEME) -> list[str]:
        """Each example's content fingerprint (data.fingerprint, by `scheme`) of what a model of `modality`
        ("text": the chat turns or the text; "image": the image) reads, over the Example calibration reads;
        computed once."""
        key = f"sha256:{modality}:{scheme}"
        if key not in self._cache:
            read = self._read.get(modality)
            self._cache[key] = [example_sha256(e, scheme) for e in read.take(self.rows)] if read is not None else []
        return self._cache[key]

    def require(self, needed: Sequence[str], what: str, hint: str) -> None:
        """Refuse a set that lacks one of `needed` (e.g. "label"), naming what the model is and the fix."""
        missing = [f for f in needed if f not in self.fields]
        if missing:
            raise EvaluationDataError(
                f"task {self.task!r}: {self.path} ({self.kind}) has no {' or '.join(missing)}, which {what} needs; "
                f"{hint}"
            )


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
    text_unit: str | None = None,
    data_format: str | None = None,
) -> EvalSet:
    """Open `source` for task `task` and resolve its label and target fields, reading no image yet.

    `max_examples`: a seeded subset of that many examples (sorted, the same for every model compared), since
    evaluation files are often sorted by label; all examples otherwise. `text_unit`, `data_format`: as
    calibration reads them (--text-unit, --data-format).
    """
    if max_examples is not None and max_examples < 1:
        raise ConfigError(f"max_examples must be at least 1, got {max_examples}")
    if isinstance(source, Path) and not source.expanduser().exists():
        raise EvaluationDataError(f"task {task!r}: evaluation data {source} does not exist")
    try:
        read = read_examples_by_modality(source, text_column=text_column, text_unit=text_unit, data_format=data_format,
                                         allow_test_split=True, split=split, prefer_splits=EVAL_SPLITS)
        data = _eval_set(task, read, source, label_column, target_column, max_examples, seed)
        data.texts()  # every text checked now, before any model is loaded
        return data
    except ConfigError as exc:  # a split that cannot be chosen, a column that is not there
        raise ConfigError(f"task {task!r}: {_for_evaluation(exc)}") from None
    except (CalibrationDataError, EvaluationDataError) as exc:
        raise EvaluationDataError(f"task {task!r}: {_for_evaluation(exc)}") from None


def _for_evaluation(exc: Exception) -> str:
    """featcal.data's messages speak of calibration data; here it is evaluation data."""
    return str(exc).replace("calibration data", "evaluation data")


def _eval_set(task: str, read: dict[str, Examples], source: str | Path, label_column: str | None,
              target_column: str | None, max_examples: int | None, seed: int) -> EvalSet:
    any_read = next(iter(read.values()), None)
    if any_read is None or len(any_read) == 0:
        src = any_read.source if any_read is not None else None
        hint = src.empty_hint() if src is not None and hasattr(src, "empty_hint") else ""
        raise EvaluationDataError(f"evaluation data {source} holds no examples{hint}")
    primary = read["text"] if "text" in read else read["image"]
    src = primary.source
    label = _field(task, read, label_column, LABEL_FIELDS, "--label-column", "label")
    default_target = read["text"].describe().get("target_column") if "text" in read else None
    target = _field(task, read, target_column, (default_target,) if default_target else (), "--target-column",
                    "target")
    fields = set(read)
    if "text" in read and read["text"].content == "chat":
        fields = (fields - {"text"}) | {"messages"}
    fields |= {name for name, value in (("label", label), ("target", target)) if value is not None}
    return EvalSet(task, src.path, src.kind, _rows(len(primary), max_examples, seed), frozenset(fields),
                   primary.class_names(label) if label else None, _read_as(read, label, target), dict(read),
                   label, target)


def _field(task: str, read: dict[str, Examples], chosen: str | None, conventional: Sequence[str], flag: str,
           role: str) -> str | None:
    """The field `role` (label, target) is read from: `chosen`, else the one conventional name present.

    It must be a field of the examples of every modality read (a column a model reads as its input cannot
    be what it is scored against)."""
    carried = {m: set(e.field_names()) for m, e in read.items()}
    everywhere = set.intersection(*carried.values())
    primary = read["text"] if "text" in read else read["image"]
    where = f"{primary.source.path} ({primary.source.kind})"
    if chosen is not None:
        if chosen not in everywhere:
            inputs = [m for m, names in carried.items() if chosen not in names]
            if any(chosen in names for names in carried.values()) or _is_input(read, chosen):
                raise ConfigError(f"{where}: {chosen!r} ({flag}) is the {' and '.join(inputs)} the models read, so it "
                                  f"cannot be the {role} too")
            held = ", ".join(map(repr, sorted(everywhere))) or "none"
            raise ConfigError(f"{where} has no column or field {chosen!r} ({flag}); its examples carry: {held}")
        return chosen
    present = [c for c in conventional if c in everywhere]
    if len(present) > 1:
        raise ConfigError(f"{where} has columns {', '.join(map(repr, present))}; name the one to read with {flag}")
    return present[0] if present else None


def _is_input(read: dict[str, Examples], name: str) -> bool:
    """Whether column `name` is what the models read (the text, image or chat columns)."""
    for modality, examples in read.items():
        columns = getattr(examples.source, "content_columns", None)
        if columns is not None and name in columns(modality):
            return True
    return False


def _read_as(read: dict[str, Examples], label: str | None, target: str | None) -> dict[str, Any]:
    """How the set is read, for eval.json: content, unit, split, the columns or chat layout read."""
    out: dict[str, Any] = {}
    contents = []
    for examples in read.values():
        described = examples.describe()
        contents.append(described.pop("content"))
        for key in ("source", "format", "target_column"):
            described.pop(key, None)
        out.update(described)
    out["content"] = contents[0] if len(contents) == 1 else contents
    if label is not None:
        out["label_column"] = label
    if target is not None:
        out["target_column"] = target
    return out


def _rows(n: int, max_examples: int | None, seed: int) -> list[int]:
    if max_examples is None or max_examples >= n:
        return list(range(n))
    return sorted(random.Random(seed).sample(range(n), max_examples))
