"""Greedy generation in batches, for text-to-text models scored on the text they produce."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from tqdm.auto import tqdm


@torch.no_grad()
def generate_batch(model: Any, tokenizer: Any, texts: Sequence[str], *, device: Any, max_new_tokens: int,
                   max_length: int) -> list[str]:
    """Greedy (no sampling, one beam) generations of one batch of prompts, special tokens dropped."""
    enc = tokenizer(list(texts), padding=True, truncation=True, max_length=max_length, return_tensors="pt").to(device)
    out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, num_beams=1)
    return tokenizer.batch_decode(out, skip_special_tokens=True)


def greedy_generations(
    model: Any, tokenizer: Any, texts: Sequence[str], *, batch_size: int, device: Any, max_new_tokens: int = 10,
    desc: str = "generate", max_length: int = 512,
) -> Iterator[str]:
    """Greedy generations of `texts`, in their order, `batch_size` prompts at a time (`max_length`: 512, as
    EvalOptions' evaluation default, not calibration's 128: a prompt is read whole), under a progress bar."""
    for start in tqdm(range(0, len(texts), batch_size), desc=desc):
        yield from generate_batch(model, tokenizer, texts[start : start + batch_size], device=device,
                                  max_new_tokens=max_new_tokens, max_length=max_length)
