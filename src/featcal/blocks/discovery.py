"""Which modules of a block are calibrated (and merged per input by RegMean), found by kind, not by name.

- "linear": every `nn.Linear` and transformers' `Conv1D` (blocks/linear.py: its weight is read as out×in);
- "layernorm": `nn.LayerNorm` with an affine, and any probed norm that centres its input (blocks/norms.py);
- "rmsnorm": any probed weight-only RMS norm, z·w or z·(1 + w) (Llama, T5, Gemma, Qwen3's q/k norms, ...).

Everything else in a block keeps its merged value (docs/method.md §2): DINOv2's LayerScale, T5's relative position
bias, a mixture of experts' router and its experts. Experts are kept even when they are Linears (a list of
expert sub-networks, as some mixture-of-experts layers hold them): each one sees only the tokens routed to
it, which differ between the merged model and each expert, so its statistics would pair unrelated tokens.
`kept_merged` describes what a block keeps, for the log and featcal.json.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from featcal.blocks.linear import features, is_conv1d, is_linear, stored_as, weight_of
from featcal.blocks.norms import NormForm, norm_form

ROUTED_EXPERTS = "mixture-of-experts experts (each sees only the tokens routed to it, which differ between " \
                 "the merged model and each expert)"
OTHER = "not a Linear, Conv1D or norm"


@dataclass(frozen=True)
class Calibrated:
    """One calibrated module of a block: its name inside the block and its kind."""

    name: str
    kind: str  # "linear" | "layernorm" | "rmsnorm"
    module: nn.Module
    form: NormForm | None = None  # a norm's: how it normalises and applies its weight

    @property
    def transposed(self) -> bool:
        """A Conv1D: its weight is stored in×out."""
        return is_conv1d(self.module)

    @property
    def weight(self) -> torch.Tensor:
        """A linear layer's weight as out×in (a view), a norm's weight as stored."""
        return weight_of(self.module) if self.kind == "linear" else self.module.weight

    def stored(self, weight: torch.Tensor) -> torch.Tensor:
        """An out×in solved weight in the layout the module stores it in."""
        return stored_as(self.module, weight) if self.kind == "linear" else weight

    @property
    def features(self) -> tuple[int, int]:
        """(in, out) of a linear layer."""
        return features(self.module)

    def params(self) -> dict[str, torch.Tensor | None]:
        """{"weight" (out×in for a linear layer), "bias"}: what the statistics read of an expert's module."""
        return {"weight": self.weight, "bias": getattr(self.module, "bias", None)}


def module_kind(mod: nn.Module, adapter: Any = None) -> str | None:
    """"linear", "layernorm" or "rmsnorm", or None: not calibrated. (`adapter`: accepted for callers that
    pass one; kinds come from the module itself.)"""
    if is_linear(mod):
        return "linear"
    form = norm_form(mod)
    return None if form is None else form.kind


def routed_expert_lists(block: nn.Module) -> list[str]:
    """Names (inside `block`) of lists of expert sub-networks: a ModuleList / ModuleDict of two or more modules
    of one class, each holding a linear layer, nested in the block (a mixture of experts' experts)."""
    out = []
    for name, mod in block.named_modules():
        if not name or not isinstance(mod, (nn.ModuleList, nn.ModuleDict)):
            continue
        items = list(mod.values()) if isinstance(mod, nn.ModuleDict) else list(mod)
        if len(items) >= 2 and len({type(m) for m in items}) == 1 and all(
                any(is_linear(s) for s in m.modules()) for m in items):
            if not any(name.startswith(p + ".") for p in out):
                out.append(name)
    return out


def calibrated_modules(block: nn.Module, adapter: Any = None) -> list[Calibrated]:
    """Every linear layer and norm inside `block` that FeatCal solves, in module order (experts excluded)."""
    experts = routed_expert_lists(block)
    out = []
    for name, mod in block.named_modules():
        if any(name == p or name.startswith(p + ".") for p in experts):
            continue
        if is_linear(mod):
            out.append(Calibrated(name, "linear", mod))
            continue
        form = norm_form(mod)
        if form is not None:
            out.append(Calibrated(name, form.kind, mod, form))
    return out


def kept_merged(block: nn.Module, adapter: Any = None) -> dict[str, str]:
    """Module (inside `block`) -> why its parameters keep their merged values, for every parameter of the block
    outside its calibrated modules; a list of experts (or stacked expert weights) is named once."""
    calibrated = {id(p) for c in calibrated_modules(block, adapter) for p in c.module.parameters()}
    experts = routed_expert_lists(block)
    out: dict[str, str] = {}
    for name, p in block.named_parameters():
        if id(p) in calibrated:
            continue
        owner = name.rpartition(".")[0]
        listed = next((e for e in experts if owner == e or owner.startswith(e + ".")), None)
        if listed is not None:
            out[listed] = ROUTED_EXPERTS
        elif p.dim() >= 3:  # expert weights stacked in one tensor (transformers 5's fused experts)
            out[owner] = ROUTED_EXPERTS
        else:
            out.setdefault(owner or name, OTHER)
    return out
