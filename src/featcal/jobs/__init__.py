"""The use cases, one request in and one typed result out: above calibration/, merging/ and evaluation/, below
cli/ (whose commands build a request from their flags, make one call and print the result).

    run_file(RunRequest(file, out=None, progress=True)) -> RunResult     `featcal run FILE.yaml`
    plan(PlanRequest(base=..., merged=..., ...)) -> PlanResult         `featcal plan`
    merge(MergeRequest(base, experts, config, out=...)) -> MergeResult      `featcal merge`
    calibrate(CalibrateRequest(merged, base, experts, calibration, out)) -> CalibratedCheckpoint
                                                                         `featcal calibrate`

run_file and plan are also `featcal.run` and `featcal.plan`, and take their request's fields as keywords;
featcal.merge and featcal.calibrate(..., out=) take keywords and build the same requests. merge and calibrate (and
their request types) load lazily: `import featcal.jobs` imports no torch (the CLI's --help imports it).
"""

from __future__ import annotations

from featcal.jobs.plan_job import PlanRequest, PlanResult, plan
from featcal.jobs.run_job import RunRequest, RunResult, run_file

__all__ = ["CalibrateRequest", "CalibratedCheckpoint", "MergeRequest", "MergeResult", "PlanRequest", "PlanResult",
           "RunRequest", "RunResult", "calibrate", "merge", "plan", "run_file"]

_LAZY = {"CalibrateRequest": "calibrate_job", "CalibratedCheckpoint": "calibrate_job", "calibrate": "calibrate_job",
         "MergeRequest": "merge_job", "MergeResult": "merge_job", "merge": "merge_job"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"featcal.jobs.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'featcal.jobs' has no attribute {name!r}")
