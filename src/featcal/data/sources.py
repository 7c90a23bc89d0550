"""Where calibration examples come from: image folders, saved HF datasets, JSONL and parquet files.

A source says which modalities it can serve and how many examples it holds, and reads only the
examples asked for, so drawing 256 images from a folder of 100k opens 256 files. Sources know
nothing about models: turning examples into tensors is `featcal.data.preprocess`'s job.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

from featcal.errors import CalibrationDataError

log = logging.getLogger(__name__)

Modality = Literal["image", "text"]

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".webp")
IMAGE_COLUMNS = ("image", "img")
TEXT_COLUMNS = ("text", "sentence", "content", "prompt", "input", "question", "document", "premise", "sentence1")
TARGET_COLUMNS = ("target", "label_text")


@dataclass(frozen=True)
class TextExample:
    """One text, plus the target text an encoder-decoder is teacher-forced with (if any)."""

    text: str
    target: str | None = None


class CalibrationSource(Protocol):
    """The selectable examples of one data source."""

    path: Path
    kind: str  # "image folder", "saved dataset", "jsonl", "parquet"

    @property
    def modalities(self) -> tuple[Modality, ...]: ...

    def __len__(self) -> int: ...

    def fetch(self, indices: Sequence[int], modality: Modality) -> list:
        """PIL images (modality "image") or TextExamples ("text"), in the order of `indices`."""
        ...


class ImageFolderSource:
    """Every image file under a folder, recursively (class sub-folders allowed), in path order."""

    kind = "image folder"

    def __init__(self, root: Path) -> None:
        self.path = root
        files = [
            p for p in root.rglob("*")
            if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES
            and not any(part.startswith(".") for part in p.relative_to(root).parts)
        ]
        self.files = sorted(files, key=lambda p: p.relative_to(root).as_posix())

    @property
    def modalities(self) -> tuple[Modality, ...]:
        return ("image",)

    def __len__(self) -> int:
        return len(self.files)

    def fetch(self, indices: Sequence[int], modality: Modality) -> list:
        return [_open_image(self.files[i]) for i in indices]


def _open_image(path: Path):
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as im:
            im.load()
            return im.copy()
    except (OSError, UnidentifiedImageError, ValueError, SyntaxError) as exc:
        raise CalibrationDataError(f"cannot read image file {path}: {exc}") from None


class TableSource:
    """A `datasets.Dataset` (saved to disk, or read from JSONL/parquet) with its columns resolved."""

    def __init__(self, dataset, path: Path, kind: str) -> None:
        self.path = path
        self.kind = kind
        self.dataset, self.image_column = _resolve_image_column(dataset, path)
        self.text_column = _text_column(self.dataset, exclude=(self.image_column,))
        self.target_column = next(
            (c for c in TARGET_COLUMNS if c in self.dataset.column_names and _is_string(self.dataset, c)), None
        )

    @property
    def modalities(self) -> tuple[Modality, ...]:
        found: list[Modality] = []
        if self.image_column is not None:
            found.append("image")
        if self.text_column is not None:
            found.append("text")
        return tuple(found)

    def __len__(self) -> int:
        return len(self.dataset)

    def fetch(self, indices: Sequence[int], modality: Modality) -> list:
        if modality == "image":
            return [self._image(int(i)) for i in indices]
        return [self._text(int(i)) for i in indices]

    def _image(self, i: int):
        try:
            image = self.dataset[i][self.image_column]
        except Exception as exc:  # decoding errors surface here, one row at a time
            raise CalibrationDataError(
                f"{self.path}: cannot decode the image in row {i} (column {self.image_column!r}): {exc}"
            ) from None
        if image is None:
            raise CalibrationDataError(f"{self.path}: row {i} has no image (column {self.image_column!r} is empty)")
        return image

    def _text(self, i: int) -> TextExample:
        row = self.dataset[i]
        text = row[self.text_column]
        if not isinstance(text, str) or not text.strip():
            raise CalibrationDataError(f"{self.path}: row {i} has no text in column {self.text_column!r}")
        target = row[self.target_column] if self.target_column else None
        return TextExample(text=text, target=target if isinstance(target, str) else None)


def _is_string(dataset, column: str) -> bool:
    from datasets import Value

    feature = dataset.features.get(column)
    return isinstance(feature, Value) and feature.dtype in ("string", "large_string")


def _resolve_image_column(dataset, path: Path):
    """The first Image feature, else a column named image/img cast to Image (paths or bytes)."""
    from datasets import Image

    for name, feature in dataset.features.items():
        if isinstance(feature, Image):
            return dataset, name
    for name in IMAGE_COLUMNS:
        if name in dataset.column_names:
            try:
                return dataset.cast_column(name, Image()), name
            except Exception as exc:
                raise CalibrationDataError(
                    f"{path}: column {name!r} cannot be read as images ({type(exc).__name__}: {exc})"
                ) from None
    return dataset, None


def _text_column(dataset, exclude: Sequence[str | None]) -> str | None:
    """A conventionally named text column, else the first string column that is not a target."""
    for name in TEXT_COLUMNS:
        if name in dataset.column_names and _is_string(dataset, name):
            return name
    for name in dataset.column_names:
        if name not in exclude and name not in TARGET_COLUMNS and _is_string(dataset, name):
            return name
    return None


def _saved_dataset(path: Path) -> TableSource:
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as exc:
        raise CalibrationDataError(f"cannot load the saved dataset {path}: {type(exc).__name__}: {exc}") from None
    if isinstance(loaded, datasets.DatasetDict):
        if "train" in loaded:
            loaded = loaded["train"]
        elif len(loaded) == 1:
            (split,) = loaded.keys()
            log.info("%s has no 'train' split; using its only split %r", path, split)
            loaded = loaded[split]
        else:
            raise CalibrationDataError(
                f"{path} is a DatasetDict without a 'train' split (splits: {', '.join(loaded)}); "
                "calibration data must come from training data"
            )
    return TableSource(loaded, path, "saved dataset")


def _jsonl(path: Path) -> TableSource:
    import datasets

    text = path.read_text(encoding="utf-8")
    records: list[dict] = []
    if path.suffix.lower() == ".json" and text.lstrip().startswith("["):
        try:
            records = json.loads(text)
        except json.JSONDecodeError as exc:
            raise CalibrationDataError(f"{path} is not valid JSON: {exc}") from None
        if not all(isinstance(r, dict) for r in records):
            raise CalibrationDataError(f"{path}: a JSON array of calibration records must hold objects")
    else:
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise CalibrationDataError(f"{path}, line {lineno}: not valid JSON ({exc})") from None
            if not isinstance(record, dict):
                raise CalibrationDataError(f"{path}, line {lineno}: expected a JSON object, got {type(record).__name__}")
            records.append(record)
    try:
        dataset = datasets.Dataset.from_list(records)
    except Exception as exc:  # mixed types in one field, nested garbage
        raise CalibrationDataError(f"{path}: records cannot be read as one table: {exc}") from None
    return TableSource(dataset, path, "jsonl")


def _parquet(path: Path) -> TableSource:
    import datasets
    import pyarrow.parquet as pq
    from datasets.table import InMemoryTable

    try:
        table = pq.read_table(path)
    except Exception as exc:
        raise CalibrationDataError(f"cannot read parquet file {path}: {exc}") from None
    return TableSource(datasets.Dataset(InMemoryTable(table)), path, "parquet")


def open_source(source: str | Path) -> CalibrationSource:
    """Recognise the format of `source` and open it (reads no image data yet)."""
    path = Path(source).expanduser()
    if not path.exists():
        raise CalibrationDataError(f"calibration data {path} does not exist")
    if path.is_dir():
        if (path / "dataset_dict.json").exists() or (path / "state.json").exists():
            return _saved_dataset(path)
        return ImageFolderSource(path)
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".ndjson", ".json"):
        return _jsonl(path)
    if suffix == ".parquet":
        return _parquet(path)
    raise CalibrationDataError(
        f"calibration data {path}: unsupported format {suffix or '(no suffix)'}; expected an image folder, "
        "a folder written by datasets' save_to_disk, a .jsonl file or a .parquet file"
    )
