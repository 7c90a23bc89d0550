"""What the engine needs to know about an architecture, and nothing about the maths.

An adapter says where the stacks of residual blocks are, which module to call with a calibration batch
to reach a stack's first block, how the block-to-block context changes (T5's shared position bias) and
which arguments each block gets (per-layer-type masks), which tokens count, and where the norms outside
the blocks are. `StructuralAdapter` (adapters/structural.py) answers all of it from the model's structure;
this base class holds the defaults and the batch checks. Calibrated modules inside a block are found by
kind (blocks/discovery.py): every linear layer (nn.Linear, transformers' Conv1D) and every norm whose
computation a probe recognises (blocks/norms.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from featcal.blocks.capture import capture_block_input
from featcal.blocks.structure import Stack, get_path
from featcal.errors import CalibrationDataError


@dataclass(frozen=True)
class FinalNorm:
    """The norm a stack's output goes through before the model's head (FeatCalConfig.calibrate_final_norm)."""

    path: str  # dotted path from the top model ("post_layernorm", "model.norm", "decoder.final_layer_norm")
    module: nn.Module
    # it normalises the class token alone (CLIP's post_layernorm on the pooled token): the other tokens never
    # reach it, so only the class token enters its statistics
    class_token_only: bool = False

    def param_names(self) -> list[str]:
        """Its parameters' full names in the top model (what experts and base must provide)."""
        return [f"{self.path}.{n}" for n, _ in self.module.named_parameters()]


class Adapter(ABC):
    """Base adapter: defaults for models whose stack entry is called with the batch as keywords."""

    name = "base"
    # key / value projections by transformers' names: in a class-token-read stack's last block they keep every
    # token's weight, since every token's key and value feed the class token (docs/method.md §4)
    kv_names: tuple[str, ...] = ("k_proj", "v_proj", "key", "value", "k", "v")
    capture_kwargs: dict[str, Any] = {}
    # int64 tensors per token a text calibration batch holds: input_ids and attention_mask
    token_tensors: int = 2

    @abstractmethod
    def stacks(self, model: nn.Module) -> list[Stack]:
        """The model's stacks of blocks, in forward order."""

    def prepare(self, model: nn.Module) -> None:
        """Anything the adapter must learn from running `model` before it is split across devices: nothing here."""
        return None

    # --- inputs -------------------------------------------------------------------------
    def main_input(self, model: nn.Module, stack: Stack) -> str:
        entry = get_path(model, stack.entry_path)
        return getattr(entry, "main_input_name", None) or getattr(model, "main_input_name", "input_ids")

    def max_tokens(self, config: Any) -> int | None:
        """The most tokens per example the model takes (its absolute position table); None: no limit."""
        return getattr(config, "max_position_embeddings", None)

    def check_batch(self, config: Any, batch: dict[str, torch.Tensor], main_input: str, where: str) -> None:
        """Cheap checks that one calibration batch fits the model (its `config`), so a bad one fails before
        any work and not deep in a forward; CalibrationDataError naming `where` (task and batch)."""
        if main_input not in batch and "inputs_embeds" not in batch:
            raise CalibrationDataError(f"{where}: no {main_input!r} (keys: {sorted(batch)})")
        x = batch.get(main_input)
        if x is None:
            return
        if x.numel() == 0:
            raise CalibrationDataError(f"{where}: {main_input!r} is empty")
        if main_input == "input_ids":
            _check_token_ids(config, batch, x, where, self.max_tokens(config))
        elif main_input == "pixel_values":
            _check_pixels(config, x, where)

    def context_bytes(self, stack: Stack, tokens: int, hidden: int, heads: int) -> int:
        """Bytes per example a text block's context holds beyond its attention mask (planner.py): none here;
        T5's position bias, Llama's rotary tables."""
        return 0

    def stack_call(
        self, model: nn.Module, stack: Stack, batch: dict[str, torch.Tensor], upstream: torch.Tensor | None
    ) -> tuple[nn.Module, dict[str, Any]]:
        """The module and keyword arguments whose forward reaches the stack's block 0.

        `upstream` is the previous stack's final output (None for the first stack).
        """
        entry = get_path(model, stack.entry_path)
        return entry, {**accepted_inputs(entry, batch), **self.capture_kwargs}

    def final_norm(self, model: nn.Module, stack: Stack) -> FinalNorm | None:
        """The norm between `stack`'s last block and the head, or None: the architecture has none (BERT's
        blocks end in their own LayerNorm, and its pooler is a Linear). Used for the last stack only."""
        return None

    def stem_norm(self, model: nn.Module, stack: Stack) -> FinalNorm | None:
        """The norm inside the stem whose output is block 0's input (BERT's embeddings.LayerNorm, CLIP's
        pre_layrnorm), or None: the architecture has none there. Used for the first stack only
        (FeatCalConfig.calibrate_stem_norm)."""
        return None

    def stack_output(self, model: nn.Module, stack: Stack, hidden: torch.Tensor) -> torch.Tensor:
        """The stack's output from its last block's output (e.g. a final norm), for the next stack."""
        return hidden

    def next_context(self, stack: Stack, layer: int, ctx: dict[str, Any], output: Any) -> dict[str, Any]:
        """The context (non-hidden arguments) of block layer+1, given block `layer`'s raw output."""
        return ctx

    def capture(self, module: nn.Module, stack: Stack, model: nn.Module,
                kwargs: dict[str, Any]) -> tuple[torch.Tensor, dict[str, Any]]:
        """Block 0's hidden input and the chain context kept with it, from `module(**kwargs)` (stack_call's).

        Here the context is what block 0 is called with. An adapter whose blocks get arguments that
        differ by layer (Gemma 3's per-type masks and rotary tables) keeps them all here and picks
        each block's in `block_kwargs`.
        """
        return capture_block_input(module, stack.blocks(model)[0], kwargs)

    def block_kwargs(self, stack: Stack, layer: int, ctx: dict[str, Any]) -> dict[str, Any]:
        """The keyword arguments block `layer` is called with, from its chain's context: the context itself here."""
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
        weighs 0 in both. Tokens flattened to (B·S, d) (a mixture of experts' block flattens them before its
        shared expert: Qwen2-MoE) take the mask flattened alike. A mask that does not fit x's token shape is
        refused.
        """
        mask = self.token_mask(stack, batch, x, cross=self.is_cross_module(stack, module_name))
        if mask is None:
            return None
        lead = tuple(x.shape[:-1])
        if len(lead) == 1 and mask.dim() == 2 and lead[0] == mask.numel():
            mask = mask.reshape(-1)
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
        """A weight-only RMS-type norm, recognised by what it computes (blocks/norms.py)."""
        from featcal.blocks.norms import norm_form

        form = norm_form(module)
        return form is not None and not form.centred


def _check_token_ids(config: Any, batch: dict[str, torch.Tensor], x: torch.Tensor, where: str,
                     limit: int | None) -> None:
    vocab = getattr(config, "vocab_size", None)
    if x.is_floating_point() or x.dim() != 2:
        raise CalibrationDataError(f"{where}: input_ids must be integer (batch, tokens), got {x.dtype} {tuple(x.shape)}")
    if vocab is not None and (int(x.max()) >= vocab or int(x.min()) < 0):
        raise CalibrationDataError(f"{where}: input_ids outside the vocabulary [0, {vocab})")
    mask = batch.get("attention_mask")
    if mask is not None and tuple(mask.shape) != tuple(x.shape):
        raise CalibrationDataError(
            f"{where}: attention_mask {tuple(mask.shape)} does not match input_ids {tuple(x.shape)}"
        )
    if limit is not None and x.shape[1] > limit:
        raise CalibrationDataError(f"{where}: {x.shape[1]} tokens, the model takes at most {limit}")


def _check_pixels(config: Any, x: torch.Tensor, where: str) -> None:
    if x.dim() != 4:
        raise CalibrationDataError(
            f"{where}: pixel_values must be (batch, channels, height, width), got {tuple(x.shape)}"
        )
    vision = getattr(config, "vision_config", config)
    channels, size = getattr(vision, "num_channels", None), getattr(vision, "image_size", None)
    if channels is not None and x.shape[1] != channels:
        raise CalibrationDataError(f"{where}: pixel_values have {x.shape[1]} channels, the model takes {channels}")
    if isinstance(size, int) and tuple(x.shape[2:]) != (size, size):
        raise CalibrationDataError(
            f"{where}: pixel_values are {tuple(x.shape[2:])} pixels, the model takes ({size}, {size})"
        )


def accepted_inputs(module: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The batch entries `module.forward` names as parameters (labels and the like are left out)."""
    import inspect

    params = inspect.signature(module.forward).parameters
    named = {n for n, p in params.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    return {k: v for k, v in batch.items() if k in named}

