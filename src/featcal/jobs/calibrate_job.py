"""`featcal calibrate` as a use case: one merged checkpoint on disk calibrated toward its experts into a new folder.

    calibrate(CalibrateRequest(merged, base, experts, calibration, out, config=..., options=..., outputs=...))
        -> CalibratedCheckpoint (.out, .report: its featcal.json, .result: the CalibrationResult, .main)

The work is calibration/front/pipeline.py's `calibrate_to_dir`, the one writer of a calibrated folder: it sits on the
calibration floor because `featcal.calibrate(..., out=)` (calibration/front/api.py) writes the same folder and may not
import this floor; here is the use case the CLI and run files call, one frozen request in, one typed result out.
"""

from __future__ import annotations

from featcal.calibration.front import pipeline  # looked up at each call: a test may replace calibrate_to_dir
from featcal.calibration.front.pipeline import CalibratedCheckpoint, CalibrateRequest

__all__ = ["CalibrateRequest", "CalibratedCheckpoint", "calibrate"]


def calibrate(request: CalibrateRequest) -> CalibratedCheckpoint:
    """Check every input (before any work), calibrate the merge and write the folder atomically, as `featcal
    calibrate` does; raises a FeatCalError naming the culprit. Under torchrun only rank 0 writes (`.main`)."""
    if not isinstance(request, CalibrateRequest):
        raise TypeError(f"calibrate takes a CalibrateRequest, not {type(request).__name__}; featcal.calibrate takes "
                        "keywords")
    return pipeline.calibrate_to_dir(request)
