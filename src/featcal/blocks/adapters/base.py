"""What the engine needs to know about an architecture, and nothing about the maths.

An adapter says where the stacks of residual blocks are (in both the transformers-5 and the 4.x
module layouts), which module to call with a calibration batch to reach a stack's first block,
how the block-to-block context changes (T5's shared position bias), which tokens count, and which
norms are weight-only RMS norms. Calibrated modules inside a block are found by type: every
`nn.Linear`, every `nn.LayerNorm`, and the adapter's RMS norm classes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from featcal.errors import CalibrationDataError, FeatCalError


def get_path(root: nn.Module, path: str) -> nn.Module | None:
    """The sub-module at dotted `path` ("" is the root itself), or None."""
    mod: Any = root
    for part in filter(None, path.split(".")):
        mod = getattr(mod, part, None)
        if mod is None:
            return None
    return mod


@dataclass(frozen=True)
class Stack:
    """One stack of residual blocks, calibrated in forward order."""

    name: str  # "encoder", "decoder", "vision", ...
    blocks_path: str  # dotted path of the nn.ModuleList of blocks, from the top model
    entry_path: str  # module called with the batch to reach block 0
    mask_key: str | None = "attention_mask"  # batch key of the 0/1 token mask of this stack's tokens
    class_token_head: bool = False  # output read from token 0 only (CLIP/ViT): last-block weighting
    cross_mask_key: str | None = None  # mask of the tokens cross-attention k/v read (T5 decoder)
    cross_modules: tuple[str, ...] = field(default_factory=tuple)  # name suffixes of those modules

    def blocks(self, model: nn.Module) -> nn.ModuleList:
        mod = get_path(model, self.blocks_path)
        if not isinstance(mod, nn.ModuleList):
            raise FeatCalError(f"{type(model).__name__}: no block list at {self.blocks_path!r}")
        return mod


class Adapter(ABC):
    """Base adapter: defaults for models whose stack entry is called with the batch as keywords."""

    name = "base"
    model_types: tuple[str, ...] = ()
    rms_classes: tuple[str, ...] = ()
    kv_names: tuple[str, ...] = ("k_proj", "v_proj", "key", "value", "k", "v")
    capture_kwargs: dict[str, Any] = {}

    @abstractmethod
    def stacks(self, model: nn.Module) -> list[Stack]:
        """The model's stacks of blocks, in forward order."""

    # --- inputs -------------------------------------------------------------------------
    def main_input(self, model: nn.Module, stack: Stack) -> str:
        entry = get_path(model, stack.entry_path)
        return getattr(entry, "main_input_name", None) or getattr(model, "main_input_name", "input_ids")

    def stack_call(
        self, model: nn.Module, stack: Stack, batch: dict[str, torch.Tensor], upstream: torch.Tensor | None
    ) -> tuple[nn.Module, dict[str, Any]]:
        """The module and keyword arguments whose forward reaches the stack's block 0.

        `upstream` is the previous stack's final output (None for the first stack).
        """
        entry = get_path(model, stack.entry_path)
        return entry, {**accepted_inputs(entry, batch), **self.capture_kwargs}

    def stack_output(self, model: nn.Module, stack: Stack, hidden: torch.Tensor) -> torch.Tensor:
        """The stack's output from its last block's output (e.g. a final norm), for the next stack."""
        return hidden

    def next_context(self, stack: Stack, layer: int, ctx: dict[str, Any], output: Any) -> dict[str, Any]:
        """The context (non-hidden arguments) of block layer+1, given block `layer`'s raw output."""
        return ctx

    # --- token weights ------------------------------------------------------------------
    def token_mask(self, stack: Stack, batch: dict[str, torch.Tensor], hidden: torch.Tensor, cross: bool = False):
        """0/1 validity of each token (B, S) of the stack's tokens, or of cross-attention's keys."""
        key = stack.cross_mask_key if cross else stack.mask_key
        mask = batch.get(key) if key else None
        if mask is None:
            return None
        if mask.dim() != 2:
            raise CalibrationDataError(f"{key} must be (batch, tokens), got shape {tuple(mask.shape)}")
        return mask.to(torch.float32)

    def module_mask(
        self, stack: Stack, batch: dict[str, torch.Tensor], module_name: str, x: torch.Tensor
    ) -> torch.Tensor | None:
        """0/1 weights (on x's device) of the tokens in x (..., d), the input of `module_name` in `stack`.

        The stack's token mask, or for cross-attention k/v the mask of the keys they read; None when
        every token counts. Shared by FeatCal's statistics and RegMean's Grams, so that padding
        weighs 0 in both. A mask that does not fit x's token shape is refused.
        """
        mask = self.token_mask(stack, batch, x, cross=self.is_cross_module(stack, module_name))
        if mask is None:
            return None
        lead = tuple(x.shape[:-1])
        if tuple(mask.shape) != lead:
            raise CalibrationDataError(
                f"token mask of shape {tuple(mask.shape)} does not match the input of {module_name} ({lead})"
            )
        return mask.to(x.device)

    def is_cross_module(self, stack: Stack, module_name: str) -> bool:
        return any(module_name.endswith(suffix) for suffix in stack.cross_modules)

    def is_kv(self, module_name: str) -> bool:
        return module_name.rsplit(".", 1)[-1] in self.kv_names

    def is_rms(self, module: nn.Module) -> bool:
        return type(module).__name__ in self.rms_classes


def accepted_inputs(module: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The batch entries `module.forward` names as parameters (labels and the like are left out)."""
    import inspect

    params = inspect.signature(module.forward).parameters
    named = {n for n, p in params.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    return {k: v for k, v in batch.items() if k in named}


def first_existing(model: nn.Module, candidates: list[str]) -> str | None:
    """The first dotted path among `candidates` naming an nn.ModuleList in `model`."""
    for c in candidates:
        if isinstance(get_path(model, c), nn.ModuleList):
            return c
    return None
