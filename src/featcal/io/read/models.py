"""One path to load a transformers model, whether it comes from the hub or a local folder."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import torch

from featcal.errors import CheckpointError
from featcal.io.read.checkpoint import (
    PICKLE_INDEX,
    PICKLE_SINGLE,
    SAFE_INDEX,
    SAFE_SINGLE,
    CheckpointReader,
    resolve_checkpoint,
)
from featcal.io.read.configs import (
    load_config,  # callers import it from here (torch-free: io/read/configs.py)
)


@contextlib.contextmanager
def hf_progress_bars(enabled: bool) -> Iterator[None]:
    """With `enabled=False`, silence transformers' own bars (loading, saving) for the duration.

    So that `--no-progress` means no bars at all, not only featcal's; the previous state is restored.
    """
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    if enabled or not was:
        yield
        return
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.enable_progress_bar()


def model_class_for(config) -> type:
    """The transformers class named in config.architectures; AutoModel for a config that names none.

    A config naming only classes transformers does not have (custom code behind `auto_map`, a renamed or
    newer class) is refused: read as the bare AutoModel its heads would be dropped from the output without a
    word (a causal LM saved without its lm_head)."""
    import transformers

    named = list(getattr(config, "architectures", None) or [])
    for arch in named:
        cls = getattr(transformers, arch, None) if isinstance(arch, str) else None
        if isinstance(cls, type):
            return cls
    if named:
        custom = " (custom code, config.auto_map, which featcal never runs)" if getattr(config, "auto_map", None) else ""
        raise CheckpointError(
            f"config.architectures names {', '.join(map(repr, named))}, which transformers {transformers.__version__} "
            f"does not have{custom}; read as the bare {getattr(config, 'model_type', '?')} model, its head would be "
            "lost: set architectures to the transformers class the weights are for"
        )
    return transformers.AutoModel


def check_loadable(path: str | os.PathLike, allow_pickle: bool = False) -> None:
    """Refuse a checkpoint folder whose weights transformers' `from_pretrained` would not find: featcal's own
    reader takes any `*.safetensors` name (`weights.safetensors`), transformers only its standard ones. Checked
    before any work wherever a model is loaded whole (the merged model calibrate starts from)."""
    p = Path(path)
    names = [SAFE_SINGLE, SAFE_INDEX] + ([PICKLE_SINGLE, PICKLE_INDEX] if allow_pickle else [])
    if not p.is_dir() or any((p / n).is_file() for n in names):
        return
    found = sorted(f.name for f in p.glob("*.safetensors"))
    if found:
        raise CheckpointError(
            f"{p} holds its weights in {', '.join(found)}, but transformers loads a model only from {SAFE_SINGLE} "
            f"or a shard index ({SAFE_INDEX}): rename the file to {SAFE_SINGLE}"
        )


def refuse_embedded_adapter(path: str | os.PathLike) -> None:
    """With `peft` installed, transformers' `from_pretrained` applies an adapter_config.json it finds beside full
    weights on top of them: a third reading of a folder featcal reads as its full weights (io/read/lora.py). Refused
    rather than loaded two ways."""
    from transformers.utils import is_peft_available

    if (Path(path) / "adapter_config.json").is_file() and is_peft_available():
        raise CheckpointError(
            f"{Path(path)} holds full weights and an adapter_config.json, and with peft installed transformers would "
            "apply the adapter on top of the weights featcal reads; move the adapter files to their own folder"
        )


def load_model(
    path_or_id: str | os.PathLike,
    *,
    model_class: type | None = None,
    allow_pickle: bool = False,
    dtype: torch.dtype | None = torch.float32,
):
    """Load a model safely: safetensors only unless `allow_pickle`, never remote code."""
    path = resolve_checkpoint(path_or_id, allow_pickle=allow_pickle)
    CheckpointReader(path, allow_pickle=allow_pickle)  # validates weights exist and are allowed
    check_loadable(path, allow_pickle)
    refuse_embedded_adapter(path)
    config = load_config(path)
    cls = model_class or model_class_for(config)
    try:
        with _load_report_silenced():  # its missing / unexpected keys are refused below, in one line
            model, info = cls.from_pretrained(
                path, config=config, use_safetensors=not allow_pickle or None, trust_remote_code=False, dtype=dtype,
                output_loading_info=True,
            )
    except Exception as exc:
        raise CheckpointError(f"cannot load {Path(path)} as {cls.__name__}: {exc}") from None
    _refuse_partial_load(Path(path), cls.__name__, info)
    model.eval()
    return model


@contextlib.contextmanager
def _load_report_silenced() -> Iterator[None]:
    import logging

    logger = logging.getLogger("transformers")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _refuse_partial_load(path: Path, name: str, info: dict) -> None:
    """A class that leaves checkpoint tensors unread (they would be missing from what featcal writes) or
    initialises weights the checkpoint lacks (random values scored or calibrated as if trained) is refused."""
    unread = sorted(info.get("unexpected_keys") or ())
    if unread:
        raise CheckpointError(
            f"{path} read as {name} leaves {len(unread)} of its tensors unread ({', '.join(unread[:3])}"
            f"{', ...' if len(unread) > 3 else ''}), which would be lost: its config.architectures does not "
            "name the class these weights are for"
        )
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        raise CheckpointError(
            f"{path} read as {name} lacks {len(missing)} of the model's weights ({', '.join(missing[:3])}"
            f"{', ...' if len(missing) > 3 else ''}), which would be random: the checkpoint is incomplete or its "
            "config.architectures names another class"
        )
