"""The use cases, one request in and one typed result out: above calibration/, merging/ and evaluation/, below
cli/ (whose commands build a request from their flags, make one call and print the result).

    run_file(RunRequest(file, out=None, progress=True)) -> RunResult     `featcal run FILE.yaml`
    plan(PlanRequest(base=..., merged=..., ...)) -> PlanResult         `featcal plan`

Both are also `featcal.run` and `featcal.plan`, and take their request's fields as keywords.
"""

from __future__ import annotations

from featcal.jobs.plan_job import PlanRequest, PlanResult, plan
from featcal.jobs.run_job import RunRequest, RunResult, run_file

__all__ = ["PlanRequest", "PlanResult", "RunRequest", "RunResult", "plan", "run_file"]
