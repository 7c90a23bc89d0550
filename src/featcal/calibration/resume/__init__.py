"""Resume checkpoints, floor 1 of calibration/ (docs/layout.md): store.py keeps the calibrated blocks and the
chains after every `checkpoint_every`-th block, with the digests that tell whether a state fits the run."""
