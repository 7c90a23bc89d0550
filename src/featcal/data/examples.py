"""Layer 1 of the data seam, public: read any source into examples, with all their fields.

    from featcal.data import read_examples

    examples = read_examples(source, *, modality=None, text_column=None, text_unit=None, data_format=None,
                             allow_test_split=False)
    len(examples); examples[0]; examples[2:5]; list(examples); examples.take([7, 3])
    examples.content     # "text", "chat" or "image"
    examples.describe()  # {"format", "content", "unit", [split, text_column, chat_layout, ...]}

`source`: a path (image folder, text file or folder, saved dataset, .jsonl / .json / .csv / .tsv /
.parquet), a Hugging Face dataset id `NAME[:CONFIG][@SPLIT]`, a `datasets.Dataset` / `DatasetDict`, or a
list of strings, chat conversations, records (dicts) or PIL images (docs/data.md lists them all).
`modality` ("image" / "text"): what to read when a source could serve both (a table with an image and
a text column; a folder holding images and text files); unset, the one the source serves. `text_column`,
`text_unit`, `data_format`, `allow_test_split`: as `featcal calibrate`'s options (--text-column,
--text-unit, --data-format, --allow-test-split); evaluation reads test splits, so it passes
allow_test_split=True.

Each item is an `Example` (data/types.py): `.text`, or `.messages` (chat turns), or `.image` (PIL), plus
`.target` (a target / label_text column) and `.fields` (every other column of the record: a label, an id;
for files, the file name, and an image folder's class sub-folder as `label`). Examples are read when
indexed, not when the source opens, so `read_examples` on 100k images opens no image. Layer 2 (turning
examples into model batches: tokenise, apply the chat template, pack, process images) is
`featcal.data.calibration` / `featcal.data.preprocess`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, overload

from featcal.data.sources import open_source
from featcal.data.tables import TRAIN_SPLITS
from featcal.data.types import Content, Example, ExampleSource, Modality
from featcal.errors import CalibrationDataError

_READ_CHUNK = 64  # examples read at a time when iterating


class Examples(Sequence[Example]):
    """The examples of one source, read lazily, for one modality."""

    def __init__(self, source: ExampleSource, modality: Modality) -> None:
        self.source = source
        self.modality = modality

    @property
    def content(self) -> Content:
        return self.source.content(self.modality)

    def describe(self) -> dict[str, Any]:
        """What the source is and how it is read (what featcal.json records per task)."""
        return {"source": str(self.source.path), **self.source.describe(self.modality)}

    def __len__(self) -> int:
        return len(self.source)

    @overload
    def __getitem__(self, index: int) -> Example: ...

    @overload
    def __getitem__(self, index: slice) -> list[Example]: ...

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self.take(range(*index.indices(len(self))))
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"example {index} of {n}")
        return self.take([index % n])[0]

    def take(self, indices: Sequence[int]) -> list[Example]:
        """The examples at `indices`, in that order."""
        return self.source.examples(list(indices), self.modality)

    def field_names(self) -> tuple[str, ...]:
        """The `fields` every example carries, known without reading one (a table's other columns; a file's
        name; an image folder's class sub-folder as `label` when every image sits in one)."""
        names = getattr(self.source, "field_names", None)
        return tuple(names(self.modality)) if names is not None else ()

    def field_values(self, name: str, indices: Sequence[int]) -> list[Any]:
        """Field `name` of the examples at `indices`, read without their content (no image decoded, no text
        checked); None where an example lacks it."""
        values = getattr(self.source, "field_values", None)
        if values is not None:
            return list(values(name, list(indices)))
        return [e.fields.get(name) for e in self.take(indices)]

    def class_names(self, name: str) -> tuple[str, ...] | None:
        """The class names of field `name` in id order, when the source says (a ClassLabel feature, class
        sub-folders); None otherwise."""
        names = getattr(self.source, "class_names", None)
        return names(name) if names is not None else None

    def __iter__(self) -> Iterator[Example]:
        for start in range(0, len(self), _READ_CHUNK):
            yield from self.take(range(start, min(start + _READ_CHUNK, len(self))))


def read_examples(
    source: Any, *, modality: Modality | None = None, text_column: str | None = None, text_unit: str | None = None,
    data_format: str | None = None, allow_test_split: bool = False, split: str | None = None,
    prefer_splits: Sequence[str] = TRAIN_SPLITS,
) -> Examples:
    """Open `source` and return its examples (see the module docstring); one-line errors for bad input."""
    if modality is not None and modality not in ("image", "text"):
        raise CalibrationDataError(f"modality must be 'image' or 'text', not {modality!r}")
    src = open_source(source, text_column=text_column, allow_test_split=allow_test_split, text_unit=text_unit,
                      data_format=data_format, modality=modality, split=split, prefer_splits=prefer_splits)
    served = _served(src)
    if modality is None:
        if len(served) > 1:
            raise CalibrationDataError(
                f"{src.path} ({src.kind}) holds both images and texts; say which to read with modality='image' "
                "or modality='text'"
            )
        modality = served[0] if served else "text"
    elif served and modality not in served:
        raise CalibrationDataError(f"{src.path} ({src.kind}) holds no {'images' if modality == 'image' else 'texts'}")
    return _checked(Examples(src, modality))


def read_examples_by_modality(
    source: Any, *, text_column: str | None = None, text_unit: str | None = None, data_format: str | None = None,
    allow_test_split: bool = False, split: str | None = None, prefer_splits: Sequence[str] = TRAIN_SPLITS,
) -> dict[Modality, Examples]:
    """Every modality `source` serves, each read as `read_examples(source, modality=...)` reads it, from one
    opening: a table of images with their captions serves an image model its images and a text model the
    captions (what `featcal eval` needs, scoring models of both kinds on one set). Empty for an empty source."""
    src = open_source(source, text_column=text_column, allow_test_split=allow_test_split, text_unit=text_unit,
                      data_format=data_format, split=split, prefer_splits=prefer_splits)
    return {m: _checked(Examples(src, m)) for m in _served(src)}


def _served(src: ExampleSource) -> tuple[Modality, ...]:
    """The modalities `src` serves; a non-empty source serving none is refused naming its string columns."""
    served = src.modalities
    if not served and len(src):
        strings = src.string_columns() if hasattr(src, "string_columns") else []
        held = f" (string columns: {', '.join(map(repr, strings))}; name the text one with text_column)" if strings else ""
        raise CalibrationDataError(f"{src.path} ({src.kind}) holds no image, text or chat column{held}")
    return served


def _checked(examples: Examples) -> Examples:
    if examples.modality == "text" and hasattr(examples.source, "text_column"):
        examples.source.text_column  # noqa: B018 - refuses an ambiguous or unusable text column before any example is read
    return examples
