"""What a candidate is scored on: its final features and predictions on the held-out examples.

One forward per held-out batch gives the last block's output (the features the drift compares) and, where
the task has a head, the predictions: a classifier head's classes (`--tune-head`, or a callable head), or,
for a causal LM, the model's own next-token predictions through its LM head (`NextToken`, issue #42). Only
predicted ids leave the device (and, for the soft tie-break, log-probabilities), never a token head's logits.
The experts' features and predictions are computed once (`expert_reference`) and held on the host.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from featcal.blocks.adapters import Adapter
from featcal.blocks.adapters.base import accepted_inputs
from featcal.blocks.capture import hidden_of
from featcal.data.batch import Batch
from featcal.errors import ConfigError


class NextToken:
    """A task's "head" that is the model's own LM head: the argmax of its logits at every valid (non-padding)
    position is the prediction compared with the expert's (tune_next_token; docs/tuning.md)."""

    def __repr__(self) -> str:
        return "NextToken()"


NEXT_TOKEN = NextToken()

# a task head: an nn.Module applied to the model's pooled output, or a callable head(model, batch) -> logits, or
# the model's own LM head
Head = nn.Module | Callable[[nn.Module, Batch], torch.Tensor] | NextToken


def has_lm_head(model: nn.Module) -> bool:
    """Whether the model predicts the next token through an LM head of its own: a decoder-only model that can
    generate and has output embeddings (a causal LM; not an encoder-decoder, not a masked LM)."""
    can_generate = getattr(model, "can_generate", None)
    get_output = getattr(model, "get_output_embeddings", None)
    config = getattr(model, "config", None)
    if not callable(can_generate) or not callable(get_output) or getattr(config, "is_encoder_decoder", False):
        return False
    return bool(can_generate()) and get_output() is not None


@dataclass
class Predictions:
    """One batch's predictions, on the host.

    ids: the predicted classes or tokens, flat. counts: with next-token predictions, how many of them each
    example holds (its valid positions), else None: one prediction per sample. log_probs: with the soft
    tie-break, the log-softmax (predictions, classes), else None.
    """

    ids: torch.Tensor
    counts: torch.Tensor | None = None
    log_probs: torch.Tensor | None = None


class _Stop(Exception):
    """Raised by the last block's hook when nothing after it is needed."""


def _to(batch: Batch, device: torch.device) -> Batch:
    return {k: v.to(device) for k, v in batch.items()}


@torch.no_grad()
def final_features(model: nn.Module, adapter: Adapter, batch: Batch, head: Head | None = None, task: str = "",
                   pooling: str = "auto", soft: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor | None, Predictions | None]:
    """(features, 0/1 token mask or None, the predictions or None) from ONE forward where possible.

    Features: the last stack's last block output (only the class token where the stack's output is
    read from it, CLIP/ViT). Without a head the forward stops after that block; an nn.Module head reads
    the model's pooled output of the same forward; the LM head reads its logits; a callable head runs the
    model itself and the block's output is taken from that forward (a second, stopped forward only if the
    head never reached it).
    """
    stack = adapter.stacks(model)[-1]
    block = stack.blocks(model)[-1]
    seen: dict[str, torch.Tensor] = {}
    stop = [head is None]

    def hook(_mod, _args, out):
        seen.setdefault("h", hidden_of(out))
        if stop[0]:
            raise _Stop

    handle = block.register_forward_hook(hook)
    output = logits = None
    try:
        if head is None or isinstance(head, NextToken):
            output = model(**accepted_inputs(model, batch))
        elif isinstance(head, nn.Module):
            output = model(**accepted_inputs(model, batch))
            logits = head(pooled_output(task, output, batch, pooling))
        else:
            logits = head(model, batch)
            if "h" not in seen:
                stop[0] = True
                model(**accepted_inputs(model, batch))
    except _Stop:
        pass
    finally:
        handle.remove()
    h = seen["h"].float()
    mask = adapter.token_mask(stack, batch, h)
    predictions = None
    if isinstance(head, NextToken):
        predictions = next_token_predictions(task, getattr(output, "logits", None), mask, soft)
    elif head is not None:
        predictions = head_predictions(task, logits, soft)
    if stack.class_token_head:
        h = h[:, :1]
        mask = None if mask is None else mask[:, :1]
    return h, mask, predictions


def pooled_output(task: str, output: Any, batch: Batch, pooling: str = "auto") -> torch.Tensor:
    """What an nn.Module head reads (tune_head_pooling): `pooler_output`, or the attention-masked token mean
    of `last_hidden_state` (sentence encoders), or auto: the first where the model has one."""
    pooled = getattr(output, "pooler_output", None)
    if pooling == "pooler" and pooled is None:
        raise ConfigError(f"head of task {task!r}: tune_head_pooling is 'pooler' but the model's output has no "
                          "pooler_output; use 'mean', or pass a callable head(model, batch) -> logits")
    if pooling != "mean" and pooled is not None:
        return pooled
    h = getattr(output, "last_hidden_state", None)
    if h is None:
        raise ConfigError(
            f"head of task {task!r}: the model's output has no last_hidden_state to pool; "
            "pass a callable head(model, batch) -> logits instead"
        )
    mask = batch.get("attention_mask")
    if mask is None:
        return h.mean(1)
    m = mask.to(h.dtype).unsqueeze(-1)
    return (h * m).sum(1) / m.sum(1).clamp_min(1.0)


def head_predictions(task: str, logits: Any, soft: bool) -> Predictions:
    """A head's predicted classes (and log-softmax as (predictions, classes) with `soft`), on the host."""
    if not isinstance(logits, torch.Tensor) or logits.dim() < 1:
        raise ConfigError(f"head of task {task!r} must return logits (a tensor), got {type(logits).__name__}")
    pred = logits.argmax(-1).flatten().cpu()
    if not soft:
        return Predictions(pred)
    return Predictions(pred, None, torch.log_softmax(logits.detach().float(), -1).reshape(-1, logits.shape[-1]).cpu())


def next_token_predictions(task: str, logits: Any, mask: torch.Tensor | None, soft: bool) -> Predictions:
    """The LM head's next-token prediction (argmax) at every valid position, padding excluded; with `soft` the
    log-softmax over the vocabulary at those positions (tokens × vocabulary floats: the soft tie-break's cost)."""
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3:
        raise ConfigError(f"task {task!r}: tune_next_token reads the model's next-token logits (batch, positions, "
                          f"vocabulary), but its output has {type(logits).__name__}; set tune_next_token false")
    valid = torch.ones(logits.shape[:2], dtype=torch.bool, device=logits.device) if mask is None else (
        mask.to(logits.device) > 0)
    ids = logits.argmax(-1)[valid].cpu()
    counts = valid.sum(1).cpu()
    if not soft:
        return Predictions(ids, counts)
    return Predictions(ids, counts, torch.log_softmax(logits[valid].float(), -1).cpu())


@dataclass
class Reference:
    """Expert t's features (and predictions) on task t's held-out batches, computed once."""

    features: list[tuple[torch.Tensor, torch.Tensor | None]]
    predictions: list[Predictions] | None


@torch.no_grad()
def expert_reference(task: str, expert: nn.Module, adapter: Adapter, batches: list[Batch], head: Head | None,
                     pooling: str = "auto", keep_log_probs: bool = False) -> Reference:
    """What every candidate is compared with: expert t's features and predictions on task t's held-out batches
    (log-probabilities kept only for the soft tie-break)."""
    dev = next(expert.parameters()).device
    feats, preds = [], [] if head is not None else None
    for b in batches:
        h, mask, pred = final_features(expert, adapter, _to(b, dev), head, task, pooling, keep_log_probs)
        feats.append((h.cpu(), None if mask is None else mask.cpu()))  # held on the host for all candidates
        if head is not None:
            preds.append(pred)
    return Reference(feats, preds)


def on_device(batch: Batch, model: nn.Module) -> Batch:
    """A held-out batch on the model's device."""
    return _to(batch, next(model.parameters()).device)
