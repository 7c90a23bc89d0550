"""The block engine, floor 2 of calibration/ (docs/layout.md): driver.py (FeatCalEngine) captures the block-0
inputs (replay.py checks the replay) and, per block, gathers statistics (gather.py: as_merged, sequential;
one_pass.py) through hooks.py and context.py's RunContext / BlockContext, then solves the block (maths/) and
the norms outside the blocks (outer_norms.py), or tries a block's candidates (block_tuning.py). Where the
models live (placement.py, expert_placement.py), the block-input chains (chains.py), the experts' recorded
outputs (expert_tape.py), the prefetched reads (prefetch.py), parameter names and the expert template."""
