"""The one door to calibration data, beside the checkpoints' (io/read/family.py `open_family`).

`open_calibration(data, reader=, options=)` takes every task's data at once: a source to read (a path, a hub
id, a `datasets.Dataset`, a list of texts, conversations, records or images: docs/data.md) or batches already
made (a tensor, a dict of model inputs, or a list of those). Whether a task's data is a source or batches is
asked here, once (`featcal.data.sources.is_source`); batches are normalised here, once (`as_batches`), and
otherwise passed on untouched. `CalibrationSet.check()` is what may run before any model loads (featcal plan,
calibrate, run and merge check with it); `.load()` returns the batches and what featcal.json records of each
task, reusing what the check opened, drew and preprocessed (data/calibration.py `SourcePlan`).

Behind featcal calibrate / run / plan (calibration/front/pipeline.py), `featcal.calibrate`'s data
(calibration/front/task_data.py) and the RegMean merges' data (merging/calibration_data.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from featcal.config import CalibrationOptions
from featcal.data.batch import BatchLike, as_batches
from featcal.data.calibration import (
    DataReader,
    SourcePlan,
    batches_record,
    naming_task,
    plan_source,
    preprocess_drawn,
    read_plan,
)
from featcal.data.sources import is_source
from featcal.errors import ConfigError

IN_MEMORY = "<in-memory batches>"  # what featcal.json names batches given in memory by


@dataclass
class CalibrationData:
    """What `CalibrationSet.load` returns: every task's batches (in the order the data was given), and what
    featcal.json records of each task read from a source (how it was read, the source, `batches_record`)."""

    batches: dict[str, list[BatchLike]]
    records: dict[str, dict[str, Any]]

    def report(self) -> dict[str, dict[str, Any]]:
        """Every task's record, batches given in memory too (named IN_MEMORY, with their `batches_record`)."""
        return {t: self.records[t] if t in self.records else {"source": IN_MEMORY, **batches_record(b)}
                for t, b in self.batches.items()}


class CalibrationSet:
    """Every task's calibration data, through one door: `check()` before any model loads, `load()` after (which
    checks first where that was not done). Built by `open_calibration`."""

    def __init__(self, data: Mapping[str, Any], reader: DataReader, options: CalibrationOptions) -> None:
        self.data = dict(data)
        self.reader = reader
        self.options = options
        # "a source, or batches?": asked here and nowhere else
        self.sources: tuple[str, ...] = tuple(t for t, d in self.data.items() if is_source(d))
        self.plans: dict[str, SourcePlan] = {}
        self._in_memory: dict[str, list[BatchLike]] = {}
        self._checked = False

    @property
    def tasks(self) -> list[str]:
        return list(self.data)

    @property
    def in_memory(self) -> tuple[str, ...]:
        """The tasks whose data are batches already made."""
        return tuple(t for t in self.data if t not in self.sources)

    def with_reader(self, reader: DataReader) -> CalibrationSet:
        """The same data and options read by `reader` (nothing checked yet)."""
        return CalibrationSet(self.data, reader, self.options)

    def check(self) -> CalibrationSet:
        """Refuse any task's data the model cannot read, loading no model: each source opened and checked
        (`plan_source`: emptiness, modality, columns, test splits, chat templates, counts), its drawn texts
        preprocessed (`preprocess_drawn`), batches given in memory normalised (`as_batches`). Errors name the task.
        Idempotent; returns the set."""
        if self._checked:
            return self
        reader = self.reader.with_config() if self.sources else self.reader  # the model's config read once
        for task, given in self.data.items():
            if task not in self.sources:
                self._in_memory[task] = as_batches(given, task)
                continue
            with naming_task(task):
                plan = plan_source(given, self.options, reader, reader.template_dirs(task))
                preprocess_drawn(plan, self.options.calibration_batch_size)
            self.plans[task] = plan
        self._checked = True
        return self

    def load(self, batch_size: int | None = None, progress: bool = False) -> CalibrationData:
        """Every task's batches of at most `batch_size` examples (default: the options' calibration_batch_size),
        and the records of the tasks read from sources. What the check opened and preprocessed is reused."""
        self.check()
        size = self.options.calibration_batch_size if batch_size is None else batch_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ConfigError(f"batch_size must be an integer of at least 1, got {size!r}")
        batches: dict[str, list[BatchLike]] = {}
        records: dict[str, dict[str, Any]] = {}
        for task, given in self.data.items():
            if task not in self.plans:
                batches[task] = self._in_memory[task]
                continue
            with naming_task(task):
                batches[task], record = read_plan(self.plans[task], size, progress)
            if isinstance(given, (str, Path)) or hasattr(given, "__fspath__"):
                record["source"] = str(given)  # as the user named it
            records[task] = {**record, **batches_record(batches[task])}
        return CalibrationData(batches, records)


def open_calibration(data: Mapping[str, Any], *, reader: DataReader | None = None,
                     options: CalibrationOptions) -> CalibrationSet:
    """Every task's calibration data (task -> a source or batches) behind one door; nothing is read yet
    (`CalibrationSet.check`, `.load`). `reader`: what reads the sources for the model (a `DataReader`; needed
    when some task's data is a source); `options`: how they are read (`CalibrationOptions`, built from a config
    by `featcal.config.calibration_options`)."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"calibration data must map task names to data, not be a {type(data).__name__}")
    if not isinstance(options, CalibrationOptions):
        raise ConfigError(f"options must be CalibrationOptions, not {type(options).__name__} "
                          "(featcal.config.calibration_options builds them from a config)")
    if reader is not None and not isinstance(reader, DataReader):
        raise ConfigError(f"reader must be a DataReader, not {type(reader).__name__}")
    return CalibrationSet(data, reader if reader is not None else DataReader(), options)
