"""The paper's settings: which hub ids, which data, which splits, and the numbers the paper reports.

A Setting is pure data; the pipelines in featcal.experiments.reproduce read it. Reference numbers come from
the paper / demo (docs/method.md §10); where the paper gives only an average, per-task references are absent.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from featcal.errors import ConfigError
from featcal.experiments.task_data.templates import glue_eval_split

Family = Literal["clip", "glue", "mergebench"]


@dataclass(frozen=True)
class DatasetRef:
    """A hub dataset (id + optional config) and the split read for calibration / for evaluation."""

    id: str
    config: str | None = None
    calibration_split: str = "train"
    eval_split: str | None = "test"

    @property
    def label(self) -> str:
        return self.id if self.config is None else f"{self.id} ({self.config})"


@dataclass(frozen=True)
class TaskSpec:
    name: str
    expert_id: str
    data: DatasetRef


@dataclass(frozen=True)
class Reference:
    """The paper's numbers for one setting: averages, plus per-task values where published."""

    merge_avg: float | None = None
    featcal_avg: float | None = None
    merge: Mapping[str, float] = field(default_factory=dict)
    featcal: Mapping[str, float] = field(default_factory=dict)
    source: str = ""


@dataclass(frozen=True)
class Setting:
    name: str
    family: Family
    base_id: str
    tasks: tuple[TaskSpec, ...]
    reference: Reference
    scaling: float = 0.3
    metric: str = "accuracy"
    lm_eval_tasks: tuple[str, ...] = ()  # mergebench: evaluated outside featcal, with lm-eval-harness
    description: str = ""

    @property
    def task_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tasks)

    def model_ids(self) -> list[str]:
        return [self.base_id] + [t.expert_id for t in self.tasks]

    def dataset_refs(self) -> list[DatasetRef]:
        seen: dict[tuple[str, str | None], DatasetRef] = {}
        for t in self.tasks:
            seen.setdefault((t.data.id, t.data.config), t.data)
        return list(seen.values())

    def restrict(self, tasks: Sequence[str] | None) -> Setting:
        """The same setting on a subset of its tasks (in the setting's order)."""
        if not tasks:
            return self
        unknown = [t for t in tasks if t not in self.task_names]
        if unknown:
            raise ConfigError(
                f"setting {self.name} has no task(s) {', '.join(unknown)}; its tasks: {', '.join(self.task_names)}"
            )
        return replace(self, tasks=tuple(t for t in self.tasks if t.name in set(tasks)))


# ---------------------------------------------------------------- CLIP ViT, 8 tasks, Task Arithmetic
CLIP_TASKS: tuple[tuple[str, DatasetRef], ...] = (
    ("sun397", DatasetRef("tanganke/sun397")),
    ("stanford-cars", DatasetRef("tanganke/stanford_cars")),
    ("resisc45", DatasetRef("tanganke/resisc45")),
    ("eurosat", DatasetRef("tanganke/eurosat")),
    ("svhn", DatasetRef("svhn", "cropped_digits")),
    ("gtsrb", DatasetRef("tanganke/gtsrb")),
    ("mnist", DatasetRef("ylecun/mnist")),
    ("dtd", DatasetRef("tanganke/dtd")),
)

_B32_REFERENCE = Reference(
    merge_avg=67.5,
    featcal_avg=85.5,
    merge={"sun397": 57.0, "stanford-cars": 55.7, "resisc45": 64.8, "eurosat": 73.3, "svhn": 77.9,
           "gtsrb": 68.5, "mnist": 96.1, "dtd": 47.1},
    featcal={"sun397": 70.1, "stanford-cars": 72.5, "resisc45": 87.9, "eurosat": 96.2, "svhn": 95.1,
             "gtsrb": 93.2, "mnist": 98.8, "dtd": 70.0},
    source="FeatCal paper / demo (arXiv 2605.13030), Task Arithmetic s=0.3, full test splits",
)


def _clip_setting(name: str, arch: str, reference: Reference) -> Setting:
    return Setting(
        name=name,
        family="clip",
        base_id=f"openai/{arch}",
        tasks=tuple(TaskSpec(t, f"tanganke/{arch}_{t}", ref) for t, ref in CLIP_TASKS),
        reference=reference,
        description=f"CLIP {arch}, 8 image tasks, Task Arithmetic (s=0.3) + FeatCal; zero-shot heads, test accuracy",
    )


# ---------------------------------------------------------------- FLAN-T5-base, GLUE, Task Arithmetic
GLUE_TASKS = ("cola", "mnli", "mrpc", "qnli", "qqp", "rte", "sst2", "stsb")


def _glue_ref(task: str) -> DatasetRef:
    return DatasetRef("nyu-mll/glue", task, calibration_split="train", eval_split=glue_eval_split(task))


# ---------------------------------------------------------------- Llama, MergeBench, Task Arithmetic
MERGEBENCH_TASKS = ("instruction", "math", "coding", "multilingual", "safety")
# lm-eval-harness tasks of MergeBench's evaluation (coding/safety are also scored by bigcode/safety-eval)
MERGEBENCH_LM_EVAL = (
    "gsm8k_cot", "m_mmlu_fr", "arc_fr", "hellaswag_fr", "m_mmlu_es", "arc_es", "hellaswag_es",
    "m_mmlu_de", "arc_de", "hellaswag_de", "m_mmlu_ru", "arc_ru", "hellaswag_ru", "ifeval", "mbpp",
    "truthfulqa",
)


def _mergebench_setting(name: str, base: str, reference: Reference) -> Setting:
    return Setting(
        name=name,
        family="mergebench",
        base_id=f"meta-llama/{base}",
        tasks=tuple(
            TaskSpec(t, f"MergeBench/{base}_{t}", DatasetRef(f"MergeBench/{t}_val", eval_split=None))
            for t in MERGEBENCH_TASKS
        ),
        reference=reference,
        metric="MergeBench average (lm-eval-harness, run separately)",
        lm_eval_tasks=MERGEBENCH_LM_EVAL,
        description=f"{base}, MergeBench 5 domains, Task Arithmetic (s=0.3) + FeatCal on the _val sets; "
        "featcal writes the checkpoint, lm-eval-harness scores it",
    )


SETTINGS: dict[str, Setting] = {
    s.name: s
    for s in (
        _clip_setting("clip-vit-b32-ta8", "clip-vit-base-patch32", _B32_REFERENCE),
        _clip_setting("clip-vit-b16-ta8", "clip-vit-base-patch16", Reference(source="not among the paper's reference numbers (docs/method.md §10)")),
        _clip_setting("clip-vit-l14-ta8", "clip-vit-large-patch14", Reference(source="not among the paper's reference numbers (docs/method.md §10)")),
        Setting(
            name="flan-t5-base-glue-ta8",
            family="glue",
            base_id="google/flan-t5-base",
            tasks=tuple(TaskSpec(t, f"tanganke/flan-t5-base_glue-{t}", _glue_ref(t)) for t in GLUE_TASKS),
            reference=Reference(78.9, 85.2, source="FeatCal paper (arXiv 2605.13030), averages only"),
            metric="exact match (stsb: Spearman ρ×100), validation splits",
            description="FLAN-T5-base, 8 GLUE tasks as text-to-text, Task Arithmetic (s=0.3) + FeatCal",
        ),
        _mergebench_setting("llama-3.2-3b-mergebench", "Llama-3.2-3B",
                            Reference(60.1, 62.1, source="FeatCal paper (arXiv 2605.13030), averages only")),
        _mergebench_setting("llama-3.1-8b-mergebench", "Llama-3.1-8B",
                            Reference(63.5, 65.8, source="FeatCal paper (arXiv 2605.13030), averages only")),
    )
}


def get_setting(name: str) -> Setting:
    if name not in SETTINGS:
        raise ConfigError(f"unknown setting {name!r}; known: {', '.join(SETTINGS)}")
    return SETTINGS[name]
