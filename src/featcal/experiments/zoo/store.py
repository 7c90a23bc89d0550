"""A built zoo on disk, and the one reader of its layout.

    DIR/zoo.json                  manifest: preset, seed, fingerprint, tasks and classes, build log
    DIR/base/                     the pretrained encoder (HF checkpoint, safetensors)
    DIR/experts/<task>/           one fine-tuned encoder per task (HF checkpoint, safetensors)
    DIR/heads/<task>.safetensors  the frozen head of each task (linear or cosine), shared by every model
    DIR/data/<task>.safetensors   uint8 images (vision) or token ids and attention masks (text), and
                                  labels, of the train / calibration / test splits

The manifest's `modality` ("vision", the default for zoos built before text existed, or "text") and
`pooling` ("pooler" or "mean") say how a split becomes model inputs and what the heads read.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from featcal.blocks.heads import CosineHead, LinearHead, load_head
from featcal.errors import CheckpointError
from featcal.evaluation.features import Inputs
from featcal.experiments.zoo.train import pixel_values

MANIFEST = "zoo.json"
SPLITS = ("train", "calibration", "test")


@dataclass(frozen=True)
class LoadedZoo:
    """A zoo's models, heads and test splits in memory: where every experiment on a zoo starts."""

    base: torch.nn.Module
    experts: dict[str, torch.nn.Module]
    heads: dict[str, LinearHead | CosineHead]
    tests: dict[str, tuple[Inputs, torch.Tensor]]
    pooling: str = "pooler"

    def mean_accuracy(self, model: torch.nn.Module, tasks: Iterable[str] | None = None) -> float:
        """`model`'s test accuracy through each task's head, averaged over `tasks` (default: all)."""
        from featcal.evaluation.classification import accuracy

        names = list(self.tests if tasks is None else tasks)
        return sum(accuracy(model, self.heads[t], *self.tests[t], pooling=self.pooling) for t in names) / len(names)


@dataclass(frozen=True)
class Zoo:
    root: Path
    manifest: dict

    @classmethod
    def open(cls, root: str | os.PathLike) -> Zoo:
        root = Path(root)
        path = root / MANIFEST
        if not path.exists():
            raise CheckpointError(f"{root} is not a built zoo (no {MANIFEST}); run `featcal zoo build --out {root}`")
        manifest = json.loads(path.read_text())
        zoo = cls(root, manifest)
        for task in zoo.tasks:
            for p in (zoo.expert_dir(task), zoo.root / "heads" / f"{task}.safetensors", zoo.root / "data" / f"{task}.safetensors"):
                if not p.exists():
                    raise CheckpointError(f"zoo {root} is incomplete: {p.relative_to(root)} is missing for task {task!r}")
        return zoo

    @property
    def tasks(self) -> list[str]:
        return list(self.manifest["tasks"])

    @property
    def modality(self) -> str:
        return self.manifest.get("modality", "vision")

    @property
    def pooling(self) -> str:
        return self.manifest.get("pooling", "pooler")

    @property
    def base_dir(self) -> Path:
        return self.root / "base"

    def expert_dir(self, task: str) -> Path:
        return self.root / "experts" / task

    @property
    def expert_dirs(self) -> dict[str, Path]:
        return {t: self.expert_dir(t) for t in self.tasks}

    def head(self, task: str) -> LinearHead | CosineHead:
        return load_head(self.root / "heads" / f"{task}.safetensors")

    def heads(self) -> dict[str, LinearHead | CosineHead]:
        return {t: self.head(t) for t in self.tasks}

    def test_splits(self) -> dict[str, tuple[Inputs, torch.Tensor]]:
        return {t: self.split(t, "test") for t in self.tasks}

    def split_size(self, task: str, split: str) -> int:
        return int(self.manifest["tasks"][task]["sizes"][split])

    def split(self, task: str, split: str, limit: int | None = None) -> tuple[Inputs, torch.Tensor]:
        """(inputs, labels) of one split: pixel_values, or a dict of text tensors; `limit` keeps its
        first examples (a fixed subset)."""
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; one of {SPLITS}")
        with safe_open(str(self.root / "data" / f"{task}.safetensors"), framework="pt") as f:
            y = f.get_tensor(f"{split}_labels")
            if self.modality == "text":
                prefix = f"{split}_"
                x: Inputs = {k[len(prefix):]: f.get_tensor(k).long() for k in f.keys()
                             if k.startswith(prefix) and k != f"{split}_labels"}
            else:
                x = f.get_tensor(f"{split}_images")
        if limit is not None:
            y = y[:limit]
            x = {k: v[:limit] for k, v in x.items()} if isinstance(x, dict) else x[:limit]
        return (x, y) if isinstance(x, dict) else (self.pixels(x), y)

    def pixels(self, images: torch.Tensor) -> torch.Tensor:
        """Stored uint8 images as model inputs: [-1, 1] (the project's CLIP zoos) or, where the manifest
        says `pixel_normalisation: imagenet` (the DINOv2 zoo), ImageNet's mean and std."""
        if self.manifest.get("pixel_normalisation") == "imagenet":
            from featcal.experiments.zoo.vision_tasks import imagenet_pixels

            return imagenet_pixels(images)
        return pixel_values(images)

    def load(self, experts: bool = True) -> LoadedZoo:
        """Base, experts (unless `experts=False`), heads and test splits, loaded."""
        from featcal.io.read.models import load_model

        return LoadedZoo(
            base=load_model(self.base_dir),
            experts={t: load_model(self.expert_dir(t)) for t in self.tasks} if experts else {},
            heads=self.heads(),
            tests=self.test_splits(),
            pooling=self.pooling,
        )
