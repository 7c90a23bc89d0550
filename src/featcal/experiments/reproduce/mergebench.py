"""MergeBench (Llama): merge the five domain experts, calibrate on the `_val` sets, hand off to lm-eval.

MergeBench scores its models with lm-eval-harness (plus bigcode / safety-eval harnesses), which
featcal does not embed: this pipeline writes the merged and calibrated checkpoints and the exact
lm-eval commands that score them. Calibration texts are the `_val` examples in MergeBench's own
fine-tuning format (an Alpaca-style instruction / input / response prompt).
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import Any

from torch import nn

from featcal.errors import CalibrationDataError
from featcal.evaluation.lm_eval import lm_eval_command
from featcal.experiments.reproduce.pipeline import Pipeline, calibration_indices, merge_paths
from featcal.experiments.reproduce.settings import TaskSpec
from featcal.io.read.checkpoint import copy_side_files
from featcal.io.read.models import load_model

# (instruction column, input column or None, response column) of each MergeBench `_val` set
MERGEBENCH_COLUMNS: dict[str, tuple[str, str | None, str]] = {
    "instruction": ("instruction", "input", "output"),
    "math": ("query", None, "response"),
    "coding": ("instruction", None, "response"),
    "multilingual": ("inputs", None, "targets"),
    "safety": ("prompt", None, "response"),
}

_HEADER = ("Below is an instruction that describes a task, paired with an input that provides further context. "
           "Write a response that appropriately completes the request.")


def sft_text(instruction: str, response: str, context: str = "") -> str:
    """One example in MergeBench's fine-tuning layout (what the experts saw)."""
    parts = [_HEADER, f"### Instruction:\n{instruction}"]
    if context:
        parts.append(f"### Input:\n{context}")
    parts.append(f"### Response:\n{response}")
    return "\n\n".join(parts)


class MergeBenchPipeline(Pipeline):
    def required_columns(self, task: TaskSpec) -> tuple[str, ...]:
        if task.name not in MERGEBENCH_COLUMNS:
            raise CalibrationDataError(f"no MergeBench text layout for task {task.name!r}")
        instruction, context, response = MERGEBENCH_COLUMNS[task.name]
        return (instruction, response)  # the input column is optional

    @cached_property
    def tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(self.side_files_dir, trust_remote_code=False)
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token  # padding is masked out; Llama ships without a pad token
        tok.padding_side = "right"  # real tokens keep positions 0..n-1, as in unpadded fine-tuning
        return tok

    def write_merged(self, tmp: Path) -> None:
        merge_paths(self.base_dir, self.expert_dirs(), self.scaling, tmp)

    def load_stage(self, stage_dir: Path) -> nn.Module:
        return load_model(stage_dir)

    @property
    def side_files_dir(self) -> Path:
        """Where the tokenizer comes from: the merged stage (an expert's, when their vocabulary grew), else the base."""
        merged = self.rundir.stage_dir("merged")
        return merged if self.rundir.has_stage("merged") else self.base_dir

    def save_stage(self, model: nn.Module, tmp: Path) -> None:
        copy_side_files(self.side_files_dir, tmp)
        model.save_pretrained(tmp)

    def calibration_batches(self, task: TaskSpec) -> list[dict[str, Any]]:
        data = self.split(task, "calibration")
        indices = calibration_indices(len(data), self.opts.num_calibration_examples, self.opts.seed,
                                      f"task {task.name}: {task.data.label}")
        instruction, context, response = MERGEBENCH_COLUMNS[task.name]
        rows = data[indices]
        has_context = context is not None and context in data.column_names
        texts = [
            sft_text(str(rows[instruction][i]), str(rows[response][i]), str(rows[context][i] or "") if has_context else "")
            for i in range(len(indices))
        ]
        batches = []
        size = self.opts.calibration_batch_size
        for start in range(0, len(texts), size):
            enc = self.tokenizer(texts[start : start + size], padding=True, truncation=True,
                                 max_length=self.opts.max_length, return_tensors="pt")
            batches.append({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]})
        return batches

    def evaluate(self, stages: dict[str, Path]) -> dict[str, dict[str, dict[str, Any]]]:
        return {}  # scored outside featcal: the commands are in metrics.json

    def extra_outputs(self, stages: dict[str, Path]) -> dict[str, Any]:
        tasks = self.setting.lm_eval_tasks
        return {
            "evaluate_with": {
                stage: lm_eval_command(path.resolve(), tasks, (self.rundir.path / "lm_eval" / stage).resolve())
                for stage, path in stages.items()
            },
            "lm_eval_tasks": list(tasks),
            "note": "MergeBench also scores coding (humaneval+/mbpp+) with bigcode-evaluation-harness and safety "
                    "with safety-eval; the paper's averages are over MergeBench's full protocol.",
        }
