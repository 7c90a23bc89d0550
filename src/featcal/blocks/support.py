"""Whether a model can be calibrated, decided from its structure alone, and what would be calibrated.

`check_model` runs on any model, a loaded one or one built on the meta device from a config (no weights
read, well under a second: `check_config`), so `featcal calibrate`, `plan` and `run` refuse an unsupported
architecture before loading anything. It refuses, naming the part:

- models transformers marks as carrying a recurrent state (`_is_stateful`: Mamba, RWKV, Jamba, ...) or
  whose config names a recurrent / convolutional layer type (`layer_types`: "linear_attention", "conv",
  "hybrid"): FeatCal replays each block on stored inputs, which a layer with a state across tokens or calls
  does not allow;
- models where no stack of blocks is found, or several and nothing tells which one the data is for
  (blocks/structure.py);
- stacks whose blocks share parameters (ALBERT's one layer called N times) or hold nothing to calibrate.

`describe` says what `featcal supported` prints: the stacks, the calibrated kinds, what stays merged.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch import nn

from featcal.blocks.discovery import calibrated_modules, kept_merged
from featcal.blocks.structure import Stack, block_lists, get_path, make_stacks, modules_reading_encoder
from featcal.errors import UnsupportedModelError

# transformers' names (configuration_utils.ALLOWED_ATTN_LAYER_TYPES) of layers that carry a state across tokens
RECURRENT_LAYER_TYPES = ("linear_attention", "conv", "hybrid", "hybrid_sliding")


def check_model(model: nn.Module) -> list[Stack]:
    """The model's stacks, or UnsupportedModelError naming what cannot be calibrated."""
    _refuse_recurrent(model)
    stacks = make_stacks(model, modules_reading_encoder)  # what StructuralAdapter(model).stacks(model) finds
    for stack in stacks:
        _check_stack(model, stack)
    return stacks


def check_config(config: Any) -> nn.Module:
    """A model of `config`'s class built on the meta device (no memory, no weights) and checked; the model."""
    from transformers import PreTrainedModel

    from featcal.io.read.models import model_class_for

    cls = model_class_for(config)
    try:
        with torch.device("meta"):  # an Auto class (a config naming no architecture) builds through from_config
            model = cls(config) if issubclass(cls, PreTrainedModel) else cls.from_config(config)
    except Exception as exc:
        raise UnsupportedModelError(
            f"cannot build a {cls.__name__} from the config of model type {getattr(config, 'model_type', '?')!r} "
            f"to check its structure ({type(exc).__name__}: {' '.join(str(exc).split())[:200]})"
        ) from None
    check_model(model)
    return model


def _refuse_recurrent(model: nn.Module) -> None:
    name = type(model).__name__
    types = list(getattr(getattr(model, "config", None), "layer_types", None) or ())
    recurrent = sorted({t for t in types if t in RECURRENT_LAYER_TYPES})
    if recurrent:
        layers = [i for i, t in enumerate(types) if t in RECURRENT_LAYER_TYPES]
        shown = ", ".join(map(str, layers[:8])) + (", ..." if len(layers) > 8 else "")
        raise UnsupportedModelError(
            f"{name}: layers {shown} are {'/'.join(recurrent)} layers (config.layer_types), which carry a state "
            "across tokens; featcal calibrates stacks of attention blocks only"
        )
    if getattr(type(model), "_is_stateful", False):
        raise UnsupportedModelError(
            f"{name} carries a recurrent state across tokens ({_stateful_parts(model)}); featcal calibrates "
            "stacks of attention blocks only"
        )


def _stateful_parts(model: nn.Module) -> str:
    """The parts of the first block list's first block that are neither linear layers nor norms."""
    lists = block_lists(model)
    if not lists:
        return "no stack of attention blocks found"
    block = get_path(model, lists[0])[0]
    parts = sorted(kept_merged(block))
    top = []
    for p in parts:
        head = p.split(".")[0]
        label = f"{head} ({type(block.get_submodule(head)).__name__})" if head else type(block).__name__
        if label not in top:
            top.append(label)
    return f"its blocks ({lists[0]}: {type(block).__name__}) hold " + ", ".join(top or ["no attention"])


def _check_stack(model: nn.Module, stack: Stack) -> None:
    name = type(model).__name__
    blocks = stack.blocks(model)
    if len({id(b) for b in blocks}) < len(blocks):
        raise UnsupportedModelError(f"{name}: its {stack.name} blocks at {stack.blocks_path!r} are one module listed "
                                    "several times (shared parameters); featcal calibrates each block once")
    entry = get_path(model, stack.entry_path)
    config = getattr(entry, "config", None) or getattr(model, "config", None)
    expected = getattr(config, "num_hidden_layers", None)
    if not getattr(config, "is_encoder_decoder", False):  # an encoder-decoder counts its stacks apart
        if isinstance(expected, int) and expected != len(blocks):
            raise UnsupportedModelError(
                f"{name}: {len(blocks)} block(s) at {stack.blocks_path!r} for {expected} layers "
                "(config.num_hidden_layers): its layers share parameters; featcal calibrates each block once"
            )
    for i, block in enumerate(blocks):
        if not calibrated_modules(block):
            raise UnsupportedModelError(f"{name}: {stack.name} block {i} ({type(block).__name__}) holds no Linear, "
                                        "Conv1D or norm featcal can calibrate")


def _kept_in_any(blocks: list[nn.Module]) -> dict[str, str]:
    """What any block keeps merged (a mixture of experts may sit in every other block only: Switch Transformers)."""
    out: dict[str, str] = {}
    for block in blocks:
        for name, why in kept_merged(block).items():
            out.setdefault(name, why)
    return out


def describe(model: nn.Module) -> dict[str, Any]:
    """What calibrating `model` would touch: per stack its blocks, the calibrated modules of its first block
    by kind, the layer types, and what keeps its merged value."""
    stacks = check_model(model)
    out = []
    for stack in stacks:
        blocks = stack.blocks(model)
        mods = calibrated_modules(blocks[0])
        kinds: Counter[str] = Counter()
        for c in mods:
            if c.kind == "linear":
                kinds["Conv1D" if c.transposed else "Linear"] += 1
            elif c.form is not None and c.form.offset:
                kinds[f"{c.kind} z·({c.form.offset:g}+w)"] += 1
            else:
                kinds[c.kind] += 1
        out.append({
            "stack": stack.name, "blocks": stack.blocks_path, "count": len(blocks), "block": type(blocks[0]).__name__,
            "entry": stack.entry_path or "(the model)", "layer_types": sorted(set(stack.layer_types)),
            "class_token": stack.class_token_head, "calibrated": dict(kinds),
            "kept_merged": _kept_in_any(blocks),
        })
    return {"model": type(model).__name__, "stacks": out}
