"""Model inputs as batches, and the pooled features a frozen head reads, for images and for text.

An input set is either a tensor (images: `pixel_values`) or a dict of equally long tensors (text:
`input_ids`, `attention_mask`, ...). Slicing a text batch drops the columns that are padding in every
row, so short sentences do not pay for the longest one (masked positions change nothing: BERT's
attention and the mean pooling both skip them). Pooling is named by the zoo: `pooler` (CLIP/ViT: the
model's own pooled class token) or `mean` (sentence encoders such as all-MiniLM-L6-v2: the masked
mean of the last hidden states).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from featcal.data.batch import Batch

Inputs = torch.Tensor | Mapping[str, torch.Tensor]
POOLINGS = ("pooler", "mean")


def num_examples(inputs: Inputs) -> int:
    if isinstance(inputs, Mapping):
        return len(next(iter(inputs.values())))
    return len(inputs)


def batch_of(inputs: Inputs, start: int, stop: int) -> Batch:
    """Rows [start, stop) as model keyword inputs; text batches trimmed to their longest row."""
    return select(inputs, slice(start, stop))


def select(inputs: Inputs, rows: slice | torch.Tensor, trim: bool = True) -> Batch:
    """The chosen rows (a slice or an index tensor) as model keyword inputs, text trimmed of padding
    (`trim=False` keeps every batch as wide as the stored texts, for code that concatenates batches)."""
    if not isinstance(inputs, Mapping):
        return {"pixel_values": inputs[rows]}
    batch = {k: v[rows] for k, v in inputs.items()}
    mask = batch.get("attention_mask")
    if trim and mask is not None and mask.ndim == 2 and len(mask):
        width = int(mask.sum(0).nonzero().max()) + 1 if mask.any() else 1
        batch = {k: (v[:, :width] if v.ndim == 2 and v.shape[1] == mask.shape[1] else v) for k, v in batch.items()}
    return batch


def batches(inputs: Inputs, size: int, trim: bool = True) -> list[Batch]:
    n = num_examples(inputs)
    return [select(inputs, slice(i, min(i + size, n)), trim) for i in range(0, n, size)]


def head_rows(inputs: Inputs, n: int) -> Inputs:
    """The first `n` examples (a fixed subset of a split)."""
    if isinstance(inputs, Mapping):
        return {k: v[:n] for k, v in inputs.items()}
    return inputs[:n]


def mean_pool(hidden: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Masked mean over tokens (sentence-transformers' mean pooling)."""
    if mask is None:
        return hidden.mean(1)
    m = mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * m).sum(1) / m.sum(1).clamp_min(1e-9)


def features(model, batch: Mapping[str, Any], pooling: str = "pooler") -> torch.Tensor:
    """The [B, d] features a head reads from `model(**batch)`."""
    out = model(**batch)
    if pooling == "pooler":
        return out.pooler_output
    if pooling == "mean":
        return mean_pool(out.last_hidden_state, batch.get("attention_mask"))
    raise ValueError(f"unknown pooling {pooling!r}; one of {POOLINGS}")


def feature_fn(pooling: str):
    """`features` bound to a pooling, in the (model, batch) form the baselines take."""
    if pooling not in POOLINGS:
        raise ValueError(f"unknown pooling {pooling!r}; one of {POOLINGS}")
    return lambda model, batch: features(model, batch, pooling)
