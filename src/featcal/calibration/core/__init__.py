"""One calibration at one setting, floor 3 of calibration/ (docs/layout.md): setting.py (calibrate_setting)
opens the sources and the resume store and runs the engine; inputs.py checks and prepares what every
calibration takes; result.py is the CalibrationResult (and the tuning records) it hands back."""
