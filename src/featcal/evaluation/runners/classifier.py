"""Sequence and image classifiers against a label column: accuracy and macro-F1 (in %).

The prediction is the argmax of the model's own head. Labels become the model's class ids through its
config's id2label (evaluation/labels.py), so a dataset that numbers its classes otherwise is translated,
or refused, never scored through the wrong map. A merge of classifiers with different label maps (its
folder holds heads/) is scored on each task through that task's head and label map (evaluation/heads.py).
"""

from __future__ import annotations

import torch
from torch import nn
from tqdm.auto import tqdm

from featcal.data.bounds import bounded_text
from featcal.evaluation.data import EvalSet
from featcal.evaluation.heads import TaskHead, apply_head, check_head_shapes, head_for, task_heads
from featcal.evaluation.labels import class_ids
from featcal.evaluation.metrics import accuracy, macro_f1
from featcal.evaluation.runners.base import Runner, Scored, length_sorted_batches


class ClassifierRunner(Runner):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._ids: dict[str, list[int]] = {}
        self.heads = task_heads(self.entry.path)  # a merge of classifiers with different label maps: one per task

    def task_head(self, task: str) -> TaskHead | None:
        """The head `task` is scored through when the model holds heads/ (refused when it has none for `task`)."""
        if self.heads is None:
            return None
        return head_for(self.heads, task, model=self.entry.name, path=self.entry.path)

    def label_config(self, task: str):
        head = self.task_head(task)
        return head.label_config(self.entry.config) if head is not None else self.entry.config

    @property
    def takes_images(self) -> bool:
        from featcal.data.preprocess import model_modality

        return model_modality(self.entry.config) == "image"

    def check(self, data: EvalSet) -> None:
        what = f"classifier {self.entry.name!r}"
        data.require(["label"], what, "name the label column with --label-column")
        if self.takes_images:
            data.require(["image"], what, "give images (an image column, or an image folder)")
        else:
            self.require_text(data, what)
        head = self.task_head(data.task)
        if head is not None:
            check_head_shapes(head, self.entry.path, model=self.entry.name)
        self._ids[data.task] = class_ids(data.labels(), data.label_names, self.label_config(data.task), task=data.task,
                                         model=self.entry.name)
        if not self.takes_images:
            self.check_token_ids(data, self._encoded(data)["input_ids"])

    @torch.no_grad()
    def score(self, model: nn.Module, data: EvalSet, *, progress: bool) -> Scored:
        gold = self._ids[data.task] if data.task in self._ids else self._checked(data)
        head = self.task_head(data.task)
        if head is not None:
            apply_head(model, head)
        predict = self._image_batches(data) if self.takes_images else self._text_batches(data)
        pred = [0] * len(data)
        for positions, inputs in tqdm(predict, desc=f"{self.entry.name}/{data.task}", disable=not progress, leave=False):
            logits = model(**{k: v.to(self.options.device) for k, v in inputs.items()}).logits
            for p, c in zip(positions, logits.argmax(-1).tolist(), strict=True):
                pred[p] = c
        details = {"head": f"{head.file.parent.name}/{head.file.name}"} if head is not None else {}
        return Scored({"accuracy": 100.0 * accuracy(pred, gold), "macro_f1": 100.0 * macro_f1(pred, gold)}, len(data),
                      details)

    def _checked(self, data: EvalSet) -> list[int]:
        self.check(data)
        return self._ids[data.task]

    def _text_batches(self, data: EvalSet):
        from featcal.data.preprocess import accepted_inputs

        accepted = accepted_inputs(self.entry.config)
        encoded = self._encoded(data)
        rows = [{k: encoded[k][i] for k in encoded.keys() if accepted is None or k in accepted} for i in range(len(data))]
        for positions in length_sorted_batches([len(r["input_ids"]) for r in rows], self.options.batch_size):
            yield positions, self.tokenizer.pad([rows[p] for p in positions], return_tensors="pt")

    def _encoded(self, data: EvalSet):
        limit = self.max_length()
        return self.tokenizer([bounded_text(self.tokenizer, t, limit) for t in data.texts()], truncation=True,
                              max_length=limit)

    def _image_batches(self, data: EvalSet):
        from featcal.data.preprocess import ImagePreprocessor

        preprocess = ImagePreprocessor(self.processor_dir, self.entry.config)
        for start in range(0, len(data), self.options.batch_size):
            positions = list(range(start, min(start + self.options.batch_size, len(data))))
            yield positions, preprocess([e.image for e in data.examples(positions, "image")])
