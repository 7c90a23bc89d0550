"""The base read from its GGUF (featcal's own loader), and the checkpoint writer the base's copy and the
experts are saved with. Keyed code: editing this file changes the base's key and so every key after it
(decoderbench/keys.py, area "base")."""

from __future__ import annotations

import json
from pathlib import Path


def load_base(gguf_path: Path):
    """The base model (featcal.io.read.gguf: dequantised float32) and its tokenizer, both from the GGUF file."""
    import transformers as T

    from featcal.io.read.gguf import load_gguf_model

    model = load_gguf_model(gguf_path, "base")
    tokenizer = T.AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    return model, tokenizer


def load_tokenizer(gguf_path: Path):
    import transformers as T

    return T.AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


def save_checkpoint(model, tokenizer, path: Path, record: dict) -> None:
    """model + tokenizer + a JSON record, written through `path`.tmp renamed into place (all or nothing)."""
    tmp = path.with_name(path.name + ".tmp")
    if tmp.exists():
        import shutil

        shutil.rmtree(tmp)  # what a killed earlier attempt left: the bench's own temporary folder
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "record.json").write_text(json.dumps(record, indent=1) + "\n")
    tmp.rename(path)


def base_dir(cache: Path, base_key: str) -> Path:
    return cache / "base" / f"base-{base_key}"


def base_checkpoint(base, tokenizer, cache: Path, base_sha: str, base_key: str, record: dict | None = None) -> Path:
    """The dequantised base as a safetensors checkpoint under its key: what `featcal eval --base` reads (it takes
    no GGUF file), and what merges and calibrations get as --base unless --base-from-gguf."""
    path = base_dir(cache, base_key)
    if not (path / "record.json").is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        save_checkpoint(base, tokenizer, path, {"from_gguf_sha256": base_sha, "key": base_key, **(record or {})})
    return path
