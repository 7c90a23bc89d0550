"""Llama-family decoders (Llama, Mistral, Qwen2): RMSNorm, no biases, rotary embeddings.

Block 0's captured call carries the causal mask, position ids and the rotary (cos, sin) pair, which
every later block reuses unchanged. The capture runs with use_cache=False so no KV cache is threaded
through (and mutated by) the block calls."""

from __future__ import annotations

from torch import nn

from featcal.calibration.adapters.base import Adapter, Stack, first_existing
from featcal.errors import FeatCalError


class LlamaAdapter(Adapter):
    name = "llama"
    model_types = ("llama", "mistral", "qwen2")
    rms_classes = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm")
    capture_kwargs = {"use_cache": False}

    def stacks(self, model: nn.Module) -> list[Stack]:
        for prefix in ("model.", ""):
            path = first_existing(model, [prefix + "layers"])
            if path is not None:
                return [Stack("decoder", path, prefix.rstrip("."))]
        raise FeatCalError(f"{type(model).__name__}: cannot find the decoder layers")
