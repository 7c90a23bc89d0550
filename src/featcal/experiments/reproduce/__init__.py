"""The paper's settings (CLIP ViT zero-shot, FLAN-T5 GLUE, Llama MergeBench) run end to end.

`reproduce(options)` (featcal.experiments.reproduce.runner) is the entry point behind `featcal reproduce`;
`SETTINGS` (featcal.experiments.reproduce.settings) lists the hub ids, splits and reference numbers.
"""

from __future__ import annotations


def __getattr__(name: str):
    # Lazy: the CLI reads the settings registry without importing torch and transformers.
    if name == "reproduce":
        from featcal.experiments.reproduce.runner import reproduce

        return reproduce
    if name == "SETTINGS":
        from featcal.experiments.reproduce.settings import SETTINGS

        return SETTINGS
    raise AttributeError(f"module 'featcal.experiments.reproduce' has no attribute {name!r}")
