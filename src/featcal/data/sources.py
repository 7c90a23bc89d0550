"""Where examples come from: recognise a source and open it (reading no image yet).

A source is a path (an image folder, a text file or folder, a saved dataset, a .jsonl / .json / .csv /
.tsv / .parquet file), a Hugging Face dataset id (`NAME[:CONFIG][@SPLIT]`, data/hub.py), or an object in
memory (a `datasets.Dataset` / `DatasetDict`, a list of strings, of chat conversations, of records
(dicts), or of PIL images). Every source says which modalities it can serve and how many examples it
holds, and reads only the examples asked for. Sources know nothing about models: turning examples into
tensors is `featcal.data.preprocess`'s job.

A folder is recognised by what it holds (data/folders.py): a folder written by save_to_disk is a saved
dataset; a folder holding images is an image folder; a folder of text files is text; a folder holding
both, or text beside data files, is refused naming what it holds, unless `data_format` says which to read.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from featcal.data.chat import is_conversation, turns
from featcal.data.folders import IMAGE_SUFFIXES, FolderContents, scan_folder
from featcal.data.hub import HubId, load_hub_dataset, parse_hub_id
from featcal.data.tables import (
    IMAGE_COLUMNS,
    NON_TEXT_COLUMNS,
    TABLE_SUFFIXES,
    TARGET_COLUMNS,
    TEST_SPLITS,
    TEXT_COLUMNS,
    TRAIN_SPLITS,
    TableSource,
    dataset_source,
    records_source,
    saved_dataset,
    table_file,
)
from featcal.data.text_files import TEXT_SUFFIXES, TextSource
from featcal.data.types import Content, Example, ExampleSource, Modality, TextExample
from featcal.errors import CalibrationDataError, SplitChoiceError

# re-exported: the names callers used when everything lived here
__all__ = [
    "DATA_FORMATS", "IMAGE_COLUMNS", "IMAGE_SUFFIXES", "NON_TEXT_COLUMNS", "TARGET_COLUMNS", "TEST_SPLITS",
    "TEXT_COLUMNS", "CalibrationSource", "Example", "ImageFolderSource", "ListSource", "Modality", "TableSource",
    "TextExample", "TextSource", "is_source", "open_source",
]

CalibrationSource = ExampleSource  # the old name of the protocol
DATA_FORMATS = ("image", "text")  # what `data_format` may force: a folder's images or text, a file read as text


class ImageFolderSource:
    """Every image file under a folder, recursively (class sub-folders allowed), in path order."""

    kind = "image folder"

    def __init__(self, root: Path, contents: FolderContents | None = None) -> None:
        self.path = root
        self.contents = contents if contents is not None else scan_folder(root)
        self.files = self.contents.images

    @property
    def modalities(self) -> tuple[Modality, ...]:
        return ("image",)

    def content(self, modality: Modality) -> Content:
        return "image"

    def describe(self, modality: Modality) -> dict[str, Any]:
        return {"format": self.kind, "content": "image", "unit": "file"}

    def __len__(self) -> int:
        return len(self.files)

    def examples(self, indices: Sequence[int], modality: Modality) -> list[Example]:
        out = []
        for i in indices:
            rel = self.files[i].relative_to(self.path)
            fields = {"file": rel.as_posix(), **({"label": rel.parts[0]} if len(rel.parts) > 1 else {})}
            out.append(Example(image=_open_image(self.files[i]), fields=fields))
        return out

    def field_names(self, modality: Modality) -> list[str]:
        """`file`, and `label` when every image sits in a class sub-folder."""
        return ["file", "label"] if self._all_in_classes() else ["file"]

    def field_values(self, name: str, indices: Sequence[int]) -> list[Any]:
        """A field read from the file names alone (no image opened)."""
        out = []
        for i in indices:
            rel = self.files[i].relative_to(self.path)
            out.append(rel.as_posix() if name == "file" else rel.parts[0] if name == "label" and len(rel.parts) > 1
                       else None)
        return out

    def class_names(self, name: str) -> tuple[str, ...] | None:
        """The class sub-folders in sorted order (torchvision's ImageFolder numbering), when every image sits in one."""
        if name != "label" or not self._all_in_classes():
            return None
        return tuple(sorted({f.relative_to(self.path).parts[0] for f in self.files}))

    def _all_in_classes(self) -> bool:
        return bool(self.files) and all(len(f.relative_to(self.path).parts) > 1 for f in self.files)

    def empty_hint(self) -> str:
        """What the folder holds instead of images (said when it holds none)."""
        other = self.contents.summary(("texts", "tables", "other"))
        return f" (no image files; it holds {other})" if other else ""


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


class ListSource:
    """Examples handed over in memory: strings, chat conversations or PIL images (one kind per list)."""

    def __init__(self, items: Sequence[Any], content: Content, name: str) -> None:
        self.path = name
        self.kind = {"text": "texts", "chat": "conversations", "image": "images"}[content] + " (in memory)"
        self._content = content
        where = "item {}"
        if content == "chat":
            items = [turns(c, f"{name}, {where.format(i + 1)}") for i, c in enumerate(items)]
        elif content == "text":
            empty = next((i for i, t in enumerate(items) if not t.strip()), None)
            if empty is not None:
                raise CalibrationDataError(f"{name}, {where.format(empty + 1)}: the text is empty")
        self.items = list(items)

    @property
    def modalities(self) -> tuple[Modality, ...]:
        return ("image",) if self._content == "image" else ("text",)

    def content(self, modality: Modality) -> Content:
        return self._content

    def describe(self, modality: Modality) -> dict[str, Any]:
        return {"format": self.kind, "content": self._content, "unit": "item"}

    def __len__(self) -> int:
        return len(self.items)

    def examples(self, indices: Sequence[int], modality: Modality) -> list[Example]:
        key = {"text": "text", "chat": "messages", "image": "image"}[self._content]
        return [Example(**{key: self.items[i]}) for i in indices]


def is_source(data: Any) -> bool:
    """Whether `data` is a source to read (a path or hub id, a `datasets` object, a list of texts,
    conversations, records or images), not batches a caller made (a tensor, a dict of tensors, or any
    iterable of those, which pass through untouched)."""
    if isinstance(data, (str, os.PathLike)):
        return True
    if type(data).__module__.startswith("datasets"):
        return True
    if not isinstance(data, (list, tuple)) or not data:
        return False
    first = data[0]
    if isinstance(first, Mapping):
        import torch

        return not any(isinstance(v, torch.Tensor) for v in first.values())  # a record, not a dict of tensors
    return isinstance(first, (str, list, tuple)) or _all_images(data[:1])


def open_source(
    source: Any, *, text_column: str | None = None, allow_test_split: bool = False, text_unit: str | None = None,
    data_format: str | None = None, modality: Modality | None = None, split: str | None = None,
    prefer_splits: Sequence[str] = TRAIN_SPLITS,
) -> ExampleSource:
    """Recognise `source` and open it (reads no image data yet).

    `text_column` names the column texts are read from in a table (else a conventional name, else its one
    candidate string column); `allow_test_split` lets a dataset holding only a test split be used;
    `text_unit` is what one example of a text file is (line / paragraph / file); `data_format` ("image",
    "text") says how to read a folder holding several kinds of files, or a file of any suffix as text;
    `modality` is what the model takes, when known: a folder is then read for it (an image model reads a
    folder's images and nothing else). `split` names the split of a DatasetDict (saved, hub or in memory)
    to read; unset, its only split, else the one of `prefer_splits` it holds (calibration: train). A
    `split` for a source without splits (a file, a folder of files) is refused, never ignored.
    """
    if data_format is not None and data_format not in DATA_FORMATS:
        raise CalibrationDataError(f"unknown data format {data_format!r}; choose one of {', '.join(DATA_FORMATS)}")
    splits = {"split": split, "prefer_splits": prefer_splits}
    if not isinstance(source, (str, os.PathLike)):
        return _in_memory(source, text_column=text_column, allow_test_split=allow_test_split, **splits)
    path = Path(source).expanduser()
    if path.is_dir() and is_saved_dataset(path):
        return saved_dataset(path, text_column=text_column, allow_test_split=allow_test_split, **splits)
    if split is not None and path.exists():
        raise SplitChoiceError(
            f"{path} is a {'folder' if path.is_dir() else 'file'} of examples with no splits: --split names a split "
            "of a DatasetDict (a folder written by save_to_disk, or a hub dataset id); drop --split for this source"
        )
    if path.is_dir():
        return _folder(path, data_format, modality, text_unit)
    if path.is_file():
        return _file(path, data_format, text_column, text_unit)
    if path.exists():  # a FIFO, a socket, a device: nothing to read examples from (and a FIFO would block)
        raise CalibrationDataError(f"calibration data {path} is not a regular file or a folder; give a data file "
                                   "or a folder")
    hub_id = parse_hub_id(os.fspath(source), TABLE_SUFFIXES + TEXT_SUFFIXES + IMAGE_SUFFIXES)
    if hub_id is None or path.exists():
        raise CalibrationDataError(f"calibration data {path} does not exist")
    if split is not None and hub_id.split is not None and split != hub_id.split:
        raise SplitChoiceError(f"{hub_id} names the split {hub_id.split!r} and --split names {split!r}; keep one")
    named = hub_id.split or split
    loaded = load_hub_dataset(HubId(hub_id.name, hub_id.config, named))
    source_ = dataset_source(loaded, str(hub_id), "hub dataset", text_column=text_column,
                             allow_test_split=allow_test_split, prefer_splits=prefer_splits)
    if named is not None:
        source_.split = named
    return source_


def is_saved_dataset(path: Path) -> bool:
    """Whether folder `path` is what datasets' save_to_disk writes: a DatasetDict's `dataset_dict.json` naming
    its splits, or a Dataset's `dataset_info.json` beside the `state.json` that lists its arrow files (a
    `state.json` of anything else, in a folder of texts, does not make it a dataset)."""
    def json_of(name: str) -> Any:
        try:
            return json.loads((path / name).read_text(encoding="utf-8")) if (path / name).is_file() else None
        except (OSError, UnicodeDecodeError, ValueError):
            return None

    splits = json_of("dataset_dict.json")
    if isinstance(splits, dict) and isinstance(splits.get("splits"), list):
        return True
    state = json_of("state.json")
    return (path / "dataset_info.json").is_file() and isinstance(state, dict) and "_data_files" in state


def _file(path: Path, data_format: str | None, text_column: str | None, text_unit: str | None) -> ExampleSource:
    suffix = path.suffix.lower()
    if data_format == "text" or suffix in TEXT_SUFFIXES:
        return TextSource(path, [path], text_unit)
    if data_format == "image":
        raise CalibrationDataError(f"calibration data {path}: data_format 'image' reads a folder of images, not a file")
    if suffix in TABLE_SUFFIXES:
        return table_file(path, text_column=text_column)
    raise CalibrationDataError(
        f"calibration data {path}: unsupported format {suffix or '(no suffix)'}; expected an image folder, a text "
        f"file ({', '.join(TEXT_SUFFIXES[:2])}) or folder, {', '.join(TABLE_SUFFIXES)}, a folder written by "
        "datasets' save_to_disk, or a hub dataset id (--data-format text reads any file as plain text)"
    )


def _folder(path: Path, data_format: str | None, modality: Modality | None, text_unit: str | None) -> ExampleSource:
    """A folder read for what it holds (see the module docstring)."""
    contents = scan_folder(path, sniff=data_format != "image" and modality != "image")
    if data_format == "image" or modality == "image":
        return ImageFolderSource(path, contents)
    if data_format == "text":
        return TextSource(path, contents.texts + contents.tables + contents.other, text_unit)
    kinds = [k for k in ("images", "texts", "tables") if getattr(contents, k)]
    if len(kinds) > 1:
        flags = " or ".join(f"--data-format {f}" for f in (("image", "text") if "images" in kinds else ("text",)))
        raise CalibrationDataError(
            f"calibration data {path} is ambiguous: it holds {contents.summary(kinds)}; say which to read with {flags} "
            "(data_format in a config), or give a folder holding one kind of file"
        )
    if kinds == ["texts"]:
        return TextSource(path, contents.texts, text_unit)
    if kinds == ["tables"]:
        raise CalibrationDataError(
            f"calibration data {path} holds {contents.summary(['tables'])}: give one data file per task, not their folder"
        )
    return ImageFolderSource(path, contents)  # images, or nothing: "holds no examples"


def _in_memory(data: Any, *, text_column: str | None, allow_test_split: bool, split: str | None,
               prefer_splits: Sequence[str]) -> ExampleSource:
    """A `datasets` object, or a list of strings / conversations / records / PIL images."""
    import datasets

    if isinstance(data, (datasets.Dataset, datasets.DatasetDict)):
        return dataset_source(data, "dataset (in memory)", "dataset (in memory)", text_column=text_column,
                              allow_test_split=allow_test_split, split=split, prefer_splits=prefer_splits)
    if split is not None:
        raise SplitChoiceError(f"split {split!r} is named, but the calibration data in memory is a list, which has no "
                               "splits")
    if not isinstance(data, (list, tuple)):
        raise CalibrationDataError(
            f"calibration data must be a path, a hub dataset id, a datasets.Dataset, a list of texts, chat "
            f"conversations, records or images, or model-ready batches; not a {type(data).__name__}"
        )
    if not data:
        raise CalibrationDataError("calibration data (in memory) holds no examples: the list is empty")
    if all(isinstance(x, str) for x in data):
        return ListSource(data, "text", "texts (in memory)")
    if all(is_conversation(x) for x in data):
        return ListSource(data, "chat", "conversations (in memory)")
    if all(isinstance(x, dict) for x in data):
        return records_source(list(data), "records (in memory)", "records (in memory)", text_column=text_column,
                              locate=lambda i: f"records (in memory), record {i + 1}")
    if _all_images(data):
        return ListSource(data, "image", "images (in memory)")
    kinds = sorted({type(x).__name__ for x in data})
    raise CalibrationDataError(
        f"calibration data (in memory) mixes or holds unreadable items ({', '.join(kinds)}); give a list of texts, "
        "of chat conversations (lists of {'role', 'content'} turns), of records (dicts) or of PIL images"
    )


def _all_images(data: Sequence[Any]) -> bool:
    try:
        from PIL import Image
    except ImportError:  # pragma: no cover - Pillow comes with the image extras
        return False
    return all(isinstance(x, Image.Image) for x in data)

