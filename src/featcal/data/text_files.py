"""Plain text as examples: a .txt / .md file, or a folder of text files, cut into units.

The unit is what one example is (`text_unit`, TEXT_UNITS):
- "line": each line without its line ending (\n, \r\n or \r); blank lines are skipped;
- "paragraph": each block of lines between blank lines (a blank line holds only whitespace), without the
  line breaks around it;
- "file": each file's whole text.
Unset, a folder is read by "file" (its files are the documents) and a single file by "paragraph".
Every file is read, and checked to be UTF-8, when the source opens, so a bad file is refused before any
model is loaded. Packing documents into token windows for decoders is the preprocessor's job
(data/packing.py), not this module's: these are the documents as the user wrote them.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from featcal.data.types import Content, Example, Modality
from featcal.errors import CalibrationDataError

TEXT_SUFFIXES = (".txt", ".md", ".markdown", ".rst", ".text")
TEXT_UNITS = ("line", "paragraph", "file")
_HEAD_BYTES = 1 << 16


def read_utf8(path: Path) -> str:
    """The file's text; a file that is not UTF-8, or holds a NUL byte (a binary file under a text name), is
    named with the line and byte at fault."""
    try:
        with path.open("rb") as f:
            raw = f.read(_HEAD_BYTES)
            if b"\0" not in raw:  # a binary (or sparse) file is refused from its head, before it is all read
                raw += f.read()
    except OSError as exc:
        raise CalibrationDataError(f"cannot read {path}: {exc.strerror or exc}") from None
    nul = raw.find(b"\0")
    if nul >= 0:  # valid UTF-8, but no text: a binary file (or a sparse one) under a text name
        line = raw.count(b"\n", 0, nul) + 1
        raise CalibrationDataError(
            f"{path}, line {line}: holds a NUL byte (offset {nul}), so it is a binary file, not text; give a text file"
        )
    try:
        return raw.decode("utf-8-sig")  # a leading byte-order mark is harmless
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise CalibrationDataError(
            f"{path}, line {line}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start}); "
            "save the file as UTF-8"
        ) from None


def split_units(text: str, unit: str) -> list[str]:
    """`text` cut into its units (see the module docstring); units holding only whitespace are dropped."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")  # Windows' and old Macs' line ends, as Python reads text
    if unit == "line":
        pieces = text.split("\n")
    elif unit == "paragraph":
        pieces, lines = [], []
        for line in [*text.split("\n"), ""]:  # a blank line (or the end) closes a paragraph
            if line.strip():
                lines.append(line)
            elif lines:
                pieces.append("\n".join(lines))
                lines = []
    elif unit == "file":
        pieces = [text]
    else:
        raise CalibrationDataError(f"unknown text unit {unit!r}; choose one of {', '.join(TEXT_UNITS)}")
    return [p for p in pieces if p.strip()]


class TextSource:
    """The units of one text file, or of every text file of a folder in path order."""

    def __init__(self, path: Path, files: Sequence[Path], unit: str | None) -> None:
        self.path = path
        self.kind = "text folder" if path.is_dir() else "text file"
        self.unit = unit or ("file" if path.is_dir() else "paragraph")
        if self.unit not in TEXT_UNITS:
            raise CalibrationDataError(f"unknown text unit {self.unit!r}; choose one of {', '.join(TEXT_UNITS)}")
        self.files = list(files)
        self._units: list[tuple[str, str]] = []  # (text, the file it came from, relative to the folder)
        for f in self.files:
            name = f.relative_to(path).as_posix() if path.is_dir() else f.name
            self._units.extend((u, name) for u in split_units(read_utf8(f), self.unit))

    @property
    def modalities(self) -> tuple[Modality, ...]:
        return ("text",)

    def content(self, modality: Modality) -> Content:
        return "text"

    def describe(self, modality: Modality) -> dict[str, Any]:
        out: dict[str, Any] = {"format": self.kind, "content": "text", "unit": self.unit}
        if self.path.is_dir():
            out["files"] = len(self.files)
        return out

    def __len__(self) -> int:
        return len(self._units)

    def field_names(self, modality: Modality) -> list[str]:
        return ["file"]

    def field_values(self, name: str, indices: Sequence[int]) -> list[Any]:
        return [self._units[i][1] if name == "file" else None for i in indices]

    def examples(self, indices: Sequence[int], modality: Modality) -> list[Example]:
        return [Example(text=self._units[i][0], fields={"file": self._units[i][1]}) for i in indices]
