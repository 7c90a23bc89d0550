"""BERT (BertModel and Bert*For* heads): the encoder blocks; padding tokens weigh 0 via attention_mask.

BERT has no final norm: every block ends in its own LayerNorm (calibrated with the block) and the pooler is
a Linear, so `calibrate_final_norm` is a no-op here (the engine logs it and records why)."""

from __future__ import annotations

from torch import nn

from featcal.blocks.adapters.base import Adapter, FinalNorm, Stack, final_norm_at, first_existing
from featcal.errors import FeatCalError


class BertAdapter(Adapter):
    name = "bert"
    model_types = ("bert",)

    def stacks(self, model: nn.Module) -> list[Stack]:
        for prefix in ("", "bert."):
            path = first_existing(model, [prefix + "encoder.layer"])
            if path is not None:
                return [Stack("encoder", path, prefix.rstrip("."))]
        raise FeatCalError(f"{type(model).__name__}: cannot find the BERT encoder layers")

    def stem_norm(self, model: nn.Module, stack: Stack) -> FinalNorm | None:
        """embeddings.LayerNorm: word + position + type embeddings, normalised, are block 0's input."""
        return final_norm_at(model, stack, "embeddings.LayerNorm")
