"""ViT (ViTModel, ViTFor*): blocks at `layers` (transformers 5) or `encoder.layer` (4.x), optionally
under `vit.`; the pooled output is the class token's, so the last block weighs other tokens less."""

from __future__ import annotations

from torch import nn

from featcal.blocks.adapters.base import Adapter, FinalNorm, Stack, final_norm_at, first_existing
from featcal.errors import FeatCalError


class ViTAdapter(Adapter):
    name = "vit"
    model_types = ("vit",)

    def stacks(self, model: nn.Module) -> list[Stack]:
        for prefix in ("", "vit."):
            path = first_existing(model, [prefix + "layers", prefix + "encoder.layer"])
            if path is not None:
                return [Stack("vision", path, prefix.rstrip("."), mask_key=None, class_token_head=True)]
        raise FeatCalError(f"{type(model).__name__}: cannot find the ViT encoder layers")

    def final_norm(self, model: nn.Module, stack: Stack) -> FinalNorm | None:
        """`layernorm`, applied to every token before the pooler / classifier reads the class token."""
        return final_norm_at(model, stack, "layernorm")
