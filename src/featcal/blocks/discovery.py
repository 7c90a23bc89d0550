"""Which modules of a block are calibrated (and merged per input by RegMean), found by kind, not by name.

- "linear": every `nn.Linear` and transformers' `Conv1D` (blocks/linear.py: its weight is read as out×in);
- "layernorm": `nn.LayerNorm` with an affine, and any probed norm that centres its input (blocks/norms.py);
- "rmsnorm": any probed weight-only RMS norm, z·w or z·(1 + w) (Llama, T5, Gemma, Qwen3's q/k norms, ...).

Everything else in a block keeps its merged value (docs/method.md §2): DINOv2's LayerScale, T5's relative position
bias, a mixture of experts' router and its experts. A mixture of experts is found by structure
(`mixtures_of_experts`):

- its experts are either a list of expert sub-networks (a ModuleList / ModuleDict of two or more modules of one
  class, each holding a linear layer) or transformers 5's fused experts (a module holding parameters of 3 or
  more dimensions whose first dimension, the expert index, they share);
- its router is the one weight matrix beside them that scores every expert: a 2-D `weight` of E rows (E the
  number of experts) held, outside the experts, under the module that holds the experts (the MoE layer),
  in a child of that layer holding no other weight matrix (a gate, or a router wrapping one Linear: PhiMoE's
  `router`, JetMoE's `router.layer`, Switch Transformers' `router.classifier`). Routers that are plain
  `nn.Linear`s are kept too: re-solving one would change which experts each token reaches;
- fused 3-D parameters with no such router are no experts (XLNet's attention stores its projections as
  3-D tensors): they are kept merged as "not a Linear, Conv1D or norm".

Experts are kept even when they are Linears: each one sees only the tokens routed to it, which differ between
the merged model and each expert, so its statistics would pair unrelated tokens. Dense layers beside them that
every token reaches (Qwen2-MoE's shared expert and its 1-output gate) are calibrated. `kept_merged` describes
what a block keeps, for the log and featcal.json.
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
ROUTER = "mixture-of-experts router (re-solving it would change which experts each token reaches)"
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


def _list_items(mod: nn.Module) -> list[nn.Module]:
    """The items of a ModuleList / ModuleDict that hold parameters (NLLB-MoE's experts also list a Dropout)."""
    items = list(mod.values()) if isinstance(mod, nn.ModuleDict) else list(mod)
    return [m for m in items if any(True for _ in m.parameters())]


def routed_expert_lists(block: nn.Module) -> list[str]:
    """Names (inside `block`) of lists of expert sub-networks: a ModuleList / ModuleDict whose items holding
    parameters are two or more modules of one class, each holding a linear layer, nested in the block (a
    mixture of experts' experts)."""
    out = []
    for name, mod in block.named_modules():
        if not name or not isinstance(mod, (nn.ModuleList, nn.ModuleDict)):
            continue
        items = _list_items(mod)
        if len(items) >= 2 and len({type(m) for m in items}) == 1 and all(
                any(is_linear(s) for s in m.modules()) for m in items):
            if not any(name.startswith(p + ".") for p in out):
                out.append(name)
    return out


@dataclass(frozen=True)
class MixturesOfExperts:
    """A block's mixtures of experts: the modules holding experts (lists, or fused 3-D parameters) and the
    modules holding their routers' weights, by name inside the block."""

    experts: tuple[str, ...] = ()
    routers: tuple[str, ...] = ()

    def holds(self, name: str) -> bool:
        """Whether module `name` is, or lies inside, experts or a router."""
        return any(name == p or name.startswith(p + ".") for p in (*self.experts, *self.routers))


def _parent(name: str) -> str:
    return name.rpartition(".")[0]


def _fused_experts(block: nn.Module) -> dict[str, int]:
    """Module -> number of experts, for every module holding parameters of 3+ dimensions that share their first
    dimension (transformers 5's fused experts, before a router confirms them); convolutions excepted."""
    out = {}
    for name, mod in block.named_modules():
        if isinstance(mod, nn.modules.conv._ConvNd):
            continue
        leading = {p.shape[0] for p in mod.parameters(recurse=False) if p.dim() >= 3}
        if len(leading) == 1:
            out[name] = leading.pop()
    return out


def _matrices(mod: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(n, p) for n, p in mod.named_parameters() if p.dim() == 2]


def _router(block: nn.Module, layer: str, n_experts: int, inside_experts) -> str | None:
    """The module holding the router of the experts under `layer`: in a child of `layer` (not experts) holding
    exactly one weight matrix, that matrix a `weight` of `n_experts` rows."""
    parent = block.get_submodule(layer) if layer else block
    for child, mod in parent.named_children():
        name = f"{layer}.{child}" if layer else child
        if inside_experts(name):
            continue
        mats = _matrices(mod)
        if len(mats) == 1 and mats[0][0].rpartition(".")[2] == "weight" and mats[0][1].shape[0] == n_experts:
            return ".".join(x for x in (name, mats[0][0].rpartition(".")[0]) if x)
    return None


def mixtures_of_experts(block: nn.Module) -> MixturesOfExperts:
    """The experts and routers of `block` (see the module docstring); empty for a block without experts."""
    lists = routed_expert_lists(block)
    fused = {n: e for n, e in _fused_experts(block).items() if not any(n == p or n.startswith(p + ".") for p in lists)}
    candidates = {n: len(_list_items(block.get_submodule(n))) for n in lists} | fused

    def inside_experts(name: str) -> bool:
        return any(name == p or name.startswith(p + ".") for p in candidates)

    experts, routers = [], []
    for name, n_experts in candidates.items():
        # the MoE layer: the experts' parent (a module of fused expert parameters may sit one level deeper)
        layers = [_parent(name)] + ([_parent(_parent(name))] if _parent(_parent(name)) else [])
        router = next((r for r in (_router(block, layer, n_experts, inside_experts) for layer in layers) if r), None)
        if router is None and name in fused:
            continue  # 3-D parameters that no router scores: no experts (XLNet's attention)
        experts.append(name)
        if router is not None and router not in routers:
            routers.append(router)
    return MixturesOfExperts(tuple(experts), tuple(routers))


def calibrated_modules(block: nn.Module, adapter: Any = None) -> list[Calibrated]:
    """Every linear layer and norm inside `block` that FeatCal solves, in module order (mixtures of experts'
    experts and routers excluded)."""
    moe = mixtures_of_experts(block)
    out = []
    for name, mod in block.named_modules():
        if moe.holds(name):
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
    outside its calibrated modules; experts (a list, or stacked expert weights) and routers are named once."""
    calibrated = {id(p) for c in calibrated_modules(block, adapter) for p in c.module.parameters()}
    moe = mixtures_of_experts(block)
    out: dict[str, str] = {}
    for name, p in block.named_parameters():
        if id(p) in calibrated:
            continue
        owner = _parent(name)
        expert = next((e for e in moe.experts if owner == e or owner.startswith(e + ".")), None)
        router = next((r for r in moe.routers if owner == r or owner.startswith(r + ".")), None)
        if expert is not None:
            out[expert] = ROUTED_EXPERTS
        elif router is not None:
            out[router] = ROUTER
        else:
            out.setdefault(owner or name, OTHER)
    return out
