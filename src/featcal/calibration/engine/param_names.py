"""Which parameters a calibration reads and writes, by name: a block's, the stem's, and both together.

Why by name: experts and the base are read tensor by tensor from their files (io/read/param_sources.py), and the
resume checkpoints store each block's parameters under the merged model's own names.
"""

from __future__ import annotations

from torch import nn

from featcal.blocks.structure import Stack


def block_param_names(model: nn.Module, stack: Stack, layer: int) -> list[str]:
    """Full names of block `layer`'s parameters (tied aliases included)."""
    block = stack.blocks(model)[layer]
    prefix = f"{stack.blocks_path}.{layer}."
    return [prefix + n for n, _ in block.named_parameters(remove_duplicate=False)]


def stem_param_names(model: nn.Module, stacks: list[Stack]) -> list[str]:
    """Parameters outside every block but under a stack entry: what a forward to block 0 reads."""
    entries = [s.entry_path for s in stacks]
    blocks = [s.blocks_path + "." for s in stacks]
    names = []
    for n, _ in model.named_parameters(remove_duplicate=False):
        under_entry = any(e == "" or n.startswith(e + ".") for e in entries)
        if under_entry and not any(n.startswith(b) for b in blocks):
            names.append(n)
    return names


def needed_param_names(model: nn.Module, stacks: list[Stack]) -> tuple[list[str], list[str]]:
    """(stem names, block names): every parameter an expert must provide; the base, the block ones."""
    blocks = [n for s in stacks for layer in range(len(s.blocks(model))) for n in block_param_names(model, s, layer)]
    return stem_param_names(model, stacks), blocks
