"""Checkpoints in, outputs out, and the process around them: three sub-packages on floors of their own.

process/ (signals, the host allocator, optional extras) sits lowest; read/ (every input as a TensorSource,
its validation and hashes) above it; write/ (atomic output, the report, the model card, task heads, the
tokenizer an output carries) on top, since what is written is made from what was read (docs/layout.md).
"""
