"""Which rows a bench run computes (`--rows`): the full sweep, or the demo's story in a few rows.

`full` (the default): every benched merge alone and + FeatCal at every calibration size and variant.
`demo` (`make demo`): base, experts, Task Arithmetic and WUDI alone, TA + FeatCal with the paper's settings and
with label-free tuning, and the best merge alone + FeatCal, all at one calibration size (default 32 per task);
the regime line's RegMean still reads the preset's full pool (256), so that line is the full sweep's.
What the demo cuts and why: docs/bench-text.md ("make demo").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from featcal.errors import ConfigError

RowSet = Literal["full", "demo"]
ROW_SETS: tuple[str, ...] = ("full", "demo")
DEFAULT_SIZE = 256  # the full sweep's calibration examples per task (or the preset's whole pool)
DEMO_SIZE = 32  # the demo's: docs/bench-text.md has the paper defaults within a point of 256 at 32
DEMO_MERGES = ("task_arithmetic", "wudi")  # the data-free baseline and the strongest merge of the text bench
DEMO_TA_VARIANTS = ("reference", "tuned")  # TA + FeatCal: the paper's settings, and featcal's label-free tuning


@dataclass(frozen=True)
class CalibratedRow:
    """One merge + FeatCal row: calibration examples per task and FeatCal variant (FEATCAL_VARIANTS)."""

    size: int
    variant: str


@dataclass(frozen=True)
class RowPlan:
    """The rows of one run, known before any work (the best merge's row: once its merge is measured)."""

    merges: tuple[str, ...]  # each merged and scored alone, in this order
    calibrated: dict[str, tuple[CalibratedRow, ...]]  # merge -> its + FeatCal rows, in order
    drift_rows: dict[str, CalibratedRow]  # merge -> the calibrated row whose drift curve the figure draws
    regime_size: int  # RegMean's examples per task in the regime line
    best_merge_row: CalibratedRow | None = None  # demo: + FeatCal on the best merge alone, unless already planned

    def variants(self) -> tuple[str, ...]:
        """Every FeatCal variant of the plan, in first-use order."""
        seen = [r.variant for rows in self.calibrated.values() for r in rows]
        if self.best_merge_row is not None:
            seen.append(self.best_merge_row.variant)
        return tuple(dict.fromkeys(seen))

    def sizes(self) -> tuple[int, ...]:
        seen = [r.size for rows in self.calibrated.values() for r in rows]
        if self.best_merge_row is not None:
            seen.append(self.best_merge_row.size)
        return tuple(dict.fromkeys(seen))

    def best_needs_row(self, best: str) -> bool:
        """Whether the best merge alone still needs its + FeatCal row (it may already have that very row)."""
        return self.best_merge_row is not None and self.best_merge_row not in self.calibrated.get(best, ())


def full_plan(methods: Sequence[str], sizes: Sequence[int], variants: Sequence[str]) -> RowPlan:
    """Every merge alone and + FeatCal at every size and variant; the drift figure at the largest size, first variant."""
    rows = tuple(CalibratedRow(n, v) for n in sizes for v in variants)
    drift = CalibratedRow(max(sizes), variants[0])
    return RowPlan(merges=tuple(methods), calibrated={m: rows for m in methods}, drift_rows={m: drift for m in methods},
                   regime_size=max(sizes))


def demo_plan(size: int, pool: int) -> RowPlan:
    """The demo's rows at `size` examples per task; the regime line's RegMean on min(256, pool) as in the full sweep."""
    reference = CalibratedRow(size, "reference")
    ta = tuple(CalibratedRow(size, v) for v in DEMO_TA_VARIANTS)
    return RowPlan(merges=DEMO_MERGES, calibrated={"task_arithmetic": ta, "wudi": ()},
                   drift_rows={m: reference for m in DEMO_MERGES}, regime_size=min(DEFAULT_SIZE, pool),
                   best_merge_row=reference)


def check_demo_settings(methods: Sequence[str] | None, sizes: Sequence[int], variants: Sequence[str],
                        baselines: Sequence[str]) -> None:
    """The demo's rows are fixed: options that would change them are refused, naming the flag, before any work."""
    if methods is not None:
        raise ConfigError("--rows demo benches task_arithmetic and wudi; drop --methods, or use --rows full")
    if len(sizes) != 1:
        raise ConfigError(f"--rows demo runs one calibration size, got --calib-sizes {','.join(map(str, sizes))}; "
                          "give one size, or use --rows full for a sweep")
    if tuple(variants) != ("reference",):
        raise ConfigError("--rows demo runs the reference and tuned variants itself; drop --featcal-variants, or use "
                          "--rows full")
    if baselines:
        raise ConfigError("--rows demo runs no comparison baselines; drop --baselines, or use --rows full")
