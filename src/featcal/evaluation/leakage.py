"""The leakage guard: a model is not scored on the examples it was calibrated on.

A calibrated (or data-merged) checkpoint's featcal.json lists, per calibration task, the fingerprint of
every example it read (`example_sha256`, data/fingerprint.py, made by the scheme `example_fingerprint`
names: 2, whitespace- and Unicode-normalised text, or 1 when absent, the exact text, as featcal.json files
written before it hold). Each evaluation example is fingerprinted the same way, by each scheme a record
uses; any match means the score would measure the calibration set, not held-out data. A
featcal.json written before fingerprints were recorded names only its sources: evaluating on one of those
very files is then taken as overlap (which examples, it cannot say). Overlap is refused unless
--allow-calibration-overlap, and then flagged in eval.json, the table and the log.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from featcal.data.fingerprint import LEGACY_SCHEME, SCHEMES
from featcal.errors import CalibrationOverlapError, ConfigError
from featcal.evaluation.data import EvalSet

log = logging.getLogger(__name__)

REPORT_NAME = "featcal.json"
MAX_REPORT_BYTES = 256 << 20  # a featcal.json of 8 tasks x 100k fingerprints is ~60 MiB


@dataclass(frozen=True)
class Overlap:
    """`examples` of task `task`'s `of` evaluation examples were in model `model`'s calibration data."""

    model: str
    task: str
    examples: int | None  # None: the same file as a calibration source, which examples unknown
    of: int
    calibration_tasks: tuple[str, ...]

    def describe(self) -> str:
        where = ", ".join(map(repr, self.calibration_tasks))
        if self.examples is None:
            return (f"model {self.model!r} was calibrated on examples drawn from the very file of task {self.task!r} "
                    f"(calibration task {where}; its featcal.json predates per-example fingerprints)")
        return (f"model {self.model!r} was calibrated on {self.examples} of the {self.of} examples of task "
                f"{self.task!r} (calibration task {where})")

    def record(self) -> dict[str, Any]:
        return {**asdict(self), "calibration_tasks": list(self.calibration_tasks)}


def calibration_record(model_dir: Path) -> dict[str, dict[str, Any]]:
    """featcal.json's `inputs.calibration` of a checkpoint folder: task -> what was recorded ({} if none)."""
    path = Path(model_dir) / REPORT_NAME
    if not path.is_file():
        return {}
    if path.stat().st_size > MAX_REPORT_BYTES:
        log.warning("%s is larger than %d MiB; not read for the leakage guard", path, MAX_REPORT_BYTES >> 20)
        return {}
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        log.warning("cannot read %s for the leakage guard: %s", path, exc)
        return {}
    inputs = report.get("inputs") if isinstance(report, dict) else None
    calibration = inputs.get("calibration") if isinstance(inputs, dict) else None
    return {str(t): r for t, r in calibration.items() if isinstance(r, dict)} if isinstance(calibration, dict) else {}


def overlaps(model: str, model_dir: Path, sets: Iterable[EvalSet], modality: str = "text") -> list[Overlap]:
    """Every evaluation set of `sets` that shares examples with `model`'s calibration data (`modality`: what
    the model reads, "text" or "image", the part of each example that is compared)."""
    recorded = calibration_record(model_dir)
    if not recorded:
        return []
    by_hash: dict[int, dict[str, set[str]]] = {}  # fingerprint scheme -> fingerprint -> calibration tasks
    unfingerprinted: dict[Path, str] = {}
    for task, rec in recorded.items():
        hashes = rec.get("example_sha256")
        if isinstance(hashes, list):
            scheme = _scheme(rec.get("example_fingerprint"), model_dir, task)
            for h in hashes:
                by_hash.setdefault(scheme, {}).setdefault(str(h), set()).add(task)
        elif isinstance(rec.get("source"), str):
            unfingerprinted[_resolved(rec["source"])] = task
    found = []
    for data in sets:
        if by_hash:
            hits = _hits(data, modality, by_hash)
            if hits:
                tasks = tuple(sorted(set().union(*hits)))
                found.append(Overlap(model, data.task, len(hits), len(data), tasks))
                continue
        same_file = unfingerprinted.get(_resolved(str(data.path)))
        if same_file is not None:
            found.append(Overlap(model, data.task, None, len(data), (same_file,)))
    return found


def _hits(data: EvalSet, modality: str, by_hash: Mapping[int, Mapping[str, set[str]]]) -> list[set[str]]:
    """For each evaluation example found in the calibration records (by any scheme they use), its tasks."""
    columns = [[known.get(h, set()) for h in data.fingerprints(modality, scheme)]
               for scheme, known in sorted(by_hash.items())]
    return [tasks for tasks in (set().union(*row) for row in zip(*columns, strict=True)) if tasks]


def _scheme(value: Any, model_dir: Path, task: str) -> int:
    """The fingerprint scheme a task's record names (absent: scheme 1, featcal.json written before it was
    recorded); one this featcal does not know is refused, not compared by another."""
    if value is None:
        return LEGACY_SCHEME
    if isinstance(value, bool) or value not in SCHEMES:
        raise ConfigError(f"{Path(model_dir) / REPORT_NAME}: calibration task {task!r} has example_fingerprint "
                          f"{value!r}, a scheme this featcal does not know ({', '.join(map(str, SCHEMES))}); "
                          "evaluate it with the featcal that calibrated it")
    return int(value)


def _resolved(path: str) -> Path:
    try:
        return Path(path).expanduser().resolve()
    except (OSError, RuntimeError):
        return Path(path)


def guard(found: list[Overlap], allowed: bool) -> None:
    """Refuse any overlap, or, when allowed, say so loudly (eval.json and the table flag it too)."""
    if not found:
        return
    if not allowed:
        first = found[0].describe()
        more = f" (and {len(found) - 1} more model/task pair(s))" if len(found) > 1 else ""
        raise CalibrationOverlapError(
            f"{first}{more}: its score there would measure the calibration set, not held-out data. Evaluate on "
            "examples it was not calibrated on, or pass --allow-calibration-overlap to score anyway (flagged)"
        )
    for item in found:
        log.warning("CALIBRATION OVERLAP: %s; scored anyway (--allow-calibration-overlap), flagged in eval.json",
                    item.describe())


def flagged(found: Iterable[Overlap]) -> Mapping[tuple[str, str], Overlap]:
    """(model, task) -> its overlap, for the table's marks."""
    return {(o.model, o.task): o for o in found}
