"""Zoo presets: model, split sizes and training budgets.

Vision (`tiny` for tests, `default`): a CLIPVisionModel pretrained here on procedural images. Text
(`text-tiny` for tests, `text`, the demo): the real all-MiniLM-L6-v2 on 8 real text tasks. Vision on real
weights (`vision-real-tiny`, `vision-real`): the real DINOv2-small on 8 real image tasks (vision_presets.py).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import ClassVar

from featcal.errors import ConfigError
from featcal.experiments.zoo.pretrain import PretrainSettings
from featcal.experiments.zoo.tasks import TASKS
from featcal.experiments.zoo.train import FinetuneSettings
from featcal.experiments.zoo.vision_presets import VISION_REAL_PRESETS, VisionRealPreset

ZOO_FORMAT = 3  # bump when the build changes what a preset produces, so stale caches are rebuilt
PRETRAIN_FORMAT = 1  # bump when pretraining changes (keys the cache of pretrained bases)


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    image_size: int = 32
    patch_size: int = 8

    def config(self):
        import transformers

        return transformers.CLIPVisionConfig(**asdict(self), num_channels=3)


@dataclass(frozen=True)
class ZooPreset:
    modality: ClassVar[str] = "vision"  # class-level: not part of the fingerprint of existing caches
    pooling: ClassVar[str] = "pooler"
    name: str
    model: ModelShape
    tasks: tuple[str, ...]
    train: int  # labelled training images per task (experts and probes)
    calibration: int  # unlabelled calibration pool per task (disjoint from train and test)
    test: int
    pretrain: PretrainSettings
    finetune: FinetuneSettings
    probe_c: float = 1.0
    # labelled examples per class the frozen head is fitted on (None: the whole training split). CLIP's
    # zero-shot heads do about as well as a 4-shot linear probe (Radford et al. 2021, fig. 6), so a
    # few-shot probe gives the base the paper's weak-head regime; experts still train on everything.
    probe_shots: int | None = None
    regime_scaling: float = 0.3  # Task Arithmetic scaling checked in the build log
    notes: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        # refused here, when the preset is made, not after minutes of pretraining when the heads are fitted
        if self.probe_shots is not None and self.probe_shots < 1:
            raise ConfigError(f"preset {self.name}: probe_shots must be at least 1, got {self.probe_shots}")

    def pretrain_fingerprint(self, seed: int) -> str:
        """Identifies the pretrained base alone (shared by presets that differ only downstream)."""
        blob = json.dumps({"format": PRETRAIN_FORMAT, "seed": seed, "model": asdict(self.model),
                           "pretrain": asdict(self.pretrain)}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def fingerprint(self, seed: int) -> str:
        blob = json.dumps({"format": ZOO_FORMAT, "seed": seed, **asdict(self)}, sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class TextZooPreset:
    """A zoo on the real all-MiniLM-L6-v2 (mean pooling) and real text tasks (featcal.experiments.zoo.text_tasks)."""

    modality: ClassVar[str] = "text"
    pooling: ClassVar[str] = "mean"
    name: str
    tasks: tuple[str, ...]
    train: int  # at most this many labelled training texts per task (small sources give fewer)
    calibration: int  # unlabelled calibration pool per task (disjoint from train and test)
    test: int
    max_length: int  # tokens per text (truncated)
    finetune: FinetuneSettings
    head_shots: int = 8  # training examples per class whose mean base embedding is the class prototype
    head_scale: float = 20.0  # logits = scale · cos(feature, prototype)
    bench_methods: tuple[str, ...] = ("average", "task_arithmetic", "ties", "regmean", "regmean++", "wudi")
    regime_scaling: float = 0.3
    wudi_steps: int = 300  # WUDI's Adam steps per Linear, in the bench and its regime line

    def __post_init__(self) -> None:
        from featcal.experiments.zoo.text_tasks import TEXT_TASKS

        unknown = [t for t in self.tasks if t not in TEXT_TASKS]
        if unknown:
            raise ConfigError(f"preset {self.name}: unknown text tasks {unknown}; one of {', '.join(TEXT_TASKS)}")
        if self.head_shots < 1:
            raise ConfigError(f"preset {self.name}: head_shots must be at least 1, got {self.head_shots}")

    def fingerprint(self, seed: int) -> str:
        from featcal.experiments.zoo.text_sources import MODEL_PACKAGE, MODEL_VERSION, SOURCES

        built = {k: v for k, v in asdict(self).items() if k not in BENCH_ONLY}  # what the build reads
        blob = json.dumps({"format": TEXT_ZOO_FORMAT, "seed": seed, "modality": "text", **built,
                           "sources": {k: v.requirement for k, v in SOURCES.items()},
                           "base": f"{MODEL_PACKAGE}=={MODEL_VERSION}"}, sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


TEXT_ZOO_FORMAT = 1  # bump when the text build changes what a preset produces
BENCH_ONLY = ("bench_methods", "wudi_steps", "notes")  # settings of the bench, not of the zoo it builds

AnyPreset = ZooPreset | TextZooPreset | VisionRealPreset

PRESETS: dict[str, AnyPreset] = {
    "tiny": ZooPreset(
        name="tiny",
        model=ModelShape(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2),
        tasks=("stripes", "landcover", "handwritten_digits", "textures"),
        train=300, calibration=64, test=200,
        pretrain=PretrainSettings(images=3000, categories=40, steps=150, batch_size=64, lr=2e-3),
        finetune=FinetuneSettings(steps=120, batch_size=32, lr=3e-3, layer_decay=0.3),
    ),
    "default": ZooPreset(
        name="default",
        model=ModelShape(hidden_size=192, intermediate_size=768, num_hidden_layers=4, num_attention_heads=3),
        tasks=tuple(TASKS),
        train=1500, calibration=256, test=500,
        # lr 1.5e-3 / 800 steps left the base worse than a random init under a linear probe (58.8 vs
        # 61.3 %); 4e-4 / 2000 steps gives 74.0 % (benchmarks/zoo_variants.py, docs/bench.md).
        pretrain=PretrainSettings(images=16000, categories=100, steps=2000, batch_size=128, lr=4e-4),
        finetune=FinetuneSettings(steps=400, batch_size=64, lr=2e-4),
        # heads fitted on 4 examples per class, as weak as CLIP's zero-shot heads: base 48.3 < TA 66.7 <
        # experts 92.9, the paper's 48 < 67.5 < 90 (all-example probes: 74.0 < 75.4 < 89.5, no room)
        probe_shots=4,
    ),
    # Experts: blocks 2-5 (embeddings and blocks 0-1 frozen), 80 steps of AdamW 6e-5, batch 32 grouped by length,
    # 48 tokens; until 2026-12-07 the whole encoder, 150 steps of 3e-5 (0.65-1.05 s a step on 2 cores, 13-20 minutes
    # for the eight): `make demo` in 20 minutes (issue 53; docs/bench-text.md). Heads: 8 examples per class, 20·cos.
    "text": TextZooPreset(
        name="text",
        tasks=("sentences_en", "reviews_en", "reviews_nl", "reviews_fr", "hedges", "tweets", "topics", "languages"),
        train=1500, calibration=256, test=400, max_length=48,
        finetune=FinetuneSettings(steps=80, batch_size=32, lr=6e-5, warmup=8, weight_decay=0.01, frozen_blocks=2,
                                  length_groups=8),
        # the authors' 300 WUDI steps cost ~29 T multiply-accumulates on MiniLM's 36 Linears with 8 experts
        # (tens of minutes on 2 cores); 100 keeps the demo's bench in minutes
        wudi_steps=100,
    ),
    # the suite's version: real weights and data, three tasks, a few steps
    "text-tiny": TextZooPreset(
        name="text-tiny",
        tasks=("sentences_en", "hedges", "languages"),
        train=96, calibration=32, test=64, max_length=32, head_shots=4,
        finetune=FinetuneSettings(steps=10, batch_size=16, lr=1e-4, warmup=2, weight_decay=0.01),
        bench_methods=("task_arithmetic",), wudi_steps=5,
    ),
}

PRESETS.update(VISION_REAL_PRESETS)  # the real DINOv2-small on 8 real image tasks (vision_presets.py)


def get_preset(name: str) -> AnyPreset:
    if name not in PRESETS:
        raise ConfigError(f"unknown zoo preset {name!r}; choose one of {', '.join(PRESETS)}")
    return PRESETS[name]
