"""Atomic output directories: write into a temporary sibling, rename into place only on success.

A crash, Ctrl-C or full disk therefore never leaves a half-written checkpoint at the target path,
and an existing non-empty directory is never replaced unless the caller asked for it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from featcal.errors import OutputExistsError


def check_output_dir(out: str | os.PathLike, overwrite: bool = False) -> Path:
    """Fail early (before any work) if `out` exists, is non-empty and `overwrite` is off."""
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise OutputExistsError(f"output path {path} exists and is not a directory")
    if path.is_dir() and any(path.iterdir()) and not overwrite:
        raise OutputExistsError(
            f"output directory {path} exists and is not empty; pass --overwrite (overwrite=True) to replace it"
        )
    return path


@contextlib.contextmanager
def atomic_output_dir(out: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Yield a fresh temporary directory next to `out`; on success it replaces `out` atomically."""
    target = check_output_dir(out, overwrite)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".featcal-tmp-{target.name}-", dir=target.parent))
    try:
        yield tmp
        for f in tmp.rglob("*"):
            if f.is_file():
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
        if target.exists():
            check_output_dir(target, overwrite)  # re-check: something may have appeared meanwhile
            trash = Path(tempfile.mkdtemp(prefix=f".featcal-tmp-old-{target.name}-", dir=target.parent))
            os.replace(target, trash / "old")
            os.replace(tmp, target)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write a text file through a temporary file and rename, so readers never see half of it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
