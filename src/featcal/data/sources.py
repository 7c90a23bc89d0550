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
# string columns that name or label an example rather than hold its text: never taken as the text by default
NON_TEXT_COLUMNS = (
    "id", "idx", "uid", "guid", "uuid", "key", "label", "labels", "class", "category", "split", "source", "path",
    "file", "filename", "url",
)
TEST_SPLITS = ("test", "testing")


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
    except Image.DecompressionBombError as exc:  # not an OSError: it would escape as a traceback
        raise CalibrationDataError(
            f"cannot read image file {path}: {exc} (PIL's guard against decompression bombs; downscale the image)"
        ) from None
    except (OSError, UnidentifiedImageError, ValueError, SyntaxError) as exc:
        raise CalibrationDataError(f"cannot read image file {path}: {exc}") from None


class TableSource:
    """A `datasets.Dataset` (saved to disk, or read from JSONL/parquet) with its columns resolved."""

    def __init__(self, dataset, path: Path, kind: str, *, text_column: str | None = None,
                 image_root: Path | None = None) -> None:
        self.path = path
        self.kind = kind
        self.split: str | None = None  # a saved dataset's split, when known
        self.dataset, self.image_column = _resolve_image_column(dataset, path, image_root)
        self._text_candidates, self._text_problem = _text_column(
            self.dataset, path, text_column, exclude=(self.image_column,)
        )
        self.target_column = next(
            (c for c in TARGET_COLUMNS if c in self.dataset.column_names and _is_string(self.dataset, c)), None
        )

    @property
    def text_column(self) -> str | None:
        """The column texts are read from; an ambiguous or unusable choice is refused here, before any read."""
        if self._text_problem is not None:
            raise CalibrationDataError(self._text_problem)
        return self._text_candidates[0] if self._text_candidates else None

    @property
    def modalities(self) -> tuple[Modality, ...]:
        found: list[Modality] = []
        if self.image_column is not None:
            found.append("image")
        if self._text_candidates or self._text_problem is not None:
            found.append("text")
        return tuple(found)

    def string_columns(self) -> list[str]:
        """Every string column (what a user may pass as the text column)."""
        return [c for c in self.dataset.column_names if _is_string(self.dataset, c)]

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


def _resolve_image_column(dataset, path: Path, root: Path | None = None):
    """The first Image feature, else a column named image/img cast to Image (paths or bytes).

    With `root` (the folder of a JSONL / parquet file), relative image paths are taken from there, so a
    data file reads the same images from whatever directory featcal is run.
    """
    from datasets import Image

    found = next((name for name, feature in dataset.features.items() if isinstance(feature, Image)), None)
    if found is None:
        found = next((name for name in IMAGE_COLUMNS if name in dataset.column_names), None)
    if found is None:
        return dataset, None
    try:
        if root is not None:
            dataset = _anchor_image_paths(dataset, found, root)
        if not isinstance(dataset.features[found], Image) or not dataset.features[found].decode:
            dataset = dataset.cast_column(found, Image())
    except Exception as exc:
        raise CalibrationDataError(
            f"{path}: column {found!r} cannot be read as images ({type(exc).__name__}: {exc})"
        ) from None
    return dataset, found


def _anchor_image_paths(dataset, column: str, root: Path):
    """`dataset` with the relative paths of image column `column` (no embedded bytes) made relative to `root`.

    Works on the Arrow chunks, so embedded image bytes are never copied into Python objects.
    """
    import os

    import pyarrow as pa
    from datasets import Image
    from datasets.table import InMemoryTable

    def anchored(p: str | None, has_bytes: bool) -> str | None:
        if p is None or has_bytes or "://" in p:
            return p
        q = os.path.expanduser(p)
        return q if os.path.isabs(q) else str(root / q)

    raw = dataset.cast_column(column, Image(decode=False))  # struct<bytes, path>, whatever the column held
    cells = raw.data.column(column)
    chunks, changed = [], False
    for chunk in cells.chunks:
        data, paths = chunk.field("bytes"), chunk.field("path").to_pylist()
        new_paths = [anchored(p, b) for p, b in zip(paths, data.is_valid().to_pylist(), strict=True)]
        changed = changed or new_paths != paths
        chunks.append(pa.StructArray.from_arrays(
            [data, pa.array(new_paths, type=pa.string())], names=["bytes", "path"], mask=chunk.is_null()
        ))
    if not changed:
        return raw
    table = raw.data.table
    table = table.set_column(table.schema.get_field_index(column), column, pa.chunked_array(chunks, type=cells.type))
    return type(dataset)(InMemoryTable(table), info=raw.info)


def _text_column(
    dataset, path: Path, chosen: str | None, exclude: Sequence[str | None]
) -> tuple[list[str], str | None]:
    """(candidate text columns, the problem with them or None): the column the user chose, else a
    conventionally named one, else the one string column that is not an image, target, id or label.

    Several candidates are a problem, not a choice to make silently: calibrating on ids or label words
    instead of the texts gives a wrong model with no error, so the user must name the column.
    """
    strings = [c for c in dataset.column_names if _is_string(dataset, c)]
    held = ", ".join(repr(c) for c in strings) or "none"
    if chosen is not None:
        if chosen not in dataset.column_names:
            return [], f"{path}: text column {chosen!r} does not exist (string columns: {held})"
        if not _is_string(dataset, chosen):
            return [], f"{path}: text column {chosen!r} does not hold strings (string columns: {held})"
        return [chosen], None
    for name in TEXT_COLUMNS:
        if name in strings:
            return [name], None
    odd = next((n for n in TEXT_COLUMNS if n in dataset.column_names and n not in exclude), None)
    if odd is not None:  # e.g. pre-tokenised ids under `text`: the texts are not where the name says
        return [], (
            f"{path}: column {odd!r} does not hold strings ({dataset.features[odd]}); name the column holding "
            f"the texts with --text-column (string columns: {held})"
        )
    candidates = [c for c in strings if c not in exclude and c not in TARGET_COLUMNS and c.lower() not in NON_TEXT_COLUMNS]
    if len(candidates) > 1:
        return candidates, (
            f"{path}: no conventionally named text column ({', '.join(TEXT_COLUMNS[:4])}, ...) and several string "
            f"columns could hold the texts: {', '.join(map(repr, candidates))}; name one with --text-column "
            "(text_column in the config)"
        )
    return candidates, None


def _is_test_split(name: object) -> bool:
    """Whether a split name (as datasets records it: 'test', 'test[:100]', 'train+test') holds test data."""
    if name is None:
        return False
    return any(part.split("[", 1)[0].strip().lower() in TEST_SPLITS for part in str(name).split("+"))


def _saved_dataset(path: Path, *, text_column: str | None = None, allow_test_split: bool = False) -> TableSource:
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as exc:
        raise CalibrationDataError(f"cannot load the saved dataset {path}: {type(exc).__name__}: {exc}") from None
    if isinstance(loaded, datasets.DatasetDict):
        if "train" in loaded:
            split = "train"
        elif len(loaded) == 1:
            (split,) = loaded.keys()
            _refuse_test_split(path, split, allow_test_split)
            log.info("%s has no 'train' split; using its only split %r", path, split)
        else:
            raise CalibrationDataError(
                f"{path} is a DatasetDict without a 'train' split (splits: {', '.join(loaded)}); "
                "calibration data must come from training data"
            )
        loaded = loaded[split]
    else:  # a Dataset saved from a split remembers which one
        split = getattr(loaded, "split", None)
        _refuse_test_split(path, split, allow_test_split)
    source = TableSource(loaded, path, "saved dataset", text_column=text_column)
    source.split = None if split is None else str(split)  # featcal.json records which split was read
    return source


def _refuse_test_split(path: Path, split: object, allowed: bool) -> None:
    """Test data must never become calibration data by accident: only when the user says so."""
    if not _is_test_split(split):
        return
    if not allowed:
        raise CalibrationDataError(
            f"{path} is the {str(split)!r} split, test data: calibrating on it would leak it into the model "
            "evaluated on it. Use a training split, or pass --allow-test-split (allow_test_split: true) if you mean it"
        )
    log.warning("%s: calibrating on its %r split, as allowed by allow_test_split", path, str(split))


def _read_utf8(path: Path) -> str:
    """The file's text; a file that is not UTF-8 is named with the line and byte at fault."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise CalibrationDataError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        return raw.decode("utf-8-sig")  # a leading byte-order mark is harmless
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise CalibrationDataError(
            f"{path}, line {line}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start}); "
            "save the file as UTF-8"
        ) from None


def _jsonl(path: Path, *, text_column: str | None = None) -> TableSource:
    import datasets

    text = _read_utf8(path)
    records: list[dict] = []
    if path.suffix.lower() == ".json" and text.lstrip().startswith("["):
        try:
            records = json.loads(text)
        except json.JSONDecodeError as exc:
            raise CalibrationDataError(f"{path} is not valid JSON: {exc}") from None
        if not all(isinstance(r, dict) for r in records):
            raise CalibrationDataError(f"{path}: a JSON array of calibration records must hold objects")
    else:
        # JSON Lines ends records at "\n" only: str.splitlines() would also split at U+2028, U+0085, ...,
        # which valid JSON may hold unescaped inside a string
        for lineno, line in enumerate(text.split("\n"), 1):
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
    return TableSource(dataset, path, "jsonl", text_column=text_column, image_root=path.parent)


def _parquet(path: Path, *, text_column: str | None = None) -> TableSource:
    import datasets
    import pyarrow.parquet as pq
    from datasets.table import InMemoryTable

    try:
        table = pq.read_table(path)
    except Exception as exc:
        raise CalibrationDataError(f"cannot read parquet file {path}: {exc}") from None
    return TableSource(
        datasets.Dataset(InMemoryTable(table)), path, "parquet", text_column=text_column, image_root=path.parent
    )


def open_source(
    source: str | Path, *, text_column: str | None = None, allow_test_split: bool = False
) -> CalibrationSource:
    """Recognise the format of `source` and open it (reads no image data yet).

    `text_column` names the column texts are read from in a table (else a conventional name, else its one
    candidate string column); `allow_test_split` lets a saved dataset holding only a test split be used.
    """
    path = Path(source).expanduser()
    if not path.exists():
        raise CalibrationDataError(f"calibration data {path} does not exist")
    if path.is_dir():
        if (path / "dataset_dict.json").exists() or (path / "state.json").exists():
            return _saved_dataset(path, text_column=text_column, allow_test_split=allow_test_split)
        return ImageFolderSource(path)
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".ndjson", ".json"):
        return _jsonl(path, text_column=text_column)
    if suffix == ".parquet":
        return _parquet(path, text_column=text_column)
    raise CalibrationDataError(
        f"calibration data {path}: unsupported format {suffix or '(no suffix)'}; expected an image folder, "
        "a folder written by datasets' save_to_disk, a .jsonl file or a .parquet file"
    )
