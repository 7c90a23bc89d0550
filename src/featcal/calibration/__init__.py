"""FeatCal calibration: closed-form, block-by-block calibration of a merged model toward its experts.

`calibrate` (api.py) is the entry point: it dispatches to one calibration at one setting (core.py) or to
the label-free hyperparameter search (tuning/), both of which check their inputs with inputs.py and
hand back a CalibrationResult (result.py). The method is docs/method.md; here:

- engine.py, the block driver: capture block-0 inputs (replay.py checks the replay), then per block the
  statistics gatherer `block_statistics` names (gather.py: as_merged, sequential; one_pass.py), each
  working through context.py's RunContext / BlockContext; resume checkpoints (resume.py) and records;
- hooks.py turns a block's forwards into statistics.py's streaming sums; solves.py solves a block's
  modules with solver.py's closed forms; outer_norms.py solves the norms outside the blocks;
- drift.py measures what a run records; chains.py stores the block-input chains, placement.py where
  the models live, distributed.py shares the batches over ranks; planner.py estimates a run's memory.

The per-architecture knowledge is in featcal.blocks.
"""
