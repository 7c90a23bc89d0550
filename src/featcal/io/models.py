"""One path to load a transformers model, whether it comes from the hub or a local folder."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from featcal.errors import CheckpointError
from featcal.io.checkpoint import CheckpointReader, resolve_checkpoint


def model_class_for(config) -> type:
    """The transformers class named in config.architectures (falls back to AutoModel)."""
    import transformers

    for arch in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, arch, None)
        if cls is not None:
            return cls
    return transformers.AutoModel


def load_model(
    path_or_id: str | os.PathLike,
    *,
    model_class: type | None = None,
    allow_pickle: bool = False,
    dtype: torch.dtype | None = torch.float32,
):
    """Load a model safely: safetensors only unless `allow_pickle`, never remote code."""
    import transformers

    path = resolve_checkpoint(path_or_id, allow_pickle=allow_pickle)
    CheckpointReader(path, allow_pickle=allow_pickle)  # validates weights exist and are allowed
    config = transformers.AutoConfig.from_pretrained(path, trust_remote_code=False)
    cls = model_class or model_class_for(config)
    try:
        model = cls.from_pretrained(
            path, config=config, use_safetensors=not allow_pickle or None, trust_remote_code=False, dtype=dtype
        )
    except Exception as exc:
        raise CheckpointError(f"cannot load {Path(path)} as {cls.__name__}: {exc}") from None
    model.eval()
    return model
