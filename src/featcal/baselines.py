"""Deprecated alias: the baselines moved in 0.2 (issue #18).

`featcal.baselines` was the documented home of `run_baseline` and the Surgery / ProbSurgery / RegMean /
WUDI entry points. Surgery and ProbSurgery now live in `featcal.experiments.baselines`, RegMean(++) and
WUDI, being merge methods, in `featcal.merging`; this module re-exports the old names with a
DeprecationWarning so existing code keeps running. It will be removed in a later release.
"""

from __future__ import annotations

import warnings

from featcal.experiments.baselines import (  # noqa: F401
    BASELINES,
    BaselineResult,
    SurgeryModules,
    fit_probsurgery,
    fit_surgery,
    regmean,
    run_baseline,
    wudi,
)

warnings.warn("featcal.baselines is deprecated: import from featcal.experiments.baselines (Surgery, ProbSurgery, "
              "run_baseline) or featcal.merging (RegMean, WUDI)", DeprecationWarning, stacklevel=2)
