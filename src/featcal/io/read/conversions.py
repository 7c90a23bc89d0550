"""Parameters that transformers builds from several checkpoint tensors, read one parameter at a time.

transformers 5 holds some weights in another layout than its checkpoints: a mixture of experts' experts
fused in 3-D tensors (Mixtral's `mlp.experts.gate_up_proj`, E × 2I × H) where `save_pretrained` writes, as
the hub's checkpoints hold them, one tensor per expert and projection (`block_sparse_moe.experts.0.w1.weight`,
`...experts.0.w3.weight`, ...). `from_pretrained` builds the parameter with the model's `WeightConverter`
(transformers.conversion_mapping: stack the experts, concatenate gate and up). `Conversion` records which
checkpoint tensors make up one such parameter, in the order the loader collects them, and `run` applies the
same converter to them, so that a block's experts are read from a checkpoint folder without loading the
model whole. `run` on meta tensors gives the parameters' names and shapes without reading anything.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Conversion:
    """One group of checkpoint tensors transformers converts into one (or several) parameters."""

    converter: Any  # transformers' WeightConverter, as its conversion mapping holds it (nothing collected)
    layer: str  # the parameter the loader files the group under (the converter's first target)
    sources: dict[str, list[str]] = field(default_factory=dict)  # source pattern -> checkpoint keys

    def add(self, pattern: str, key: str) -> None:
        self.sources.setdefault(pattern, []).append(key)

    def keys(self) -> list[str]:
        """Every checkpoint tensor of the group."""
        return [k for keys in self.sources.values() for k in keys]

    def run(self, read: Callable[[str], torch.Tensor], model: Any) -> dict[str, torch.Tensor]:
        """Parameter name -> value: the checkpoint tensors (`read(key)`) through the converter, in the order
        `from_pretrained` gives them to it (checkpoint keys in natural order: expert 10 after expert 9)."""
        from transformers.core_model_loading import dot_natural_key

        conv = copy.deepcopy(self.converter)
        for pattern, keys in self.sources.items():
            for key in sorted(keys, key=dot_natural_key):
                conv.add_tensor(self.layer, key, pattern, read(key))
        out = conv.convert(self.layer, model=model, config=getattr(model, "config", None))
        return {name: value[0] if isinstance(value, list) else value for name, value in out.items()}

    def shapes(self, meta: Callable[[str], tuple[tuple[int, ...], torch.dtype]],
               model: Any) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Parameter name -> (shape, dtype) of what `run` gives, from the tensors' headers (nothing read)."""
        def empty(key: str) -> torch.Tensor:
            shape, dtype = meta(key)
            return torch.empty(shape, dtype=dtype, device="meta")

        return {name: (tuple(v.shape), v.dtype) for name, v in self.run(empty, model).items()}
