"""FeatCal calibration: closed-form, block-by-block calibration of a merged model toward its experts.

`calibrate` (api.py) is the entry point; solver.py holds the closed-form solves, statistics.py the
streaming sums, engine.py the block driver, adapters/ the per-architecture knowledge, chains.py the
storage of block-input chains, sources.py where expert/base parameters are read from.
"""
