"""Which parameters are Linear weights a weight-space baseline may solve for, and which it must average.

RegMean and WUDI treat the weight of every `nn.Linear` specially and average everything else. A Linear
whose weight is tied to another parameter (an LM head sharing the input embedding) is averaged too:
solving it as a Linear would silently change the tied embedding as well.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from torch import nn


def as_patterns(exclude: str | Iterable[str]) -> tuple[str, ...]:
    """A regex or a collection of regexes, as a tuple (a lone string is one pattern, not its letters)."""
    return (exclude,) if isinstance(exclude, str) else tuple(exclude)


def tied_names(model: nn.Module) -> set[str]:
    """Names of parameters that share storage with another parameter name."""
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return {n for names in groups.values() if len(names) > 1 for n in names}


def linear_modules(model: nn.Module, exclude: Iterable[str] = ()) -> dict[str, nn.Linear]:
    """Untied `nn.Linear` modules by name, minus those whose name matches an `exclude` regex."""
    patterns = [re.compile(p) for p in exclude]
    tied = tied_names(model)
    out = {}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        if f"{name}.weight" in tied or any(p.search(name) for p in patterns):
            continue
        out[name] = module
    return out
