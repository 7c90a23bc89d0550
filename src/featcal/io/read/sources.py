"""Where merge inputs come from: checkpoint directories, hub ids, or models already in memory.

Every input is turned into an object with CheckpointReader's interface (`keys`, `meta`, `get`,
`config`, `path`), so validation and the streaming driver never care which kind they were given.
In-memory models are viewed with the names and tied-weight de-duplication that `save_pretrained`
would write, so that a module and its saved checkpoint are interchangeable inputs.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Union

import torch
from torch import nn

from featcal.errors import CheckpointError
from featcal.io.read.checkpoint import CheckpointReader
from featcal.io.read.tensor_source import DictSource

MergeInput = Union[str, os.PathLike, nn.Module, CheckpointReader]

# safetensors dtype codes (https://github.com/huggingface/safetensors, format: little-endian data)
_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


class UnmappedReader(CheckpointReader):
    """A CheckpointReader whose `get` reads each tensor with plain file I/O instead of the memory map.

    Why: pages read through a memory map stay mapped (and counted in the process's RSS) for as long as
    the reader is open, so a merge that keeps T expert readers open would show T checkpoints of RSS
    even though it holds one tensor at a time. Reading with `readinto` into a fresh tensor leaves only
    that tensor in the process; the OS page cache still speeds up repeated passes. Headers and shapes
    (`keys`, `meta`) still come from CheckpointReader. Pickled checkpoints use CheckpointReader.get.
    """

    def __init__(self, path_or_id: str | os.PathLike, *, allow_pickle: bool = False) -> None:
        super().__init__(path_or_id, allow_pickle=allow_pickle)
        self._headers: dict[Path, tuple[int, dict]] = {}

    def _header(self, file: Path) -> tuple[int, dict]:
        """(offset of the data section, header dict) of a safetensors file, parsed once."""
        if file not in self._headers:
            with open(file, "rb") as fh:
                size = int.from_bytes(fh.read(8), "little")
                self._headers[file] = (8 + size, json.loads(fh.read(size)))
        return self._headers[file]

    def get(self, name: str) -> torch.Tensor:
        files = getattr(self, "_files", None)
        if getattr(self, "_pickled", None) is not None or not files or name not in files:
            return super().get(name)  # pickles, or a missing name (CheckpointReader's error message)
        file = files[name]
        start, header = self._header(file)
        info = header[name]
        dtype = _ST_DTYPES.get(info["dtype"])
        if dtype is None:
            raise CheckpointError(f"{file}: tensor {name!r} has unsupported dtype {info['dtype']}")
        begin, end = info["data_offsets"]
        data = torch.empty(end - begin, dtype=torch.uint8)
        with open(file, "rb") as fh:
            fh.seek(start + begin)
            got = fh.readinto(memoryview(data.numpy()))
        if got != end - begin:
            raise CheckpointError(f"{file}: tensor {name!r} is truncated ({got} of {end - begin} bytes)")
        return data.view(dtype).reshape(info["shape"])


def checkpoint_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors `module.save_pretrained` would write: tied duplicates removed, names as on disk.

    Plain torch modules (not transformers models) give their state dict unchanged.
    """
    state = {k: v.detach() for k, v in module.state_dict().items()}
    try:
        from transformers import PreTrainedModel
        from transformers.modeling_utils import remove_tied_weights_from_state_dict, revert_weight_conversion
    except ImportError:  # pragma: no cover - transformers is a dependency; an older one lacks these helpers
        return state
    if isinstance(module, PreTrainedModel):
        state = remove_tied_weights_from_state_dict(state, module)
        state = revert_weight_conversion(module, state)
    return {k: v.detach().cpu() for k, v in state.items()}


def module_config(module: nn.Module) -> dict:
    """config.json-like dict of a module: its config, with `architectures` set as save_pretrained sets it."""
    config = getattr(module, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        return {}
    data = config.to_dict()
    data["architectures"] = [type(module).__name__]
    return data


class ModuleSource(DictSource):
    """CheckpointReader's read interface over an in-memory model (no copy of its weights), by the names its
    checkpoint would have."""

    def __init__(self, module: nn.Module, label: str | None = None) -> None:
        super().__init__(checkpoint_state_dict(module), label or f"<in-memory {type(module).__name__}>")
        self.module = module
        self._config = module_config(module)

    @property
    def config(self) -> dict:
        return dict(self._config)

    def check_can_save(self) -> None:
        """A checkpoint needs a transformers config: refuse plain torch modules as the base of `out`."""
        config = getattr(self.module, "config", None)
        if config is None or not hasattr(config, "save_pretrained"):
            raise CheckpointError(
                f"base {self.path} has no transformers config, so no checkpoint directory can be written "
                "from it; merge without `out` to get the state dict"
            )

    def save_config(self, directory: Path) -> None:
        """Write config.json (and generation_config.json for generative models) into `directory`."""
        self.check_can_save()
        config = copy.deepcopy(self.module.config)  # do not touch the caller's model
        config.architectures = [type(self.module).__name__]
        config.save_pretrained(directory)
        gen = getattr(self.module, "generation_config", None)
        can_generate = getattr(self.module, "can_generate", lambda: False)
        if gen is not None and can_generate():
            gen.save_pretrained(directory)
