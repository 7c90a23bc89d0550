"""What each cached result of the bench is keyed on: its inputs, its settings, and the code that computes it.

Every cached result lives in a folder named by a key (12 hex of a sha256). A key hashes

    base        the GGUF's sha256 + the code that reads it into the model the experts start from ("base")
    expert      the base's key, the domain, the sha256 of the very training windows (tokens) it is trained
                on, the training settings and torch seed, + the training code ("train")
    merge       its `featcal merge` arguments + the merging code ("merge")
    calibrate   its `featcal calibrate` arguments + the calibration code ("calibrate")
    eval        its `featcal eval` arguments + the evaluation code ("eval")

A stage's arguments name what it reads by paths that already carry their own keys (experts, the base's
checkpoint and every model by the key of what wrote it; window files by their content's sha256), so a
key also changes whenever anything upstream changes, and only then.

The code of each kind is a fixed list of source folders and files (AREAS), found from what the stage's
`featcal` command imports when it runs (docs/bench-decoder.md, "Stage keys"). Code outside every area
(featcal's cli/, evaluation's plots, the bench's own report and plan code, docs) is in no key: a refactor
there reruns nothing. Which featcal commit (and whether the work tree was dirty) a result was computed
under is recorded beside it, never keyed.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

BENCH_ROOT = Path(__file__).resolve().parent

# area -> {root: paths under that root (a folder: every .py below it)}
AREAS: dict[str, dict[str, tuple[str, ...]]] = {
    # featcal.io.read.gguf.load_gguf_model (+ the model class and tied-name lookups it calls), the bench's loader
    # and checkpoint writer: what the dequantised base, and so every expert's starting point, is
    "base": {"featcal": ("io/read/gguf.py", "io/read/models.py", "io/read/param_sources.py"), "bench": ("basemodel.py",)},
    "train": {"bench": ("training.py",)},  # the fine-tuning loop (the data is keyed by content)
    # featcal merge imports merging/, io/, data/, config/ and (RegMean, WUDI) blocks/; never calibration/
    "merge": {"featcal": ("merging", "blocks", "io", "data", "config")},
    # featcal calibrate (with or without --tune) imports calibration/, blocks/, io/, data/, config/
    "calibrate": {"featcal": ("calibration", "blocks", "io", "data", "config")},
    # featcal eval imports evaluation/, io/, data/, config/
    "eval": {"featcal": ("evaluation", "io", "data", "config")},
}
KIND_AREA = {"merge": "merge", "calibrate": "calibrate", "eval": "eval", "select": "eval"}

_ROOTS: dict[str, Path] = {}
_DIGESTS: dict[str, str] = {}


def roots() -> dict[str, Path]:
    """featcal's package folder and the bench's (decoderbench/): what AREAS' paths are relative to."""
    if not _ROOTS:
        import featcal

        _ROOTS.update(featcal=Path(featcal.__file__).resolve().parent, bench=BENCH_ROOT)
    return _ROOTS


def set_roots(**paths: Path) -> None:
    """Read the areas from other folders (tests: a copy of the sources), forgetting every digest computed."""
    roots()
    _ROOTS.update({k: Path(v) for k, v in paths.items()})
    _DIGESTS.clear()


def area_files(area: str) -> list[tuple[str, Path]]:
    """(name, path) of every source file of `area`, sorted; the name is `root/relative path`."""
    out = {}
    for root, paths in AREAS[area].items():
        base = roots()[root]
        for rel in paths:
            p = base / rel
            files = sorted(p.rglob("*.py")) if p.is_dir() else [p]
            for f in files:
                out[f"{root}/{f.relative_to(base).as_posix()}"] = f
    return sorted(out.items())


def code_digest(area: str) -> str:
    """sha256 (12 hex) of the area's source files (names and bytes), computed once per process."""
    if area not in _DIGESTS:
        h = hashlib.sha256()
        for name, f in area_files(area):
            h.update(name.encode() + b"\0" + f.read_bytes() + b"\0")
        _DIGESTS[area] = h.hexdigest()[:12]
    return _DIGESTS[area]


def code_digests() -> dict[str, str]:
    return {area: code_digest(area) for area in AREAS}


def key_of(parts) -> str:
    """sha256 (12 hex) of a JSON-able description."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:12]


def base_key(gguf_sha256: str) -> str:
    """The dequantised base: the GGUF file's content and the code that reads and saves it."""
    return key_of({"gguf": gguf_sha256, "code": code_digest("base")})


TRAINING_SETTINGS = ("seq_len", "batch_size", "steps", "lr", "warmup", "train_layers")


def expert_parts(settings: dict, base: str, domain: str, windows_sha256: str, train_seed: int) -> dict:
    """What an expert's key hashes (recorded beside it as well)."""
    return {"base": base, "domain": domain, "windows": windows_sha256, "train_seed": train_seed,
            "settings": {k: settings[k] for k in TRAINING_SETTINGS}, "code": code_digest("train")}


def stage_key(kind: str, args: list[str]) -> str:
    area = KIND_AREA[kind]
    return key_of({"args": args, "code": {area: code_digest(area)}})


def git_state(area: str | None = None) -> dict:
    """featcal's git commit and whether the work tree was dirty (and, for an area, whether any of its own
    sources differ from that commit), now: what a result was computed under."""
    root = roots()["featcal"]

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if commit is None:
        return {"commit": None, "why": f"{root} is not in a git work tree"}
    status = git("status", "--porcelain")
    out = {"commit": commit, "dirty": bool(status)}
    if area is not None:
        paths = [str(p) for _, p in area_files(area)]
        mine = git("status", "--porcelain", "--", *paths)
        out["key_sources_dirty"] = bool(mine) if mine is not None else None
    return out
