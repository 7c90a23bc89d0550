"""Lazy, safe reading of Hugging Face checkpoints (local directories or hub ids).

Tensors are read one at a time through `safetensors.safe_open` (memory-mapped), so code that walks a
checkpoint holds at most the tensors it is using. Pickled weights (`*.bin`) are refused unless the
caller opts in, and are then read with `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from featcal.errors import CheckpointError
from featcal.io.read.tensor_source import TensorSource

SAFE_SINGLE = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
PICKLE_SINGLE = "pytorch_model.bin"
PICKLE_INDEX = "pytorch_model.bin.index.json"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack")
HUB_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken"]

TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json", "spiece.model", "tokenizer.model",
    "sentencepiece.bpe.model",
)


def resolve_checkpoint(path_or_id: str | os.PathLike, *, allow_pickle: bool = False) -> Path:
    """Return a local directory for a checkpoint: the path itself, or a hub snapshot.

    The hub path honours HF_HOME and HF_HUB_OFFLINE; without network it fails with one clear message.
    """
    path = Path(path_or_id)
    if path.exists():
        if not path.is_dir():
            raise CheckpointError(f"checkpoint {path} is a file; featcal expects a checkpoint directory")
        return path
    text = str(path_or_id)
    if text.startswith((".", "/", "~")) or text.count("/") > 1:
        raise CheckpointError(f"checkpoint directory {text} does not exist")
    try:
        from huggingface_hub import snapshot_download

        patterns = HUB_PATTERNS + (["*.bin"] if allow_pickle else [])
        return Path(snapshot_download(text, allow_patterns=patterns))
    except Exception as exc:  # network, auth, missing repo: one message, no traceback
        raise CheckpointError(
            f"could not resolve checkpoint {text!r}: not a local directory and not reachable on the hub "
            f"({type(exc).__name__}). Pass a local path, or set HF_HOME to a cache that holds it."
        ) from None


class CheckpointReader(TensorSource):
    """Read-only view of one checkpoint's tensors, by name, without loading them all."""

    def __init__(self, path_or_id: str | os.PathLike, *, allow_pickle: bool = False) -> None:
        self.path = resolve_checkpoint(path_or_id, allow_pickle=allow_pickle)
        self._files: dict[str, Path] = {}  # tensor name -> file
        self._handles: dict[Path, object] = {}
        self._pickled: dict[str, torch.Tensor] | None = None
        self._keys_of: dict[Path, set[str]] = {}  # shard -> the tensors its header lists
        index = self.path / SAFE_INDEX
        single = self.path / SAFE_SINGLE
        if index.exists() and single.exists():
            # transformers loads model.safetensors and ignores the shards, so a reader that took the index
            # would check, hash and merge other weights than the ones calibrated: refuse the folder instead
            raise CheckpointError(
                f"{self.path} holds both {SAFE_SINGLE} and a shard index ({SAFE_INDEX}), two sets of weights; "
                "featcal cannot tell which one you mean: remove the one that is stale"
            )
        if index.exists():
            weight_map = read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index} has no weight_map: not a safetensors shard index")
            odd = [v for v in weight_map.values() if not _is_shard_name(v)]
            if odd:
                raise CheckpointError(
                    f"{index}: weight_map names {odd[0]!r}, not a shard file in {self.path} (a file name ending "
                    ".safetensors)"
                )
            self._files = {k: self.path / v for k, v in weight_map.items()}
        elif single.exists():
            self._files = {k: single for k in self._handle(single).keys()}
        else:
            # a non-standard single-file name; never a LoRA adapter's weights beside them (io/read/lora.py)
            others = sorted(p.name for p in self.path.glob("*.safetensors") if not p.name.startswith("adapter_model"))
            if others:
                for name in others:
                    f = self.path / name
                    self._files.update({k: f for k in self._handle(f).keys()})
            elif (self.path / PICKLE_SINGLE).exists() or (self.path / PICKLE_INDEX).exists():
                if not allow_pickle:
                    raise CheckpointError(
                        f"{self.path} holds only pickled weights (pytorch_model.bin); pickles can run code "
                        "when loaded, so featcal refuses them. Convert to safetensors, or pass "
                        "--allow-pickle (allow_pickle=True) to load them with torch.load(weights_only=True)."
                    )
                self._pickled = self._load_pickled()
            else:
                raise CheckpointError(f"no model weights (*.safetensors) found in {self.path}")
        for f in set(self._files.values()):
            if not f.exists():
                raise CheckpointError(f"{self.path}: shard {f.name} named in the index is missing")
        if index.exists():  # the index must say where each tensor really is (headers only)
            for name, f in sorted(self._files.items()):
                if name not in self._shard_keys(f):
                    raise CheckpointError(
                        f"{index}: the index puts tensor {name!r} in shard {f.name}, which does not hold it"
                    )

    def _handle(self, file: Path):
        if file not in self._handles:
            try:
                self._handles[file] = safe_open(str(file), framework="pt", device="cpu")
            except Exception as exc:
                raise CheckpointError(f"cannot read {file}: {exc} (truncated or not a safetensors file?)") from None
        return self._handles[file]

    def _shard_keys(self, file: Path) -> set[str]:
        if file not in self._keys_of:
            self._keys_of[file] = set(self._handle(file).keys())
        return self._keys_of[file]

    def _load_pickled(self) -> dict[str, torch.Tensor]:
        files = [self.path / PICKLE_SINGLE]
        if (self.path / PICKLE_INDEX).exists():
            wm = read_json(self.path / PICKLE_INDEX).get("weight_map") or {}
            files = sorted({self.path / v for v in wm.values()})
        out: dict[str, torch.Tensor] = {}
        for f in files:
            try:
                loaded = torch.load(f, map_location="cpu", weights_only=True)
            except pickle.UnpicklingError as exc:
                raise CheckpointError(
                    f"refusing {f}: it holds more than plain tensors ({_unpickling_reason(exc)}), and unpickling "
                    "that could run code; torch.load(weights_only=True) refused it, and so does featcal. "
                    "Convert the checkpoint to safetensors where you trust its source."
                ) from None
            except Exception as exc:
                raise CheckpointError(f"cannot load {f} with torch.load(weights_only=True): {exc}") from None
            if not isinstance(loaded, dict) or not all(isinstance(v, torch.Tensor) for v in loaded.values()):
                raise CheckpointError(f"{f} is not a state dict (a mapping of tensor names to tensors)")
            out.update(loaded)
        return out

    @property
    def config(self) -> dict:
        cfg = self.path / "config.json"
        if not cfg.exists():
            raise CheckpointError(f"{self.path} has no config.json")
        return read_json(cfg)

    def keys(self) -> list[str]:
        return sorted(self._pickled) if self._pickled is not None else sorted(self._files)

    def __contains__(self, name: str) -> bool:
        return name in (self._pickled if self._pickled is not None else self._files)

    def get(self, name: str) -> torch.Tensor:
        if self._pickled is not None:
            return self._pickled[name]
        if name not in self._files:
            raise CheckpointError(f"{self.path}: tensor {name!r} is missing")
        try:
            return self._handle(self._files[name]).get_tensor(name)
        except Exception as exc:
            raise CheckpointError(f"{self.path}: cannot read tensor {name!r}: {exc}") from None

    def meta(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        """Shape and dtype of a tensor without reading its data."""
        if self._pickled is not None:
            t = self._pickled[name]
            return tuple(t.shape), t.dtype
        sl = self._handle(self._files[name]).get_slice(name)
        return tuple(sl.get_shape()), _DTYPES[sl.get_dtype()]

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        for k in self.keys():
            yield k, self.get(k)


def _is_shard_name(value: object) -> bool:
    """A shard index entry must name a safetensors file in the checkpoint folder itself, nothing elsewhere."""
    return (isinstance(value, str) and value.endswith(".safetensors") and "/" not in value and "\\" not in value
            and value not in (".", ".."))


def read_json(path: Path) -> dict:
    """A JSON object from `path`, or a CheckpointError naming the file."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from None
    except RecursionError:  # a crafted file nested thousands of levels deep
        raise CheckpointError(f"cannot read {path}: it nests its values too deeply for a JSON config") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} does not hold a JSON object")
    return data


def _unpickling_reason(exc: Exception) -> str:
    """The informative clause of torch's multi-paragraph weights_only error (not its allowlisting advice)."""
    text = " ".join(str(exc).split())
    found = re.search(r"Unsupported .*?(?= was not|\. |\.$|$)", text)
    return found.group(0) if found else type(exc).__name__


_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


# an input's files that describe that input (its model card, mergekit's recipe): an output gets its own card
# (io/write/card.py), so these are never copied stale; featcal.json keeps their sha256
CARRIED_FILES = ("README.md", "mergekit_config.yml", "mergekit_config.yaml")
# the folder beside a model that holds each task's head (io/write/task_heads.py writes it; evaluation and
# --tune-head read it; check_copied_links checks it): named here, on the reading floor, for all of them
HEADS_DIR = "heads"


def check_copied_links(folder: str | os.PathLike, label: str) -> None:
    """Refuse, before any work, a file featcal copies from an input folder into an output (its config, tokenizer
    and processor files, anything beside the weights, and heads/) that is a symbolic link leading outside the
    folder: the file it reaches (a token, a key) would be copied into an output made to be shared (issue 49). A
    hub cache snapshot's links into its repository's blobs/ are the snapshot's own files."""
    root = Path(folder)
    if not root.is_dir():
        return
    real = root.resolve()
    allowed = [real]
    if real.parent.name == "snapshots" and real.parent.parent.name.startswith("models--"):
        allowed.append(real.parent.parent / "blobs")
    copied = [p for p in root.iterdir() if p.name == HEADS_DIR or not p.name.endswith((*WEIGHT_SUFFIXES, ".index.json"))]
    heads = root / HEADS_DIR
    if heads.is_dir():
        copied += [Path(d) / n for d, dirs, files in os.walk(heads) for n in (*dirs, *files)]
    for p in copied:
        target = p.resolve()
        if not any(target == a or target.is_relative_to(a) for a in allowed):
            raise CheckpointError(f"{label}: {p} is a symbolic link to {target}, outside {root}; featcal copies it into "
                                  "its output, which would carry that file from elsewhere on this machine: copy the "
                                  "file into the folder instead of linking to it")


def copy_side_files(src: str | os.PathLike, dst: str | os.PathLike) -> list[str]:
    """Copy a checkpoint's non-weight files (config, tokenizer, processor) into `dst`; not its report, card or
    mergekit recipe (CARRIED_FILES)."""
    copied = []
    for p in Path(src).iterdir():
        if p.is_file() and not p.name.endswith(WEIGHT_SUFFIXES) and not p.name.endswith(".index.json"):
            if p.name in ("featcal.json", "adapter_config.json", *CARRIED_FILES):  # an adapter's config is no part of the output
                continue
            shutil.copy2(p, Path(dst) / p.name)
            copied.append(p.name)
    return copied
