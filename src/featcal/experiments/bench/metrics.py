"""The benchmark's summary numbers, as pure functions of accuracies (fractions in [0, 1])."""

from __future__ import annotations

from collections.abc import Mapping

from featcal.evaluation.metrics import gap_closed  # noqa: F401  (re-exported: bench rows use it)


def mean(values: Mapping[str, float]) -> float:
    if not values:
        raise ValueError("mean of no accuracies")
    return sum(values.values()) / len(values)


def normalised_accuracy(per_task: Mapping[str, float], experts: Mapping[str, float]) -> float:
    """Mean over tasks of accuracy / the task's expert accuracy (1.0 = as good as every expert)."""
    return sum(per_task[t] / experts[t] for t in per_task if experts[t] > 0) / len(per_task)


BELOW_FLOOR = "MEASUREMENT ERROR: below the forward floor, not a result"


def cost_ratio_text(ratio: float) -> str:
    """A measured cost / floor ratio as printed: one below 1 is impossible for any implementation (the floor
    is one forward of each model) and says the measurement is wrong (a floor timed under load, a cache)."""
    return f"{ratio:.2f}x ({BELOW_FLOOR})" if ratio < 1 else f"{ratio:.2f}x"
