"""CLIP ViT settings: merge and calibrate the vision towers, evaluate them with zero-shot heads.

The hub's CLIP experts are CLIPVisionModel checkpoints (saved by transformers 4, `vision_model.`
prefix) fine-tuned from the base CLIPModel's vision tower, with the text tower frozen. So the
merge and FeatCal act on vision towers only, and every stage is evaluated with the same heads:
the base's text tower, projection and temperature.
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from featcal.errors import CalibrationDataError, CheckpointError
from featcal.evaluation.zero_shot import (
    ZeroShotClassifier,
    build_text_head,
    evaluate_zero_shot,
    image_batches,
)
from featcal.experiments.reproduce.pipeline import Pipeline, calibration_indices, eval_indices
from featcal.experiments.reproduce.settings import TaskSpec
from featcal.experiments.task_data.templates import clip_prompts
from featcal.io.read.checkpoint import CheckpointReader
from featcal.merging.writer import save_state_dict


def load_vision_tower(path: str | Path) -> nn.Module:
    """A CLIPVisionModel from a CLIPModel checkpoint or a CLIPVisionModel one (4.x or 5.x key layout).

    transformers 5 maps both the CLIPModel's `vision_model.*` keys and the 4.x CLIPVisionModel
    layout (the hub experts) onto its flat CLIPVisionModel; anything else is refused by name.
    The result is always keyed in the 5.x layout.
    """
    import transformers as T

    path = Path(path)
    reader = CheckpointReader(path)  # refuses pickles, names missing shards
    model_type = reader.config.get("model_type")
    if model_type not in ("clip", "clip_vision_model"):
        raise CheckpointError(f"{path}: expected a CLIP or CLIP vision checkpoint, found model_type {model_type!r}")
    verbosity = T.logging.get_verbosity()
    if model_type == "clip":
        T.logging.set_verbosity_error()  # the text tower's keys are expected to be left out: no load report
    try:
        model = T.CLIPVisionModel.from_pretrained(path, use_safetensors=True, trust_remote_code=False,
                                                  dtype=torch.float32)
    except Exception as exc:
        raise CheckpointError(f"cannot load {path} as CLIPVisionModel: {exc}") from None
    finally:
        T.logging.set_verbosity(verbosity)
    # A fresh model remembers no load-time key conversion, so every tower (base from a CLIPModel,
    # 4.x or 5.x expert) saves and merges under the same 5.x names.
    fresh = T.CLIPVisionModel(model.config)
    fresh.load_state_dict(model.state_dict())
    return fresh.eval()


class ClipPipeline(Pipeline):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._tower_dir: Path | None = None
        self._tower_model: nn.Module | None = None

    def required_columns(self, task: TaskSpec) -> tuple[str, ...]:
        return ("image", "label")

    def preflight(self) -> dict[str, Any]:
        """The generic checks, plus: each split's label count matches the task's class names."""
        summary = super().preflight()
        for task in self.setting.tasks:
            classnames, _ = clip_prompts(task.name)
            for which in ("calibration", "eval"):
                n_labels = _label_count(self.split(task, which))
                if n_labels is not None and n_labels != len(classnames):
                    raise CalibrationDataError(
                        f"task {task.name}: dataset {task.data.label} has {n_labels} classes, the zero-shot "
                        f"head {len(classnames)} class names"
                    )
        return summary

    # ----------------------------------------------------------------- models
    @cached_property
    def base_clip(self) -> nn.Module:
        import transformers as T

        model = T.CLIPModel.from_pretrained(self.base_dir, use_safetensors=True, trust_remote_code=False,
                                            dtype=torch.float32)
        return model.eval()

    @cached_property
    def processor(self) -> Any:
        import transformers as T

        return T.CLIPProcessor.from_pretrained(self.base_dir, trust_remote_code=False)

    @cached_property
    def base_vision(self) -> nn.Module:
        return load_vision_tower(self.base_dir)

    def write_merged(self, tmp: Path) -> None:
        from featcal.merging.api import merge

        # The base checkpoint is a whole CLIPModel: its vision tower, in memory, is what is merged.
        experts = {t: load_vision_tower(d) for t, d in self.expert_dirs().items()}
        state = merge(self.base_vision, experts, method="task_arithmetic", scaling=self.scaling)
        save_state_dict(dict(state), tmp)
        self.base_vision.config.architectures = ["CLIPVisionModel"]
        self.base_vision.config.save_pretrained(tmp)
        self.processor.save_pretrained(tmp)

    def load_stage(self, stage_dir: Path) -> nn.Module:
        return load_vision_tower(stage_dir)

    def save_stage(self, model: nn.Module, tmp: Path) -> None:
        model.save_pretrained(tmp)
        self.processor.save_pretrained(tmp)

    def calibration_base(self) -> Any:
        return self.base_vision  # the base's tower, already loaded: a CLIPModel checkpoint has other keys too

    # ----------------------------------------------------------------- data
    def calibration_batches(self, task: TaskSpec) -> list[dict[str, Any]]:
        data = self.split(task, "calibration")
        indices = calibration_indices(len(data), self.opts.num_calibration_examples, self.opts.seed,
                                      f"task {task.name}: {task.data.label}")
        batches = image_batches(data, self.processor.image_processor, indices, self.opts.calibration_batch_size,
                                label_column=None)
        return [{"pixel_values": pixels} for pixels, _ in batches]

    # ----------------------------------------------------------------- evaluation
    def head(self, task: TaskSpec) -> torch.Tensor:
        """The task's zero-shot head, built once from the base text tower and kept in DIR/heads."""
        path = self.rundir.path / "heads" / f"{task.name}.safetensors"
        if path.is_file():
            return load_file(path)["head"]
        classnames, templates = clip_prompts(task.name)
        head = build_text_head(self.base_clip, self.processor.tokenizer, classnames, templates, device=self.device)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        save_file({"head": head.contiguous()}, str(tmp))
        tmp.replace(path)
        return head

    def _tower(self, stage_dir: Path) -> nn.Module:
        """The vision tower of a stage; one stage's tower is kept in memory at a time."""
        if self._tower_model is None or self._tower_dir != stage_dir:
            self._tower_model = self.load_stage(stage_dir)
            self._tower_dir = stage_dir
        return self._tower_model

    def evaluate_task(self, stage: str, stage_dir: Path, task: TaskSpec) -> dict[str, Any]:
        data = self.split(task, "eval")
        classifier = ZeroShotClassifier.from_clip(self.base_clip, self.head(task), vision_model=self._tower(stage_dir))
        indices = eval_indices(len(data), self.opts.max_eval_samples, self.opts.seed)
        return evaluate_zero_shot(classifier, data.select(indices), self.processor.image_processor,
                                  batch_size=self.opts.batch_size, device=self.device, desc=f"{stage}/{task.name}")


def _label_count(dataset: Any) -> int | None:
    feature = dataset.features.get("label")
    return len(feature.names) if getattr(feature, "names", None) else None
