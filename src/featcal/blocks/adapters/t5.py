"""T5 (T5ForConditionalGeneration, T5Model, T5EncoderModel): encoder blocks, then decoder blocks.

- Norms are T5LayerNorm (RMS, weight only); the attention and feed-forward Linears have no bias.
- Block 0 of each stack computes the relative position bias (with the mask folded in) and returns it;
  later blocks receive it as `position_bias` (and `encoder_decoder_position_bias` in the decoder).
- The decoder is teacher-forced with the batch's decoder_input_ids (else labels shifted right, else
  one decoder_start_token_id). Its cross-attention reads the encoder output after the encoder's final
  norm: the CALIBRATED merged encoder for the merged side, each expert's own encoder for that expert.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from featcal.blocks.adapters.base import Adapter, FinalNorm, Stack, final_norm_at, get_path
from featcal.errors import CalibrationDataError


class T5Adapter(Adapter):
    name = "t5"
    model_types = ("t5", "mt5")
    rms_classes = ("T5LayerNorm", "MT5LayerNorm")
    kv_names = ("k", "v")
    capture_kwargs = {"use_cache": False}
    token_tensors = 4  # input_ids, attention_mask, decoder_input_ids, decoder_attention_mask

    def stacks(self, model: nn.Module) -> list[Stack]:
        out = [Stack("encoder", "encoder.block", "encoder")]
        if isinstance(get_path(model, "decoder.block"), nn.ModuleList):
            out.append(
                Stack(
                    "decoder", "decoder.block", "decoder", mask_key="decoder_attention_mask",
                    cross_mask_key="attention_mask", cross_modules=("EncDecAttention.k", "EncDecAttention.v"),
                )
            )
        return out

    def main_input(self, model: nn.Module, stack: Stack) -> str:
        return "input_ids"

    def max_tokens(self, config: Any) -> int | None:
        return None  # relative position buckets: no position table to run past

    def context_bytes(self, stack: Stack, tokens: int, hidden: int, heads: int) -> int:
        """The float32 relative position bias (heads, S, S); the decoder holds the cross-attention's too."""
        return heads * tokens * tokens * 4 * (2 if stack.name == "decoder" else 1)

    def stack_call(self, model, stack, batch, upstream):
        if stack.name == "encoder":
            kw = {k: batch[k] for k in ("input_ids", "attention_mask", "inputs_embeds") if k in batch}
            return model.encoder, kw
        if upstream is None:
            raise CalibrationDataError("the T5 decoder needs the encoder output")
        dec = batch.get("decoder_input_ids")
        if dec is None and batch.get("labels") is not None:
            dec = model._shift_right(batch["labels"])
        if dec is None:
            start = model.config.decoder_start_token_id
            start = model.config.pad_token_id if start is None else start
            dec = torch.full((upstream.shape[0], 1), int(start), dtype=torch.long, device=upstream.device)
        kw: dict[str, Any] = {
            "input_ids": dec, "encoder_hidden_states": upstream, "use_cache": False,
            "attention_mask": batch.get("decoder_attention_mask"), "encoder_attention_mask": batch.get("attention_mask"),
        }
        return model.decoder, kw

    def final_norm(self, model: nn.Module, stack: Stack) -> FinalNorm | None:
        """The stack's `final_layer_norm` (RMS): the decoder's before the LM head, the encoder's in an encoder-only
        model. An encoder's norm that feeds a decoder is not a final norm: it stays merged."""
        return final_norm_at(model, stack, "final_layer_norm")

    def stack_output(self, model, stack, hidden):
        stack_mod = get_path(model, stack.entry_path)
        return stack_mod.dropout(stack_mod.final_layer_norm(hidden))

    def next_context(self, stack, layer, ctx, output):
        if isinstance(output, tuple):
            ctx = dict(ctx)
            ctx["position_bias"] = output[1]
            if stack.name == "decoder" and len(output) > 2:
                ctx["encoder_decoder_position_bias"] = output[2]
        return ctx
