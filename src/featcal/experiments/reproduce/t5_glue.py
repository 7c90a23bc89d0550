"""FLAN-T5 on GLUE: merge the task experts, calibrate encoder and decoder, score greedy generations.

Calibration batches are TRAIN examples as the experts saw them in fine-tuning: the task's prompt
for the encoder, the label text (shifted right) for the decoder. Evaluation is on the validation
splits (GLUE's test labels are hidden), exact match for the classification tasks and Spearman ρ
for stsb (featcal.experiments.task_data.glue).
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import Any

from torch import nn

from featcal.experiments.reproduce.pipeline import Pipeline, calibration_indices, eval_indices, merge_paths
from featcal.experiments.reproduce.settings import TaskSpec
from featcal.experiments.task_data import glue as glue_eval
from featcal.experiments.task_data.templates import glue_prompt
from featcal.io.read.checkpoint import copy_side_files
from featcal.io.read.models import load_config, load_model


class T5GluePipeline(Pipeline):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._model_dir: Path | None = None
        self._loaded: nn.Module | None = None

    def required_columns(self, task: TaskSpec) -> tuple[str, ...]:
        return (*glue_prompt(task.name).fields, "label")

    @cached_property
    def tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.base_dir, trust_remote_code=False)

    def write_merged(self, tmp: Path) -> None:
        merge_paths(self.base_dir, self.expert_dirs(), self.scaling, tmp)

    def load_stage(self, stage_dir: Path) -> nn.Module:
        return load_model(stage_dir)

    def save_stage(self, model: nn.Module, tmp: Path) -> None:
        copy_side_files(self.base_dir, tmp)  # tokenizer, generation config; save_pretrained's config wins
        model.save_pretrained(tmp)

    def calibration_batches(self, task: TaskSpec) -> list[dict[str, Any]]:
        data = self.split(task, "calibration")
        indices = calibration_indices(len(data), self.opts.num_calibration_examples, self.opts.seed,
                                      f"task {task.name}: {task.data.label}")
        start = _decoder_start(self.base_dir)
        return glue_eval.calibration_batches(task.name, data, indices, self.tokenizer,
                                             batch_size=self.opts.calibration_batch_size,
                                             decoder_start_token_id=start, max_length=self.opts.max_length)

    def _model(self, stage_dir: Path) -> nn.Module:
        """The model of a stage; one stage's model is kept in memory at a time."""
        if self._loaded is None or self._model_dir != stage_dir:
            self._loaded = self.load_stage(stage_dir)
            self._model_dir = stage_dir
        return self._loaded

    def evaluate_task(self, stage: str, stage_dir: Path, task: TaskSpec) -> dict[str, Any]:
        data = self.split(task, "eval")
        subset = data.select(eval_indices(len(data), self.opts.max_eval_samples, self.opts.seed))
        return glue_eval.evaluate_glue(self._model(stage_dir), self.tokenizer, task.name, subset,
                                       batch_size=self.opts.batch_size, device=self.device,
                                       desc=f"{stage}/{task.name}", max_length=self.opts.max_length)


def _decoder_start(model_dir: Path) -> int:
    config = load_config(model_dir)
    start = getattr(config, "decoder_start_token_id", None)
    return int(start if start is not None else config.pad_token_id)
