"""Causal LMs on held-out text or chat: mean token loss, perplexity and next-token accuracy.

Every token after the first is predicted from the ones before it (the logits at position i score token
i + 1). Plain text: every such token counts. Chat (`messages`): only the assistant turns count, as
fine-tuning on chat data trains them: the conversation is rendered with the tokenizer's chat template,
and an assistant turn is the text its rendering adds after the prompt that asks for it (the template
with add_generation_prompt), its end-of-turn marker included. The loss is the mean over all counted
tokens of the task (not a mean of per-example means), perplexity its exponential.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from featcal.data.bounds import bounded_text, render_chat
from featcal.errors import CalibrationDataError, EvaluationDataError
from featcal.evaluation.data import EvalSet
from featcal.evaluation.metrics import perplexity
from featcal.evaluation.runners.base import Runner, Scored, length_sorted_batches

log = logging.getLogger(__name__)

IGNORE = -100  # the label of a position that is not scored (transformers' convention)


class CausalLMRunner(Runner):
    def check(self, data: EvalSet) -> None:
        if "messages" in data.fields:
            if not getattr(self.tokenizer, "chat_template", None):
                raise EvaluationDataError(
                    f"task {data.task!r} holds chat turns, but the tokenizer of model {self.entry.name!r} "
                    f"({self.processor_dir}) has no chat template to render them; give plain text instead"
                )
            if not getattr(self.tokenizer, "is_fast", False):
                raise EvaluationDataError(
                    f"task {data.task!r} holds chat turns, and finding the assistant tokens needs a fast tokenizer "
                    f"(tokenizer.json), which {self.processor_dir} lacks"
                )
            for row, example in zip(data.rows, data.examples(), strict=True):
                if not any(t.get("role") == "assistant" for t in example.messages):
                    raise EvaluationDataError(
                        f"task {data.task!r}: {data.path}: example {row + 1} has no assistant turn, so nothing of it "
                        "would be scored (a causal LM is scored on the assistant turns of a chat); drop it"
                    )
        else:
            self.require_text(data, f"causal LM {self.entry.name!r}")
        # rendered and tokenised now (then again when scored): a chat template that fails or a tokenizer that
        # does not fit the model is refused before any model is loaded
        self.check_token_ids(data, [ids for ids, _ in self.encode(data, warn=False)])

    def encode(self, data: EvalSet, *, warn: bool = True) -> list[tuple[list[int], list[int]]]:
        """(input ids, labels: the id where the token is scored, IGNORE elsewhere) of every example."""
        encoded, truncated = [], 0
        limit = self.max_length()
        if "messages" in data.fields:
            for example in data.examples():
                ids, labels, cut = chat_labels(self.tokenizer, example.messages, limit)
                truncated += cut
                encoded.append((ids, labels))
        else:
            texts = [bounded_text(self.tokenizer, t, limit) for t in data.texts()]
            for ids in self.tokenizer(texts, truncation=False)["input_ids"]:  # one call: the fast path
                truncated += len(ids) > limit
                encoded.append((ids[:limit], list(ids[:limit])))
        if truncated and warn:
            log.warning("task %r: %d of %d examples are longer than %d tokens and were truncated (--max-length)",
                        data.task, truncated, len(encoded), limit)
        return encoded

    @torch.no_grad()
    def score(self, model: nn.Module, data: EvalSet, *, progress: bool) -> Scored:
        encoded = self.encode(data)
        pad = self.tokenizer.pad_token_id
        device = self.options.device
        loss_sum = torch.zeros((), dtype=torch.float64)
        correct = tokens = 0
        batches = length_sorted_batches([len(ids) for ids, _ in encoded], self.options.batch_size)
        for batch in tqdm(batches, desc=f"{self.entry.name}/{data.task}", disable=not progress, leave=False):
            ids, mask, labels = _padded([encoded[i] for i in batch], pad)
            # position i predicts token i + 1; the last position predicts nothing. Scored over the logits as the
            # model returns them (no copy of the scored rows: on a small model that copy, not the forward, was
            # what kept eval below 0.8x a plain forward loop; benchmarks/eval_speed.py)
            target = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], IGNORE)], dim=1)
            scored = target != IGNORE
            if not scored.any():
                continue
            logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits.float()
            target, scored = target.to(logits.device), scored.to(logits.device)
            flat = logits.flatten(0, 1)
            loss_sum += F.cross_entropy(flat, target.flatten(), ignore_index=IGNORE, reduction="sum").double().cpu()
            predicted = flat.max(-1).indices  # argmax's first-maximum rule, at about half its time on the CPU
            correct += int(((predicted == target.flatten()) & scored.flatten()).sum())
            tokens += int(scored.sum())
        if tokens == 0:
            what = "assistant tokens" if "messages" in data.fields else "tokens after the first of any example"
            raise EvaluationDataError(f"task {data.task!r}: no {what} to score")
        loss = float(loss_sum) / tokens
        return Scored({"loss": loss, "perplexity": perplexity(loss), "next_token_accuracy": 100.0 * correct / tokens},
                      len(encoded), {"tokens": tokens})


def _padded(rows: Sequence[tuple[list[int], list[int]]], pad: int) -> tuple[torch.Tensor, ...]:
    """Right-padded (input_ids, attention_mask, labels) of a batch."""
    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)
    for r, (row_ids, row_labels) in enumerate(rows):
        ids[r, : len(row_ids)] = torch.tensor(row_ids, dtype=torch.long)
        mask[r, : len(row_ids)] = 1
        labels[r, : len(row_labels)] = torch.tensor(row_labels, dtype=torch.long)
    return ids, mask, labels


def assistant_spans(tokenizer, messages: Sequence[Mapping[str, str]]) -> tuple[str, list[tuple[int, int]]]:
    """(the rendered conversation, the character spans of its assistant turns).

    A turn's span runs from the end of the prompt that asks for it (the conversation before it, rendered
    with add_generation_prompt) to the end of the conversation up to it. A template whose renderings are
    not prefixes of one another cannot be split this way, and is refused. Every rendering is bounded in
    time and size (data/bounds.py), a template that fails refused in one line.
    """
    turns = [dict(m) for m in messages]
    full = _render(tokenizer, turns)
    spans = []
    for i, turn in enumerate(turns):
        if turn["role"] != "assistant":
            continue
        before = _prompt(tokenizer, turns[:i])
        upto = _render(tokenizer, turns[: i + 1])
        if not (upto.startswith(before) and full.startswith(upto)):
            raise EvaluationDataError(
                "the chat template does not render a conversation as the prefix of its continuation, so the "
                "assistant turns cannot be told apart from the prompts; give plain text instead"
            )
        spans.append((len(before), len(upto)))
    return full, spans


def _render(tokenizer, turns: list[dict], generation_prompt: bool = False) -> str:
    try:
        return render_chat(tokenizer, turns, None, origin="the tokenizer's", add_generation_prompt=generation_prompt)
    except CalibrationDataError as exc:  # the data seam's error class; here it is evaluation data
        raise EvaluationDataError(str(exc)) from None


def _prompt(tokenizer, turns: list[dict]) -> str:
    """The rendering that asks for the next assistant turn (a template may not render an empty conversation:
    then nothing comes before a first turn)."""
    if not turns:
        try:
            return _render(tokenizer, turns, generation_prompt=True)
        except EvaluationDataError:
            return ""
    return _render(tokenizer, turns, generation_prompt=True)


def chat_labels(tokenizer, messages: Sequence[Mapping[str, str]], limit: int) -> tuple[list[int], list[int], bool]:
    """(input ids, labels scoring only the assistant tokens, whether the conversation was truncated)."""
    text, spans = assistant_spans(tokenizer, messages)
    enc = tokenizer(bounded_text(tokenizer, text, limit), add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    labels = [tok if any(s <= start < e for s, e in spans) and end > start else IGNORE
              for tok, (start, end) in zip(ids, offsets, strict=True)]
    return ids[:limit], labels[:limit], len(ids) > limit
