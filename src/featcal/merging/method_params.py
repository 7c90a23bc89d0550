"""The parameter models of the data-assisted merges RegMean(++) and WUDI, with the published defaults: declared
once, with their methods' other facts, in the method table (featcal.config.methods); importable here too."""

from __future__ import annotations

from featcal.config.methods import RegMeanParams, WudiParams

__all__ = ["RegMeanParams", "WudiParams"]
