"""Atomic output directories: write into a temporary sibling, rename into place only on success.

A crash, Ctrl-C or full disk therefore never leaves a half-written checkpoint at the target path,
and an existing non-empty directory is never replaced unless the caller asked for it. When it is
replaced, the old content is moved aside first and moved back if the swap fails, so it is either the
old or the new checkpoint that sits at the target, never neither.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import secrets
import shutil
import socket
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from featcal.errors import ConfigError, FeatCalError, OutputExistsError
from featcal.io.process import interrupts

TMP_PREFIX = ".featcal-tmp-"
_OWNED = re.compile(r"-(\d+)_([0-9a-f]{8})-\w+$")  # `-PID_HOST-XXXXXX` at the end of an owned temp name
log = logging.getLogger(__name__)


def _host_tag() -> str:
    return hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


def owned_tempdir(prefix: str, parent: Path) -> Path:
    """mkdtemp whose name says which process on which host made it (so a rerun can tell it was killed),
    with the permissions the umask gives a new directory (mkdtemp's are always 0700)."""
    tmp = owned_name(prefix, parent)
    make_owned(tmp)
    return tmp


def owned_name(prefix: str, parent: Path) -> Path:
    """A fresh name for an owned temporary directory, not yet created: a caller that must remove it whatever
    happens names it first, then creates it inside its `try` (`make_owned`), so that an interrupt landing
    between the creation and the `try` cannot leave it behind."""
    return Path(parent) / f"{prefix}{os.getpid()}_{_host_tag()}-{secrets.token_hex(4)}"


def make_owned(path: Path) -> None:
    """Create the directory `owned_name` gave, with the umask's permissions; removed again if that fails."""
    try:
        os.mkdir(path, 0o777 & ~current_umask())
        os.chmod(path, 0o777 & ~current_umask())  # mkdir's mode is itself filtered by the umask: say it plainly
    except BaseException:
        with contextlib.suppress(OSError):
            os.rmdir(path)
        raise


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it exists, someone else's
        return True
    return True


def sweep_stale(parent: Path, prefix: str) -> list[Path]:
    """Remove temp directories `owned_tempdir(prefix, parent)` made in processes of this host that are dead
    (SIGKILL, power cut): featcal's own leftovers, never anything it did not name. Returns what went."""
    gone = []
    if not parent.is_dir():
        return gone
    for p in parent.iterdir():
        m = _OWNED.search(p.name)
        if not (p.name.startswith(prefix) and p.is_dir() and m and m.group(2) == _host_tag()):
            continue
        if int(m.group(1)) != os.getpid() and not _alive(int(m.group(1))):
            shutil.rmtree(p, ignore_errors=True)
            log.info("removed %s, left by a featcal process (pid %s) that was killed", p, m.group(1))
            gone.append(p)
    return gone


def current_umask() -> int:
    """The process umask (read without changing it where /proc allows; else set and restored at once)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def os_error_of(exc: BaseException) -> OSError | None:
    """The OSError behind `exc`: itself, one it was raised from, or one a library wrapped into its own
    exception's text (safetensors raises SafetensorError('... (os error 28)') on a full disk)."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError):
            return e
        m = re.search(r"os error (\d+)|Os \{ code: (\d+)", str(e))
        if m:
            code = int(m.group(1) or m.group(2))
            return OSError(code, os.strerror(code))
        e = e.__cause__ or e.__context__
    return None


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
    _check_writable(path)
    return path


def check_replaceable(out: str | os.PathLike, overwrite: bool, marker: str = "featcal.json") -> None:
    """With `overwrite`, replace only an empty directory or one featcal wrote (it holds `marker`): a typo
    such as `--out ~ --overwrite` must not swap a home directory, or any folder of the user's, for a merge."""
    path = Path(out).expanduser()
    if overwrite and path.is_dir() and any(path.iterdir()) and not (path / marker).is_file():
        raise OutputExistsError(
            f"--overwrite replaces only an output featcal wrote, and {path} holds no {marker}: it is not one; "
            "choose another --out, or empty it yourself"
        )


def _check_writable(path: Path) -> None:
    """Can the output be created beside `path`? Tried for real (a directory made and removed in the nearest
    existing ancestor): permission bits say nothing to root, nor about a read-only mount."""
    ancestor = path.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise OutputWriteError(f"cannot create the output {path}: {ancestor} is a file, not a directory")
    probe = owned_name(f"{TMP_PREFIX}probe-", ancestor)
    try:
        try:
            os.mkdir(probe)
        finally:  # an interrupt between the two must not leave the probe behind
            with contextlib.suppress(FileNotFoundError):
                os.rmdir(probe)
    except OSError as exc:
        raise OutputWriteError(f"cannot write the output {path}: {ancestor} is not writable ({exc.strerror or exc})") from None


def refuse_output_over_inputs(out: str | os.PathLike, inputs: Mapping[str, Any], *, what: str = "output directory",
                              flag: str = "--out") -> None:
    """Refuse an output that is an input or holds one (replacing it with --overwrite would delete the input), or
    that lies inside an input folder (its files would join that input: a checkpoint folder's contents, a data
    folder's files, read as data the next time it is; issue 49).

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
        if source.is_dir() and source in target.parents:
            raise ConfigError(
                f"the {what} {out} lies inside an input ({label}: {item}), whose folder it would add files to "
                f"(read with that input the next time it is); choose another {flag}"
            )


def make_parents(directory: Path) -> list[Path]:
    """mkdir -p `directory`; return the directories it created, deepest first (for `remove_created`)."""
    created = []
    for d in [directory, *directory.parents]:
        if d.exists():
            break
        created.append(d)
    directory.mkdir(parents=True, exist_ok=True)
    return created


CREATED_MARKER = ".created-by-featcal"  # marks a directory featcal itself created, so that only such a one is removed


def make_marked(directory: Path) -> list[Path]:
    """mkdir -p `directory`, leaving CREATED_MARKER in each directory this call created (deepest first in the
    list returned): a later run, even after this one was killed, can tell which it may remove."""
    created = make_parents(directory)
    for d in reversed(created):
        (d / CREATED_MARKER).touch()
    return created


def remove_marked_if_empty(directory: Path) -> bool:
    """rmdir `directory` (and then each parent) while featcal created it (its marker) and nothing else is in it
    now; True if `directory` itself was removed."""
    removed = False
    for d in (directory, *directory.parents):
        marker = d / CREATED_MARKER
        try:
            if not (marker.is_file() and {p.name for p in d.iterdir()} == {CREATED_MARKER}):
                break
            marker.unlink()
            d.rmdir()
        except OSError:
            break
        removed = removed or d == directory
    return removed


def remove_created(created: list[Path]) -> None:
    """Undo `make_parents`: rmdir each directory it created, deepest first, stopping at the first one
    something else has written into (it and its parents stay)."""
    for d in created:
        try:
            d.rmdir()
        except OSError:
            return


def _fsync_tree(root: Path) -> None:
    """Persist every file, and give files and folders the umask's permissions: some writers (transformers'
    shard writer, mkstemp, mkdtemp) make them 0600 / 0700 whatever the umask."""
    mask = current_umask()
    for f in root.rglob("*"):
        if f.is_file() and not f.is_symlink():
            os.chmod(f, 0o666 & ~mask)
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        elif f.is_dir() and not f.is_symlink():
            os.chmod(f, 0o777 & ~mask)


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
    trash = owned_name(f"{TMP_PREFIX}old-{target.name}-", target.parent)
    old = trash / "old"
    try:
        make_owned(trash)
        os.replace(target, old)
        os.replace(tmp, target)
    except BaseException:
        if not target.exists() and old.exists():
            os.replace(old, target)  # the previous checkpoint goes back where it was
        if not old.exists():  # never delete the previous checkpoint while it is still in there
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
    created = make_parents(target.parent)
    for prefix in (f"{TMP_PREFIX}{target.name}-", f"{TMP_PREFIX}old-{target.name}-"):
        sweep_stale(target.parent, prefix)  # what a killed run for this output left
    tmp = owned_name(f"{TMP_PREFIX}{target.name}-", target.parent)
    try:
        make_owned(tmp)
        yield tmp
        _fsync_tree(tmp)
        interrupts.check()  # a SIGTERM whose exception was swallowed (in a finaliser) publishes nothing
        _swap_in(tmp, target, overwrite)
        _fsync_dir(target.parent)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        remove_created(created)
        cause = None if isinstance(exc, (FeatCalError, KeyboardInterrupt)) else os_error_of(exc)
        if cause is not None:
            kept = "; its previous content is intact" if target.exists() else ""
            error = OutputWriteError(
                f"could not write {target}: {cause.strerror or cause}; nothing was written there "
                f"(the temporary directory was removed){kept}"
            )
            error.errno = cause.errno
            raise error from exc
        raise


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write a file through a temporary file and rename, so readers never see half of it (a figure rendered
    in memory, a manifest's text)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        os.chmod(tmp, 0o666 & ~current_umask())  # mkstemp's files are always 0600
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """atomic_write_bytes for text, in UTF-8."""
    atomic_write_bytes(path, text.encode("utf-8"))
