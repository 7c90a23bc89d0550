"""Calibration data of the merges that read it (RegMean, RegMean++: needs_calibration in the registry), checked
before any work.

A task's data is either a source (a path, a hub dataset id, a `datasets.Dataset`, a list of texts or chat
conversations: docs/data.md), loaded exactly as `featcal calibrate` loads it (a seeded sample of
`num_calibration_examples`, in batches of `calibration_batch_size`, preprocessed with the base's image
processor or tokenizer), or batches already in memory (a tensor or a dict of model inputs, or a list of
those), as `featcal.calibrate` takes them. Data-free methods refuse calibration data rather than
silently ignore it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

from featcal.config import DEFAULT_MAX_LENGTH, DataOptions, MergeConfig, method_names, method_spec
from featcal.data.batch import BatchLike, as_batches
from featcal.data.calibration import (
    batches_record,
    check_task_names,
    check_task_sources,
    data_options,
    load_task_sources,
)
from featcal.data.sources import is_batch_data
from featcal.errors import CalibrationDataError, ConfigError
from featcal.io.models import load_config

CalibrationInput = Union[str, os.PathLike, BatchLike, Sequence[BatchLike], Sequence[Any]]


def _is_source(data: Any) -> bool:
    """A source to read (a path, hub id, dataset, texts, conversations), not batches already made."""
    return not is_batch_data(data)


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
) -> None:
    """Every task's data usable, loading no model: a source exists and holds enough examples of the
    base's modality; in-memory batches are non-empty tensors or dicts. `model_dir`: the base checkpoint
    directory (its config and processor decide how sources are read), None for an in-memory base;
    `experts`: where a chat template is looked for when the base's tokenizer has none."""
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
        raise ConfigError(f"max_length must be an integer of at least 1, got {max_length!r}")
    sources = [t for t, d in calibration.items() if _is_source(d)]
    if sources and model_dir is None:
        raise ConfigError(
            f"calibration data of task(s) {', '.join(map(repr, sources))} is given as a path (or another source to "
            "read), which needs the base as a checkpoint directory (its image processor or tokenizer); pass batches "
            "instead, or the base's path"
        )
    model_config = load_config(model_dir, error=CalibrationDataError) if sources else None
    check_task_sources({t: calibration[t] for t in sources}, model_dir=model_dir, config=model_config,
                       options=data_options(config, max_length=max_length, allow_fewer=allow_fewer), experts=experts)
    for task, data in calibration.items():
        if not _is_source(data):
            as_batches(data, task)


@dataclass
class LoadedCalibration:
    """Per-task batches, what featcal.json records about them, and the data options that applied."""

    batches: dict[str, list[BatchLike]]
    report: dict[str, dict[str, Any]]
    params: dict[str, Any] = field(default_factory=dict)


def load_calibration(
    calibration: Mapping[str, CalibrationInput],
    *,
    model_dir: Path | None,
    config: MergeConfig,
    max_length: int = DEFAULT_MAX_LENGTH,
    allow_fewer: bool = False,
    progress: bool = False,
    experts: Mapping[str, Any] | None = None,
) -> LoadedCalibration:
    """The batches of every task (checked by `check_calibration_data` first); the model's config is read
    once for all the tasks given as sources."""
    sources = {t: d for t, d in calibration.items() if _is_source(d)}
    model_config = load_config(model_dir, error=CalibrationDataError) if sources else None
    loaded, records = load_task_sources(
        sources, model_dir=model_dir, config=model_config, batch_size=config.calibration_batch_size, experts=experts,
        options=data_options(config, max_length=max_length, allow_fewer=allow_fewer), progress=progress,
    )
    batches: dict[str, list[BatchLike]] = {}
    report: dict[str, dict[str, Any]] = {}
    for task, data in calibration.items():
        if task in sources:  # the source, its format, unit, ...
            batches[task], report[task] = loaded[task], {"source": "<in-memory batches>", **records[task]}
        else:
            batches[task] = as_batches(data, task)
            report[task] = {"source": "<in-memory batches>", **batches_record(batches[task])}
    params: dict[str, Any] = {}
    if sources:  # how the sources were sampled and read: the data options (one model: config/data.py)
        params = {**{k: getattr(config, k) for k in DataOptions.model_fields}, "max_length": max_length,
                  "allow_fewer": allow_fewer}
    return LoadedCalibration(batches, report, params)
