"""What a checkpoint can be scored on, read from its structure: the class its config names, and the task
that class serves in transformers' own auto-class tables (so a family featcal never saw is recognised
the same way as the ones it was tested on, or refused before any model is loaded).

- text_to_text: an encoder-decoder LM (T5, BART, ...): exact match of greedy generations with targets;
- causal_lm: a decoder LM: token loss, perplexity and next-token accuracy on held-out text or chat;
- classifier: a sequence or image classification head: accuracy and macro-F1 against labels;
- zero_shot: an image-text model (CLIP, ...), or a bare vision tower read with such a model's text head
  (--base): zero-shot accuracy from class names.
A bare encoder (BertModel, ViTModel, ...) has no head to score and is refused, naming what would make it
evaluable.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from featcal.errors import ConfigError


@dataclass(frozen=True)
class ModelKind:
    """How a model is scored: its metrics (the first one is the gap column's), and which way is better."""

    name: str
    model_class: type
    metrics: tuple[str, ...]
    higher_is_better: tuple[bool, ...]

    @property
    def primary(self) -> str:
        return self.metrics[0]

    def better_is_higher(self, metric: str) -> bool:
        return self.higher_is_better[self.metrics.index(metric)]


METRICS: dict[str, tuple[tuple[str, ...], tuple[bool, ...]]] = {
    "text_to_text": (("exact_match",), (True,)),
    "causal_lm": (("loss", "perplexity", "next_token_accuracy"), (False, False, True)),
    "classifier": (("accuracy", "macro_f1"), (True, True)),
    "zero_shot": (("accuracy",), (True,)),
}


@cache
def _task_classes() -> tuple[tuple[str, frozenset[str]], ...]:
    """(kind, class names) from transformers' auto tables, the most specific first."""
    from transformers.models.auto import modeling_auto as auto

    def names(*tables) -> frozenset[str]:
        out: set[str] = set()
        for table in tables:
            for value in table.values():
                out.update((value,) if isinstance(value, str) else value)
        return frozenset(out)

    return (
        ("text_to_text", names(auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES)),
        ("causal_lm", names(auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)),
        ("classifier", names(auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
                             auto.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES)),
        ("zero_shot", names(auto.MODEL_FOR_ZERO_SHOT_IMAGE_CLASSIFICATION_MAPPING_NAMES)),
    )


def model_kind(config, *, name: str, zero_shot_base: bool = False) -> ModelKind:
    """The kind of the model whose transformers config is `config` (`name` labels it in errors).

    `zero_shot_base`: an image-text model is given as --base, whose text head can score a bare vision tower.
    """
    from featcal.data.preprocess import model_modality
    from featcal.io.read.models import model_class_for

    cls = model_class_for(config)
    for kind, classes in _task_classes():
        if cls.__name__ in classes:
            return _kind(kind, cls)
    if model_modality(config) == "image" and zero_shot_base:
        return _kind("zero_shot", cls)
    raise ConfigError(_no_head_message(name, config, cls))


def _kind(kind: str, cls: type) -> ModelKind:
    metrics, better = METRICS[kind]
    return ModelKind(kind, cls, metrics, better)


def _no_head_message(name: str, config, cls: type) -> str:
    from featcal.data.preprocess import model_modality

    what = cls.__name__ if cls.__name__ != "AutoModel" else f"a bare {config.model_type} model (config names no architecture)"
    if model_modality(config) == "image":
        fix = ("save it with an image-classification head (e.g. ...ForImageClassification with id2label), or, for a "
               "CLIP vision tower, pass --base the CLIP model whose text tower scores it zero-shot")
    else:
        fix = ("save it with a task head: ...ForSequenceClassification (with id2label) to score a label column, "
               "...ForCausalLM for held-out text, or an encoder-decoder LM for targets")
    return f"model {name!r} is {what}, an encoder with no task head: featcal eval has nothing to score; {fix}"
