"""Hugging Face datasets by id: `NAME[:CONFIG][@SPLIT]`, read through `datasets.load_dataset`.

`openai/gsm8k:main@train`, `imdb`, `org/set@train[:1000]`. Without a split the dataset's 'train' split
is read (else its only split; a test split only with allow_test_split), as for a saved dataset. A string
is taken for a hub id only when no file or folder of that name exists and it cannot be a path (it does
not start with '/', '.' or '~', holds at most one '/', and does not end in a data file's suffix).

Offline (HF_HUB_OFFLINE=1 or HF_DATASETS_OFFLINE=1) a dataset is read from the `datasets` cache, and a
dataset not cached there is refused in one line that names the variables and the local alternatives.
`datasets` reads those variables once, when it is imported; featcal reads them again when it loads, so
setting one later (as a test or a notebook does) still keeps the load off the network.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass

from featcal.errors import CalibrationDataError

_HUB_ID = re.compile(
    r"^(?P<name>[A-Za-z0-9][\w.-]*(?:/[A-Za-z0-9][\w.-]*)?)(?::(?P<config>[\w.-]+))?(?:@(?P<split>[\w.%:+\[\]-]+))?$"
)
_TRUE = ("1", "ON", "YES", "TRUE")
LOCAL_ALTERNATIVES = ("a folder written by save_to_disk, a .jsonl / .csv / .tsv / .parquet file, "
                      "a text file or folder")


@dataclass(frozen=True)
class HubId:
    name: str
    config: str | None = None
    split: str | None = None

    def __str__(self) -> str:
        return self.name + (f":{self.config}" if self.config else "") + (f"@{self.split}" if self.split else "")


def parse_hub_id(text: str, data_suffixes: tuple[str, ...]) -> HubId | None:
    """The hub id `text` spells, or None when it cannot be one (a path: see the module docstring)."""
    if text.startswith(("/", ".", "~")) or text.lower().endswith(data_suffixes):
        return None
    match = _HUB_ID.match(text)
    if match is None:
        return None
    return HubId(match["name"], match["config"], match["split"])


def offline() -> bool:
    """Whether the environment asks for no network (the variables `datasets` and huggingface_hub read)."""
    names = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")
    return any(os.environ.get(n, "").upper() in _TRUE for n in names)


@contextlib.contextmanager
def _offline_as_the_environment_says() -> Iterator[None]:
    """datasets / huggingface_hub offline for this load when the environment says so now."""
    import datasets.config
    import huggingface_hub.constants as hub_constants

    if not offline():
        yield
        return
    before = (datasets.config.HF_HUB_OFFLINE, hub_constants.HF_HUB_OFFLINE)
    datasets.config.HF_HUB_OFFLINE = hub_constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, hub_constants.HF_HUB_OFFLINE = before


def load_hub_dataset(hub_id: HubId):
    """The Dataset (with a split) or DatasetDict (without) that `hub_id` names; one-line errors."""
    import datasets

    try:
        with _offline_as_the_environment_says():
            return datasets.load_dataset(hub_id.name, hub_id.config, split=hub_id.split)
    except Exception as exc:
        raise CalibrationDataError(_why(hub_id, exc)) from None


def _why(hub_id: HubId, exc: Exception) -> str:
    reason = " ".join(str(exc).split())
    where = f"calibration data {str(hub_id)!r} is no local file or folder, and as a Hugging Face dataset id"
    if offline() and isinstance(exc, ConnectionError):
        return (f"{where} it is not in the local datasets cache while offline (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE "
                f"is set): load it once online to cache it, or pass a local copy ({LOCAL_ALTERNATIVES})")
    if isinstance(exc, ConnectionError):
        return (f"{where} it cannot be fetched: the Hugging Face Hub is unreachable ({reason}). Set HF_HUB_OFFLINE=1 "
                f"(or HF_DATASETS_OFFLINE=1) to read it from the local datasets cache, or pass a local copy "
                f"({LOCAL_ALTERNATIVES})")
    if type(exc).__name__ in ("DatasetNotFoundError", "FileNotFoundError", "RepositoryNotFoundError"):
        return f"{where} it does not exist ({reason}); a local path must exist, a hub id is NAME[:CONFIG][@SPLIT]"
    hint = ""
    if "config" in reason.lower():
        hint = "; name the config as NAME:CONFIG"
    elif "split" in reason.lower():
        hint = "; name the split as NAME@SPLIT"
    return f"{where} it cannot be read: {type(exc).__name__}: {reason}{hint}"
