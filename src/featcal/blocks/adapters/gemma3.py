"""Gemma 3 text decoders (Gemma3ForCausalLM, Gemma3TextModel; model_type "gemma3_text").

What differs from Llama, and what FeatCal does about it:

- Norms are Gemma3RMSNorm, y = z·(1 + w), with w stored (zeros at init). The RMS solve is a weighted
  mean, γ = (Σt et γt + λ γ̄)/(Σt et + λ), whose coefficients sum to 1 per channel, and the anchor
  ρ·θm + (1−ρ)·θ0 is an affine blend too: solving on the stored w gives exactly the w whose 1 + w is
  the solve on γ = 1 + w, so w is calibrated as stored, with no conversion (merges act on task
  vectors, where the 1 cancels as well). tests/test_gemma3.py checks it against a solve on 1 + w.
- Four norms per block (input, post-attention, pre- and post-feed-forward), all calibrated, and the
  attention's per-head query and key norms (q_norm, k_norm), whose input is (batch, heads, tokens,
  head_dim): the token mask is broadcast over the heads, each (token, head) row one sample of the
  per-channel moments, padding weighing 0.
- Blocks are sliding-window or global (config.layer_types), and the model calls each type with its
  own attention mask and its own rotary table (different bases). Replaying block 0's arguments
  would give a global block a sliding mask. So the chain context holds one set of arguments per
  type, taken from the model's own calls of every block (`capture_block_calls`: no block computes)
  and checked identical within a type; `block_kwargs` hands each block its type's.
- The scaled embedding, the final norm and the tied LM head are outside the blocks: they stay merged
  (the final norm, `norm`, is solved as the in-block ones with `calibrate_final_norm`, w as stored).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from featcal.blocks.adapters.base import Adapter, FinalNorm, Stack, final_norm_at, first_existing, get_path
from featcal.blocks.capture import capture_block_calls
from featcal.errors import CalibrationDataError, FeatCalError


def _identical(a: Any, b: Any) -> bool:
    """The same object, or tensors (tuples of tensors) of equal shape and values."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_identical(x, y) for x, y in zip(a, b, strict=True))
    return False


class Gemma3Adapter(Adapter):
    name = "gemma3"
    model_types = ("gemma3_text",)
    rms_classes = ("Gemma3RMSNorm",)
    capture_kwargs = {"use_cache": False}
    head_norms = ("q_norm", "k_norm")  # per-head norms: input (batch, heads, tokens, head_dim)

    def __init__(self) -> None:
        self._head_dim: int | None = None  # from the config, once stacks() has seen the model

    def stacks(self, model: nn.Module) -> list[Stack]:
        config = model.config
        self._head_dim = getattr(config, "head_dim", None)
        for prefix in ("model.", ""):
            path = first_existing(model, [prefix + "layers"])
            if path is None:
                continue
            n = len(get_path(model, path))
            types = tuple(getattr(config, "layer_types", None) or ())
            if len(types) < n:
                raise FeatCalError(f"{type(model).__name__}: config.layer_types names {len(types)} layer types "
                                   f"for {n} blocks")
            return [Stack("decoder", path, prefix.rstrip("."), layer_types=types[:n])]
        raise FeatCalError(f"{type(model).__name__}: cannot find the decoder layers")

    def final_norm(self, model: nn.Module, stack: Stack) -> FinalNorm | None:
        """`norm` (Gemma3RMSNorm), between the last decoder layer and the LM head."""
        return final_norm_at(model, stack, "norm")

    # --- per-type block arguments ---------------------------------------------------------------
    def capture(self, module: nn.Module, stack: Stack, model: nn.Module,
                kwargs: dict[str, Any]) -> tuple[torch.Tensor, dict[str, Any]]:
        """Block 0's input and {"shared": arguments every type gets, "by_type": {type: the rest}}."""
        hidden, calls = capture_block_calls(module, stack.blocks(model), kwargs)
        first: dict[str, tuple[int, dict[str, Any]]] = {}
        for i, (kind, call) in enumerate(zip(stack.layer_types, calls, strict=True)):
            j, ref = first.setdefault(kind, (i, call))
            if ref is not call and (ref.keys() != call.keys() or not all(_identical(ref[k], call[k]) for k in ref)):
                raise FeatCalError(
                    f"{type(model).__name__}: block {i} ({kind}) is called with other arguments than block {j} "
                    "of the same type; FeatCal keeps one set of block arguments per layer type"
                )
        per_type = {kind: call for kind, (_, call) in first.items()}
        calls0 = next(iter(per_type.values()))
        shared = {k: v for k, v in calls0.items() if all(k in c and c[k] is v for c in per_type.values())}
        by_type = {kind: {k: v for k, v in c.items() if k not in shared} for kind, c in per_type.items()}
        return hidden, {"shared": shared, "by_type": by_type}

    def block_kwargs(self, stack: Stack, layer: int, ctx: dict[str, Any]) -> dict[str, Any]:
        return {**ctx["shared"], **ctx["by_type"][stack.layer_types[layer]]}

    def context_bytes(self, stack: Stack, tokens: int, hidden: int, heads: int) -> int:
        """Per layer type a float32 rotary cos and sin (S, head_dim); each type past the first, one more mask."""
        types = max(len(set(stack.layer_types)), 1)
        head_dim = self._head_dim or hidden // max(heads, 1)
        return types * 2 * tokens * head_dim * 4 + (types - 1) * tokens * tokens

    # --- token weights --------------------------------------------------------------------------
    def module_mask(self, stack: Stack, batch: dict[str, torch.Tensor], module_name: str,
                    x: torch.Tensor) -> torch.Tensor | None:
        """The stack's token mask; for the per-head q/k norms, broadcast over their heads (B, H, S)."""
        if module_name.rsplit(".", 1)[-1] not in self.head_norms or x.dim() != 4:
            return super().module_mask(stack, batch, module_name, x)
        mask = self.token_mask(stack, batch, x)
        if mask is None:
            return None
        b, h, s = x.shape[:3]
        if tuple(mask.shape) != (b, s):
            raise CalibrationDataError(
                f"token mask of shape {tuple(mask.shape)} does not match the input of {module_name} "
                f"({b}, heads, {s})"
            )
        return mask[:, None, :].expand(b, h, s).to(x.device)
