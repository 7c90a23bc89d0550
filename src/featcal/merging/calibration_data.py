"""Calibration data of the merges that read it (RegMean, RegMean++: needs_calibration in the registry), checked
before any work.

A task's data is either a source (a path, a hub dataset id, a `datasets.Dataset`, a list of texts or chat
conversations: docs/data.md), loaded exactly as `featcal calibrate` loads it (a seeded sample of
`num_calibration_examples`, in batches of `calibration_batch_size`, preprocessed with the base's image
processor or tokenizer), or batches already in memory (a tensor or a dict of model inputs, or a list of
those), as `featcal.calibrate` takes them: both through the data seam's one door (featcal.data.open_calibration).
Data-free methods refuse calibration data rather than silently ignore it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

from featcal.config import DEFAULT_MAX_LENGTH, MergeConfig, calibration_options, method_names, method_spec
from featcal.data.batch import BatchLike
from featcal.data.calibration import DataReader, check_task_names
from featcal.data.calibration_set import CalibrationSet, open_calibration
from featcal.errors import ConfigError

CalibrationInput = Union[str, os.PathLike, BatchLike, Sequence[BatchLike], Sequence[Any]]


def check_calibration_request(
    method: str, experts: Mapping[str, Any], calibration: Mapping[str, CalibrationInput] | None
) -> None:
    """RegMean(++) needs data for exactly the experts' tasks; data-free methods take none. No I/O."""
    if not method_spec(method).needs_calibration:
        if calibration:
            readers = [m for m in method_names() if method_spec(m).needs_calibration]
            raise ConfigError(
                f"merge method {method!r} is data-free and takes no calibration data; drop --calib "
                f"(calibration=) or choose {' or '.join(readers)}"
            )
        return
    if not calibration:
        raise ConfigError(
            f"merge method {method!r} needs calibration data: one --calib NAME=DATA per expert "
            "(calibration={task: data} in Python, merge.calibration in a run file)"
        )
    if not isinstance(calibration, Mapping):
        raise ConfigError(f"calibration must map task names to data, not be a {type(calibration).__name__}")
    check_task_names(experts, calibration)


def check_calibration_data(
    calibration: Mapping[str, CalibrationInput],
    *,
    model_dir: Path | None,
    config: MergeConfig,
    max_length: int = DEFAULT_MAX_LENGTH,
    allow_fewer: bool = False,
    experts: Mapping[str, Any] | None = None,
) -> CalibrationSet:
    """Every task's data usable, loading no model: a source exists and holds enough examples of the
    base's modality; in-memory batches are non-empty tensors or dicts. `model_dir`: the base checkpoint
    directory (its config and processor decide how sources are read), None for an in-memory base;
    `experts`: where a chat template is looked for when the base's tokenizer has none. Returns the checked
    data, which `load_calibration` reads without opening anything again."""
    options = calibration_options(config, max_length=max_length, allow_fewer=allow_fewer)
    data = open_calibration(calibration, reader=DataReader(model_dir, experts=experts or {}), options=options)
    if data.sources and model_dir is None:
        raise ConfigError(
            f"calibration data of task(s) {', '.join(map(repr, data.sources))} is given as a path (or another source "
            "to read), which needs the base as a checkpoint directory (its image processor or tokenizer); pass "
            "batches instead, or the base's path"
        )
    return data.check()


@dataclass
class LoadedCalibration:
    """Per-task batches, what featcal.json records about them, and the data options that applied."""

    batches: dict[str, list[BatchLike]]
    report: dict[str, dict[str, Any]]
    params: dict[str, Any] = field(default_factory=dict)


def load_calibration(data: CalibrationSet, *, progress: bool = False) -> LoadedCalibration:
    """The batches of every task of `data` (checked by `check_calibration_data`), what featcal.json records of
    each (batches given in memory named as such), and, when some task was read from a source, the options it
    was read with (CalibrationOptions.report)."""
    loaded = data.load(progress=progress)
    params = data.options.report() if data.sources else {}
    return LoadedCalibration(loaded.batches, loaded.report(), params)
