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


def module_kind(mod: nn.Module, adapter: Adapter) -> str | None:
    """"linear", "layernorm" (with an affine), "rmsnorm" (adapter-declared), or None: not calibrated."""
    if isinstance(mod, nn.Linear):
        return "linear"
    if isinstance(mod, nn.LayerNorm) and mod.elementwise_affine:
        return "layernorm"
    if adapter.is_rms(mod):
        return "rmsnorm"
    return None


def calibrated_modules(block: nn.Module, adapter: Adapter) -> list[Calibrated]:
    """Every Linear, LayerNorm and (adapter-declared) RMS norm inside `block`, in module order."""
    out = []
    for name, mod in block.named_modules():
        kind = module_kind(mod, adapter)
        if kind is not None:
            out.append(Calibrated(name, kind, mod))
    return out
