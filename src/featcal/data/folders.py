"""What a folder holds, sorted by kind: image files, text files, data files (tables), and the rest.

Every file under the folder counts, recursively, except hidden ones (a name starting with '.', or under
a hidden folder); symbolic links are followed (a folder reached twice is read once), and a link to
nothing is refused. Images and data files are known by their suffix; text files by theirs (.txt, .md, ...)
or, for any other suffix, by their content: the first 4 KiB decode as UTF-8 and hold no NUL byte (what
git calls a text file), so a folder of source code reads as text. Everything else is `other`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from featcal.data.tables import TABLE_SUFFIXES
from featcal.data.text_files import TEXT_SUFFIXES
from featcal.errors import CalibrationDataError

log = logging.getLogger(__name__)

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".webp")
_SNIFF_BYTES = 4096
_NOUNS = {"images": "image file", "texts": "text file", "tables": "data file", "other": "other file"}


@dataclass
class FolderContents:
    """A folder's files by kind, each list in path order (relative POSIX path)."""

    root: Path
    images: list[Path] = field(default_factory=list)
    texts: list[Path] = field(default_factory=list)
    tables: list[Path] = field(default_factory=list)
    other: list[Path] = field(default_factory=list)

    def summary(self, kinds: Sequence[str]) -> str:
        """E.g. "4 image files (a/x.png, b.png, ...) and 1 text file (notes.txt)" for the non-empty `kinds`."""
        parts = []
        for kind in kinds:
            files = getattr(self, kind)
            if not files:
                continue
            names = [p.relative_to(self.root).as_posix() for p in files[:3]]
            more = ", ..." if len(files) > 3 else ""
            parts.append(f"{len(files)} {_NOUNS[kind]}{'s' if len(files) != 1 else ''} ({', '.join(names)}{more})")
        return " and ".join(parts)


def scan_folder(root: Path, *, sniff: bool = True) -> FolderContents:
    """The folder's non-hidden files by kind. `sniff=False` reads no file (files of unknown suffix are
    `other`): an image folder read for a vision model needs only the names."""
    files = sorted(_files(root), key=lambda p: p.relative_to(root).as_posix())
    out = FolderContents(root)
    for p in files:
        suffix = p.suffix.lower()
        if suffix in IMAGE_SUFFIXES:
            out.images.append(p)
        elif suffix in TABLE_SUFFIXES:
            out.tables.append(p)
        elif suffix in TEXT_SUFFIXES or (sniff and _looks_like_text(p)):
            out.texts.append(p)
        else:
            out.other.append(p)
    return out


def _files(root: Path) -> list[Path]:
    """Every non-hidden file under `root`. Symbolic links are followed, to files and to folders (a class
    sub-folder linked from elsewhere is read like any other); a folder reached a second time (a link loop, or
    two links to one folder) is read once, with a warning; a link to nothing, or a folder that cannot be
    listed, is refused rather than skipped."""
    def refuse(exc: OSError) -> None:
        raise CalibrationDataError(f"cannot list {exc.filename}: {exc.strerror or exc}") from None

    found: list[Path] = []
    seen = {os.path.realpath(root)}
    for folder, subfolders, names in os.walk(root, onerror=refuse, followlinks=True):
        kept = []
        for name in sorted(subfolders):
            if name.startswith("."):
                continue
            real = os.path.realpath(os.path.join(folder, name))
            if real in seen:
                log.warning("%s leads to a folder already read (%s); not read twice", os.path.join(folder, name), real)
                continue
            seen.add(real)
            kept.append(name)
        subfolders[:] = kept
        for name in names:
            if name.startswith("."):
                continue
            path = Path(folder) / name
            if not path.exists():
                raise CalibrationDataError(f"{path} is a symbolic link to nothing ({os.readlink(path)}); remove it or "
                                           "restore its target")
            if path.is_file():
                found.append(path)
    return found


def _looks_like_text(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            head = f.read(_SNIFF_BYTES)
    except OSError:
        return False
    if not head or b"\0" in head:
        return False
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as exc:
        return exc.start >= len(head) - 3  # only a character cut at the 4 KiB boundary
    return True
