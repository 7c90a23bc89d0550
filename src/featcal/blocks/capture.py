"""Block-input capture: run a model until its first block and keep what that block receives."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from featcal.errors import FeatCalError


class _StopForward(Exception):
    """Raised by the block-0 pre-hook: the rest of the model's forward is not needed."""


def hidden_of(output: Any) -> torch.Tensor:
    """Blocks return a tensor (CLIP, Llama in transformers 5) or a tuple whose first item is it (T5)."""
    return output[0] if isinstance(output, (tuple, list)) else output


def capture_block_input(module: nn.Module, block: nn.Module, kwargs: dict[str, Any]) -> tuple[torch.Tensor, dict]:
    """Run `module(**kwargs)` until `block` is called; return (hidden_states, other arguments by name)."""
    seen: dict[str, Any] = {}

    def hook(_mod, args, kw):
        seen["args"], seen["kwargs"] = args, kw
        raise _StopForward

    handle = block.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        module(**kwargs)
    except _StopForward:
        pass
    finally:
        handle.remove()
    if "args" not in seen:
        raise FeatCalError(f"{type(module).__name__}: the forward never reached {type(block).__name__} 0")
    return split_call(block, inspect.signature(block.forward), seen["args"], seen["kwargs"])


def capture_block_calls(module: nn.Module, blocks: nn.ModuleList,
                        kwargs: dict[str, Any]) -> tuple[torch.Tensor, list[dict[str, Any]]]:
    """Run `module(**kwargs)` with every block of `blocks` passing its input through untouched; return
    block 0's hidden input and the other arguments each block was called with.

    No block computes anything (offloaded blocks may stay on the host). Only valid where a block's
    arguments do not depend on the blocks before it (masks and rotary tables made once by the
    model, as in Gemma 3), since each block is handed block 0's input.
    """
    calls: list[tuple[torch.Tensor, dict[str, Any]] | None] = [None] * len(blocks)
    patched: list[nn.Module] = []

    def pass_through(i: int, block: nn.Module):
        sig = inspect.signature(block.forward)  # before it is shadowed

        def forward(*args, **kw):
            calls[i] = split_call(block, sig, args, kw)
            return calls[i][0]
        return forward

    try:
        for i, block in enumerate(blocks):
            if "forward" in vars(block):
                raise FeatCalError(f"{type(block).__name__} {i} has its forward replaced; cannot capture its arguments")
            block.forward = pass_through(i, block)  # shadows the class's forward on this instance only
            patched.append(block)
        module(**kwargs)
    finally:
        for block in patched:
            del block.forward
    missing = [i for i, c in enumerate(calls) if c is None]
    if missing:
        raise FeatCalError(f"{type(module).__name__}: the forward never called block(s) {missing}")
    return calls[0][0], [c[1] for c in calls]  # type: ignore[index]


def record_block_calls(module: nn.Module, blocks: nn.ModuleList,
                       kwargs: dict[str, Any]) -> list[tuple[torch.Tensor, dict[str, Any], Any, int]]:
    """Run `module(**kwargs)` in full, every block computing; per block (hidden input, other arguments, raw
    output, times called) of its first call. For checking, once, what the model itself hands each block."""
    seen: list[list[Any]] = [[None, None, None, 0] for _ in blocks]
    handles = []
    for i, block in enumerate(blocks):
        sig = inspect.signature(block.forward)

        def pre(_m, args, kw, i=i, sig=sig, block=block):
            seen[i][3] += 1
            if seen[i][3] == 1:
                seen[i][0], seen[i][1] = split_call(block, sig, args, kw)

        def post(_m, _args, _kw, out, i=i):
            if seen[i][2] is None:
                seen[i][2] = out

        handles.append(block.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(block.register_forward_hook(post, with_kwargs=True))
    try:
        module(**kwargs)
    finally:
        for h in handles:
            h.remove()
    return [tuple(s) for s in seen]  # type: ignore[misc]


def split_call(block: nn.Module, sig: inspect.Signature, args: tuple,
                kwargs: dict[str, Any]) -> tuple[torch.Tensor, dict[str, Any]]:
    """(hidden states, every other argument by name) of one call of `block`, whose forward has signature `sig`."""
    bound = sig.bind(*args, **kwargs)
    params = sig.parameters
    ctx: dict[str, Any] = {}
    hidden_name = next(iter(params))
    for name, value in bound.arguments.items():
        kind = params[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            ctx.update(value)
        elif kind is inspect.Parameter.VAR_POSITIONAL:
            if value:
                raise FeatCalError(f"{type(block).__name__} is called with extra positional arguments")
        elif name != hidden_name:
            ctx[name] = value
    return bound.arguments[hidden_name], ctx
