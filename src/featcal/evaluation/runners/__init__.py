"""One runner per model kind (evaluation/kinds.py): how that kind is run and scored on a task."""

from __future__ import annotations

from featcal.evaluation.options import EvalOptions
from featcal.evaluation.runners.base import ModelEntry, Runner


def runner_for(entry: ModelEntry, options: EvalOptions, *, text_model: ModelEntry | None = None) -> Runner:
    """The runner of `entry`'s kind; `text_model`: the image-text model that scores a bare vision tower."""
    from featcal.evaluation.runners.causal_lm import CausalLMRunner
    from featcal.evaluation.runners.classifier import ClassifierRunner
    from featcal.evaluation.runners.text_to_text import TextToTextRunner
    from featcal.evaluation.runners.zero_shot import ZeroShotRunner

    kind = entry.kind.name
    if kind == "zero_shot":
        return ZeroShotRunner(entry, options, text_model=text_model)
    runner = {"causal_lm": CausalLMRunner, "classifier": ClassifierRunner, "text_to_text": TextToTextRunner}[kind]
    return runner(entry, options)
