"""One example's content fingerprint, so that evaluation can tell which examples calibration saw.

Calibration records the fingerprint of every example it drew (featcal.json, `example_sha256`), and
`featcal eval` fingerprints its own examples the same way: an evaluation example that a calibrated model
was calibrated on is then found whatever file, format or order it comes in. Only the model's input is
fingerprinted (the text, the chat turns, the image's pixels), never a label or target: calibration reads
no labels, and an input seen in calibration is leaked whatever answer it is scored against.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from typing import Any

# the fields of a record that hold the model's input, most specific first
INPUT_FIELDS = ("messages", "text", "image")


def example_sha256(example: Any) -> str:
    """sha256 (hex) of what the model reads from `example`.

    Takes a string, a PIL image, a TextExample or any record (dataclass or mapping) holding one of
    INPUT_FIELDS; text is hashed as UTF-8, an image as its mode, size and decoded pixels (so a PNG file
    and the same image stored in a dataset match), chat turns as canonical JSON.
    """
    h = hashlib.sha256()
    content = _input_of(example)
    if isinstance(content, str):
        h.update(b"text\0" + content.encode("utf-8"))
    elif _is_image(content):
        h.update(f"image\0{content.mode}\0{content.size[0]}x{content.size[1]}\0".encode())
        h.update(content.tobytes())
    else:
        h.update(b"json\0" + json.dumps(content, sort_keys=True, ensure_ascii=False, default=str).encode("utf-8"))
    return h.hexdigest()


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
