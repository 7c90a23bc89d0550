"""One example's content fingerprint, so that evaluation can tell which examples calibration saw.

Calibration records the fingerprint of every example it drew (featcal.json, `example_sha256`, with the
scheme it was made by in `example_fingerprint`), and `featcal eval` fingerprints its own examples the same
way: an evaluation example that a calibrated model was calibrated on is then found whatever file, format
or order it comes in. Only the model's input is fingerprinted (the text, the chat turns, the image's
pixels), never a label or target: calibration reads no labels, and an input seen in calibration is leaked
whatever answer it is scored against.

Schemes (FINGERPRINT_SCHEME is the one written now):
1. the text (or each turn's content) exactly as read: a trailing space made another fingerprint, though
   the model reads the same text. featcal.json files without `example_fingerprint` were written with it,
   and `featcal eval` still compares them by it.
2. the text normalised as tokenizers see it before they split it (`normalised_text`): Unicode NFKC, format
   characters (zero-width spaces, BOMs, soft hyphens) dropped, whitespace runs (spaces, tabs, line breaks)
   made one space, leading and trailing whitespace stripped. A text that needs none of this has the same
   fingerprint under both schemes; images are fingerprinted the same way under both.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import unicodedata
from collections.abc import Mapping
from typing import Any

# the fields of a record that hold the model's input, most specific first
INPUT_FIELDS = ("messages", "text", "image")
FINGERPRINT_SCHEME = 2  # what calibration records now (featcal.json's `example_fingerprint`)
LEGACY_SCHEME = 1  # what a featcal.json without `example_fingerprint` holds
SCHEMES = (LEGACY_SCHEME, FINGERPRINT_SCHEME)


def example_sha256(example: Any, scheme: int = FINGERPRINT_SCHEME) -> str:
    """sha256 (hex) of what the model reads from `example`, by fingerprint `scheme` (see the module docstring).

    Takes a string, a PIL image, a TextExample or any record (dataclass or mapping) holding one of
    INPUT_FIELDS; text is hashed as UTF-8 (normalised from scheme 2 on), an image as its mode, size and
    decoded pixels (so a PNG file and the same image stored in a dataset match), chat turns as canonical JSON.
    """
    if scheme not in SCHEMES:
        raise ValueError(f"unknown example fingerprint scheme {scheme!r}; known: {SCHEMES}")
    h = hashlib.sha256()
    content = _input_of(example)
    if scheme >= 2:
        content = _normalised(content)
    if isinstance(content, str):
        h.update(b"text\0" + content.encode("utf-8"))
    elif _is_image(content):
        h.update(f"image\0{content.mode}\0{content.size[0]}x{content.size[1]}\0".encode())
        h.update(content.tobytes())
    else:
        h.update(b"json\0" + json.dumps(content, sort_keys=True, ensure_ascii=False, default=str).encode("utf-8"))
    return h.hexdigest()


def normalised_text(text: str) -> str:
    """`text` as fingerprint scheme 2 reads it: NFKC, format characters dropped, whitespace runs one space,
    stripped. Texts that differ only in what this removes are the same example to the leakage guard."""
    text = unicodedata.normalize("NFKC", text)
    if not text.isascii():
        text = "".join(c for c in text if unicodedata.category(c) != "Cf")
    return " ".join(text.split())


def _normalised(content: Any) -> Any:
    """Texts, and the string contents of chat turns, normalised; anything else as it is."""
    if isinstance(content, str):
        return normalised_text(content)
    if isinstance(content, (list, tuple)) and all(isinstance(t, Mapping) for t in content):
        return [{k: normalised_text(v) if k == "content" and isinstance(v, str) else v for k, v in t.items()}
                for t in content]
    return content


def _is_image(value: Any) -> bool:
    return hasattr(value, "tobytes") and hasattr(value, "mode") and hasattr(value, "size")


def _input_of(example: Any) -> Any:
    """The input part of a record; the value itself when it is already a text, an image or a list of turns."""
    if isinstance(example, str) or _is_image(example):
        return example
    for name in INPUT_FIELDS:
        value = example.get(name) if isinstance(example, Mapping) else getattr(example, name, None)
        if value is not None:
            return value
    return dataclasses.asdict(example) if dataclasses.is_dataclass(example) else example
