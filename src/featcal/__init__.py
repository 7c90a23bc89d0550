"""featcal: merge fine-tuned transformers, then calibrate the merge back toward its experts (FeatCal).

Public API:
    merge(base, experts, method=..., out=None, **params)        -> state dict / checkpoint
    calibrate(merged, base=..., experts=..., calibration=..., config=FeatCalConfig())
                                                                 -> CalibrationResult (.model, .drift, ...)
    evaluate(tasks, models, base=..., merged=..., calibrated=..., experts=..., out=None)
                                                                 -> eval.json's content (models x tasks)
    run(file, out=None, progress=True)                           -> RunResult (`featcal run FILE.yaml`)
    plan(base=..., merged=..., experts=..., calibration=..., out=..., config=...)
                                                                 -> PlanResult (`featcal plan`: memory, time)
The last two are featcal.jobs.run_file and featcal.jobs.plan: each takes one frozen request (featcal.jobs.RunRequest,
PlanRequest), or its fields as keywords.
"""

from __future__ import annotations

from featcal.errors import (
    CalibrationDataError,
    CheckpointError,
    ConfigError,
    FeatCalError,
    OutputExistsError,
)

__version__ = "0.1.0"

__all__ = [
    "FeatCalConfig",
    "MergeConfig",
    "FeatCalError",
    "CheckpointError",
    "ConfigError",
    "CalibrationDataError",
    "OutputExistsError",
    "merge",
    "calibrate",
    "CalibrationResult",
    "evaluate",
    "run",
    "plan",
]


def __getattr__(name: str):
    # Lazy: `import featcal` stays cheap (`featcal --version` imports it: no pydantic schema, no torch), and each
    # entry point lives in its own module.
    if name in ("FeatCalConfig", "MergeConfig"):
        from featcal import config

        return getattr(config, name)
    if name == "merge":
        from featcal.merging.api import merge

        return merge
    if name == "calibrate":
        from featcal.calibration.front.api import calibrate

        return calibrate
    if name == "evaluate":
        from featcal.evaluation.api import evaluate

        return evaluate
    if name == "run":
        from featcal.jobs import run_file

        return run_file
    if name == "plan":
        from featcal.jobs import plan

        return plan
    if name == "CalibrationResult":
        from featcal.calibration.core.result import CalibrationResult

        return CalibrationResult
    raise AttributeError(f"module 'featcal' has no attribute {name!r}")
