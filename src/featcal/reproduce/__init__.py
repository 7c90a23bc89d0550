"""The paper's settings (CLIP ViT zero-shot, FLAN-T5 GLUE, Llama MergeBench) run end to end.

`reproduce(options)` (featcal.reproduce.runner) is the entry point behind `featcal reproduce`;
`SETTINGS` (featcal.reproduce.settings) lists the hub ids, splits and reference numbers.
"""

from __future__ import annotations


def __getattr__(name: str):
    # Lazy: the CLI reads the settings registry without importing torch and transformers.
    if name == "reproduce":
        from featcal.reproduce.runner import reproduce

        return reproduce
    if name == "SETTINGS":
        from featcal.reproduce.settings import SETTINGS

        return SETTINGS
    raise AttributeError(f"module 'featcal.reproduce' has no attribute {name!r}")
