"""Where the experts' weights live during a calibration: "resident" or "streamed" (issue #40), and why.

Streamed (the general path): each expert's block is copied into the one expert template when the block needs
it, read ahead from its files on a background thread (prefetch.py). Resident: every expert is a model in memory,
on the calibration device, in the template's dtype, and nothing is offloaded; then the template's parameters are
pointed at the expert's own tensors (no copy per block, no template-sized second model kept: its own values are
released as they are replaced). Nothing writes into the template's parameters, so the experts are never modified;
the forwards read the same values, so the result is bit for bit the streamed one (tests/calibration/test_prefetch.py).

The choice is recorded in featcal.json as {"experts": "resident" | "streamed", "why": ...}.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from featcal.config import FeatCalConfig

RESIDENT, STREAMED = "resident", "streamed"


@dataclass(frozen=True)
class ExpertPlacement:
    experts: str  # RESIDENT or STREAMED
    why: str

    @property
    def resident(self) -> bool:
        return self.experts == RESIDENT

    def record(self) -> dict[str, str]:
        """What featcal.json records under "placement"."""
        return {"experts": self.experts, "why": self.why}


def choose(experts: Mapping[str, Any], template: nn.Module, device: torch.device, config: FeatCalConfig,
           allowed: bool = True) -> ExpertPlacement:
    """Resident where every expert is a model in memory whose parameters already sit on `device` in the
    template's dtype (nothing to copy, nothing to read), not offloading; else streamed, saying what rules it out."""
    if not allowed:
        return ExpertPlacement(STREAMED, "the resident path is switched off")
    if config.offload_blocks:
        return ExpertPlacement(STREAMED, "offload_blocks: one block at a time on the device")
    on_files = [t for t, e in experts.items() if not isinstance(e, nn.Module)]
    if on_files:
        return ExpertPlacement(STREAMED, f"expert(s) {', '.join(on_files)} read from files, the next block read "
                                         "ahead on a background thread")
    dtype = next(template.parameters()).dtype
    for t, e in experts.items():
        elsewhere = {str(p.device) for p in e.parameters() if p.device != device}
        if elsewhere:
            return ExpertPlacement(STREAMED, f"expert {t!r} is in memory on {sorted(elsewhere)[0]}, the calibration "
                                             f"on {device}")
        other = {str(p.dtype) for p in e.parameters() if p.is_floating_point() and p.dtype != dtype}
        if other:
            return ExpertPlacement(STREAMED, f"expert {t!r} holds {sorted(other)[0]}, the model being calibrated "
                                             f"{dtype}")
    return ExpertPlacement(RESIDENT, f"every expert is in memory on {device} in {dtype}: used in place, no copy "
                                     "per block")


@torch.no_grad()
def point_into(model: nn.Module, values: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Point `model`'s parameters named in (name, value) pairs at those values (the resident path: no copy where
    device and dtype agree, else at a converted copy, the values `copy_into` would write). Never writes into a
    parameter: it may be an expert's own tensor since an earlier load."""
    params = dict(model.named_parameters(remove_duplicate=False))
    for name, value in values:
        p = params[name]
        if value.shape != p.shape:
            raise ValueError(f"{name}: shape {tuple(value.shape)}, the template's {tuple(p.shape)}")
        p.data = value.detach().to(device=p.device, dtype=p.dtype)
