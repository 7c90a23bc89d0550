"""The benchmark's summary numbers, as pure functions of accuracies (fractions in [0, 1])."""

from __future__ import annotations

from collections.abc import Mapping


def mean(values: Mapping[str, float]) -> float:
    if not values:
        raise ValueError("mean of no accuracies")
    return sum(values.values()) / len(values)


def normalised_accuracy(per_task: Mapping[str, float], experts: Mapping[str, float]) -> float:
    """Mean over tasks of accuracy / the task's expert accuracy (1.0 = as good as every expert)."""
    return sum(per_task[t] / experts[t] for t in per_task if experts[t] > 0) / len(per_task)


def gap_closed(model: float, merge: float, experts: float) -> float | None:
    """Share of the merge -> experts gap that `model` closes; None when there is no gap to close.

    Experts at or below the merge leave no gap: a "share" of a negative gap would print nonsense
    (300 % when a model moves away from experts that sit under the merge), so it is None (n/a) too.
    """
    gap = experts - merge
    if gap < 1e-12:
        return None
    return (model - merge) / gap


BELOW_FLOOR = "MEASUREMENT ERROR: below the forward floor, not a result"


def cost_ratio_text(ratio: float) -> str:
    """A measured cost / floor ratio as printed: one below 1 is impossible for any implementation (the floor
    is one forward of each model) and says the measurement is wrong (a floor timed under load, a cache)."""
    return f"{ratio:.2f}x ({BELOW_FLOOR})" if ratio < 1 else f"{ratio:.2f}x"
