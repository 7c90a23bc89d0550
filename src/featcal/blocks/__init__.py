"""Architecture knowledge shared by merging, calibration and the baselines: adapters (where a
model's blocks are), block-input capture, the modules a block calibrates, Gram sums, heads."""
