"""Expert and base parameters by the calibrated model's names: an in-memory model's, or an opened input's.

The engine asks for parameters by the names of the model being calibrated (transformers-5 names).
A checkpoint saved by transformers 4 may spell them differently (CLIPVisionModel's `vision_model.`
prefix, ViT's `encoder.layer.N.attention.attention.query`); `checkpoint_key_map` maps them with
transformers' own checkpoint-conversion rules, so a path expert is read block by block and never
loaded whole. A parameter transformers builds from several checkpoint tensors (a mixture of experts' fused
experts, saved one tensor per expert) is built the same way, when read (io/read/conversions.py).
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Iterable

import torch
from torch import nn

from featcal.errors import CheckpointError
from featcal.io.read.conversions import Conversion
from featcal.io.read.tensor_source import DictSource, MappedSource, TensorSource


def parameter_aliases(model: nn.Module) -> dict[str, list[str]]:
    """Every parameter name (tied ones included) -> all names of the same tensor, canonical first."""
    groups: dict[int, list[str]] = defaultdict(list)
    for name, p in model.named_parameters(remove_duplicate=False):
        groups[id(p)].append(name)
    return {name: names for names in groups.values() for name in names}


def checkpoint_key_map(model: nn.Module, checkpoint_keys: list[str],
                       conversions: dict[str, Conversion] | None = None) -> dict[str, str]:
    """Model parameter name -> checkpoint tensor name, through transformers' renaming rules.

    A checkpoint tensor that transformers converts with others into a parameter (its `WeightConverter`s) is
    filed in `conversions` (the parameter the loader files it under -> its group); without `conversions`,
    refused."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, rename_source_key

    names = set(parameter_aliases(model))
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    meta = {n: True for n in names}
    prefix = getattr(model, "base_model_prefix", None) or None
    out: dict[str, str] = {}
    for key in checkpoint_keys:
        if key in names:
            out.setdefault(key, key)
            continue
        renamed, pattern = rename_source_key(key, renamings, converters, prefix, meta)
        if pattern is not None:
            if conversions is None:
                raise CheckpointError(f"checkpoint tensor {key!r} needs a weight conversion ({pattern}) that "
                                      "this reader does not apply")
            if renamed in names:
                conversions.setdefault(renamed, Conversion(by_pattern[pattern], renamed)).add(pattern, key)
            continue
        if renamed in names:
            out.setdefault(renamed, key)
    return out


# A source read by the calibrated model's parameter names: the one TensorSource interface (keys, meta, get,
# shape), named for what calibration reads (kept as the 0.1 name of this role).
ParamSource = TensorSource


class ModelSource(DictSource):
    """An in-memory model's parameters, every alias of a tied one included (never modified)."""

    def __init__(self, model: nn.Module, label: str) -> None:
        super().__init__(dict(model.named_parameters(remove_duplicate=False)), label)
        self.module = model

    @property
    def config(self) -> dict:
        from featcal.io.read.sources import module_config

        return module_config(self.module)


class CheckpointSource(MappedSource):
    """A checkpoint (any opened input: a folder, a LoRA adapter applied to its base, a dequantised GGUF file)
    viewed by the parameter names of `template`, read one tensor at a time.

    Folders are read with plain file reads (UnmappedReader), not the memory map: pages read through a map stay
    in the process's RSS while the reader is open, so T open experts would cost T checkpoints of RSS by the
    last block although only one block is ever needed.

    A parameter transformers builds from several checkpoint tensors (a mixture of experts' fused experts,
    which `save_pretrained` writes one tensor per expert) is built from them when read, with transformers' own
    converter (io/read/conversions.py): one block's experts at a time, never the whole model.
    """

    def __init__(self, path: str | os.PathLike | None, template: nn.Module, label: str, *,
                 allow_pickle: bool = False, reader: TensorSource | None = None) -> None:
        from featcal.io.read.sources import UnmappedReader

        self.label = label
        # `reader`: the input as io/read/family.py opened it; else the folder `path`
        reader = reader or UnmappedReader(path, allow_pickle=allow_pickle)
        conversions: dict[str, Conversion] = {}
        key_map = checkpoint_key_map(template, reader.keys(), conversions)
        for name, names in parameter_aliases(template).items():  # a tied parameter may be saved under one alias only
            if name not in key_map:
                found = next((key_map[a] for a in names if a in key_map), None)
                if found is not None:
                    key_map[name] = found
        super().__init__(reader, key_map, {}, view=f"{label} by the parameter names of {type(template).__name__}")
        self.template = template
        # converted parameter name -> (its group, shape, dtype); a group may give several parameters
        self.converted: dict[str, tuple[Conversion, tuple[int, ...], torch.dtype]] = {}
        for conv in conversions.values():
            for name, (shape, dtype) in conv.shapes(reader.meta, template).items():
                self.converted[name] = (conv, shape, dtype)
        self._pending: dict[str, torch.Tensor] = {}  # the other parameters of the group converted last

    @property
    def reader(self) -> TensorSource:
        return self.source

    @property
    def config(self) -> dict:
        return self.source.config

    def keys(self) -> list[str]:
        return sorted({*self.key_map, *self.converted})

    def __contains__(self, name: str) -> bool:
        return name in self.key_map or name in self.converted

    def meta(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        if name in self.converted:
            return self.converted[name][1:]
        return self.source.meta(self.key_map[name])

    def get(self, name: str) -> torch.Tensor:
        if name in self.converted:
            return self._convert(name)
        if name not in self.key_map:
            raise CheckpointError(f"{self.label} ({self.source.path}): tensor {name!r} is missing")
        return self.source.get(self.key_map[name])

    def _convert(self, name: str) -> torch.Tensor:
        if name in self._pending:
            return self._pending.pop(name)
        values = self.converted[name][0].run(self.source.get, self.template)
        value = values.pop(name)
        self._pending = values
        return value

    def shape(self, name: str) -> tuple[int, ...] | None:
        if name in self.converted:
            return self.converted[name][1]
        key = self.key_map.get(name)
        return None if key is None else self.source.meta(key)[0]


def validate_source(source: ParamSource, reference: nn.Module, names: list[str]) -> None:
    """Refuse, before any work, a source missing any of `names` or holding it with another shape."""
    params = dict(reference.named_parameters(remove_duplicate=False))
    for name in names:
        want = tuple(params[name].shape)
        got = source.shape(name)
        if got is None:
            raise CheckpointError(f"{source.label}: parameter {name!r} is missing (the merged model has it, {want})")
        if tuple(got) != want:
            raise CheckpointError(f"{source.label}: parameter {name!r} has shape {tuple(got)}, the merged model {want}")


@torch.no_grad()
def load_into(model: nn.Module, names: list[str], source: ParamSource) -> None:
    """Copy `names` from `source` into `model`'s parameters, in place (dtype/device of the model)."""
    copy_into(model, ((name, source.get(name)) for name in names))


@torch.no_grad()
def copy_into(model: nn.Module, values: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy (name, value) pairs into `model`'s parameters of those names, in place (dtype/device of the model),
    one at a time as `values` yields them."""
    params = dict(model.named_parameters(remove_duplicate=False))
    for name, value in values:
        p = params[name]
        p.copy_(value.to(device=p.device, dtype=p.dtype))
