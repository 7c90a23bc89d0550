"""Text-to-text models (T5, ...) against target texts: exact match (in %) of greedy generations.

A generation matches when it equals its target after metrics.normalise_answer (case and surrounding
whitespace ignored). Generation stops at the end-of-sequence token, or a few tokens past the longest
target: a longer answer cannot match.
"""

from __future__ import annotations

import torch
from torch import nn
from tqdm.auto import tqdm

from featcal.data.bounds import bounded_text
from featcal.errors import EvaluationDataError
from featcal.evaluation.data import EvalSet
from featcal.evaluation.generation import generate_batch
from featcal.evaluation.metrics import exact_match
from featcal.evaluation.runners.base import Runner, Scored, length_sorted_batches

SLACK_TOKENS = 4  # beyond the longest target, for spacing and case variants that normalise to it


class TextToTextRunner(Runner):
    def check(self, data: EvalSet) -> None:
        what = f"text-to-text model {self.entry.name!r}"
        self.require_text(data, what)
        data.require(["target"], what, "name the column of target texts with --target-column")
        limit = self.max_length()
        targets = self._target_ids(data)  # a missing or blank target is refused now, before any model runs
        long = next((i for i, ids in enumerate(targets) if len(ids) > limit), None)
        if long is not None:
            raise EvaluationDataError(
                f"task {data.task!r}: {data.path}: the target of example {data.rows[long] + 1} is longer than {limit} "
                "tokens, so no generation (cut at --max-length) could match it; raise --max-length or drop it"
            )
        self.check_token_ids(data, self._input_ids(data) + targets)

    @torch.no_grad()
    def score(self, model: nn.Module, data: EvalSet, *, progress: bool) -> Scored:
        limit = self.max_length()
        texts = [bounded_text(self.tokenizer, t, limit) for t in data.texts()]
        targets = data.targets()
        lengths = [len(ids) for ids in self._input_ids(data)]
        longest = min(max(len(ids) for ids in self._target_ids(data)), limit)
        generated = [""] * len(texts)
        batches = length_sorted_batches(lengths, self.options.batch_size)
        for positions in tqdm(batches, desc=f"{self.entry.name}/{data.task}", disable=not progress, leave=False):
            outputs = generate_batch(model, self.tokenizer, [texts[p] for p in positions], device=self.options.device,
                                     max_new_tokens=longest + SLACK_TOKENS, max_length=self.max_length())
            for p, text in zip(positions, outputs, strict=True):
                generated[p] = text
        return Scored({"exact_match": exact_match(generated, targets)}, len(texts))

    def _input_ids(self, data: EvalSet) -> list[list[int]]:
        limit = self.max_length()
        texts = [bounded_text(self.tokenizer, t, limit) for t in data.texts()]
        return list(self.tokenizer(texts, truncation=True, max_length=limit)["input_ids"])

    def _target_ids(self, data: EvalSet) -> list[list[int]]:
        """Each target's ids (a huge one tokenised only past --max-length: it is refused anyway)."""
        limit = self.max_length()
        targets = [bounded_text(self.tokenizer, t, limit) for t in data.targets()]
        return list(self.tokenizer(text_target=targets)["input_ids"])
