"""Classification heads read on pooled features: a linear probe or a cosine (zero-shot-style) head."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from featcal.errors import CheckpointError


class LinearHead(torch.nn.Linear):
    """Class logits from pooled features; saved as `weight` and `bias` in one safetensors file."""

    def save(self, path: str | os.PathLike) -> None:
        save_file({"weight": self.weight.detach().contiguous(), "bias": self.bias.detach().contiguous()}, str(path))

    @classmethod
    def load(cls, path: str | os.PathLike) -> LinearHead:
        p = Path(path)
        if not p.exists():
            raise CheckpointError(f"classification head {p} does not exist")
        t = load_file(str(p))
        if set(t) != {"weight", "bias"} or t["weight"].ndim != 2:
            raise CheckpointError(f"{p} is not a linear head (expected 2-D 'weight' and 'bias')")
        head = cls(t["weight"].shape[1], t["weight"].shape[0])
        with torch.no_grad():
            head.weight.copy_(t["weight"])
            head.bias.copy_(t["bias"])
        return head.eval()


class CosineHead(torch.nn.Module):
    """logits = scale · cos(features, class prototype): a zero-shot-style head (CLIP's is the same form,
    with text-tower prototypes). Saved as `prototypes` (unit rows) and `scale` in one safetensors file."""

    def __init__(self, prototypes: torch.Tensor, scale: float, normalise: bool = True) -> None:
        super().__init__()
        p = prototypes.float()
        self.register_buffer("prototypes", torch.nn.functional.normalize(p, dim=-1) if normalise else p)
        self.scale = float(scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * torch.nn.functional.normalize(x, dim=-1) @ self.prototypes.T

    def save(self, path: str | os.PathLike) -> None:
        save_file({"prototypes": self.prototypes.contiguous(), "scale": torch.tensor([self.scale])}, str(path))

    @classmethod
    def from_features(cls, feats: torch.Tensor, labels: np.ndarray | torch.Tensor, n_classes: int,
                      scale: float) -> CosineHead:
        """Prototype of each class = the mean of its examples' unit-normalised features."""
        y = torch.as_tensor(np.asarray(labels), dtype=torch.long)
        missing = sorted(set(range(n_classes)) - set(y.tolist()))
        if missing:
            raise ValueError(f"cosine head: classes {missing} have no example")
        f = torch.nn.functional.normalize(feats.float(), dim=-1)
        return cls(torch.stack([f[y == c].mean(0) for c in range(n_classes)]), scale).eval()


def load_head(path: str | os.PathLike) -> LinearHead | CosineHead:
    """A saved head of either kind, told apart by its tensors."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"classification head {p} does not exist")
    keys = set(load_file(str(p)))
    if keys == {"prototypes", "scale"}:
        t = load_file(str(p))
        if t["prototypes"].ndim != 2:
            raise CheckpointError(f"{p} is not a cosine head (expected 2-D 'prototypes')")
        return CosineHead(t["prototypes"], float(t["scale"][0]), normalise=False).eval()  # saved unit rows, bit-exact
    return LinearHead.load(p)
