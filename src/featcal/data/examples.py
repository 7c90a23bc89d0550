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

    def __iter__(self) -> Iterator[Example]:
        for start in range(0, len(self), _READ_CHUNK):
            yield from self.take(range(start, min(start + _READ_CHUNK, len(self))))


def read_examples(
    source: Any, *, modality: Modality | None = None, text_column: str | None = None, text_unit: str | None = None,
    data_format: str | None = None, allow_test_split: bool = False,
) -> Examples:
    """Open `source` and return its examples (see the module docstring); one-line errors for bad input."""
    if modality is not None and modality not in ("image", "text"):
        raise CalibrationDataError(f"modality must be 'image' or 'text', not {modality!r}")
    src = open_source(source, text_column=text_column, allow_test_split=allow_test_split, text_unit=text_unit,
                      data_format=data_format, modality=modality)
    served = src.modalities
    if not served and len(src):
        strings = src.string_columns() if hasattr(src, "string_columns") else []
        held = f" (string columns: {', '.join(map(repr, strings))}; name the text one with text_column)" if strings else ""
        raise CalibrationDataError(f"{src.path} ({src.kind}) holds no image, text or chat column{held}")
    if modality is None:
        if len(served) > 1:
            raise CalibrationDataError(
                f"{src.path} ({src.kind}) holds both images and texts; say which to read with modality='image' "
                "or modality='text'"
            )
        modality = served[0] if served else "text"
    elif served and modality not in served:
        raise CalibrationDataError(f"{src.path} ({src.kind}) holds no {'images' if modality == 'image' else 'texts'}")
    if modality == "text" and hasattr(src, "text_column"):
        src.text_column  # noqa: B018 - refuses an ambiguous or unusable text column before any example is read
    return Examples(src, modality)
