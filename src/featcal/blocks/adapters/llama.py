"""Llama-family decoders (Llama, Mistral, Qwen2): RMSNorm, no biases, rotary embeddings.

Block 0's captured call carries the causal mask, position ids and the rotary (cos, sin) pair, which
every later block reuses unchanged. The capture runs with use_cache=False so no KV cache is threaded
through (and mutated by) the block calls."""

from __future__ import annotations

from torch import nn

from featcal.blocks.adapters.base import Adapter, FinalNorm, Stack, final_norm_at, first_existing
from featcal.errors import FeatCalError


class LlamaAdapter(Adapter):
    name = "llama"
    model_types = ("llama", "mistral", "qwen2")
    rms_classes = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm")
    capture_kwargs = {"use_cache": False}

    def context_bytes(self, stack: Stack, tokens: int, hidden: int, heads: int) -> int:
        """The float32 rotary cos and sin tables, (S, head_dim) each."""
        return 2 * tokens * (hidden // max(heads, 1)) * 4

    def stacks(self, model: nn.Module) -> list[Stack]:
        layer_types = getattr(model.config, "layer_types", None) or []
        if len(set(layer_types)) > 1:  # e.g. Qwen2 with sliding-window layers: one mask per layer type
            raise FeatCalError(
                f"{type(model).__name__} mixes attention layer types {sorted(set(layer_types))}; FeatCal reuses "
                "block 0's attention mask for every block, so only uniform layer types are supported"
            )
        for prefix in ("model.", ""):
            path = first_existing(model, [prefix + "layers"])
            if path is not None:
                return [Stack("decoder", path, prefix.rstrip("."))]
        raise FeatCalError(f"{type(model).__name__}: cannot find the decoder layers")

    def final_norm(self, model: nn.Module, stack: Stack) -> FinalNorm | None:
        """`norm` (RMS), between the last decoder layer and the LM head."""
        return final_norm_at(model, stack, "norm")
