"""Which modules of a block are calibrated (and merged per input by RegMean): Linear and norms."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from featcal.blocks.adapters import Adapter


@dataclass(frozen=True)
class Calibrated:
    """One calibrated module of a block: its name inside the block and its kind."""

    name: str
    kind: str  # "linear" | "layernorm" | "rmsnorm"
    module: nn.Module


def calibrated_modules(block: nn.Module, adapter: Adapter) -> list[Calibrated]:
    """Every Linear, LayerNorm and (adapter-declared) RMS norm inside `block`, in module order."""
    out = []
    for name, mod in block.named_modules():
        if isinstance(mod, nn.Linear):
            out.append(Calibrated(name, "linear", mod))
        elif isinstance(mod, nn.LayerNorm) and mod.elementwise_affine:
            out.append(Calibrated(name, "layernorm", mod))
        elif adapter.is_rms(mod):
            out.append(Calibrated(name, "rmsnorm", mod))
    return out
