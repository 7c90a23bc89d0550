"""Writing a merged state dict as an ordinary Hugging Face checkpoint directory (safetensors)."""

from __future__ import annotations

import json
from pathlib import Path

from huggingface_hub import split_torch_state_dict_into_shards
from safetensors.torch import save_file
from torch import Tensor

from featcal.io.read.checkpoint import SAFE_INDEX, SAFE_SINGLE

DEFAULT_MAX_SHARD_SIZE = "5GB"


def save_state_dict(state: dict[str, Tensor], directory: Path, max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> list[str]:
    """model.safetensors, or numbered shards plus model.safetensors.index.json when it is bigger.

    The metadata `format: pt` is what transformers' from_pretrained expects. Returns the file names.
    """
    pattern = SAFE_SINGLE.replace(".safetensors", "{suffix}.safetensors")
    split = split_torch_state_dict_into_shards(state, filename_pattern=pattern, max_shard_size=max_shard_size)
    written = []
    for filename, names in split.filename_to_tensors.items():
        save_file({n: state[n] for n in names}, str(directory / filename), metadata={"format": "pt"})
        written.append(filename)
    if split.is_sharded:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())},
                 "weight_map": split.tensor_to_filename}
        (directory / SAFE_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        written.append(SAFE_INDEX)
    return written
