"""What every source yields: examples, and the protocol a source follows (no I/O here).

An `Example` is one record as the user has it, before any model sees it: a text, or a chat
conversation, or an image, plus the target text an encoder-decoder is teacher-forced with and every
other field of the record (a label, an id, the file it came from), which evaluation reads and
calibration ignores.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

Modality = Literal["image", "text"]
Content = Literal["image", "text", "chat"]


@dataclass(frozen=True)
class Example:
    """One example: `text`, or `messages` (chat turns {"role", "content"}), or `image` (a PIL image).

    `target`: the text an encoder-decoder is teacher-forced with (a `target` / `label_text` column), if any.
    `fields`: the record's other values (a label column, an id; for files, the file and, in an image folder,
    the class sub-folder as `label`).
    """

    text: str | None = None
    target: str | None = None
    messages: tuple[dict[str, Any], ...] | None = None
    image: Any = None
    fields: Mapping[str, Any] = field(default_factory=dict)

    @property
    def content(self) -> Content:
        if self.messages is not None:
            return "chat"
        return "image" if self.image is not None else "text"


class ExampleSource(Protocol):
    """The selectable examples of one data source; reads only the examples asked for."""

    path: Path | str  # a path, or what names an in-memory or hub source in messages and reports
    kind: str  # its format: "image folder", "text file", "jsonl", "csv", "hub dataset", ...

    @property
    def modalities(self) -> tuple[Modality, ...]:
        """What a model can be fed from it: "image", "text" (chat conversations are text)."""
        ...

    def content(self, modality: Modality) -> Content:
        """What its examples of `modality` hold: "image", "text" or "chat"."""
        ...

    def describe(self, modality: Modality) -> dict[str, Any]:
        """What featcal.json records about how it is read (format, content, unit, columns, split)."""
        ...

    def __len__(self) -> int: ...

    def examples(self, indices: Sequence[int], modality: Modality) -> list[Example]:
        """The examples at `indices`, in that order, with the `modality` part filled."""
        ...


# Deprecated name (0.1): a text example with an optional target
TextExample = Example
