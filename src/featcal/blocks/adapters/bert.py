"""BERT (BertModel and Bert*For* heads): the encoder blocks; padding tokens weigh 0 via attention_mask."""

from __future__ import annotations

from torch import nn

from featcal.blocks.adapters.base import Adapter, Stack, first_existing
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
