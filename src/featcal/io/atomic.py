"""Atomic output directories: write into a temporary sibling, rename into place only on success.

A crash, Ctrl-C or full disk therefore never leaves a half-written checkpoint at the target path,
and an existing non-empty directory is never replaced unless the caller asked for it. When it is
replaced, the old content is moved aside first and moved back if the swap fails, so it is either the
old or the new checkpoint that sits at the target, never neither.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from featcal.errors import ConfigError, FeatCalError, OutputExistsError

TMP_PREFIX = ".featcal-tmp-"


class OutputWriteError(FeatCalError, OSError):
    """Writing an output failed (full disk, permissions, ...); nothing was left at the target.

    An OSError too, so callers that catch OSError keep working; a FeatCalError, so the CLI prints it
    as one line.
    """


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


def refuse_output_over_inputs(out: str | os.PathLike, inputs: Mapping[str, Any], *, what: str = "output directory",
                              flag: str = "--out") -> None:
    """Refuse an output that is an input or holds one (replacing it with --overwrite would delete the input).

    `inputs`: label -> path (entries that are not existing paths, e.g. hub ids or in-memory models,
    are skipped). Checked on resolved paths, so symlinks and `..` cannot hide the nesting.
    """
    target = Path(out).expanduser().resolve()
    for label, item in inputs.items():
        if not isinstance(item, (str, os.PathLike)) or not Path(item).expanduser().exists():
            continue
        source = Path(item).expanduser().resolve()
        if source == target:
            raise ConfigError(f"the {what} {out} is an input ({label}); choose another {flag}")
        if target in source.parents:
            raise ConfigError(
                f"the {what} {out} contains an input ({label}: {item}), which replacing it would delete; "
                f"choose another {flag}"
            )


def _make_parents(directory: Path) -> list[Path]:
    """mkdir -p `directory`; return the directories it created, deepest first (to undo on failure)."""
    created = []
    for d in [directory, *directory.parents]:
        if d.exists():
            break
        created.append(d)
    directory.mkdir(parents=True, exist_ok=True)
    return created


def _fsync_tree(root: Path) -> None:
    for f in root.rglob("*"):
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())


def _fsync_dir(directory: Path) -> None:
    """Persist a rename (best effort: not every platform can open a directory)."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _swap_in(tmp: Path, target: Path, overwrite: bool) -> None:
    """Move `tmp` to `target`; an existing target is set aside and restored if the move fails."""
    if not target.exists():
        os.replace(tmp, target)
        return
    check_output_dir(target, overwrite)  # re-check: something may have appeared meanwhile
    trash = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}old-{target.name}-", dir=target.parent))
    old = trash / "old"
    os.replace(target, old)
    try:
        os.replace(tmp, target)
    except BaseException:
        if not target.exists():
            os.replace(old, target)  # the previous checkpoint goes back where it was
        shutil.rmtree(trash, ignore_errors=True)
        raise
    shutil.rmtree(trash, ignore_errors=True)


@contextlib.contextmanager
def atomic_output_dir(out: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Yield a fresh temporary directory next to `out`; on success it replaces `out` atomically.

    On any failure (an exception in the body, Ctrl-C, a failed fsync or rename) the temporary
    directory and any parent directories created for `out` are removed and `out` is as it was. An
    OSError (e.g. ENOSPC) is re-raised as OutputWriteError, which names `out` and says so.
    """
    target = check_output_dir(out, overwrite)
    created = _make_parents(target.parent)
    tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{target.name}-", dir=target.parent))
    try:
        yield tmp
        _fsync_tree(tmp)
        _swap_in(tmp, target, overwrite)
        _fsync_dir(target.parent)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        for d in created:  # deepest first; stops at the first one something else has written into
            with contextlib.suppress(OSError):
                d.rmdir()
        if isinstance(exc, OSError) and not isinstance(exc, FeatCalError):
            kept = "; its previous content is intact" if target.exists() else ""
            error = OutputWriteError(
                f"could not write {target}: {exc.strerror or exc}; nothing was written there "
                f"(the temporary directory was removed){kept}"
            )
            error.errno = exc.errno
            raise error from exc
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
