"""What every reproduce pipeline shares: data checks, seeded draws, the merge and calibrate stages.

A family (CLIP, FLAN-T5 GLUE, MergeBench) subclasses Pipeline and says how to load its models,
how to turn its datasets into calibration batches, and how to evaluate a stage's checkpoint.
The order is always: preflight (open every split, check columns and sizes) -> merged -> featcal
-> evaluate; each stage is skipped when the run directory already holds it.
"""

from __future__ import annotations

import logging
import random
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

from torch import nn

from featcal.errors import CalibrationDataError, CheckpointError
from featcal.experiments.reproduce.options import ReproduceOptions
from featcal.experiments.reproduce.resolve import Resolved, load_split, local_dir
from featcal.experiments.reproduce.rundir import RunDir
from featcal.experiments.reproduce.settings import Setting, TaskSpec
from featcal.io.read.checkpoint import CheckpointReader
from featcal.io.write.report import Timer, build_report, write_report

log = logging.getLogger(__name__)


def calibration_indices(n_rows: int, num: int, seed: int, what: str) -> list[int]:
    """`num` distinct rows drawn with `seed` (the same draw as `featcal calibrate`)."""
    from featcal.data.calibration import sample_indices

    if n_rows < num:
        raise CalibrationDataError(
            f"{what} has {n_rows} rows, fewer than --num-calibration-examples {num}"
        )
    return sample_indices(n_rows, num, seed)


def eval_indices(n_rows: int, max_samples: int | None, seed: int) -> list[int]:
    """All rows, or a seeded subset of `max_samples` (sorted; the same for every model compared).

    A subset is drawn rather than the first rows, since hub test splits are often sorted by label.
    """
    if max_samples is None or max_samples >= n_rows:
        return list(range(n_rows))
    return sorted(random.Random(seed).sample(range(n_rows), max_samples))


class Pipeline(ABC):
    """Shared driver; subclasses implement the family-specific hooks below."""

    def __init__(self, setting: Setting, resolved: Resolved, rundir: RunDir, opts: ReproduceOptions) -> None:
        self.setting = setting
        self.resolved = resolved
        self.rundir = rundir
        self.opts = opts
        self.device = opts.torch_device()
        self.scaling = opts.scaling if opts.scaling is not None else setting.scaling
        self.timings: dict[str, float | str] = {}  # seconds per stage, or "reused"
        self._splits: dict[tuple[str, str], Any] = {}

    # ----------------------------------------------------------------- data
    def split(self, task: TaskSpec, which: str) -> Any:
        name = task.data.calibration_split if which == "calibration" else task.data.eval_split
        if name is None:
            raise CalibrationDataError(f"task {task.name}: dataset {task.data.label} has no {which} split here")
        key = (task.name, name)
        if key not in self._splits:
            self._splits[key] = load_split(self.resolved, task.data, name)
        return self._splits[key]

    @abstractmethod
    def required_columns(self, task: TaskSpec) -> tuple[str, ...]:
        """Columns every split of `task` must have."""

    def _check_columns(self, task: TaskSpec, split: str, data: Any) -> None:
        missing = [c for c in self.required_columns(task) if c not in data.column_names]
        if missing:
            raise CalibrationDataError(
                f"task {task.name}: dataset {task.data.label} split {split!r} lacks column(s) {missing} "
                f"(has {data.column_names})"
            )

    def preflight(self) -> dict[str, Any]:
        """Open every split the run reads and check its columns and size, and every checkpoint's
        headers, before any model is loaded (hub ids not yet cached are downloaded here)."""
        summary: dict[str, Any] = {}
        for task in self.setting.tasks:
            calib = self.split(task, "calibration")
            self._check_columns(task, task.data.calibration_split, calib)
            calibration_indices(len(calib), self.opts.num_calibration_examples, self.opts.seed,
                                f"task {task.name}: {task.data.label} split {task.data.calibration_split!r}")
            entry = {"calibration_rows": len(calib)}
            if task.data.eval_split is not None:
                ev = self.split(task, "eval")
                self._check_columns(task, task.data.eval_split, ev)
                entry["eval_rows"] = len(ev)
                entry["eval_examples"] = len(eval_indices(len(ev), self.opts.max_eval_samples, self.opts.seed))
            summary[task.name] = entry
        for model_id in self.setting.model_ids():  # headers only: weights present, safetensors, readable
            try:
                CheckpointReader(self.model_dir(model_id))
            except CheckpointError as exc:
                raise CheckpointError(f"{model_id}: {exc}") from None
        return summary

    # ----------------------------------------------------------------- models
    def model_dir(self, model_id: str) -> Path:
        return local_dir(self.resolved, model_id)

    @property
    def base_dir(self) -> Path:
        return self.model_dir(self.setting.base_id)

    def expert_dirs(self) -> dict[str, Path]:
        return {t.name: self.model_dir(t.expert_id) for t in self.setting.tasks}

    # ----------------------------------------------------------------- hooks
    @abstractmethod
    def write_merged(self, tmp: Path) -> None:
        """Write the Task Arithmetic checkpoint into the (empty, temporary) stage directory."""

    @abstractmethod
    def load_stage(self, stage_dir: Path) -> nn.Module:
        """The model a stage directory holds, as calibrated / evaluated."""

    @abstractmethod
    def calibration_batches(self, task: TaskSpec) -> list[dict[str, Any]]:
        """The task's seeded calibration draw, as keyword-input batches."""

    def calibration_base(self) -> Any:
        """What `calibrate` gets as `base` (a path by default: read lazily)."""
        return str(self.base_dir)

    def calibration_experts(self) -> dict[str, Any]:
        return {t: str(d) for t, d in self.expert_dirs().items()}

    @abstractmethod
    def save_stage(self, model: nn.Module, tmp: Path) -> None:
        """Save a calibrated model (with its tokenizer / processor files) into the stage directory."""

    def evaluate_task(self, stage: str, stage_dir: Path, task: TaskSpec) -> dict[str, Any]:
        """One stage on one task; families scored outside featcal override `evaluate` instead."""
        raise NotImplementedError(f"{type(self).__name__} does not evaluate inside featcal")

    def eval_key(self) -> dict[str, Any]:
        return {"max_eval_samples": self.opts.max_eval_samples, "seed": self.opts.seed, "max_length": self.opts.max_length}

    # ----------------------------------------------------------------- stages
    def merged(self) -> Path:
        timer = Timer()
        path, reused = self.rundir.stage("merged", self._write_merged_with_report)
        self.timings["merge"] = "reused" if reused else round(timer.seconds, 3)
        log.info("%s merged checkpoint: %s", "reusing" if reused else "wrote", path)
        return path

    def _write_merged_with_report(self, tmp: Path) -> None:
        timer = Timer()
        self.write_merged(tmp)
        write_report(tmp, build_report("reproduce:merge", {
            "setting": self.setting.name, "method": "task_arithmetic", "scaling": self.scaling,
            "base": self.setting.base_id, "experts": {t.name: t.expert_id for t in self.setting.tasks},
        }, seconds=round(timer.seconds, 3)))

    def calibrated(self, merged_dir: Path) -> Path:
        timer = Timer()
        path, reused = self.rundir.stage("featcal", lambda tmp: self._write_calibrated(merged_dir, tmp))
        self.timings["featcal"] = "reused" if reused else round(timer.seconds, 3)
        log.info("%s calibrated checkpoint: %s", "reusing" if reused else "wrote", path)
        return path

    def _write_calibrated(self, merged_dir: Path, tmp: Path) -> None:
        from featcal.calibration.front.api import calibrate

        data_timer = Timer()
        calibration = {t.name: self.calibration_batches(t) for t in self.setting.tasks}
        data_seconds = data_timer.seconds
        merged_model = self.load_stage(merged_dir)
        config = self.opts.featcal_config()
        timer = Timer()
        result = calibrate(
            merged_model, base=self.calibration_base(), experts=self.calibration_experts(),
            calibration=calibration, config=config,
        )
        seconds = timer.seconds
        self.save_stage(result.model, tmp)
        write_report(tmp, build_report("reproduce:featcal", {
            "setting": self.setting.name, **config.model_dump(mode="json"),
        }, seconds={"calibration_data": round(data_seconds, 3), "calibrate": round(seconds, 3)},
            drift=result.drift_records()))

    def evaluate(self, stages: dict[str, Path]) -> dict[str, dict[str, dict[str, Any]]]:
        """Every stage on every task; each result is stored, and reused by a rerun with the same key."""
        results: dict[str, dict[str, dict[str, Any]]] = {}
        key = self.eval_key()
        for stage, stage_dir in stages.items():
            results[stage] = {}
            for task in self.setting.tasks:
                cached = self.rundir.cached_eval(stage, task.name, key)
                if cached is None:
                    timer = Timer()
                    cached = self.evaluate_task(stage, stage_dir, task)
                    cached["seconds"] = round(timer.seconds, 3)
                    self.rundir.store_eval(stage, task.name, key, cached)
                results[stage][task.name] = cached
        return results

    def extra_outputs(self, stages: dict[str, Path]) -> dict[str, Any]:
        """Anything the family adds to metrics.json (MergeBench: the lm-eval commands)."""
        return {}


def merge_paths(base_dir: Path, expert_dirs: dict[str, Path], scaling: float, tmp: Path) -> None:
    """Task Arithmetic of checkpoints on disk (streamed tensor by tensor) into the stage dir `tmp`."""
    from featcal.io.read.checkpoint import copy_side_files
    from featcal.io.read.vocab import plan_for_checkpoints
    from featcal.merging.api import merge
    from featcal.merging.writer import save_state_dict

    state = merge(str(base_dir), {t: str(d) for t, d in expert_dirs.items()}, "task_arithmetic", scaling=scaling)
    copy_side_files(base_dir, tmp)
    save_state_dict(dict(state), tmp)
    vocab = plan_for_checkpoints(base_dir, expert_dirs)  # experts with more vocabulary rows (MergeBench's Llamas)
    if vocab is not None:
        vocab.write(tmp)  # config vocab_size and tokenizer as the grown rows need
