"""Open any merge or calibration input by what it is: a checkpoint folder or hub id, an in-memory
model, a GGUF file (dequantised: io/gguf.py) or a LoRA / PEFT adapter over the base (io/lora.py).

Sits above the source kinds so that each of them stays ignorant of the others.
"""

from __future__ import annotations

import os

from torch import nn

from featcal.errors import CheckpointError
from featcal.io.checkpoint import CheckpointReader
from featcal.io.gguf import open_gguf
from featcal.io.lora import open_adapter, reads_as_adapter
from featcal.io.sources import MergeInput, ModuleSource, UnmappedReader


def open_source(
    item: MergeInput, *, label: str, allow_pickle: bool = False, base: object | None = None,
    kind: str | None = None,
) -> CheckpointReader | ModuleSource:
    """A reader for one merge input; errors name the input (`label`, e.g. "expert 'mnist'").

    A LoRA / PEFT adapter folder is an expert over `base` (the base's reader): io/lora.py; a folder holding
    an adapter and full weights is refused unless `kind` ("full" / "adapter") says which to read
    (`reads_as_adapter`); without `base` (the base itself) it is read as full weights. A `.gguf` file (or a
    folder holding one) is dequantised into memory: io/gguf.py.
    """
    if isinstance(item, (CheckpointReader, ModuleSource)):
        return item
    if isinstance(item, nn.Module):
        return ModuleSource(item, label=f"<in-memory {type(item).__name__} ({label})>")
    as_adapter = reads_as_adapter(item, label, kind, may_be_adapter=base is not None)
    if as_adapter:
        if base is None:
            raise CheckpointError(
                f"{label}: {item} is a LoRA/PEFT adapter, not a model; give the model it was trained on as the base"
            )
        return open_adapter(item, base, label, allow_pickle=allow_pickle)
    gguf = open_gguf(item, label, base)
    if gguf is not None:
        return gguf
    if isinstance(item, (str, os.PathLike)):
        try:
            return UnmappedReader(item, allow_pickle=allow_pickle)
        except CheckpointError as exc:
            raise CheckpointError(f"{label}: {exc}") from None
    raise CheckpointError(
        f"{label}: expected a checkpoint path, hub id or torch.nn.Module, got {type(item).__name__}"
    )
