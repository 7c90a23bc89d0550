"""Classification heads and accuracy for encoders read through a fixed head on pooled features.

A head maps the encoder's pooled features to class logits: a linear probe (vision zoo) or a cosine
classifier on class prototypes (text zoo). It is fitted once on the base, frozen, and then shared by
the base, the experts and every merged or calibrated model, so accuracy differences come from the
encoder alone. Inputs are a tensor (pixel_values) or a dict of text tensors (featcal.evaluation.features).
The zoo, `featcal bench` and the baselines score through here; the accuracy itself is metrics.accuracy.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from featcal.blocks.heads import LinearHead
from featcal.evaluation.features import Inputs, batch_of, features, num_examples
from featcal.evaluation.metrics import accuracy as top1_accuracy


@torch.no_grad()
def pooled_features(model, inputs: Inputs, batch_size: int = 256, pooling: str = "pooler") -> torch.Tensor:
    """Pooled features for every example, in the inputs' order: CLIP's post-layernormed class token, or a
    masked token mean. Text is read shortest first, so each batch is trimmed to its own longest text (on the text
    zoo's test sets a third fewer token positions than batches in stored order; masked positions change nothing,
    the features differ by float round-off only)."""
    model.eval()
    n = num_examples(inputs)
    order = _by_length(inputs)
    if order is not None:
        inputs = {k: v[order] for k, v in inputs.items()}
    out = torch.cat([features(model, batch_of(inputs, i, min(i + batch_size, n)), pooling)
                     for i in range(0, n, batch_size)])
    if order is None:
        return out
    return torch.empty_like(out).index_copy_(0, order, out)


def _by_length(inputs: Inputs) -> torch.Tensor | None:
    """Text rows ordered by their last unmasked position (stable), or None where there is nothing to sort."""
    if not isinstance(inputs, Mapping):
        return None
    mask = inputs.get("attention_mask")
    if mask is None or mask.ndim != 2 or not len(mask) or not all(len(v) == len(mask) for v in inputs.values()):
        return None
    positions = torch.arange(1, mask.shape[1] + 1)
    last = (mask.ne(0) * positions).amax(1)
    return torch.sort(last, stable=True).indices


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
    if len(labels) == 0:
        raise ValueError("accuracy of an empty test set is undefined")
    pred = head(pooled_features(model, inputs, batch_size, pooling)).argmax(-1)
    return top1_accuracy(pred, labels)
