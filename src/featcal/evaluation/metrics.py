"""The metrics, as pure functions of predictions and references: one implementation of each.

`featcal eval`, the benchmark, the reproduction pipelines and the baselines all score through these, so
an accuracy or a share of the gap closed means the same thing wherever it is printed. Where a
well-kept library already computes a metric (scikit-learn's macro-F1, scipy's Spearman), it is used.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import numpy as np
import torch

# metrics computed by an optional package: the featcal extra that brings it (featcal/io/process/extras.py)
METRIC_EXTRAS = {"macro_f1": "eval", "spearman": "eval"}


def check_metric_packages(metrics) -> None:
    """Refuse, before any model is run, metrics whose package is missing, naming the extra."""
    from featcal.io.process.extras import require

    for metric in sorted(set(metrics) & set(METRIC_EXTRAS)):
        require(METRIC_EXTRAS[metric], f"the {metric} metric")


def _as_array(values) -> np.ndarray:
    if isinstance(values, torch.Tensor):
        return values.detach().cpu().numpy()
    return np.asarray(values)


def accuracy(predictions, labels) -> float:
    """Share in [0, 1] of predictions equal to their label (class ids, tensors or sequences)."""
    pred, gold = _as_array(predictions).reshape(-1), _as_array(labels).reshape(-1)
    if len(pred) != len(gold):
        raise ValueError(f"{len(pred)} predictions for {len(gold)} labels")
    if len(gold) == 0:
        raise ValueError("accuracy of an empty test set is undefined")
    return float((pred == gold).mean())


def macro_f1(predictions, labels) -> float:
    """Unweighted mean over classes of F1 in [0, 1] (scikit-learn's, over the classes present in either
    side; a class never predicted scores 0 rather than warning)."""
    from sklearn.metrics import f1_score

    pred, gold = _as_array(predictions).reshape(-1), _as_array(labels).reshape(-1)
    if len(pred) != len(gold):
        raise ValueError(f"{len(pred)} predictions for {len(gold)} labels")
    if len(gold) == 0:
        raise ValueError("macro-F1 of an empty test set is undefined")
    return float(f1_score(gold, pred, average="macro", zero_division=0))


def normalise_answer(text: str) -> str:
    """A generated or reference answer as compared: stripped, lower-cased, inner whitespace collapsed."""
    return " ".join(text.strip().lower().split())


def exact_match(predictions: Sequence[str], references: Sequence[str]) -> float:
    """Share (in %) of predictions equal to their reference after normalise_answer."""
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions for {len(references)} references")
    if not predictions:
        raise ValueError("exact match of nothing is undefined")
    hits = sum(normalise_answer(p) == normalise_answer(r) for p, r in zip(predictions, references, strict=True))
    return 100.0 * hits / len(predictions)


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman's rank correlation (scipy's); 0.0 when either side is constant (ρ undefined: no ranking signal)."""
    from scipy.stats import ConstantInputWarning, spearmanr

    a, b = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 1:
        raise ValueError(f"spearman needs two equal-length vectors, got {a.shape} and {b.shape}")
    if len(a) < 2:
        raise ValueError("spearman needs at least two pairs")
    if np.all(a == a[0]) or np.all(b == b[0]):
        return 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConstantInputWarning)
        rho = float(spearmanr(a, b).statistic)
    return 0.0 if math.isnan(rho) else rho


def perplexity(mean_token_loss: float) -> float:
    """exp(mean negative log-likelihood per token), inf where that overflows."""
    try:
        return math.exp(mean_token_loss)
    except OverflowError:
        return math.inf


# A gap smaller than this share of the metric's scale (max |merged|, |experts|) is no gap: float32 scores hold about
# seven significant digits, so a difference of 7e-7 nats between losses near 3 is rounding, and a "share" of it
# printed 11900 %. GAP_ABSOLUTE_FLOOR keeps a metric whose scale is near zero from dividing by rounding too.
GAP_RELATIVE_TOLERANCE = 1e-6
GAP_ABSOLUTE_FLOOR = 1e-9


def no_gap_reason(merge: float, experts: float, *, higher_is_better: bool = True) -> str | None:
    """Why there is no merge -> experts gap to close (the experts no better than the merge, or better by no more
    than GAP_RELATIVE_TOLERANCE of the metric's scale, or a value not finite), None when there is one."""
    sign = 1.0 if higher_is_better else -1.0
    gap = sign * (experts - merge)
    if not (math.isfinite(merge) and math.isfinite(experts)):
        return f"no gap: merged {merge} or experts {experts} is not a finite score"
    if gap <= 0:
        return f"no gap: the experts ({experts:.6g}) are no better than the merge ({merge:.6g})"
    tolerance = max(GAP_ABSOLUTE_FLOOR, GAP_RELATIVE_TOLERANCE * max(abs(merge), abs(experts)))
    if gap <= tolerance:
        return (f"no gap: the experts ({experts:.9g}) beat the merge ({merge:.9g}) by {gap:.2g}, within "
                f"{GAP_RELATIVE_TOLERANCE:g} of the metric's scale ({tolerance:.2g}): rounding, not a gap")
    return None


def gap_closed(model: float, merge: float, experts: float, *, higher_is_better: bool = True) -> float | None:
    """Share of the merge -> experts gap that `model` closes; None when there is no gap to close.

    Experts no better than the merge leave no gap: a "share" of a negative gap would print nonsense
    (300 % when a model moves away from experts that sit under the merge), so it is None (n/a) too; so is a
    gap within rounding of the metric's scale (no_gap_reason). For a metric where lower is better (a loss),
    the gap is measured downward.
    """
    if no_gap_reason(merge, experts, higher_is_better=higher_is_better) is not None:
        return None
    return (model - merge) / (experts - merge)
