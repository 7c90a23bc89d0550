"""What a calibration will cost before it runs, floor 5 of calibration/ (docs/layout.md): cost.py counts the
engine's forwards and bytes, planner.py prices its memory, fit.py fits the plan to a budget and reports it,
time_estimate.py turns counts into time (counting the tuning search's calibrations, so it sits above tuning/)."""
