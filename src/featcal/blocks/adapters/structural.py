"""The adapter of every supported model: what the engine needs to know, found from the model's structure.

- Stacks, entries, encoder / decoder pairs and vision towers: blocks/structure.py.
- Calibrated modules by kind (Linear, Conv1D, LayerNorm, probed RMS norms): blocks/discovery.py.
- Block arguments are captured from the running model. Where every block is called alike, block 0's call
  (masks, position ids, rotary tables) is replayed in every block. Where the config names several layer
  types (sliding-window and full attention: Gemma 2 / 3, Mistral / Qwen2 with sliding windows, ModernBERT),
  each block's own call is recorded while the model runs with its blocks passing their input through (no
  block computes), the calls are checked identical within a type, and each block gets its type's. Either
  way the engine checks once, on one batch, that every block is called as it would replay
  (calibration/engine/driver.py, `check_context_replay`): an architecture calling its blocks otherwise is refused.
- An encoder-decoder's decoder is teacher-forced with `decoder_input_ids` (else `labels` shifted right,
  else one decoder start token); its cross-attention reads the encoder's output after the encoder's final
  norm, each side's own (blocks/probe.py finds that norm). The decoder modules reading the encoder's output
  (cross-attention keys and values, whose tokens are the encoder's) are found by calling the decoder's block
  0 once on a made-up input and seeing which Linears read it (blocks/structure.py).
- Norms outside the blocks (the stem norm before block 0, the final norm before the head) come from the
  probe too (blocks/probe.py), and only when they are asked for.

Per-family code is left only where a family's blocks hand each other something the structure cannot show:
T5's relative position bias, computed by block 0 and passed on (adapters/t5.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from featcal.blocks.adapters.base import Adapter, FinalNorm, accepted_inputs
from featcal.blocks.capture import capture_block_calls, capture_block_input
from featcal.blocks.probe import StackProbe, probe_stacks
from featcal.blocks.structure import Stack, forward_inputs, get_path, make_stacks, modules_reading_encoder
from featcal.errors import CalibrationDataError, FeatCalError, UnsupportedModelError


def _identical(a: Any, b: Any) -> bool:
    """The same object, or tensors (tuples of tensors) of equal shape and values."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_identical(x, y) for x, y in zip(a, b, strict=True))
    return a == b if isinstance(a, (bool, int, float, str, type(None))) else False


def shift_right(labels: torch.Tensor, start: int, pad: int) -> torch.Tensor:
    """Decoder inputs from labels: the start token, then the labels but the last; -100 (ignored) as padding."""
    shifted = labels.new_zeros(labels.shape)
    shifted[..., 1:] = labels[..., :-1].clone()
    shifted[..., 0] = start
    shifted.masked_fill_(shifted == -100, pad)
    return shifted


class StructuralAdapter(Adapter):
    """Any block-stacked transformers model; see the module docstring."""

    name = "structural"

    def __init__(self, model: nn.Module | None = None) -> None:
        config = getattr(model, "config", None)
        self.name = str(getattr(config, "model_type", None) or type(model).__name__)
        self._config = config
        self._probe: dict[str, StackProbe] | None = None
        self._cross: dict[str, tuple[str, ...]] = {}

    # --- where the blocks are ----------------------------------------------------------------------
    def stacks(self, model: nn.Module) -> list[Stack]:
        return make_stacks(model, self._cross_modules)

    def _cross_modules(self, model: nn.Module, blocks_path: str) -> tuple[str, ...]:
        """Names (inside a decoder block) of the linear layers that read the encoder's output."""
        if blocks_path not in self._cross:
            self._cross[blocks_path] = modules_reading_encoder(model, blocks_path)
        return self._cross[blocks_path]

    def main_input(self, model: nn.Module, stack: Stack) -> str:
        entry = get_path(model, stack.entry_path)
        return getattr(entry, "main_input_name", None) or getattr(model, "main_input_name", "input_ids")

    @property
    def token_tensors(self) -> int:  # type: ignore[override]
        """int64 tensors per token a text batch holds: ids and mask, and the decoder's for an encoder-decoder."""
        return 4 if getattr(self._config, "is_encoder_decoder", False) else 2

    # --- calling the stacks ----------------------------------------------------------------------
    def stack_call(self, model: nn.Module, stack: Stack, batch: dict[str, torch.Tensor],
                   upstream: torch.Tensor | None) -> tuple[nn.Module, dict[str, Any]]:
        entry = get_path(model, stack.entry_path)
        names = forward_inputs(entry)
        if stack.cross_mask_key is not None:  # the decoder of an encoder-decoder
            return entry, self._decoder_call(model, names, batch, upstream)
        kwargs = accepted_inputs(entry, batch)
        if "use_cache" in names:
            kwargs["use_cache"] = False  # no KV cache threaded through (and mutated by) the block calls
        return entry, kwargs

    def _decoder_call(self, model: nn.Module, names: set[str], batch: dict[str, torch.Tensor],
                      upstream: torch.Tensor | None) -> dict[str, Any]:
        if upstream is None:
            raise CalibrationDataError(f"the {type(model).__name__} decoder needs the encoder output")
        config = model.config
        start = getattr(config, "decoder_start_token_id", None)
        pad = getattr(config, "pad_token_id", None)
        start = pad if start is None else start
        dec = batch.get("decoder_input_ids")
        if dec is None and batch.get("labels") is not None:
            dec = shift_right(batch["labels"], int(start), int(pad if pad is not None else 0))
        if dec is None:
            dec = torch.full((upstream.shape[0], 1), int(start), dtype=torch.long, device=upstream.device)
        kwargs: dict[str, Any] = {
            "input_ids": dec, "encoder_hidden_states": upstream, "use_cache": False,
            "attention_mask": batch.get("decoder_attention_mask"), "encoder_attention_mask": batch.get("attention_mask"),
        }
        return {k: v for k, v in kwargs.items() if k in names}

    def capture(self, module: nn.Module, stack: Stack, model: nn.Module,
                kwargs: dict[str, Any]) -> tuple[torch.Tensor, dict[str, Any]]:
        """Block 0's input and its call's other arguments; with several layer types, those of each type
        ({"shared": every type's, "by_type": {type: the rest}}), recorded from the model's own calls."""
        if not stack.layer_types:
            return capture_block_input(module, stack.blocks(model)[0], kwargs)
        hidden, calls = capture_block_calls(module, stack.blocks(model), kwargs)
        first: dict[str, tuple[int, dict[str, Any]]] = {}
        for i, (kind, call) in enumerate(zip(stack.layer_types, calls, strict=True)):
            j, ref = first.setdefault(kind, (i, call))
            if ref is not call and (ref.keys() != call.keys() or not all(_identical(ref[k], call[k]) for k in ref)):
                raise FeatCalError(
                    f"{type(model).__name__}: block {i} ({kind}) is called with other arguments than block {j} "
                    "of the same type; FeatCal keeps one set of block arguments per layer type"
                )
        per_type = {kind: call for kind, (_, call) in first.items()}
        calls0 = next(iter(per_type.values()))
        shared = {k: v for k, v in calls0.items() if all(k in c and c[k] is v for c in per_type.values())}
        by_type = {kind: {k: v for k, v in c.items() if k not in shared} for kind, c in per_type.items()}
        return hidden, {"shared": shared, "by_type": by_type}

    def block_kwargs(self, stack: Stack, layer: int, ctx: dict[str, Any]) -> dict[str, Any]:
        if not stack.layer_types:
            return ctx
        return {**ctx["shared"], **ctx["by_type"][stack.layer_types[layer]]}

    def stack_output(self, model: nn.Module, stack: Stack, hidden: torch.Tensor) -> torch.Tensor:
        """An encoder's output for its decoder: its last block's output through its final norm, if it has one."""
        found = self._probed(model)[stack.name]
        if not found.output_is_final_norm:
            raise UnsupportedModelError(
                f"{type(model).__name__}: its {stack.name} output is not its last block's output (through a final "
                "norm); featcal cannot tell what the next stack reads"
            )
        if found.final_norm is None or found.class_token_only:
            return hidden
        return get_path(model, found.final_norm)(hidden)

    # --- the norms outside the blocks --------------------------------------------------------------
    def prepare(self, model: nn.Module) -> None:
        """Run the probe now, while the whole model sits on one device, where a later step will need it
        (an encoder's output, handed to its decoder while the blocks may be offloaded)."""
        if len(self.stacks(model)) > 1:
            self._probed(model)

    def _probed(self, model: nn.Module) -> dict[str, StackProbe]:
        if self._probe is None:
            self._probe = probe_stacks(model, self.stacks(model), self._probe_call)
        return self._probe

    def _probe_call(self, model, stack, batch, upstream):
        return self.stack_call(model, stack, batch, upstream)

    def final_norm(self, model: nn.Module, stack: Stack) -> FinalNorm | None:
        """The norm reading the last block's output before the head (the probe's), or None."""
        found = self._probed(model)[stack.name]
        if found.final_norm is None:
            return None
        return FinalNorm(found.final_norm, get_path(model, found.final_norm), found.class_token_only)

    def stem_norm(self, model: nn.Module, stack: Stack) -> FinalNorm | None:
        """The norm whose output is block 0's input (the probe's), or None."""
        found = self._probed(model)[stack.name]
        return None if found.stem_norm is None else FinalNorm(found.stem_norm, get_path(model, found.stem_norm))

    # --- token weights ---------------------------------------------------------------------------
    def module_mask(self, stack: Stack, batch: dict[str, torch.Tensor], module_name: str,
                    x: torch.Tensor) -> torch.Tensor | None:
        """The token mask of x (..., d); for a per-head input (batch, heads, tokens, d) or (batch, tokens,
        heads, d), Qwen3's and Gemma's q/k norms, the mask spread over the heads."""
        if x.dim() != 4:
            return super().module_mask(stack, batch, module_name, x)
        mask = self.token_mask(stack, batch, x, cross=self.is_cross_module(stack, module_name))
        if mask is None:
            return None
        return spread_over_heads(mask, x, module_name).to(x.device)

    # --- the planner -------------------------------------------------------------------------------
    def context_bytes(self, stack: Stack, tokens: int, hidden: int, heads: int) -> int:
        """Per example: rotary cos and sin (S, head_dim) float32 per layer type where the model is rotary, and
        one more (S, S) mask per layer type past the first."""
        types = max(len(set(stack.layer_types)), 1)
        config = self._config
        rotary = getattr(config, "rope_parameters", None) is not None or getattr(config, "rope_theta", None) is not None
        head_dim = getattr(config, "head_dim", None) or hidden // max(heads, 1)
        return (types * 2 * tokens * int(head_dim) * 4 if rotary else 0) + (types - 1) * tokens * tokens


def spread_over_heads(mask: torch.Tensor, x: torch.Tensor, module_name: str) -> torch.Tensor:
    """A (B, S) token mask as x's leading shape, (B, H, S) or (B, S, H): the tokens' axis is the one of length
    S; when heads and tokens are as many, the one with the larger stride (the projection's token axis)."""
    b, s = mask.shape
    if x.shape[0] != b or s not in x.shape[1:3]:
        raise CalibrationDataError(
            f"token mask of shape {tuple(mask.shape)} does not match the input of {module_name} {tuple(x.shape[:-1])}"
        )
    tokens_second = x.shape[1] == s and (x.shape[2] != s or x.stride(1) >= x.stride(2))
    if tokens_second:
        return mask[:, :, None].expand(b, s, x.shape[2])
    return mask[:, None, :].expand(b, x.shape[1], s)
