"""Comparison baselines for FeatCal: post-merge Surgery / ProbSurgery and the merges RegMean(++) / WUDI.

Entry point: `run_baseline(name, merged=..., base=..., experts=..., calibration=..., **params)`;
see featcal.experiments.baselines.api and docs/baselines.md.
"""

from featcal.experiments.baselines.api import BASELINES, BaselineResult, run_baseline
from featcal.experiments.baselines.probsurgery import fit_probsurgery
from featcal.experiments.baselines.surgery import SurgeryModules, fit_surgery
from featcal.merging.regmean import regmean
from featcal.merging.wudi import wudi

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
