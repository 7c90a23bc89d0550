"""Text-to-text models (T5, ...) against target texts: exact match (in %) of greedy generations.

A generation matches when it equals its target after metrics.normalise_answer (case and surrounding
whitespace ignored). Generation stops at the end-of-sequence token, or a few tokens past the longest
target: a longer answer cannot match.
"""

from __future__ import annotations

import torch
from torch import nn
from tqdm.auto import tqdm

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
        data.targets()  # a missing or blank target is refused now, before any model runs

    @torch.no_grad()
    def score(self, model: nn.Module, data: EvalSet, *, progress: bool) -> Scored:
        texts, targets = data.texts(), data.targets()
        lengths = [len(ids) for ids in self.tokenizer(texts, truncation=True, max_length=self.max_length())["input_ids"]]
        longest = max(len(ids) for ids in self.tokenizer(text_target=targets)["input_ids"])
        generated = [""] * len(texts)
        batches = length_sorted_batches(lengths, self.options.batch_size)
        for positions in tqdm(batches, desc=f"{self.entry.name}/{data.task}", disable=not progress, leave=False):
            outputs = generate_batch(model, self.tokenizer, [texts[p] for p in positions], device=self.options.device,
                                     max_new_tokens=longest + SLACK_TOKENS, max_length=self.max_length())
            for p, text in zip(positions, outputs, strict=True):
                generated[p] = text
        return Scored({"exact_match": exact_match(generated, targets)}, len(texts))
