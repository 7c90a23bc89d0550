"""Where a zoo sits against the regime of real fine-tunes, in one line every bench prints and stores.

On real fine-tunes (the paper's CLIP ViT-B/32, FLAN-T5 on GLUE) the base is below Task Arithmetic,
TA below the experts, and the data-assisted or subspace merges RegMean and WUDI land well above TA
(CLIP: TA 68.0, RegMean 82.4, WUDI 84.5). A test bed whose RegMean and WUDI fall below TA lacks the
property both rest on (each expert's change acting mostly on its own task's inputs), which FeatCal
needs too; the bench says so instead of letting the table speak alone.
"""

from __future__ import annotations

from typing import Any


def regime(base: float, task_arithmetic: float, experts: float, regmean: float, wudi: float,
           scaling: float, regmean_examples: int | None = None) -> dict[str, Any]:
    """Average accuracies (fractions) -> the regime record, with its printed `line`.

    `regmean_examples`: RegMean's examples per task. Named in the line because RegMean's accuracy depends on
    it (the bench gives it the largest calibration size), so one seed's regime line moves with --calib-sizes."""
    ordered = base < task_arithmetic < experts
    above = {"regmean": regmean > task_arithmetic, "wudi": wudi > task_arithmetic}
    real = ordered and all(above.values())
    if real:
        verdict = "in the regime of real fine-tunes (base < TA < experts, RegMean and WUDI above TA)"
    else:
        why = [] if ordered else ["base < TA < experts does not hold"]
        why += [f"{m.replace('regmean', 'RegMean').replace('wudi', 'WUDI')} is not above TA"
                for m, ok in above.items() if not ok]
        verdict = "NOT in the regime of real fine-tunes: " + "; ".join(why)
    regmean_on = f" ({regmean_examples}/task)" if regmean_examples is not None else ""
    line = (f"regime: base {100 * base:.1f}, TA ({scaling}) {100 * task_arithmetic:.1f}, experts {100 * experts:.1f}; "
            f"RegMean {100 * (regmean - task_arithmetic):+.1f}{regmean_on}, WUDI {100 * (wudi - task_arithmetic):+.1f} points vs TA: "
            f"{verdict}")
    return {"base": base, "task_arithmetic": task_arithmetic, "task_arithmetic_scaling": scaling, "experts": experts,
            "regmean": regmean, "regmean_examples": regmean_examples, "wudi": wudi, "regmean_minus_ta": regmean - task_arithmetic,
            "wudi_minus_ta": wudi - task_arithmetic, "ordered": ordered, "data_assisted_above_ta": all(above.values()),
            "real_fine_tune_regime": real, "line": line}
