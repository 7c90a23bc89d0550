"""Where a transformers model keeps its stacks of residual blocks, found from its structure.

transformers' conventions, not a table of model types:

- a stack is an `nn.ModuleList` of blocks, each holding at least one linear layer, that no other such
  list contains (the layers of Llama's `model.layers`, BERT's `encoder.layer`, GPT-2's `transformer.h`,
  T5's `encoder.block`; a list nested in a block, T5's `layer` or a list of experts, is part of the block);
- its entry, the module called with a calibration batch to reach block 0, is the nearest module above
  the list whose forward takes the model's input (`input_ids` or `pixel_values`): the base model
  (`model`, `bert`, `transformer`), a vision tower, or an encoder / decoder of its own;
- an encoder-decoder (`config.is_encoder_decoder`) has two stacks, the encoder's then the decoder's,
  under `get_encoder()` and `get_decoder()`; the decoder's cross-attention reads the encoder's output;
- a model with several independent stacks and a vision tower among them (CLIPModel, SiglipModel) is
  calibrated on its vision tower, the one its image data reaches; other such models are refused;
- blocks whose config names several layer types (`config.layer_types`: sliding-window and full attention)
  are called per type with the arguments the model itself gives each block (adapters/structural.py).

The module layouts of transformers 4 (`vit.encoder.layer`) and 5 (`vit.layers`) are both found this way.

`Stack` (what one stack is) and `make_stacks` live here, below the adapters and blocks/support.py, so that the
support check, the probe and the adapters all describe a model's stacks from one floor (issue 52);
`modules_reading_encoder` is the one call that finds a decoder's cross-attention inputs.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from featcal.blocks.linear import is_linear
from featcal.errors import FeatCalError, UnsupportedModelError

MAIN_INPUTS = ("input_ids", "pixel_values")


def get_path(root: nn.Module, path: str) -> nn.Module | None:
    """The sub-module at dotted `path` ("" is the root itself), or None."""
    mod: Any = root
    for part in filter(None, path.split(".")):
        mod = getattr(mod, part, None)
        if mod is None:
            return None
    return mod


@dataclass(frozen=True)
class Stack:
    """One stack of residual blocks, calibrated in forward order."""

    name: str  # "encoder", "decoder", "vision", ...
    blocks_path: str  # dotted path of the nn.ModuleList of blocks, from the top model
    entry_path: str  # module called with the batch to reach block 0
    mask_key: str | None = "attention_mask"  # batch key of the 0/1 token mask of this stack's tokens
    class_token_head: bool = False  # output read from token 0 only (CLIP/ViT): last-block weighting
    cross_mask_key: str | None = None  # mask of the tokens cross-attention k/v read (T5 decoder)
    cross_modules: tuple[str, ...] = field(default_factory=tuple)  # name suffixes of those modules
    # attention type of each block (Gemma 3: "sliding_attention" / "full_attention"), when blocks get
    # per-type arguments; empty when every block is called alike
    layer_types: tuple[str, ...] = field(default_factory=tuple)

    @property
    def mask_keys(self) -> tuple[str, ...]:
        """The batch keys that block-level code reads (the token masks); the model inputs feed the stem only."""
        return tuple(k for k in (self.mask_key, self.cross_mask_key) if k)

    def blocks(self, model: nn.Module) -> nn.ModuleList:
        mod = get_path(model, self.blocks_path)
        if not isinstance(mod, nn.ModuleList):
            raise FeatCalError(f"{type(model).__name__}: no block list at {self.blocks_path!r}")
        return mod


@dataclass(frozen=True)
class BlockList:
    """A candidate stack: its list's path, its entry's path and the input that entry takes."""

    path: str
    entry: str
    main_input: str


def block_lists(model: nn.Module) -> list[str]:
    """Dotted paths of the top-level lists of blocks (ModuleLists whose every item holds a linear layer)."""
    found: list[str] = []
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.ModuleList) or len(mod) == 0:
            continue
        if any(name.startswith(p + ".") for p in found):
            continue  # nested in a block of a list already found
        if all(any(is_linear(s) for s in block.modules()) for block in mod):
            found.append(name)
    return found


def forward_inputs(module: nn.Module) -> set[str]:
    """The named parameters of `module.forward`."""
    try:
        params = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return set()
    return {n for n, p in params.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}


def entry_of(model: nn.Module, path: str) -> tuple[str, str] | None:
    """(entry path, main input) of the block list at `path`: the nearest module above it whose forward
    takes one of MAIN_INPUTS; None when none does."""
    parts = path.split(".")
    for cut in range(len(parts) - 1, -1, -1):
        entry = ".".join(parts[:cut])
        mod = get_path(model, entry)
        if mod is None:
            continue
        names = forward_inputs(mod)
        main = getattr(mod, "main_input_name", None)
        if main in MAIN_INPUTS and main in names:
            return entry, main
        for name in MAIN_INPUTS:
            if name in names:
                return entry, name
    return None


def _under(model: nn.Module, path: str, module: nn.Module | None) -> bool:
    """Whether the module at `path` lies inside `module`."""
    if module is None:
        return False
    return any(m is module for m in _ancestors(model, path))


def _ancestors(model: nn.Module, path: str) -> list[nn.Module]:
    parts = path.split(".")
    return [m for m in (get_path(model, ".".join(parts[:i])) for i in range(len(parts))) if m is not None]


def candidate_lists(model: nn.Module) -> list[BlockList]:
    """Every top-level block list with its entry; refused (naming it) when no module above it takes an input."""
    out = []
    for path in block_lists(model):
        found = entry_of(model, path)
        if found is None:
            raise UnsupportedModelError(
                f"{type(model).__name__}: no module above its blocks at {path!r} takes input_ids or pixel_values, "
                "so featcal cannot tell how calibration data reaches them"
            )
        out.append(BlockList(path, *found))
    return out


def _is_decoder(model: nn.Module, block: nn.Module) -> bool:
    """Whether a lone stack is a decoder's: its attention says it is causal (`is_causal`, transformers'
    attention modules); where no module of the block says either way (MPT, BLOOM), whether transformers
    registers a causal-LM head for the model type and no masked-LM one (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)."""
    declared = [m.is_causal for m in block.modules() if isinstance(getattr(m, "is_causal", None), bool)]
    if declared:
        return any(declared)
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    config = getattr(model, "config", None)
    if getattr(config, "is_decoder", False):
        return True
    model_type = getattr(config, "model_type", None)
    return model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and model_type not in MODEL_FOR_MASKED_LM_MAPPING_NAMES


def find_lists(model: nn.Module) -> list[tuple[str, BlockList]]:
    """(stack name, block list) of every stack FeatCal calibrates, in forward order; UnsupportedModelError
    naming what is missing or ambiguous."""
    config = getattr(model, "config", None)
    lists = candidate_lists(model)
    if not lists:
        raise UnsupportedModelError(
            f"{type(model).__name__}: no stack of residual blocks found (an nn.ModuleList of blocks holding "
            "Linear layers); featcal calibrates block-stacked transformers only"
        )
    if getattr(config, "is_encoder_decoder", False):
        return _encoder_decoder(model, lists)
    if len(lists) == 1:
        only = lists[0]
        if only.main_input == "pixel_values":
            return [("vision", only)]
        return [("decoder" if _is_decoder(model, get_path(model, only.path)[0]) else "encoder", only)]
    vision = [b for b in lists if b.main_input == "pixel_values"]
    if len(vision) == 1:  # a dual encoder (CLIPModel, SiglipModel): its image tower
        return [("vision", vision[0])]
    names = ", ".join(b.path for b in lists)
    raise UnsupportedModelError(
        f"{type(model).__name__} has several independent stacks of blocks ({names}); featcal cannot tell which "
        "of them the calibration data is meant for"
    )


def _encoder_decoder(model: nn.Module, lists: list[BlockList]) -> list[tuple[str, BlockList]]:
    encoder = model.get_encoder() if hasattr(model, "get_encoder") else None
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    enc = [b for b in lists if _under(model, b.path, encoder)]
    dec = [b for b in lists if _under(model, b.path, decoder) and b not in enc]
    if len(enc) != 1 or len(dec) > 1 or len(enc) + len(dec) != len(lists):
        names = ", ".join(b.path for b in lists)
        raise UnsupportedModelError(
            f"{type(model).__name__}: cannot tell its encoder blocks from its decoder blocks ({names})"
        )
    return [("encoder", enc[0])] + ([("decoder", dec[0])] if dec else [])


def layer_types_of(model: nn.Module, n_blocks: int) -> tuple[str, ...]:
    """config.layer_types for a stack of `n_blocks` when it names more than one type; () when blocks are alike."""
    types = tuple(getattr(getattr(model, "config", None), "layer_types", None) or ())
    if len(set(types)) < 2:
        return ()
    if len(types) < n_blocks:
        raise UnsupportedModelError(
            f"{type(model).__name__}: config.layer_types names {len(types)} layer types for {n_blocks} blocks"
        )
    return types[:n_blocks]


def make_stacks(model: nn.Module, cross_modules) -> list[Stack]:
    """The model's stacks (Stack, above) from `find_lists`. `cross_modules(model, path)` names the
    modules of a decoder's blocks that read the encoder output."""
    out = []
    lists = find_lists(model)
    encoder_decoder = len(lists) == 2
    for name, bl in lists:
        n = len(get_path(model, bl.path))
        vision = bl.main_input == "pixel_values"
        if encoder_decoder and name == "decoder":
            out.append(Stack(name, bl.path, bl.entry, mask_key="decoder_attention_mask",
                             cross_mask_key="attention_mask", cross_modules=tuple(cross_modules(model, bl.path))))
            continue
        out.append(Stack(name, bl.path, bl.entry, mask_key=None if vision else "attention_mask",
                         class_token_head=vision and has_class_token(model, bl.entry, bl.path),
                         layer_types=() if encoder_decoder else layer_types_of(model, n)))
    return out


def has_class_token(model: nn.Module, entry_path: str, blocks_path: str) -> bool:
    """Whether a vision stem prepends a learned token of its own (CLIP's class embedding, ViT's and DINOv2's
    cls token): a parameter of exactly `hidden_size` elements held by the entry itself or by a module
    registered before the blocks (the stem), other than a norm, linear, convolution or embedding layer.
    Such a model reads its output from that token (the pooled output), so the last block weighs the other
    tokens less (docs/method.md §4). A model without one (SigLIP, whose head pools every token with a learned query
    of its own, registered after the blocks) weighs every token alike."""
    from featcal.blocks.norms import norm_form

    entry = get_path(model, entry_path)
    hidden = getattr(getattr(entry, "config", None), "hidden_size", None)
    if entry is None or not isinstance(hidden, int):
        return False
    inside = blocks_path[len(entry_path) + 1:] if entry_path else blocks_path
    stem: list[nn.Module] = [entry]
    for name, child in entry.named_children():
        if inside == name or inside.startswith(name + "."):
            break
        stem.extend(child.modules())
    layers = (nn.Linear, nn.Embedding, nn.modules.conv._ConvNd)
    for mod in stem:
        if isinstance(mod, layers) or is_linear(mod) or norm_form(mod) is not None:
            continue
        if any(p.numel() == hidden for p in mod.parameters(recurse=False)):
            return True
    return False


def modules_reading_encoder(model: nn.Module, blocks_path: str) -> tuple[str, ...]:
    """Call decoder block 0 once on a made-up input (2 tokens) and encoder output (3 tokens); the linear
    layers whose input is that encoder output."""
    block = get_path(model, blocks_path)[0]
    param = next(block.parameters())
    width = _input_width(block)
    hidden = torch.zeros(1, 2, width, dtype=param.dtype, device=param.device)
    encoder = torch.zeros(1, 3, width, dtype=param.dtype, device=param.device)
    seen: list[str] = []
    handles = [m.register_forward_hook(lambda _m, a, _o, n=n: seen.append(n) if a and a[0] is encoder else None)
               for n, m in block.named_modules() if is_linear(m)]
    try:
        with torch.no_grad():
            block(hidden, encoder_hidden_states=encoder)
    except Exception as exc:
        if param.device.type == "meta":
            return ()
        raise UnsupportedModelError(
            f"{type(model).__name__}: could not call its decoder block on a made-up input to find the modules "
            f"reading the encoder output ({type(exc).__name__}: {' '.join(str(exc).split())[:200]})"
        ) from None
    finally:
        for h in handles:
            h.remove()
    if not seen:
        raise UnsupportedModelError(f"{type(model).__name__}: no module of its decoder blocks reads the encoder output")
    return tuple(seen)


def _input_width(block: nn.Module) -> int:
    """The width of a block's hidden states: the input width of its first linear layer."""
    from featcal.blocks.linear import features

    for m in block.modules():
        if is_linear(m):
            return features(m)[0]
    raise UnsupportedModelError(f"{type(block).__name__} holds no linear layer")
