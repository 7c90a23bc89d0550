"""Comparison baselines for FeatCal: post-merge Surgery / ProbSurgery and the merges RegMean(++) / WUDI.

Entry point: `run_baseline(name, merged=..., base=..., experts=..., calibration=..., **params)`;
see featcal.baselines.api and docs/baselines.md.
"""

from featcal.baselines.api import BASELINES, BaselineResult, run_baseline
from featcal.baselines.probsurgery import fit_probsurgery
from featcal.baselines.regmean import regmean
from featcal.baselines.surgery import SurgeryModules, fit_surgery
from featcal.baselines.wudi import wudi

__all__ = [
    "BASELINES",
    "BaselineResult",
    "SurgeryModules",
    "fit_probsurgery",
    "fit_surgery",
    "regmean",
    "run_baseline",
    "wudi",
]
