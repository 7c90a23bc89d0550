"""The front of calibration, floor 5 of calibration/ (docs/layout.md): api.py (featcal.calibrate),
in_memory.py (models in, a CalibrationResult out: one setting, core/, or the search, tuning/), pipeline.py
(calibrate_to_dir: checkpoints in, an output folder out), task_data.py (the calibration data of a request) and
data_summary.py (the lines that say how each task's data was read)."""
