"""FeatCal calibration: closed-form, block-by-block calibration of a merged model toward its experts.

`calibrate` (api.py) is the entry point: it dispatches to one calibration at one setting (core.py) or to
the label-free hyperparameter search (tuning.py), both of which check their inputs with inputs.py and
hand back a CalibrationResult (result.py). solver.py holds the closed-form solves, statistics.py the
streaming sums, engine.py the block driver, chains.py the storage of block-input chains; the
per-architecture knowledge is in featcal.blocks.adapters.
"""
