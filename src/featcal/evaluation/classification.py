"""Classification heads and accuracy for vision encoders (CLIP-style: a fixed head on pooled features).

A head is a plain linear map from the encoder's pooled output to class logits. It is fitted once
(a linear probe on the base's features), frozen, and then shared by the base, the experts and every
merged or calibrated model, so accuracy differences come from the encoder alone.
"""

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


@torch.no_grad()
def pooled_features(model, pixel_values: torch.Tensor, batch_size: int = 256) -> torch.Tensor:
    """The encoder's pooled output (CLIP: post-layernormed class token) for every image."""
    model.eval()
    chunks = [model(pixel_values=pixel_values[i : i + batch_size]).pooler_output for i in range(0, len(pixel_values), batch_size)]
    return torch.cat(chunks)


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
def accuracy(model, head: torch.nn.Module, pixel_values: torch.Tensor, labels: np.ndarray | torch.Tensor,
             batch_size: int = 256) -> float:
    """Top-1 accuracy in [0, 1] of `head(model(x).pooler_output)`."""
    y = torch.as_tensor(labels)
    if len(y) == 0:
        raise ValueError("accuracy of an empty test set is undefined")
    pred = head(pooled_features(model, pixel_values, batch_size)).argmax(-1)
    return float((pred == y).float().mean())
