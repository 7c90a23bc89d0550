"""Image-text models (CLIP, ...) and bare vision towers on labelled images: zero-shot accuracy (in %).

The classes are the task's class names (a ClassLabel feature, class sub-folders, or labels given as
names), each embedded by the text tower through every --template and averaged (zero_shot.build_text_head).
A whole image-text model is read with its own text tower; a bare vision tower (what featcal merges and
calibrates when the experts fine-tuned only the vision side) with the text tower, projection and
temperature of the image-text model given as --base, as the paper's CLIP evaluation does.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from featcal.errors import ConfigError, EvaluationDataError
from featcal.evaluation.data import EvalSet
from featcal.evaluation.metrics import accuracy
from featcal.evaluation.runners.base import ModelEntry, Runner, Scored
from featcal.evaluation.zero_shot import ZeroShotClassifier, as_tensor, build_text_head


class ZeroShotRunner(Runner):
    def __init__(self, entry: ModelEntry, options, *, text_model: ModelEntry | None = None) -> None:
        """`text_model`: the image-text model whose text tower scores a bare vision tower (the --base)."""
        super().__init__(entry, options)
        self.own_text = _has_text_tower(entry.kind.model_class)
        if not self.own_text and text_model is None:
            raise ConfigError(f"model {entry.name!r} is a vision tower with no text tower: pass --base, the "
                              "image-text model (e.g. CLIP) it was fine-tuned from, whose text tower scores it")
        self.text_entry = entry if self.own_text else text_model
        self._text_model: nn.Module | None = None
        self._heads: dict[str, torch.Tensor] = {}

    @property
    def processor_dir(self) -> Path:
        """A vision tower saved without an image processor is preprocessed by the processor of the image-text
        model it is read through (as calibration preprocesses it with the base's); --processor overrides."""
        from featcal.data.preprocess import has_processor_files

        if has_processor_files(self.entry.path, "image") or self.options.processor is not None:
            return super().processor_dir
        if has_processor_files(self.text_entry.path, "image"):
            return self.text_entry.path
        return super().processor_dir

    def check(self, data: EvalSet) -> None:
        what = f"zero-shot model {self.entry.name!r}"
        data.require(["image"], what, "give images (an image column, or an image folder)")
        data.require(["label"], what, "name the label column with --label-column")
        self.class_ids(data)

    def class_ids(self, data: EvalSet) -> tuple[tuple[str, ...], list[int]]:
        """(class names in id order, each example's class id)."""
        labels = data.labels()
        if all(isinstance(v, str) for v in labels):
            names = data.label_names or tuple(sorted(set(labels)))
            index = {n: i for i, n in enumerate(names)}
            return names, [index[v] for v in labels]
        if data.label_names is None:
            raise EvaluationDataError(
                f"task {data.task!r}: zero-shot classification needs class names, and the labels of {data.path} are "
                "bare ids: give the labels as class names, or a dataset whose label column is a ClassLabel"
            )
        n = len(data.label_names)
        bad = sorted({v for v in labels if not (isinstance(v, int) and 0 <= v < n)})
        if bad:
            raise EvaluationDataError(f"task {data.task!r}: label ids {bad[:5]} are outside its {n} class names")
        return data.label_names, list(labels)

    def head(self, data: EvalSet) -> torch.Tensor:
        if data.task not in self._heads:
            names, _ = self.class_ids(data)
            self._heads[data.task] = build_text_head(self.text_model(), self._text_tokenizer(), names,
                                                     self.options.templates, device=self.options.device)
        return self._heads[data.task]

    def text_model(self) -> nn.Module:
        if self._text_model is None:
            from featcal.io.read.models import load_model

            self._text_model = load_model(self.text_entry.path, model_class=self.text_entry.kind.model_class,
                                          allow_pickle=self.options.allow_pickle).to(self.options.device).eval()
        return self._text_model

    def _text_tokenizer(self):
        from transformers import AutoTokenizer

        from featcal.data.preprocess import has_processor_files

        folder = self.text_entry.path if has_processor_files(self.text_entry.path, "text") else self.options.processor
        if folder is None:
            raise ConfigError(f"model {self.text_entry.name!r} ({self.text_entry.path}) was saved without its "
                              "tokenizer, which builds the zero-shot heads: pass --processor DIR")
        return AutoTokenizer.from_pretrained(Path(folder), trust_remote_code=False)

    @torch.no_grad()
    def score(self, model: nn.Module, data: EvalSet, *, progress: bool) -> Scored:
        from featcal.data.preprocess import ImagePreprocessor

        _, gold = self.class_ids(data)
        head = self.head(data)
        preprocess = ImagePreprocessor(self.processor_dir, self.entry.config)
        if self.own_text:
            classify = lambda pixels: F.normalize(as_tensor(model.get_image_features(pixel_values=pixels)).float(),  # noqa: E731
                                                  dim=-1) @ head.to(pixels.device).T
        elif hasattr(self.text_model(), "visual_projection") and hasattr(self.text_model(), "logit_scale"):
            classify = ZeroShotClassifier.from_clip(self.text_model(), head, vision_model=model)
        else:
            raise ConfigError(f"model {self.text_entry.name!r} ({type(self.text_model()).__name__}) has no CLIP-style "
                              f"visual projection to read vision tower {self.entry.name!r} through")
        pred: list[int] = []
        starts = range(0, len(data), self.options.batch_size)
        for start in tqdm(starts, desc=f"{self.entry.name}/{data.task}", disable=not progress, leave=False):
            positions = list(range(start, min(start + self.options.batch_size, len(data))))
            pixels = preprocess([e.image for e in data.examples(positions, "image")])["pixel_values"].to(self.options.device)
            pred.extend(classify(pixels).argmax(-1).tolist())
        return Scored({"accuracy": 100.0 * accuracy(pred, gold)}, len(data))


def _has_text_tower(cls: type) -> bool:
    return callable(getattr(cls, "get_text_features", None)) and callable(getattr(cls, "get_image_features", None))
