"""FeatCal calibration: closed-form, block-by-block calibration of a merged model toward its experts.

The method is docs/method.md. The package is on floors of its own (docs/layout.md, and the test's
CALIBRATION_FLOORS); a part imports its own modules or a lower floor's, never a higher one's:

- front/ (5): `calibrate` (api.py) is the entry point: it dispatches (in_memory.py) to one calibration at one
  setting (core/) or to the label-free hyperparameter search (tuning/); pipeline.py's calibrate_to_dir writes
  an output folder;
- planning/ (5): the cost, memory plan and time estimate of a run (`featcal plan`);
- tuning/ (4): the label-free hyperparameter search, calibrating candidates through core/;
- core/ (3): one calibration at one setting (setting.py), the checks every calibration makes (inputs.py), the
  CalibrationResult it hands back (result.py);
- engine/ (2): the block driver (driver.py): capture block-0 inputs (replay.py checks the replay), then per
  block the statistics gatherer `block_statistics` names (gather.py: as_merged, sequential; one_pass.py), each
  working through context.py's RunContext / BlockContext; hooks.py turns a block's forwards into streaming sums;
  outer_norms.py solves the norms outside the blocks; chains.py stores the block-input chains, placement.py
  where the models live;
- maths/ (1): the streaming statistics, their sums over ranks (distributed.py), the drift sums, the
  closed-form solves (solver.py, solves.py); resume/ (1): the resume checkpoints (store.py).

The per-architecture knowledge is in featcal.blocks.
"""
