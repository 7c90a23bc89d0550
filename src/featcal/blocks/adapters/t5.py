"""T5-style stacks (T5, mT5, ...): the one thing structure cannot show, a position bias handed block to block.

Block 0 of each stack computes the relative position bias (with the attention mask folded in) and returns
it after its hidden states; every later block receives it as `position_bias` (and, in the decoder, the
cross-attention's as `encoder_decoder_position_bias`). So a later block's context is block 0's context
with those taken from the previous block's output (`next_context`). Everything else (where the stacks
are, the teacher-forced decoder, the encoder's final norm before the decoder, RMS norms found by probing)
is the structural adapter's.

It is chosen by structure too: a stack whose blocks' forward takes `position_bias` (adapters/__init__.py).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from featcal.blocks.adapters.structural import StructuralAdapter
from featcal.blocks.structure import Stack, forward_inputs


def passes_position_bias(model: nn.Module, stacks: list[Stack]) -> bool:
    """Whether the blocks of some stack take a `position_bias` argument from the block before them."""
    return any("position_bias" in forward_inputs(s.blocks(model)[0]) for s in stacks)


class PositionBiasAdapter(StructuralAdapter):
    """The structural adapter, with the position bias threaded from each block to the next."""

    def next_context(self, stack: Stack, layer: int, ctx: dict[str, Any], output: Any) -> dict[str, Any]:
        if isinstance(output, tuple):
            ctx = dict(ctx)
            ctx["position_bias"] = output[1]
            if stack.cross_mask_key is not None and len(output) > 2:
                ctx["encoder_decoder_position_bias"] = output[2]
        return ctx

    def context_bytes(self, stack: Stack, tokens: int, hidden: int, heads: int) -> int:
        """The float32 relative position bias (heads, S, S); the decoder holds the cross-attention's too."""
        return heads * tokens * tokens * 4 * (2 if stack.cross_mask_key is not None else 1)
