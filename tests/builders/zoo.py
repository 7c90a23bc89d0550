"""A micro synthetic zoo preset: two tasks, one 32-wide block, a few steps; a build takes seconds.

Holds no tests itself.
"""

from __future__ import annotations

import dataclasses

from featcal.experiments.zoo.presets import PRESETS, ModelShape, ZooPreset
from featcal.experiments.zoo.pretrain import PretrainSettings
from featcal.experiments.zoo.train import FinetuneSettings


def micro_preset(name: str = "micro", steps: int = 5, warmup: int = 2) -> ZooPreset:
    """The `tiny` preset cut down; `steps` / `warmup` for both pre-training and fine-tuning."""
    return dataclasses.replace(
        PRESETS["tiny"], name=name, tasks=("stripes", "colours"),
        model=ModelShape(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2),
        train=64, calibration=16, test=32,
        pretrain=PretrainSettings(images=200, categories=8, steps=steps, batch_size=16, lr=1e-3, warmup=warmup),
        finetune=FinetuneSettings(steps=steps, batch_size=16, lr=1e-3, warmup=warmup),
    )
