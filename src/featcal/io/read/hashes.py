"""What identifies an input: the sha256 of its files, read in chunks.

Reading concerns, apart from the report that records them (io/write/report.py), so that the readers of
adapters and GGUF files record their inputs' digests without importing the writing side.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def file_sha256(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def checkpoint_hashes(directory: str | os.PathLike) -> dict[str, str]:
    """sha256 of each weight file and config of a checkpoint directory (what identifies an input)."""
    d = Path(directory)
    if d.is_file():  # a single-file input (a GGUF file)
        return {d.name: file_sha256(d)}
    files = sorted(p for p in d.iterdir() if p.suffix in {".safetensors", ".json", ".bin"} and p.is_file())
    return {p.name: file_sha256(p) for p in files}
