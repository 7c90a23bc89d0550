"""`featcal merge` as a use case: experts merged into their base, the merged checkpoint written.

    merge(MergeRequest(base, experts, config, out=..., options=..., outputs=..., calibration=...))
        -> MergeResult (.state: the merged state dict, .out, .report: its featcal.json)

The work is merging/api.py's `merge_to`, beside the keyword entry point `featcal.merge` that builds the same
request (merging/ may not import this floor); here is the use case the CLI and run files call.
"""

from __future__ import annotations

import featcal.merging.api as merging_api  # looked up at each call: a test may replace merge_to
from featcal.merging.api import MergeRequest, MergeResult

__all__ = ["MergeRequest", "MergeResult", "merge"]


def merge(request: MergeRequest) -> MergeResult:
    """Check every input (before any work), merge tensor by tensor, check the result for NaN / Inf and (with
    `request.out`) write the folder atomically, as `featcal merge` does; raises a FeatCalError naming the culprit."""
    if not isinstance(request, MergeRequest):
        raise TypeError(f"merge takes a MergeRequest, not {type(request).__name__}; featcal.merge takes keywords")
    return merging_api.merge_to(request)
