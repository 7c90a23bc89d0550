"""Architecture adapters: pick one by `config.model_type`; unknown architectures are refused by name."""

from __future__ import annotations

from torch import nn

from featcal.blocks.adapters.base import Adapter, FinalNorm, Stack
from featcal.blocks.adapters.bert import BertAdapter
from featcal.blocks.adapters.clip import CLIPAdapter
from featcal.blocks.adapters.dinov2 import Dinov2Adapter
from featcal.blocks.adapters.gemma3 import Gemma3Adapter
from featcal.blocks.adapters.llama import LlamaAdapter
from featcal.blocks.adapters.t5 import T5Adapter
from featcal.blocks.adapters.vit import ViTAdapter
from featcal.errors import FeatCalError

ADAPTERS: tuple[type[Adapter], ...] = (
    CLIPAdapter, ViTAdapter, Dinov2Adapter, BertAdapter, T5Adapter, LlamaAdapter, Gemma3Adapter,
)

__all__ = ["ADAPTERS", "Adapter", "FinalNorm", "Stack", "adapter_for"]


def adapter_for(model: nn.Module) -> Adapter:
    """The adapter for `model`, chosen by its config.model_type; FeatCalError names unsupported classes."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    for cls in ADAPTERS:
        if model_type in cls.model_types:
            return cls()
    supported = ", ".join(t for cls in ADAPTERS for t in cls.model_types)
    raise FeatCalError(
        f"FeatCal does not support {type(model).__name__} (model_type {model_type!r}); supported model types: {supported}"
    )
