"""What a model does around its blocks, seen in one forward on a made-up batch: the norms outside them.

Structure alone cannot say which norm of a stem feeds block 0 and which one reads the last block's output
(BART registers its embedding norm after its layers; CLIP's post-norm reads the class token only), so the
model is run once on a tiny batch (a few token ids, or one image of the configured size) with hooks on its
blocks and on every norm under the stack's entry but outside the blocks:

- the stem norm is the last such norm run before block 0 whose output is block 0's input;
- the final norm is the first one run after the last block whose input is that block's output, or its
  first token alone (`class_token_only`, CLIP);
- a stack's output (what an encoder hands its decoder) must be the final norm of its last block's output,
  or that output itself: anything else in between is refused, never guessed.

The probe reads no calibration data and changes nothing; its result names modules by path, so it holds
for every model of the same architecture (merged, template, experts).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from featcal.blocks.capture import split_call
from featcal.blocks.norms import norm_form
from featcal.blocks.structure import Stack, get_path
from featcal.errors import UnsupportedModelError


@dataclass(frozen=True)
class StackProbe:
    """What one stack's probe found (paths from the top model)."""

    stem_norm: str | None
    final_norm: str | None
    class_token_only: bool
    output_is_final_norm: bool  # the entry's output is final_norm(last block output) (or it, without a norm)


def probe_batch(model: nn.Module, main_input: str, device: torch.device) -> dict[str, torch.Tensor]:
    """A tiny batch the model accepts: 5 token ids (and a 3-token decoder input), or one random image."""
    config = getattr(model, "config", None)
    g = torch.Generator().manual_seed(0)
    if main_input == "pixel_values":
        vision = getattr(config, "vision_config", None) or config
        size = getattr(vision, "image_size", 224)
        size = tuple(size) if isinstance(size, (tuple, list)) else (int(size), int(size))
        channels = int(getattr(vision, "num_channels", 3))
        return {"pixel_values": torch.randn(1, channels, *size, generator=g).to(device)}
    vocab = int(getattr(config, "vocab_size", None) or 8)
    ids = (torch.arange(2, 7) % vocab)[None].to(device)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if getattr(config, "is_encoder_decoder", False):
        batch["decoder_input_ids"] = ids[:, :3]
        batch["decoder_attention_mask"] = torch.ones_like(ids[:, :3])
    return batch


def _hidden(output: Any) -> torch.Tensor:
    return output[0] if isinstance(output, (tuple, list)) else output


def _output_hidden(output: Any) -> torch.Tensor | None:
    for key in ("last_hidden_state",):
        value = getattr(output, key, None)
        if isinstance(value, torch.Tensor):
            return value
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    return output if isinstance(output, torch.Tensor) else None


def _equal(a: Any, b: Any) -> bool:
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and bool(torch.equal(a, b))


def probe_stacks(model: nn.Module, stacks: list[Stack], call) -> dict[str, StackProbe]:
    """Run every stack once, in order, on a made-up batch; `call(model, stack, batch, upstream)` is the
    adapter's stack_call. Returns each stack's StackProbe by name."""
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    if device.type == "meta":
        raise UnsupportedModelError("internal: the stack probe needs the model's weights")
    entry0 = get_path(model, stacks[0].entry_path)
    main = getattr(entry0, "main_input_name", None) or getattr(model, "main_input_name", "input_ids")
    batch = probe_batch(model, main, device)
    out: dict[str, StackProbe] = {}
    upstream = None
    with torch.no_grad():
        for stack in stacks:
            result, stack_out = _probe_one(model, stack, batch, upstream, call)
            out[stack.name] = result
            upstream = stack_out
    return out


def _probe_one(model, stack: Stack, batch, upstream, call) -> tuple[StackProbe, torch.Tensor | None]:
    blocks = stack.blocks(model)
    entry_path = stack.entry_path
    entry = get_path(model, entry_path)
    inside = stack.blocks_path[len(entry_path) + 1:] if entry_path else stack.blocks_path
    norms = {}
    for name, mod in entry.named_modules():
        if name == inside or name.startswith(inside + ".") or norm_form(mod) is None:
            continue
        norms[f"{entry_path}.{name}" if entry_path else name] = mod
    events: list[tuple[str, Any, Any]] = []  # (what, input, output) in call order
    signature = inspect.signature(blocks[0].forward)
    handles = [blocks[0].register_forward_pre_hook(
        lambda m, args, kwargs: events.append(("block0", split_call(m, signature, args, kwargs)[0], None)),
        with_kwargs=True)]
    handles.append(blocks[-1].register_forward_hook(lambda _m, _a, o: events.append(("last", None, _hidden(o)))))
    for path, mod in norms.items():
        handles.append(mod.register_forward_hook(lambda _m, a, o, p=path: events.append((p, a[0] if a else None, o))))
    try:
        module, kwargs = call(model, stack, batch, upstream)
        output = module(**kwargs)
    except Exception as exc:  # a model that cannot run on the made-up batch
        raise UnsupportedModelError(
            f"{type(model).__name__}: could not run its {stack.name} stack on a probe batch to find the norms "
            f"around its blocks ({type(exc).__name__}: {' '.join(str(exc).split())[:200]})"
        ) from None
    finally:
        for h in handles:
            h.remove()
    order = [e[0] for e in events]
    if "block0" not in order or "last" not in order:
        raise UnsupportedModelError(f"{type(model).__name__}: its {stack.name} blocks did not run on a probe batch")
    first, last = order.index("block0"), len(order) - 1 - order[::-1].index("last")
    h0, h_last = events[first][1], events[last][2]
    stem = next((p for p, _x, y in reversed(events[:first]) if p in norms and _equal(y, h0)), None)
    final, cls_only = None, False
    for p, x, _y in events[last + 1:]:
        if p not in norms:
            continue
        if _equal(x, h_last):
            final = p
        elif isinstance(h_last, torch.Tensor) and h_last.dim() == 3 and _equal(x, h_last[:, 0]):
            final, cls_only = p, True
        if final is not None:
            break
    result = _output_hidden(output)
    expected = h_last
    if final is not None and not cls_only:
        expected = norms[final](h_last)
    same = result is not None and isinstance(expected, torch.Tensor) and result.shape == expected.shape \
        and bool(torch.allclose(result, expected, rtol=1e-5, atol=1e-6))
    return StackProbe(stem, final, cls_only, same), (expected if same else None)

