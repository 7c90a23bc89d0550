"""Residual blocks of any transformers model, found without per-architecture tables, for RegMean++.

Blocks are the children of the outermost `nn.ModuleList`s that contain Linear layers (CLIP/ViT/BERT
encoder layers, Llama decoder layers, T5 encoder and decoder blocks), ordered as one real forward
pass calls them. To run a block on the merged model's own propagated input, the model is run
whole and stopped right after that block: the model itself supplies every mask, position bias or
rotary embedding its blocks need, so no architecture knowledge is copied here. The price is that
block l re-runs blocks < l: O(L²) block forwards per task instead of O(L) for a cached chain (the
FeatCal engine's block-input capture would remove that; see docs/baselines.md).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from featcal.baselines.inputs import Batch, call_model


class _StopForward(Exception):
    """Raised from a block's forward hook to end a forward pass once that block has run."""


def _block_lists(model: nn.Module) -> list[tuple[str, nn.ModuleList]]:
    lists = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList)]
    outer = [
        (n, m) for n, m in lists
        if not any(n != o and n.startswith(o + ".") for o, _ in lists)
    ]
    return [(n, m) for n, m in outer if any(isinstance(s, nn.Linear) for s in m.modules())]


@torch.no_grad()
def find_blocks(model: nn.Module, probe: Batch) -> list[str]:
    """Names of the model's blocks (e.g. 'encoder.layers.0') in the order a forward on `probe` runs them."""
    order: list[str] = []
    handles = []
    for list_name, blocks in _block_lists(model):
        for i, block in enumerate(blocks):
            name = f"{list_name}.{i}" if list_name else str(i)
            handles.append(block.register_forward_pre_hook(
                lambda _m, _a, name=name: order.append(name) if name not in order else None
            ))
    try:
        call_model(model, probe)
    finally:
        for h in handles:
            h.remove()
    return order


def _parent(model: nn.Module, block_name: str) -> tuple[nn.ModuleList, int]:
    list_name, _, index = block_name.rpartition(".")
    parent = model.get_submodule(list_name) if list_name else model
    return parent, int(index)


@contextmanager
def swapped_block(model: nn.Module, block_name: str, replacement: nn.Module) -> Iterator[nn.Module]:
    """`model` with block `block_name` temporarily replaced (e.g. by an expert's block)."""
    parent, index = _parent(model, block_name)
    original = parent[index]
    parent[index] = replacement
    try:
        yield model
    finally:
        parent[index] = original


@torch.no_grad()
def run_until(model: nn.Module, block_name: str, batch: Batch) -> None:
    """Forward `batch` through `model` and stop as soon as block `block_name` has returned."""
    parent, index = _parent(model, block_name)

    def stop(_m, _args, _out):
        raise _StopForward

    handle = parent[index].register_forward_hook(stop)
    try:
        call_model(model, batch)
    except _StopForward:
        pass
    finally:
        handle.remove()
