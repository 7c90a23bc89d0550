"""The expert template: a copy of the merged model into which each expert's parameters are loaded, block by block.

Why lean: every block parameter of the template is overwritten with an expert's value before it is read (a
block's parameters are loaded whole, for each task, inside that block's calibration), so a full copy of the
blocks carried nothing. The template keeps storage for its stems (embeddings, final norms, heads: what the
forwards to block 0 and the outer norms read) for the whole run; a block's parameters get storage while that
block is calibrated and give it back after, so the template costs the stems and one block instead of a second
whole model (for the 1B decoder's plan in float32: 1.2 instead of 4.6 GiB; docs/bench-scaling.md).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from featcal.blocks.structure import Stack


def expert_template(model: nn.Module, stacks: Sequence[Stack]) -> nn.Module:
    """A copy of `model` whose block parameters hold no storage (same names, dtypes and devices; shape (0,)).

    The blocks' parameters are never copied: deepcopy's memo maps each to an empty parameter, so tied ones stay
    tied and the peak while copying is the stems only."""
    memo: dict[int, nn.Parameter] = {}
    for stack in stacks:
        for block in stack.blocks(model):
            for p in block.parameters():
                memo[id(p)] = nn.Parameter(p.detach().new_empty(0), requires_grad=p.requires_grad)
    return copy.deepcopy(model, memo)


@contextmanager
def block_storage(expert_block: nn.Module, merged_block: nn.Module) -> Iterator[None]:
    """Storage for the template's block while it is calibrated, shaped, typed and placed like the merged block's
    parameters (uninitialised: each task's expert values are loaded into all of them before any is read);
    released after, also when the block fails."""
    merged = dict(merged_block.named_parameters())
    params = dict(expert_block.named_parameters())
    for name, p in params.items():
        p.data = torch.empty_like(merged[name])
    try:
        yield
    finally:
        for p in params.values():
            p.data = p.data.new_empty(0)
