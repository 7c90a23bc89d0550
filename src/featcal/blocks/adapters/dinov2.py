"""DINOv2 (Dinov2Model, Dinov2For*): blocks at `encoder.layer`, optionally under `dinov2.`; the pooled
output is the layer-normed class token, so the last block weighs other tokens less (as for CLIP/ViT).

Calibrated, per block: norm1, the q/k/v/o projections, norm2, fc1, fc2 (every Linear and LayerNorm).
LayerScale (`layer_scale1.lambda1`, `layer_scale2.lambda1`, a per-channel scale on the attention and
MLP branches) is KEPT AS MERGED, as SPEC §2.6 keeps every parameter that is not a Linear or a norm, and
as the dense reference (tests/reference_featcal.py) does. Why not calibrate it: o_proj and fc2, just
before it, are already solved per output channel toward their experts' outputs, and a diagonal scale
after a fully solved matrix adds no freedom that W lacks. What keeping it costs: the solves target
W_t x (the expert's output before its own scale λ_t), so each channel's branch lands at λ_merged/λ_t
of the expert's. Fine-tuning moves λ little: |Δλ|/|λ| was 0.07-0.12 % per expert in the vision-real-tiny
zoo, so λ_merged/λ_t stays within about 0.1 % of 1 (each vision-real zoo records it per expert as
`layer_scale_relative_change`; docs/bench-vision-real.md).
The stem (patch embedding, class token, position table) and the final layernorm stay merged, as for
every vision adapter, unless `calibrate_final_norm` (the layernorm, over every token).
"""

from __future__ import annotations

from torch import nn

from featcal.blocks.adapters.base import Adapter, FinalNorm, Stack, final_norm_at, first_existing
from featcal.errors import FeatCalError


class Dinov2Adapter(Adapter):
    name = "dinov2"
    model_types = ("dinov2",)

    def stacks(self, model: nn.Module) -> list[Stack]:
        for prefix in ("", "dinov2."):
            path = first_existing(model, [prefix + "encoder.layer"])
            if path is not None:
                return [Stack("vision", path, prefix.rstrip("."), mask_key=None, class_token_head=True)]
        raise FeatCalError(f"{type(model).__name__}: cannot find the DINOv2 encoder layers")

    def final_norm(self, model: nn.Module, stack: Stack) -> FinalNorm | None:
        """`layernorm`, applied to every token before the class token is read."""
        return final_norm_at(model, stack, "layernorm")
