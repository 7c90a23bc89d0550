"""Linear layers by kind, and which parameters a weight-space baseline may solve for.

FeatCal, RegMean and WUDI solve the weight of every linear layer: `nn.Linear` (weight stored out×in) and
transformers' `Conv1D` (the GPT-2 family's linear layer: y = x W + b, its weight stored TRANSPOSED, in×out).
Everything that reads or writes such a weight goes through `weight_of` / `stored_as`, so that the maths
always sees W as out×in and the checkpoint keeps its own layout.

RegMean and WUDI average everything else. A linear layer whose weight is tied to another parameter (an
LM head sharing the input embedding) is averaged too: solving it as a Linear would silently change the
tied embedding as well.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn


def _conv1d_class() -> type | None:
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # pragma: no cover - transformers is a dependency
        return None
    return Conv1D


_CONV1D = _conv1d_class()


def is_conv1d(module: nn.Module) -> bool:
    """transformers' Conv1D: a linear layer whose weight is stored in×out."""
    return _CONV1D is not None and isinstance(module, _CONV1D)


def is_linear(module: nn.Module) -> bool:
    """A linear layer FeatCal solves: nn.Linear (and its subclasses) or transformers' Conv1D."""
    return isinstance(module, nn.Linear) or is_conv1d(module)


def weight_of(module: nn.Module, stored: torch.Tensor | None = None) -> torch.Tensor:
    """The layer's weight as out×in (a transposed view of a Conv1D's; nothing is copied); with `stored`, that
    tensor (the same weight of another model: a base, an expert) read in the layer's layout."""
    w = module.weight if stored is None else stored
    return w.T if is_conv1d(module) else w


def stored_as(module: nn.Module, weight: torch.Tensor) -> torch.Tensor:
    """An out×in `weight` in the layout `module` stores it in (a Conv1D's is in×out)."""
    return weight.T if is_conv1d(module) else weight


def features(module: nn.Module) -> tuple[int, int]:
    """(in, out) widths of a linear layer."""
    w = weight_of(module)
    return int(w.shape[1]), int(w.shape[0])


def as_patterns(exclude: str | Iterable[str]) -> tuple[str, ...]:
    """A regex or a collection of regexes, as a tuple (a lone string is one pattern, not its letters)."""
    return (exclude,) if isinstance(exclude, str) else tuple(exclude)


def tied_names(model: nn.Module) -> set[str]:
    """Names of parameters that share storage with another parameter name."""
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return {n for names in groups.values() if len(names) > 1 for n in names}


def linear_modules(model: nn.Module, exclude: Iterable[str] = ()) -> dict[str, nn.Module]:
    """Untied linear layers (nn.Linear, Conv1D) by name, minus those whose name matches an `exclude` regex."""
    patterns = [re.compile(p) for p in exclude]
    tied = tied_names(model)
    out = {}
    for name, module in model.named_modules():
        if not is_linear(module):
            continue
        if f"{name}.weight" in tied or any(p.search(name) for p in patterns):
            continue
        out[name] = module
    return out
