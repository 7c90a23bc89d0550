"""What every runner shares: its interface, the processor files it reads, and length-sorted batching.

A runner scores one kind of model (evaluation/kinds.py) on one task. `check` runs before any model is
loaded and refuses a task the model cannot be scored on (a missing column, a label map that does not
fit); `score` then runs the model, batch by batch, and returns the task's metrics.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from torch import nn

from featcal.errors import ConfigError, EvaluationDataError
from featcal.evaluation.data import EvalSet
from featcal.evaluation.kinds import ModelKind
from featcal.evaluation.options import EvalOptions

log = logging.getLogger(__name__)


@dataclass
class Scored:
    """One model's metrics on one task, over `examples` examples (`details`: what else eval.json records)."""

    values: dict[str, float]
    examples: int
    details: dict[str, Any] = field(default_factory=dict)


@dataclass
class ModelEntry:
    """A model to evaluate: its table name, role, local directory, config and kind."""

    name: str
    role: str  # "base", "merged", "calibrated", "expert", "model"
    path: Path
    config: Any
    kind: ModelKind
    source: str  # the path or hub id as given
    task: str | None = None  # an expert's own task


def length_sorted_batches(lengths: Sequence[int], batch_size: int) -> list[list[int]]:
    """Positions grouped into batches of similar length, longest first: padding is spent only where rows
    differ, and the first batch shows the memory peak at once. Ties keep their order (deterministic)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


class Runner(ABC):
    """Scores one model kind; one instance per model (it holds the model's processor)."""

    def __init__(self, entry: ModelEntry, options: EvalOptions) -> None:
        self.entry = entry
        self.options = options

    @abstractmethod
    def check(self, data: EvalSet) -> None:
        """Refuse `data` if this model cannot be scored on it, reading no weight."""

    @abstractmethod
    def score(self, model: nn.Module, data: EvalSet, *, progress: bool) -> Scored:
        """The model's metrics on every example of `data`."""

    def label_config(self, task: str) -> Any | None:
        """What reads `task`'s class labels (a config with id2label and num_labels); None for a kind without them."""
        del task
        return None

    def load_model(self) -> nn.Module:
        from featcal.io.read.models import load_model

        model = load_model(self.entry.path, model_class=self.entry.kind.model_class,
                           allow_pickle=self.options.allow_pickle)
        return model.to(self.options.device).eval()

    @property
    def processor_dir(self) -> Path:
        """Where the tokenizer / image processor is read: the model's folder, else --processor."""
        from featcal.data.preprocess import has_processor_files, model_modality

        modality = model_modality(self.entry.config)
        if has_processor_files(self.entry.path, modality):
            return self.entry.path
        if self.options.processor is not None:
            return Path(self.options.processor)
        if modality == "image":
            return self.entry.path  # resized and normalised as calibration does without one (with its warning)
        raise ConfigError(
            f"model {self.entry.name!r} ({self.entry.path}) was saved without its tokenizer: pass --processor DIR, "
            "the folder of the model it was fine-tuned or merged from"
        )

    @cached_property
    def tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        try:
            tok = AutoTokenizer.from_pretrained(self.processor_dir, trust_remote_code=False)
        except Exception as exc:
            raise ConfigError(f"model {self.entry.name!r}: cannot load the tokenizer in {self.processor_dir}: "
                              f"{' '.join(str(exc).split())}") from None
        if tok.pad_token is None:
            if tok.eos_token is None:
                raise ConfigError(f"model {self.entry.name!r}: the tokenizer in {self.processor_dir} has neither a "
                                  "pad nor an eos token to pad batches with")
            tok.pad_token = tok.eos_token  # padding is masked out (and never a target)
        tok.padding_side = "right"  # real tokens keep positions 0..n-1, as in unpadded training
        return tok

    def max_length(self) -> int:
        positions = getattr(self.entry.config, "max_position_embeddings", None)
        return min(self.options.max_length, positions) if positions else self.options.max_length

    def check_token_ids(self, data: EvalSet, rows: Sequence[Sequence[int]]) -> None:
        """Refuse token ids the model has no embedding for (a tokenizer that does not match the checkpoint):
        the forward would fail with an IndexError, or read another row's memory on some devices."""
        config = self.entry.config
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        vocab = getattr(text, "vocab_size", None)
        largest = max((max(r) for r in rows if len(r)), default=None)
        if isinstance(vocab, int) and largest is not None and largest >= vocab:
            raise EvaluationDataError(
                f"task {data.task!r}: the tokenizer of model {self.entry.name!r} ({self.processor_dir}) produces token "
                f"id {largest}, but the model's vocabulary has {vocab} entries: tokenizer and checkpoint do not match "
                "(--processor names another tokenizer)"
            )

    def require_text(self, data: EvalSet, what: str) -> None:
        if "text" not in data.fields:
            raise EvaluationDataError(
                f"task {data.task!r}: {data.path} ({data.kind}) has no text column, which {what} needs; "
                "name the column with --text-column"
            )
