"""FLAN-T5 on GLUE as text-to-text: prompts in, greedy generations out, GLUE metrics on the text.

Classification tasks (cola, mnli, mrpc, qnli, qqp, rte, sst2) score exact match between the
generated text and the label word, after stripping surrounding whitespace and lower-casing.
stsb scores Spearman's ρ between the gold similarity and the first number in the generated text;
a generation with no number is given STSB_FALLBACK (0.0, FusionBench's choice: below the 0–5 scale,
so it ranks as "least similar"), and the count of such generations is reported.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from featcal.data.batch import Batch
from featcal.data.preprocess import teacher_forced_decoder_inputs
from featcal.errors import CalibrationDataError
from featcal.evaluation.generation import greedy_generations
from featcal.evaluation.metrics import exact_match, normalise_answer, spearman  # noqa: F401  (re-exported)
from featcal.experiments.task_data.templates import glue_prompt

STSB_FALLBACK = 0.0
_TARGET_MAX_LENGTH = 32  # label words and stsb scores are a few tokens
# the functions' max_length default, 512, is the paper's GLUE setting (reproduce/options.py), not calibration's 128
_NUMBER = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)")


def parse_similarity(text: str) -> float | None:
    """The first number in a generation ('3.8', 'about 4', '4.0.'), or None if there is none."""
    match = _NUMBER.search(text)
    return float(match.group()) if match else None


def score(task: str, generations: Sequence[str], labels: Sequence[float | int]) -> dict[str, float | int]:
    """The task's GLUE metric (in %, ρ×100 for stsb) from generated texts and gold labels."""
    prompt = glue_prompt(task)
    if prompt.labels is None:
        parsed = [parse_similarity(g) for g in generations]
        preds = [STSB_FALLBACK if p is None else p for p in parsed]
        return {
            "score": 100.0 * spearman(preds, [float(v) for v in labels]),
            "metric": "spearman",
            "unparsable": sum(p is None for p in parsed),
            "n": len(generations),
        }
    refs = [prompt.target_text(v) for v in labels]
    return {"score": exact_match(generations, refs), "metric": "exact_match", "n": len(generations)}


def text_pairs(task: str, dataset: Any, indices: Sequence[int]) -> tuple[list[str], list[float | int]]:
    """(prompts, labels) of the rows `indices`."""
    prompt = glue_prompt(task)
    missing = [c for c in (*prompt.fields, "label") if c not in dataset.column_names]
    if missing:
        raise CalibrationDataError(f"GLUE {task}: dataset lacks column(s) {missing} (has {dataset.column_names})")
    rows = dataset[list(indices)]
    texts = [prompt.input_text({f: rows[f][i] for f in prompt.fields}) for i in range(len(indices))]
    return texts, list(rows["label"])


def calibration_batches(
    task: str,
    dataset: Any,
    indices: Sequence[int],
    tokenizer: Any,
    *,
    batch_size: int,
    decoder_start_token_id: int,
    max_length: int = 512,
) -> list[Batch]:
    """Encoder inputs plus teacher-forced decoder inputs (the label text, shifted right) per batch.

    The decoder needs some input to calibrate; the label text of a TRAIN example is what the expert
    saw in fine-tuning, so its decoder features are the ones the expert specialised. The decoder inputs
    and mask are built as for any calibration data (data.preprocess.teacher_forced_decoder_inputs; label
    texts are truncated at 32 tokens).
    """
    prompt = glue_prompt(task)
    texts, labels = text_pairs(task, dataset, indices)
    batches = []
    for start in range(0, len(texts), batch_size):
        enc = tokenizer(texts[start : start + batch_size], padding=True, truncation=True, max_length=max_length,
                        return_tensors="pt")
        targets = [prompt.target_text(v) for v in labels[start : start + batch_size]]
        shifted, dec_mask = teacher_forced_decoder_inputs(
            tokenizer, targets, len(targets), decoder_start_token_id=decoder_start_token_id,
            pad_token_id=tokenizer.pad_token_id, max_length=_TARGET_MAX_LENGTH,
        )
        batches.append({
            "input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"],
            "decoder_input_ids": shifted, "decoder_attention_mask": dec_mask,
        })
    return batches


def generations(
    model: Any, tokenizer: Any, texts: Sequence[str], *, batch_size: int, device: Any, max_new_tokens: int = 10,
    desc: str = "generate", max_length: int = 512,
) -> Iterator[str]:
    """Greedy generations, batch by batch (max_new_tokens=10 covers every GLUE answer word or score)."""
    yield from greedy_generations(model, tokenizer, texts, batch_size=batch_size, device=device,
                                  max_new_tokens=max_new_tokens, desc=desc, max_length=max_length)


@torch.no_grad()
def evaluate_glue(
    model: Any,
    tokenizer: Any,
    task: str,
    dataset: Any,
    *,
    batch_size: int = 32,
    device: str | torch.device = "cpu",
    desc: str | None = None,
    max_length: int = 512,
) -> dict[str, float | int]:
    """Greedy-generate an answer for every row of a GLUE split and score it."""
    n = len(dataset)
    if n == 0:
        raise CalibrationDataError(f"GLUE {task}: the evaluation split is empty")
    texts, labels = text_pairs(task, dataset, range(n))
    model = model.to(device).eval()
    gens = list(generations(model, tokenizer, texts, batch_size=batch_size, device=device, desc=desc or task,
                            max_length=max_length))
    return score(task, gens, labels)
