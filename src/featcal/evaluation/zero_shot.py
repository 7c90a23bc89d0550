"""CLIP zero-shot classification: text-tower heads from class names × templates, batched accuracy.

A head is built once per task from the (unmerged) text tower: every template is filled with every
class name, embedded, L2-normalised, averaged over templates and normalised again (the recipe of the
task-arithmetic benchmark). Logits are `logit_scale.exp() * normalise(image features) @ headᵀ`.
Image features come from the vision tower being evaluated (merged or calibrated) followed by the
base model's `visual_projection`, so only the vision tower differs between the compared models.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from featcal.errors import CalibrationDataError, ConfigError
from featcal.evaluation.metrics import accuracy


@torch.no_grad()
def build_text_head(
    clip_model: nn.Module,
    tokenizer: Any,
    classnames: Sequence[str],
    templates: Sequence[str],
    *,
    device: str | torch.device = "cpu",
    batch_size: int = 256,
) -> torch.Tensor:
    """Zero-shot head weights, shape (classes, projection_dim), each row unit-norm."""
    if not classnames or not templates:
        raise ConfigError("a zero-shot head needs at least one class name and one template")
    clip_model = clip_model.to(device).eval()
    # long class names (GTSRB) must be cut at the text tower's positions, whatever the tokenizer's limit
    max_length = getattr(getattr(getattr(clip_model, "config", None), "text_config", None), "max_position_embeddings", None)
    rows = []
    for name in tqdm(classnames, desc="zero-shot head", leave=False, disable=len(classnames) < 50):
        texts = [t.format(name) for t in templates]
        embs = []
        for start in range(0, len(texts), batch_size):
            tok = tokenizer(texts[start : start + batch_size], padding=True, truncation=True, max_length=max_length,
                            return_tensors="pt")
            tok = {k: v.to(device) for k, v in tok.items() if k in ("input_ids", "attention_mask")}
            embs.append(as_tensor(clip_model.get_text_features(**tok)).float())
        emb = F.normalize(torch.cat(embs), dim=-1).mean(dim=0)
        rows.append(F.normalize(emb, dim=-1))
    return torch.stack(rows).cpu()


def as_tensor(out: Any) -> torch.Tensor:
    """get_*_features return a tensor in transformers 4, and in 5 an output whose pooler_output is it."""
    if isinstance(out, torch.Tensor):
        return out
    for attr in ("pooler_output", "text_embeds", "image_embeds"):
        value = getattr(out, attr, None)
        if isinstance(value, torch.Tensor):
            return value
    raise TypeError(f"cannot read features from {type(out).__name__}")


def zero_shot_logits(image_features: torch.Tensor, head: torch.Tensor, logit_scale: float) -> torch.Tensor:
    """logit_scale * cos(image feature, class embedding) for every class (logit_scale already exp'ed)."""
    return logit_scale * F.normalize(image_features.float(), dim=-1) @ head.to(image_features.device).T


class ZeroShotClassifier(nn.Module):
    """A vision tower + the base's projection + a text head: pixel_values -> class logits."""

    def __init__(self, vision_model: nn.Module, visual_projection: nn.Module, head: torch.Tensor, logit_scale: float):
        super().__init__()
        self.vision_model = vision_model
        self.visual_projection = visual_projection
        self.register_buffer("head", head.float())
        self.logit_scale = float(logit_scale)

    @classmethod
    def from_clip(cls, clip_model: nn.Module, head: torch.Tensor, vision_model: nn.Module | None = None):
        """Use `clip_model`'s projection and temperature, and its own vision tower unless one is given."""
        scale = float(clip_model.logit_scale.detach().exp())
        return cls(vision_model or clip_model.vision_model, clip_model.visual_projection, head, scale)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        pooled = self.vision_model(pixel_values=pixel_values).pooler_output
        return zero_shot_logits(self.visual_projection(pooled), self.head, self.logit_scale)


def image_batches(
    dataset: Any,
    image_processor: Any,
    indices: Sequence[int],
    batch_size: int,
    *,
    image_column: str = "image",
    label_column: str | None = "label",
) -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
    """(pixel_values, labels) batches of the rows `indices`, preprocessed by the model's own processor."""
    for col in [image_column] + ([label_column] if label_column else []):
        if col not in dataset.column_names:
            raise CalibrationDataError(f"dataset has no column {col!r} (columns: {dataset.column_names})")
    for start in range(0, len(indices), batch_size):
        rows = dataset[list(indices[start : start + batch_size])]
        images = [img.convert("RGB") for img in rows[image_column]]
        pixels = image_processor(images=images, return_tensors="pt")["pixel_values"]
        labels = torch.as_tensor(rows[label_column]) if label_column else None
        yield pixels, labels


@torch.no_grad()
def evaluate_zero_shot(
    classifier: nn.Module,
    dataset: Any,
    image_processor: Any,
    *,
    batch_size: int = 64,
    device: str | torch.device = "cpu",
    desc: str = "eval",
) -> dict[str, float | int]:
    """Top-1 accuracy (in %) of `classifier` over every row of a labelled image dataset."""
    indices = list(range(len(dataset)))
    if not indices:
        raise CalibrationDataError(f"{desc}: the evaluation split is empty")
    classifier = classifier.to(device).eval()
    preds, gold = [], []
    n_batches = (len(indices) + batch_size - 1) // batch_size
    for pixels, labels in tqdm(image_batches(dataset, image_processor, indices, batch_size), total=n_batches, desc=desc):
        preds.append(classifier(pixels.to(device)).argmax(dim=-1).cpu())
        gold.append(labels)
    return {"accuracy": 100.0 * accuracy(torch.cat(preds), torch.cat(gold)), "n": len(indices)}
