"""Every input of a merge or a calibration, read: checkpoints, hub ids, in-memory models, LoRA adapters, GGUF.

family.py is the one front door; the rest are the kinds of input (as TensorSources), their layouts and grown
vocabularies, the checks that they form one family, and their sha256. Nothing here writes an output.
"""
