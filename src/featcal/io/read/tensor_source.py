"""What every input of a merge or a calibration is, once opened: tensors by name, read one at a time.

One interface for all of them (a checkpoint folder or hub id, an in-memory model, a LoRA adapter applied
to its base, a dequantised GGUF file, any of those viewed under other names or at another vocabulary
size), so that opening (io/read/family.py), validation (io/read/validate.py), the streaming merge and the block-by-
block calibration never ask which kind they were given. A source is named either as its checkpoint names
its tensors (the merge's view) or by the parameter names of the model being calibrated (io/read/param_sources.py's
views); the interface is the same.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from featcal.errors import CheckpointError


class TensorSource:
    """Names, headers and values of one model's tensors, and its config.json as a dict.

    Subclasses implement `keys`, `meta` and `get` (and `config` where they have one); `shape` and `in` follow
    from those. `label` names the input in messages ("expert 'mnist'"); `path` says where it comes from.
    """

    path: Any = None
    label: str = ""

    @property
    def config(self) -> dict:
        return {}

    def keys(self) -> list[str]:
        raise NotImplementedError

    def meta(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        """Shape and dtype of tensor `name`, without reading its values."""
        raise NotImplementedError

    def get(self, name: str) -> torch.Tensor:
        """The tensor's values (may be the source's own tensor: callers never modify it in place)."""
        raise NotImplementedError

    def __contains__(self, name: str) -> bool:
        return name in self.keys()

    def shape(self, name: str) -> tuple[int, ...] | None:
        """Shape of `name`, or None when the source does not hold it."""
        return tuple(self.meta(name)[0]) if name in self else None


class MappedSource(TensorSource):
    """Another source's tensors under other names (`key_map`: name here -> name there), with a config of its own:
    a checkpoint under its class's names (io/read/layouts.py), a LoRA adapter over its base (io/read/lora.py), a checkpoint
    by the calibrated model's parameter names (io/read/param_sources.py)."""

    def __init__(self, source: Any, key_map: Mapping[str, str], config: dict, view: str) -> None:
        self.source = source
        self.path = source.path
        self.label = self.label or getattr(source, "label", "")
        self.key_map = dict(key_map)
        self._config = dict(config)
        self.view = view  # what the renaming did, for messages and reports

    @property
    def config(self) -> dict:
        return dict(self._config)

    def keys(self) -> list[str]:
        return sorted(self.key_map)

    def __contains__(self, name: str) -> bool:
        return name in self.key_map

    def meta(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        return self.source.meta(self.key_map[name])

    def get(self, name: str) -> torch.Tensor:
        if name not in self.key_map:
            raise CheckpointError(f"{self.path}: tensor {name!r} is missing")
        return self.source.get(self.key_map[name])


class DictSource(TensorSource):
    """Tensors held by a model in memory, by name (references, never copies: callers do not modify them)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], label: str) -> None:
        self.path = self.label = label
        self.tensors = dict(tensors)

    def keys(self) -> list[str]:
        return sorted(self.tensors)

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def meta(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        t = self.tensors[name]
        return tuple(t.shape), t.dtype

    def get(self, name: str) -> torch.Tensor:
        if name not in self.tensors:
            raise CheckpointError(f"{self.path}: tensor {name!r} is missing")
        return self.tensors[name].detach()
