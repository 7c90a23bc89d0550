"""Classification heads and accuracy for encoders read through a fixed head on pooled features.

A head maps the encoder's pooled features to class logits: a linear probe (vision zoo) or a cosine
classifier on class prototypes (text zoo). It is fitted once on the base, frozen, and then shared by
the base, the experts and every merged or calibrated model, so accuracy differences come from the
encoder alone. Inputs are a tensor (pixel_values) or a dict of text tensors (featcal.evaluation.features).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from featcal.errors import CheckpointError
from featcal.evaluation.features import Inputs, batch_of, features, num_examples


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


@torch.no_grad()
def pooled_features(model, inputs: Inputs, batch_size: int = 256, pooling: str = "pooler") -> torch.Tensor:
    """Pooled features for every example: CLIP's post-layernormed class token, or a masked token mean."""
    model.eval()
    n = num_examples(inputs)
    return torch.cat([features(model, batch_of(inputs, i, min(i + batch_size, n)), pooling)
                      for i in range(0, n, batch_size)])


def fit_linear_probe(features: torch.Tensor, labels: np.ndarray | torch.Tensor, n_classes: int,
                     c: float = 1.0, max_iter: int = 300) -> LinearHead:
    """Multinomial logistic regression on frozen features, as a LinearHead.

    Full-batch L-BFGS in float64 on standardised features (then folded back into the weights), with
    an L2 penalty of 1/(c·N) per example as in scikit-learn's `C`: deterministic, and seconds even
    where scikit-learn's solver crawls on badly scaled features.
    """
    y = torch.as_tensor(np.asarray(labels), dtype=torch.long)
    missing = sorted(set(range(n_classes)) - set(y.tolist()))
    if missing:
        raise ValueError(f"linear probe: classes {missing} have no training example")
    x = features.double()
    mu, sd = x.mean(0), x.std(0).clamp_min(1e-6)
    z = (x - mu) / sd
    w = torch.zeros(n_classes, x.shape[1], dtype=torch.float64, requires_grad=True)
    b = torch.zeros(n_classes, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], lr=1.0, max_iter=max_iter, tolerance_grad=1e-9, tolerance_change=1e-12,
                            history_size=20, line_search_fn="strong_wolfe")
    penalty = 0.5 / (c * len(y))

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(z @ w.T + b, y) + penalty * w.pow(2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    head = LinearHead(x.shape[1], n_classes)
    with torch.no_grad():
        head.weight.copy_((w / sd).float())
        head.bias.copy_((b - (w / sd) @ mu).float())
    return head.eval()


@torch.no_grad()
def accuracy(model, head: torch.nn.Module, inputs: Inputs, labels: np.ndarray | torch.Tensor,
             batch_size: int = 256, pooling: str = "pooler") -> float:
    """Top-1 accuracy in [0, 1] of `head(pooled features of model(inputs))`."""
    y = torch.as_tensor(labels)
    if len(y) == 0:
        raise ValueError("accuracy of an empty test set is undefined")
    pred = head(pooled_features(model, inputs, batch_size, pooling)).argmax(-1)
    return float((pred == y).float().mean())
