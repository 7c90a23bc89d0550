"""CLIP vision encoders: CLIPVisionModel (5.x flat layout or 4.x `vision_model.` wrapper) and CLIPModel's
vision tower. Only the vision encoder blocks are calibrated; the stem (embeddings + pre_layrnorm) and the
head (post_layernorm, projection) stay merged, unless `calibrate_final_norm` (post_layernorm, which reads
the class token alone). The output is read from the class token only."""

from __future__ import annotations

from torch import nn

from featcal.blocks.adapters.base import Adapter, FinalNorm, Stack, final_norm_at, first_existing


class CLIPAdapter(Adapter):
    name = "clip"
    model_types = ("clip", "clip_vision_model")

    def stacks(self, model: nn.Module) -> list[Stack]:
        path = first_existing(model, ["encoder.layers", "vision_model.encoder.layers"])
        if path is None:
            from featcal.errors import FeatCalError

            raise FeatCalError(f"{type(model).__name__}: cannot find the CLIP vision encoder layers")
        entry = path[: -len("encoder.layers")].rstrip(".")
        return [Stack("vision", path, entry, mask_key=None, class_token_head=True)]

    def stem_norm(self, model: nn.Module, stack: Stack) -> FinalNorm | None:
        """pre_layrnorm (sic, transformers' name), between the embeddings and block 0, on every token."""
        return final_norm_at(model, stack, "pre_layrnorm")

    def final_norm(self, model: nn.Module, stack: Stack) -> FinalNorm | None:
        """post_layernorm, which CLIP applies to the class token alone (the pooled output)."""
        return final_norm_at(model, stack, "post_layernorm", class_token_only=True)
